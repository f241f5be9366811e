"""The tiny lab the grader's tests grade: two single-process exercises (lab 08's 1F1B
generator and lab 07's bucket assignment) keep them fast; the real labs are graded by the
same code. ``labs`` (tests/conftest.py) is a folder holding it, both exercises unfinished.
"""

from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

LAB = "99_grading_test"

ONE_F_ONE_B = """def one_f_one_b(stages, micro_batches):
    plan = []
    for s in range(stages):
        warm = min(stages - s - 1, micro_batches)
        actions = [f"F{k}" for k in range(warm)]
        for k in range(micro_batches - warm):
            actions += [f"F{warm + k}", f"B{k}"]
        actions += [f"B{k}" for k in range(micro_batches - warm, micro_batches)]
        plan.append(actions)
    return plan"""

ASSIGN = """def assign_buckets(sizes, bucket_mb):
    limit = float("inf") if bucket_mb is None else bucket_mb * 2**20
    buckets, total = [], 0
    for i, nbytes in enumerate(sizes):
        if buckets and total + nbytes <= limit:
            buckets[-1].append(i)
            total += nbytes
        else:
            buckets.append([i])
            total = nbytes
    return buckets"""

UNFINISHED = "def {name}(*args):\n    # YOUR CODE HERE\n    raise NotImplementedError"
CHECK_1F1B = "ok.grading.check_1f1b_schedule(one_f_one_b)"
CHECK_BUCKETS = "ok.grading.check_assign_buckets(assign_buckets)"


def notebook(first, second, extra=(), checks=(CHECK_1F1B, CHECK_BUCKETS)):
    cells = [new_markdown_cell("# a lab"), new_code_cell("import overlapkit as ok"),
             *[new_code_cell(c) for c in extra], new_code_cell(first),
             new_code_cell(checks[0]), new_code_cell(second), new_code_cell(checks[1])]  # fmt: skip
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    return nb


def write_lab(folder):
    """``folder``/99_grading_test.ipynb: the lab itself, both exercises unfinished."""
    import nbformat  # noqa: PLC0415

    folder.mkdir(exist_ok=True)
    lab = notebook(UNFINISHED.format(name="one_f_one_b"), UNFINISHED.format(name="assign_buckets"))
    nbformat.write(lab, folder / f"{LAB}.ipynb")
    return folder
