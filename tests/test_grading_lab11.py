# ruff: noqa: E501 - the edits quote learner code as it sits in a file
"""Lab 11's checks: the solutions pass; typical mistakes get a message that names them."""

import textwrap

import pytest

import overlapkit as ok

AG = textwrap.dedent("""
    import torch
    import overlapkit as ok

    def ag_matmul(x, weight):
        me, world = ok.rank(), ok.world_size()
        rows = x.shape[0]
        out = x.new_empty((world * rows, weight.shape[0]))
        chunk = x
        for k in range(world):
            src = (me - k) % world
            handles = []
            if k < world - 1:
                nxt = torch.empty_like(chunk)
                handles = [ok.p2p.isend(chunk, (me + 1) % world),
                           ok.p2p.irecv(nxt, (me - 1) % world)]
            out[src * rows : (src + 1) * rows] = chunk @ weight.t()
            for h in handles:
                h.wait()
            if k < world - 1:
                chunk = nxt
        return out
""")

MOE = textwrap.dedent("""
    import torch
    import overlapkit as ok

    def chunked_moe(x, expert_of, expert, chunks):
        world = ok.world_size()
        plans = []
        for lo, hi in ok.collectives.chunk_bounds(len(x), chunks):
            order = torch.argsort(expert_of[lo:hi], stable=True) + lo
            plans.append((order, torch.bincount(expert_of[lo:hi], minlength=world)))
        send = torch.stack([counts for _, counts in plans])
        recv = ok.moe.exchange_counts(send)

        def dispatch(c):
            buf = x.new_empty((int(recv[c].sum()), x.shape[1]))
            h = ok.all_to_all(buf, x[plans[c][0]], recv[c].tolist(), send[c].tolist(),
                              async_op=True)
            return buf, h

        out = torch.empty_like(x)
        pending = dispatch(0)
        combines = []
        for c in range(chunks):
            nxt = dispatch(c + 1) if c + 1 < chunks else None
            buf, h = pending
            h.wait()
            y = expert(buf)
            back = x.new_empty((len(plans[c][0]), x.shape[1]))
            h2 = ok.all_to_all(back, y, send[c].tolist(), recv[c].tolist(), async_op=True)
            combines.append((c, back, h2))
            pending = nxt
        for c, back, h in combines:
            h.wait()
            out[plans[c][0]] = back
        return out
""")


def _unindent(text):
    """The edits are written as the function sits in a file; the sources are dedented."""
    return "\n".join(line[4:] if line.startswith("    ") else line for line in text.split("\n"))


def _build(source, name, *edits):
    for old, new in edits:
        old, new = _unindent(old), _unindent(new)
        assert old in source, old
        source = source.replace(old, new)
    namespace = {}
    exec(compile(source, f"<learner {name}>", "exec"), namespace)  # noqa: S102
    return namespace[name]


def _text(report):
    return "\n".join(message for _, message in report.cases)


def test_the_ag_matmul_solution_passes():
    assert ok.grading.check_ag_matmul(_build(AG, "ag_matmul")).all_passed


@pytest.mark.parametrize(
    ("edits", "words"),
    [
        # the shard in hand taken from the wrong neighbour's side
        ([("src = (me - k) % world", "src = (me + k) % world")], "they hold shard"),
        # multiplying before the wait, and never waiting
        ([("            for h in handles:\n                h.wait()\n", "")], "never waited"),
        # the kit's gather instead of messages
        (
            [
                (
                    "        out = x.new_empty((world * rows, weight.shape[0]))\n",
                    "        full = x.new_empty((world * rows, x.shape[1]))\n"
                    "        ok.ring_all_gather(full, x)\n        return full @ weight.t()\n",
                )
            ],
            "called ok.ring_all_gather",
        ),
        # waiting for the next shard before multiplying the one in hand
        (
            [
                (
                    "            out[src * rows : (src + 1) * rows] = chunk @ weight.t()\n"
                    "            for h in handles:\n                h.wait()\n",
                    "            for h in handles:\n                h.wait()\n"
                    "            out[src * rows : (src + 1) * rows] = chunk @ weight.t()\n",
                )
            ],
            "waited for each incoming shard before it multiplied",
        ),
        # the received shard never used: the own shard multiplied N times
        (
            [("                chunk = nxt\n", "                pass\n")],
            "they hold shard 0's product",
        ),
        # the built-in collective
        (
            [
                (
                    "        out = x.new_empty((world * rows, weight.shape[0]))\n",
                    "        full = x.new_empty((world * rows, x.shape[1]))\n"
                    "        torch.distributed.all_gather_into_tensor(full, x)\n"
                    "        return full @ weight.t()\n",
                )
            ],
            "called torch.distributed.all_gather_into_tensor",
        ),
        # waits before the multiplication, and again after (the second wait is a no-op)
        (
            [
                (
                    "            out[src * rows : (src + 1) * rows] = chunk @ weight.t()\n",
                    "            for h in handles:\n                h.wait()\n"
                    "            out[src * rows : (src + 1) * rows] = chunk @ weight.t()\n",
                )
            ],
            "waited for each incoming shard before it multiplied",
        ),
        # the next shard received into the one being sent and multiplied
        (
            [("                nxt = torch.empty_like(chunk)", "                nxt = chunk")],
            "received the next shard into the tensor it was still sending",
        ),
    ],
    ids=[
        "wrong index",
        "missing wait",
        "kit gather",
        "no overlap",
        "never forwards",
        "built-in",
        "waited early and again",
        "received over the shard in hand",
    ],
)
def test_ag_matmul_mistakes_are_named(edits, words):
    report = ok.grading.check_ag_matmul(_build(AG, "ag_matmul", *edits))
    assert not report.all_passed
    assert words in _text(report), _text(report)


