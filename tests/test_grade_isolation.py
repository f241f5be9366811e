"""The grader against a student who has read its source: forged verdicts, hijacked modules,
code hidden in pickles and return values, kernels that ignore interrupts, processes left
behind. Each forgery scores 0 for its exercise; the honest exercise beside it scores full.

Uses the tiny two-exercise lab of tests/tinylab.py (1F1B schedule + bucket assignment,
3 points each), whose checks call the learner's function in the judge's place: on a rank
of its own (``overlapkit.sandbox.sealed``).
"""

import contextlib
import json
import os
import sys
import time
import types

import nbformat
import psutil
import pytest

from overlapkit import plaindata
from overlapkit.grade.judge import run_check
from overlapkit.grade.labs import Exercise
from overlapkit.grading import lab10
from overlapkit.launcher import RankFailedError, launch
from tests.test_grade import _by_name, _student
from tests.tinylab import ASSIGN, ONE_F_ONE_B, notebook

FORGED = '{"score": 1.0, "cases": [{"passed": true, "message": "forged"}]}'

# a verdict printed where the old grader read it, and written to every descriptor a
# forger can reach from inside the student's function
PRINTS_A_VERDICT = f"""def assign_buckets(sizes, bucket_mb):
    import os
    print('@@overlapkit-grade@@{FORGED}')
    for fd in range(3, 64):
        try:
            os.write(fd, b'{FORGED}')
        except OSError:
            pass
    return [[i] for i in range(len(sizes))]"""

# runs when the function's pickle is read: print a verdict, write it to every descriptor
_FORGE_CODE = (
    f"import os\nprint('@@overlapkit-grade@@' + {FORGED!r})\n"
    f"for fd in range(3, 64):\n    try: os.write(fd, {FORGED.encode()!r})\n"
    "    except OSError: pass\n"
)
REDUCE_AT_LOAD = f"""class _Forge:
    def __reduce__(self):
        return (exec, ({_FORGE_CODE!r},))
FORGE = _Forge()
def assign_buckets(sizes, bucket_mb):
    FORGE
    return [[i] for i in range(len(sizes))]"""

# the grader's own modules, replaced from a cell: beside the notebook and in the kernel's folder
_FAKE_MODULE = f"print('@@overlapkit-grade@@' + {FORGED!r})\nraise SystemExit(0)\n"
HIJACK = f"""import pathlib
for folder in (pathlib.Path.cwd(), pathlib.Path(HERE)):
    for name in ("cloudpickle.py", "json.py", "overlapkit.py", "sitecustomize.py"):
        (folder / name).write_text({_FAKE_MODULE!r})"""


def test_a_forged_verdict_or_a_pickle_that_runs_code_scores_zero_beside_full_marks(tmp_path, labs):
    for forger in (PRINTS_A_VERDICT, REDUCE_AT_LOAD):
        result = _grade(tmp_path, labs, notebook(ONE_F_ONE_B, forger))
        ex = _by_name(result)
        assert ex["1f1b_schedule"]["points"] == 3.0, ex["1f1b_schedule"]["feedback"]
        assert ex["assign_buckets"]["points"] == 0.0
        assert "forged" not in ex["assign_buckets"]["feedback"]
        assert "✘" in ex["assign_buckets"]["feedback"]  # the check ran and judged the work


def test_modules_written_beside_the_notebook_do_not_replace_the_graders(tmp_path, labs):
    here = str(tmp_path / "students")
    hijack = f"HERE = {here!r}\n" + HIJACK
    result = _grade(tmp_path, labs, notebook(ONE_F_ONE_B, ASSIGN, extra=[hijack]))
    assert (tmp_path / "students" / "cloudpickle.py").exists()  # the cell did run
    assert result["score"] == 6.0, result  # both honest exercises, judged by the real kit


def test_a_kernel_that_ignores_interrupts_is_ended_within_the_limit(tmp_path, labs, monkeypatch):
    from overlapkit.grade import kernel

    monkeypatch.setattr(kernel, "GRACE_S", 5.0)  # the grace is waited for: shorter here
    began = tmp_path / "began"
    deaf = (f"import signal, time\nopen({str(began)!r}, 'w').write(repr(time.time()))\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "while True:\n    time.sleep(0.1)")  # fmt: skip
    result = _grade(tmp_path, labs, notebook(ONE_F_ONE_B, ASSIGN, extra=[deaf]), cell_limit=20)
    took = time.time() - float(began.read_text())  # from the cell's start
    assert any("ignored the interrupt" in n for n in result["notes"]), result["notes"]
    assert result["score"] == 0  # nothing could be harvested from a kernel that had to die
    # the limit, the grace, and 13 s for a busy machine to end the kernel and tidy up (31.9 s
    # beside two other pytest workers); nbclient's own timeout noticed the killed kernel
    # only after waiting its limit a second time: 20 + 20 s and more (44 s on a quiet one)
    assert took < 20 + 5 + 13, took


def test_processes_a_notebook_leaves_running_are_ended(tmp_path, labs):
    pids = tmp_path / "pids.json"
    leave = (
        "import json, subprocess, sys\n"
        "kept = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "away = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "                        start_new_session=True)\n"
        f"open({str(pids)!r}, 'w').write(json.dumps([kept.pid, away.pid]))"
    )
    result = _grade(tmp_path, labs, notebook(ONE_F_ONE_B, ASSIGN, extra=[leave]))
    assert result["score"] == 6.0
    for pid in json.loads(pids.read_text()):
        assert not _alive(pid), f"process {pid} started by the notebook still runs"


_KEEPS_FORKING = """
import os, sys, time
while True:
    if os.fork() == 0:
        with open(sys.argv[1], "a") as f:
            f.write(f"{os.getpid()} ")
        time.sleep(120)
        os._exit(0)
    time.sleep(0.002)
"""

_SWEEP = """
import subprocess, sys, time
from overlapkit.grade.processes import adopt_orphans, descendants, end_new_processes
adopt_orphans()  # as python -m overlapkit.grade does
before = descendants()
subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]])
time.sleep(1.0)
end_new_processes(before)
"""


def test_a_process_that_keeps_forking_is_ended_with_all_it_forked(tmp_path):
    """A process that forks while the grader ends what a notebook left leaves children the
    grader's one list never held, and the next judge's list of processes already there
    would spare them. The grader lists again until nothing new is left, stopping each
    process before it kills it."""
    import subprocess

    pids = tmp_path / "forked"
    pids.touch()
    try:
        subprocess.run([sys.executable, "-c", _SWEEP, str(pids), _KEEPS_FORKING], timeout=120,
                       check=True)  # fmt: skip
        time.sleep(0.2)
        forked = [int(p) for p in pids.read_text().split()]
        assert len(forked) > 20, forked  # it did fork while it ran
        alive = [p for p in forked if _alive(p)]
        assert not alive, f"{len(alive)} of {len(forked)} forked processes still run"
    finally:  # whatever the sweep missed ends here, not after the test
        for pid in (int(p) for p in pids.read_text().split()):
            with contextlib.suppress(OSError):
                os.kill(pid, 9)


def test_the_judge_reads_a_table_of_float_subclasses_as_not_plain_data(tmp_path):
    """Lab 10's table, made of a float whose arithmetic always agrees: the judge never
    unpickles it (its methods would run there), and the check says what it got."""
    folder = tmp_path / "saved"
    folder.mkdir()
    source = (
        "import torch\n"
        "class Agreeable(float):\n"
        "    def __sub__(self, other): return 0.0\n"
        "    def __truediv__(self, other): return 1.0\n"
        "row = {'step_ms': Agreeable(30.0), 'hidden': Agreeable(0.8)}\n"
        f"torch.save({{'before': row, 'after': row}}, {str(folder / 'REPORT.pt')!r})\n"
        f"torch.save({{'wrapper': 'bucketed', 'bucket_mb': 1}}, {str(folder / 'TUNED.pt')!r})\n"
        "import cloudpickle\n"
        f"open({str(folder / 'REPORT.pkl')!r}, 'wb').write(cloudpickle.dumps({{'before': row}}))\n"
    )
    module = types.ModuleType("student_notebook")  # importable here, as __main__ is there
    sys.modules[module.__name__] = module
    try:
        exec(compile(source, "<student>", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    ex = Exercise("check_tuning", ["REPORT", "TUNED"], {}, "", points=4.0)
    report = run_check(ex, str(folder), limit=120)
    assert isinstance(report, dict), report
    assert report["score"] == 0
    assert any("REPORT" in c["message"] for c in report["cases"]), report


def _rank_returns_code():
    class Forge:
        def __reduce__(self):
            return (os.system, ("touch /tmp/overlapkit-forged-by-a-rank",))

    return Forge()


def _rank_raises_code():
    class Boom(Exception):
        def __reduce__(self):
            return (os.system, ("touch /tmp/overlapkit-forged-by-a-rank",))

    raise Boom("boom")


@pytest.mark.parametrize("fn", [_rank_returns_code, _rank_raises_code])
def test_under_distrust_a_ranks_value_or_exception_runs_no_code_in_the_caller(fn):
    marker = "/tmp/overlapkit-forged-by-a-rank"
    if os.path.exists(marker):
        os.remove(marker)
    with plaindata.distrust(), pytest.raises(RankFailedError) as caught:
        launch(fn, world_size=1, timeout=60, quiet=True)
    assert not os.path.exists(marker)
    assert "posix.system" in str(caught.value) or "Boom: boom" in str(caught.value)


def test_under_distrust_plain_values_and_builtin_exceptions_come_back():
    with plaindata.distrust():
        got = launch(_plain_value, world_size=2, timeout=60, quiet=True)
        assert got[1]["rank"] == 1 and got[0]["t"].tolist() == [0.0, 0.0]
        with pytest.raises(NotImplementedError):
            launch(_unfinished, world_size=1, timeout=60, quiet=True)


def _plain_value():
    import torch

    import overlapkit as ok

    return {"rank": ok.rank(), "t": torch.zeros(2), "pair": (1, "a")}


def _unfinished():
    raise NotImplementedError


def _grade(tmp_path, labs, nb, cell_limit=120.0):
    from overlapkit.grade import grade_notebook

    return grade_notebook(_student(tmp_path, nb), labs, cell_limit=cell_limit)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_notebook_that_rewrites_the_lab_it_is_graded_against_stops_the_grading(tmp_path, labs):
    """The kernel runs as the grader's user: it can write the lab (or the kit, or a .pth).
    The grader cannot forbid it in-process, so it notices and stops rather than judge on."""
    from overlapkit.grade.tamper import EnvironmentChanged

    lab = labs / "99_grading_test.ipynb"
    rewrite = f"import pathlib\np = pathlib.Path({str(lab)!r})\np.write_text(p.read_text() + ' ')"
    with pytest.raises(EnvironmentChanged, match="99_grading_test.ipynb"):
        _grade(tmp_path, labs, notebook(ONE_F_ONE_B, ASSIGN, extra=[rewrite]))


def test_cells_after_the_last_check_are_not_run_so_a_hang_there_costs_nothing(tmp_path, labs):
    nb = notebook(ONE_F_ONE_B, ASSIGN)
    nb.cells.append(nbformat.v4.new_code_cell("import time\ntime.sleep(600)  # a plot's loop"))
    began = time.monotonic()
    result = _grade(tmp_path, labs, nb, cell_limit=300)
    assert result["score"] == 6.0
    assert any("1 code cell(s) after the last check were not run" in n for n in result["notes"])
    assert time.monotonic() - began < 250  # the sleeping cell would have taken 300 s


def test_a_same_size_edit_with_its_modification_time_put_back_is_still_noticed(tmp_path, labs):
    """``os.utime`` can restore a file's modification time, not its change time."""
    from overlapkit.grade.tamper import EnvironmentChanged

    lab = labs / "99_grading_test.ipynb"
    sneak = (
        f"import os, pathlib\np = pathlib.Path({str(lab)!r})\nst = os.stat(p)\n"
        "p.write_text(p.read_text().replace('a lab', 'A lab'))\n"
        "os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))"
    )
    with pytest.raises(EnvironmentChanged, match="99_grading_test.ipynb"):
        _grade(tmp_path, labs, notebook(ONE_F_ONE_B, ASSIGN, extra=[sneak]))


# a cell can put a package into site-packages that every later Python loads (a torch
# plug-in's entry point, numpy's _distributor_init_local): one that rewrites the judge's
# json.dumps would give 4/4 to an unfinished notebook. Here the cell writes into a
# stand-in import root, not the test's own site-packages.
_PLUG_IN = (
    "import pathlib\nroot = pathlib.Path({root!r})\n"
    "(root / 'zz_backend_ext').mkdir()\n(root / 'zz_backend_ext' / '__init__.py').write_text('')\n"
    "(root / 'zz_backend_ext-0.1.dist-info').mkdir()\n"
    "(root / 'zz_backend_ext-0.1.dist-info' / 'entry_points.txt').write_text("
    "'[torch.backends]\\nzz = zz_backend_ext:init\\n')"
)
_NESTED = (
    "import pathlib\nplace = pathlib.Path({root!r}) / 'numpy' / '_distributor_init_local'\n"
    "place.mkdir()\n(place / '__init__.py').write_text('')"
)


@pytest.mark.parametrize(
    "cell, added",
    [
        (_PLUG_IN, "zz_backend_ext-0.1.dist-info (added"),
        (_NESTED, "_distributor_init_local (added"),
    ],  # fmt: skip
    ids=["plug_in", "nested_package"],
)
def test_a_package_a_notebook_adds_where_python_imports_from_stops_the_grading(
    tmp_path, labs, monkeypatch, cell, added
):
    from overlapkit.grade import tamper
    from overlapkit.grade.tamper import EnvironmentChanged

    root = tmp_path / "site-packages"
    (root / "numpy").mkdir(parents=True)
    monkeypatch.setattr(tamper, "import_roots", lambda: [os.path.join(str(root), "")])
    nb = notebook(ONE_F_ONE_B, ASSIGN, extra=[cell.format(root=str(root))])
    with pytest.raises(EnvironmentChanged) as stopped:
        _grade(tmp_path, labs, nb)
    assert added in str(stopped.value), stopped.value


# a .pyc that only the judge loads (torch.load's serialization package) rewritten in
# place, its header kept: no folder changes
_IN_PLACE = (
    "import os, pathlib\n"
    "p = pathlib.Path({root!r}) / 'numpy' / '__pycache__' / 'mod.cpython-311.pyc'\n"
    "st = os.stat(p)\nwith open(p, 'r+b') as f:\n    f.seek(16)\n    f.write(b'forged')\n"
    "os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))"
)


def test_a_file_a_notebook_edits_in_place_where_python_imports_from_stops_the_grading(
    tmp_path, labs, monkeypatch
):
    from overlapkit.grade import tamper
    from overlapkit.grade.tamper import EnvironmentChanged

    root = tmp_path / "site-packages"
    (root / "numpy" / "__pycache__").mkdir(parents=True)
    (root / "numpy" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(bytes(64))
    monkeypatch.setattr(tamper, "import_roots", lambda: [os.path.join(str(root), "")])
    nb = notebook(ONE_F_ONE_B, ASSIGN, extra=[_IN_PLACE.format(root=str(root))])
    with pytest.raises(EnvironmentChanged) as stopped:
        _grade(tmp_path, labs, nb)
    assert "mod.cpython-311.pyc (changed)" in str(stopped.value), stopped.value


def test_what_chooses_the_judges_interpreter_is_fingerprinted_there_or_not(tmp_path):
    """``home`` in pyvenv.cfg can point the judge at a standard library of the student's; a
    ``python311.zip`` that does not exist is on sys.path first."""
    import tempfile

    from overlapkit.grade import tamper

    paths = tamper._interpreter()
    assert os.path.join(sys.prefix, "pyvenv.cfg") in paths
    zipped = [p for p in sys.path if p.endswith(".zip")]
    assert all(os.path.realpath(p) in paths for p in zipped), (zipped, paths)
    # not the folder the grader runs in, nor /tmp above it (every process writes there)
    assert os.path.join(tempfile.gettempdir(), "") not in paths
    assert os.path.join(os.getcwd(), "") not in paths or os.getcwd().startswith(sys.prefix)
    # a path that was absent and appears is named as added
    later = tmp_path / "python311.zip"
    before = {str(later): tamper.ABSENT}
    later.write_bytes(b"PK")
    assert tamper.changes(before, tamper.fingerprint(tmp_path, like=before)) == [f"{later} (added)"]


def test_the_judge_runs_with_torchs_plug_ins_off(tmp_path):
    """An installed ``torch.backends`` entry point runs at ``import torch``; not in a judge."""
    dist = tmp_path / "zzplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: zzplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[torch.backends]\nzz = zzplug:init\n")
    marker = tmp_path / "ran"
    (tmp_path / "zzplug.py").write_text(f"def init():\n    open({str(marker)!r}, 'w').close()\n")
    import subprocess

    from overlapkit.grade.judge import judge_environment

    loaded = {}
    for name, env in (("plain", dict(os.environ)), ("judge", judge_environment())):
        env["PYTHONPATH"] = str(tmp_path)
        subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True, timeout=120)
        loaded[name] = marker.exists()
        marker.unlink(missing_ok=True)
    if not loaded["plain"]:
        pytest.skip("this torch loads no device back-end plug-ins (before 2.5)")
    assert not loaded["judge"]


def _in_a_notebook(source: str):
    """The function ``source`` defines, as a notebook's cell would (in ``__main__``): it
    pickles by value, so a rank does not import this test module to run it."""
    names = {"__name__": "__main__"}
    exec(compile(source, "<student>", "exec"), names)
    return next(v for k, v in names.items() if k != "__name__" and callable(v))


_BYTES_BY_THE_KIT = """def bytes_moved(collective, nbytes, world):
    from overlapkit.costmodel import bytes_moved_per_rank as count  # bound early, renamed
    return count(collective, nbytes, world)"""

_BUCKETS_BY_THE_KIT = """def assign_buckets(sizes, bucket_mb):
    import overlapkit.costmodel as cm
    return cm.ddp_buckets(sizes, bucket_mb)"""


@pytest.mark.parametrize(
    "check, source, words",
    [
        ("check_bytes_moved", _BYTES_BY_THE_KIT, "ok.costmodel.bytes_moved_per_rank"),
        ("check_assign_buckets", _BUCKETS_BY_THE_KIT, "ok.costmodel.ddp_buckets"),
    ],
)
def test_the_kits_own_answer_under_another_name_scores_zero_also_in_the_judge(check, source, words):
    """In a notebook (in-process) and as the judge holds it (sealed, called on a rank)."""
    import cloudpickle

    import overlapkit as ok
    from overlapkit.sandbox.sealed import Sealed

    fn = _in_a_notebook(source)
    for learner in (fn, Sealed(fn.__name__, cloudpickle.dumps(fn))):
        with plaindata.distrust():
            report = getattr(ok.grading, check)(learner)
        assert report.score == 0, report.cases
        assert words in report.cases[0][1] and "the kit's own answer" in report.cases[0][1]


def test_under_the_grader_only_what_the_witness_measured_counts_as_measured(tmp_path):
    """Lab 10's measure() asks the grader's witness (a process outside the kernel), which
    measures and keeps the note; the judge reads the witness's notes. A note forged in the
    kernel (lab 10's bypass: records.note with an invented row) never reaches the judge,
    while the row measure() really returned does, without a re-measurement."""
    from overlapkit.grade.kernel import execute  # noqa: PLC0415

    cells = [
        "from overlapkit.grading import lab10\nfrom overlapkit.sandbox import records\n"
        "records.note(lab10.NOTED, {'config': lab10.BASELINE, 'step_ms': 412.34, 'hidden': 0.01})",
        "TUNED = {'wrapper': 'bucketed', 'bucket_mb': 1}\n"
        "m = lab10.measure(TUNED)\n"
        "REPORT = {'before': {'step_ms': 412.34, 'hidden': 0.01},\n"
        "          'after': {'step_ms': m['step_ms'], 'hidden': m['hidden']}}",
    ]
    student = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    folder = tmp_path / "saved"
    folder.mkdir()
    measures = ("overlapkit.grading.lab10",)
    found, notes = execute(student, ["REPORT", "TUNED"], str(folder), 120, 240, measures=measures)
    assert found.get("REPORT") == "ok" and found.get("TUNED") == "ok", (found, notes)
    assert not notes, notes
    ex = Exercise("check_tuning", ["REPORT", "TUNED"], {}, "", points=4.0)
    report = run_check(ex, str(folder), limit=120)
    assert isinstance(report, dict), report
    assert report["score"] == 0
    assert [c["message"] for c in report["cases"]] == [
        "before: step 412.3 ms, hidden 0.01: measure(BASELINE) never ran in this notebook "
        "(BASELINE is {'wrapper': 'bucketed', 'bucket_mb': 25}): measure it with the "
        "notebook's measure(), which notes what it returns (numbers from a launch of your "
        "own, or typed in, do not count)",
        lab10.NOT_NOTED + " (after is what measure(TUNED) returned; the other row is not)",
    ], report


def test_the_witness_refuses_a_configuration_the_lab_does_not_take_and_goes_on():
    """What the kernel sends the witness is a request, checked like measure()'s argument."""
    from overlapkit.sandbox import witness  # noqa: PLC0415

    with witness.Witness(("overlapkit.grading.lab10",)) as w, pytest.MonkeyPatch.context() as mp:
        mp.setenv(witness.ENV, w.path)
        for bad, words in [
            ({"wrapper": "magic"}, "'wrapper' must be one of"),
            ({"wrapper": "bucketed", "bucket_mb": -1}, "size in MiB > 0"),
            ({"wrapper": "bucketed", "steps": 1}, "takes only wrapper"),
        ]:
            with pytest.raises(ValueError, match=words):
                lab10.measure(bad)
            with pytest.raises(RuntimeError, match=words):  # sent as is: the witness says it
                witness.ask(lab10.NOTED, bad)
        assert w.notes() == {}


def test_the_ranks_of_a_check_that_builds_no_optimizer_skip_torchs_warm_up(tmp_path):
    """Each call of a single-process exercise runs on a rank of its own: a judge of a
    ``judge.LIGHT`` check must not pay torch's 2.5 s warm-up in each (13 s for one check,
    and a 10 s limit missed under load)."""
    import cloudpickle

    from overlapkit.grade.judge import LIGHT

    assert "check_assign_buckets" in LIGHT
    folder, seen = tmp_path / "saved", tmp_path / "seen.json"
    folder.mkdir()
    source = (
        "def assign_buckets(sizes, bucket_mb):\n"
        "    import json, sys\n"
        f"    open({str(seen)!r}, 'w').write(json.dumps('torch._dynamo' in sys.modules))\n"
        + "\n".join(ASSIGN.splitlines()[1:])
    )
    (folder / "assign_buckets.pkl").write_bytes(cloudpickle.dumps(_in_a_notebook(source)))
    ex = Exercise("check_assign_buckets", ["assign_buckets"], {}, "", points=3.0)
    report = run_check(ex, str(folder), limit=120)
    assert isinstance(report, dict) and report["score"] == 1.0, report["cases"][:1]
    assert json.loads(seen.read_text()) is False  # the rank never imported torch._dynamo


def test_a_function_that_ends_its_rank_is_not_called_again_case_after_case(tmp_path):
    """A forger that writes over its rank's descriptors (or any function that ends its
    process) costs one call, not a new process and forkserver per case."""
    import cloudpickle

    import overlapkit as ok
    from overlapkit.sandbox.sealed import Sealed

    calls = tmp_path / "calls"
    fn = _in_a_notebook(
        "def assign_buckets(sizes, bucket_mb):\n"
        "    import os\n"
        f"    open({str(calls)!r}, 'a').write('x')\n"
        "    os._exit(3)"
    )
    with plaindata.distrust():
        report = ok.grading.check_assign_buckets(Sealed(fn.__name__, cloudpickle.dumps(fn)))
    assert report.score == 0 and len(report.cases) > 2, report.cases
    assert "exited with code 3 before returning" in report.cases[0][1], report.cases[0]
    for _, message in report.cases[1:]:
        assert "ended its process in an earlier case" in message and "not called again" in message
    assert calls.read_text() == "x"