def test_an_unfinished_ag_matmul_says_so():
    def ag_matmul(x, weight):
        raise NotImplementedError

    assert "not implemented yet" in _text(ok.grading.check_ag_matmul(ag_matmul))


@pytest.mark.parametrize(
    "edits",
    [
        [],
        # each combine waited one chunk later, after the next chunk's expert
        [
            (
                "            combines.append((c, back, h2))\n",
                "            combines.append((c, back, h2))\n"
                "            if c:\n                combines[c - 1][2].wait()\n",
            )
        ],
    ],
    ids=["the solution", "combines waited one chunk later"],
)
def test_the_chunked_moe_solutions_pass(edits):
    report = ok.grading.check_chunked_moe(_build(MOE, "chunked_moe", *edits))
    assert report.all_passed, _text(report)


@pytest.mark.parametrize(
    ("edits", "words"),
    [
        # outputs left in expert order
        (
            [
                (
                    "            out[plans[c][0]] = back",
                    "            out[plans[c][0].sort().values] = back",
                )
            ],
            "it holds token",
        ),
        # the combine's split sizes the dispatch's way round
        (
            [
                (
                    "ok.all_to_all(back, y, send[c].tolist(), recv[c].tolist()",
                    "ok.all_to_all(back, y, recv[c].tolist(), send[c].tolist()",
                )
            ],
            "split_sizes",
        ),
        # each dispatch waited as soon as it is issued, the next only after computing
        (
            [
                ("            nxt = dispatch(c + 1) if c + 1 < chunks else None\n", ""),
                (
                    "            pending = nxt\n",
                    "            pending = dispatch(c + 1) if c + 1 < chunks else None\n"
                    "            if pending:\n                pending[1].wait()\n",
                ),
            ],
            "no dispatch in flight while its expert computed",
        ),
        # the expert reads the chunk before its dispatch arrived
        (
            [("            h.wait()\n            y = expert(buf)", "            y = expert(buf)")],
            "never waited",
        ),
        # the built-in all_to_all_single
        (
            [
                (
                    "            h = ok.all_to_all(buf, x[plans[c][0]], recv[c].tolist(), send[c].tolist(),\n"
                    "                              async_op=True)",
                    "            h = torch.distributed.all_to_all_single(buf, x[plans[c][0]], recv[c].tolist(),\n"
                    "                              send[c].tolist(), async_op=True)",
                )
            ],
            "called torch.distributed.all_to_all_single",
        ),
        # each combine waited as soon as it is issued: nothing computes while it travels
        (
            [
                (
                    "            combines.append((c, back, h2))\n",
                    "            combines.append((c, back, h2))\n            h2.wait()\n",
                )
            ],
            "waited for chunk 0's combine before its expert began on chunk 1: nothing computed",
        ),
        # the combine as a blocking all-to-all
        (
            [
                (
                    "ok.all_to_all(back, y, send[c].tolist(), recv[c].tolist(), async_op=True)",
                    "ok.all_to_all(back, y, send[c].tolist(), recv[c].tolist())",
                ),
                ("            h.wait()\n            out[", "            out["),
            ],
            "waited for chunk 0's combine before its expert began on chunk 1: nothing computed",
        ),
        # the chunk's tokens numbered from 0: every chunk sends the first chunk's rows
        (
            [
                (
                    "order = torch.argsort(expert_of[lo:hi], stable=True) + lo",
                    "order = torch.argsort(expert_of[lo:hi], stable=True)",
                )
            ],
            "Add the chunk's offset: order = torch.argsort(expert_of[lo:hi], stable=True) + lo",
        ),
        # the next dispatch issued early but waited at once, before this chunk computes
        (
            [
                (
                    "            nxt = dispatch(c + 1) if c + 1 < chunks else None\n",
                    "            nxt = dispatch(c + 1) if c + 1 < chunks else None\n"
                    "            if nxt:\n                nxt[1].wait()\n",
                )
            ],
            "no dispatch in flight while its expert computed",
        ),
    ],
    ids=[
        "not unsorted",
        "swapped splits",
        "not pipelined",
        "missing wait",
        "built-in",
        "combine waited at once",
        "blocking combine",
        "no chunk offset",
        "next dispatch waited at once",
    ],
)
def test_chunked_moe_mistakes_are_named(edits, words):
    report = ok.grading.check_chunked_moe(_build(MOE, "chunked_moe", *edits))
    assert not report.all_passed
    assert words in _text(report), _text(report)
