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


@pytest.mark.parametrize(
    "edits",
    [
        [],
        # the ring the other way round, the product as F.linear
        [
            ("src = (me - k) % world", "src = (me + k) % world"),
            ("ok.p2p.isend(chunk, (me + 1) % world)", "ok.p2p.isend(chunk, (me - 1) % world)"),
            ("ok.p2p.irecv(nxt, (me - 1) % world)", "ok.p2p.irecv(nxt, (me + 1) % world)"),
            ("chunk @ weight.t()", "torch.nn.functional.linear(chunk, weight)"),
        ],
        # polled with is_completed() while multiplying row by row, then waited
        [
            (
                "            out[src * rows : (src + 1) * rows] = chunk @ weight.t()\n",
                "            for i in range(rows):\n"
                "                out[src * rows + i] = chunk[i : i + 1] @ weight.t()\n"
                "                [h.is_completed() for h in handles]\n"
                "            while not all(h.is_completed() for h in handles):\n"
                "                pass\n",
            )
        ],
    ],
    ids=["the solution", "the other way round", "polled"],
)
def test_the_ag_matmul_solutions_pass(edits):
    report = ok.grading.check_ag_matmul(_build(AG, "ag_matmul", *edits))
    assert report.all_passed, _text(report)


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
            (
                "every block holds shard 0's product, this rank's own: the shards it received "
                "were never multiplied. After each step's wait, take the received shard in hand"
            ),
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
        # the loop one step short: the last shard in hand is never multiplied
        (
            [("        for k in range(world):", "        for k in range(world - 1):")],
            "the block of shard 1 was never computed: no product on rank 0 took shard 1's rows",
        ),
        # each shard multiplied before its receive is waited (waited one step later)
        (
            [
                ("        chunk = x\n", "        chunk = x\n        pending = []\n"),
                (
                    "            for h in handles:\n                h.wait()\n",
                    "            for h in pending:\n                h.wait()\n"
                    "            pending = handles\n",
                ),
            ],
            "a shard multiplied before its receive was waited: the check keeps a receive buffer full of NaN",
        ),
        # the world size written as 2: on 3 ranks rank 2 sends to rank 1, which never receives
        (
            [("me, world = ok.rank(), ok.world_size()", "me, world = ok.rank(), 2")],
            (
                "to be received, but rank 1 returned having received 0 message(s) from it",
                "It passed on 2 ranks and fails on 3: did you write 2 where ok.world_size() belongs?",
            ),
        ),
        # the ring's neighbours taken mod 2
        (
            [
                (
                    "ok.p2p.isend(chunk, (me + 1) % world)",
                    "ok.p2p.isend(chunk, (me + 1) % 2)",
                ),
                (
                    "ok.p2p.irecv(nxt, (me - 1) % world)",
                    "ok.p2p.irecv(nxt, (me - 1) % 2)",
                ),
            ],
            "It passed on 2 ranks and fails on 3: did you write 2 where ok.world_size() belongs?",
        ),
        # a loop of 2 steps: right on 2 ranks, a block never computed on 3
        (
            [("        for k in range(world):", "        for k in range(2):")],
            "Did the loop run N = 3 steps, one per shard, the own one included? It passed on 2 "
            "ranks and fails on 3: did you write 2 where ok.world_size() belongs?",
        ),
        # the output made for 2 ranks' rows
        (
            [
                (
                    "out = x.new_empty((world * rows, weight.shape[0]))",
                    "out = x.new_empty((2 * rows, weight.shape[0]))",
                )
            ],
            "it passed on 2 ranks and fails on 3: did you write 2 where ok.world_size() belongs?",
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
        "one step short",
        "multiplied before its wait",
        "world written as 2",
        "neighbours mod 2",
        "two steps",
        "output for 2 ranks",
    ],
)
def test_ag_matmul_mistakes_are_named(edits, words):
    report = ok.grading.check_ag_matmul(_build(AG, "ag_matmul", *edits))
    assert not report.all_passed
    for fragment in words if isinstance(words, tuple) else (words,):
        assert fragment in _text(report), _text(report)


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
        # the buffers' sizes looked at while their all-to-alls are in flight
        [
            (
                "            h.wait()\n            y = expert(buf)",
                "            assert len(buf) == buf.shape[0] == buf.size(0)\n"
                "            h.wait()\n            y = expert(buf)",
            ),
            (
                "            combines.append((c, back, h2))\n",
                "            combines.append((c, back, h2))\n"
                "            assert back.numel() == back.shape[0] * back.shape[1]\n",
            ),
        ],
    ],
    ids=["the solution", "combines waited one chunk later", "sizes read in flight"],
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
        # the combine's output copied out before its wait
        (
            [
                (
                    "            h.wait()\n            out[plans[c][0]] = back",
                    "            out[plans[c][0]] = back\n            h.wait()",
                )
            ],
            (
                "got [nan, nan, nan, nan]",
                "chunk 0's combine output was read before its wait() returned. The check fills "
                "a tensor that an all-to-all is still writing with NaN",
            ),
        ),
        # the expert computes on the dispatched tokens before their wait
        (
            [
                (
                    "            h.wait()\n            y = expert(buf)",
                    "            y = expert(buf)\n            h.wait()",
                )
            ],
            "chunk 0's dispatched tokens (the dispatch's output) were read before its wait() returned",
        ),
        # the chunk's tokens dispatched in their own order, outputs put back by the sort
        (
            [
                (
                    "x[plans[c][0]], recv[c].tolist()",
                    "x[los[c] : los[c] + len(plans[c][0])], recv[c].tolist()",
                ),
                (
                    "        plans = []\n",
                    "        plans = []\n        los = [lo for lo, _ in ok.collectives.chunk_bounds(len(x), chunks)]\n",
                ),
            ],
            (
                # which token comes first out of order depends on the tokens, drawn afresh
                "chunk 0's dispatch sent token ",
                "which goes to rank ",
                "send the chunk's tokens sorted by expert",
            ),
        ),
        # neither sorted for the dispatch nor put back after the combine
        (
            [
                (
                    "x[plans[c][0]], recv[c].tolist()",
                    "x[los[c] : los[c] + len(plans[c][0])], recv[c].tolist()",
                ),
                (
                    "        plans = []\n",
                    "        plans = []\n        los = [lo for lo, _ in ok.collectives.chunk_bounds(len(x), chunks)]\n",
                ),
                (
                    "            out[plans[c][0]] = back",
                    "            out[los[c] : los[c] + len(back)] = back",
                ),
            ],
            "send the chunk's tokens sorted by expert",
        ),
        # the world size written as 2
        (
            [("        world = ok.world_size()", "        world = 2")],
            (
                # whichever rank raises first is named, with what it raised
                "chunked_moe on 3 ranks, 4 chunks: rank ",
                " raised ",
                "it passed on 2 ranks and fails on 3: did you write 2 (or minlength=2) where ok.world_size() belongs?",
            ),
        ),
        # the counts' length written as 2
        (
            [("minlength=world)", "minlength=2)")],
            "it passed on 2 ranks and fails on 3: did you write 2 (or minlength=2) where ok.world_size() belongs?",
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
        "combine read before its wait",
        "expert before the dispatch's wait",
        "dispatch not sorted",
        "neither sorted nor put back",
        "world written as 2",
        "minlength 2",
    ],
)
def test_chunked_moe_mistakes_are_named(edits, words):
    report = ok.grading.check_chunked_moe(_build(MOE, "chunked_moe", *edits))
    assert not report.all_passed
    for fragment in words if isinstance(words, tuple) else (words,):
        assert fragment in _text(report), _text(report)


def test_an_all_to_all_by_a_name_saved_before_the_check_is_told_not_counted_as_none():
    """The check watches ok.all_to_all by that name: a right answer calling it through a name
    taken beforehand is told how to call it, not that it ran no all-to-all."""
    source = MOE.replace(
        "import overlapkit as ok\n", "import overlapkit as ok\n\nA2A = ok.all_to_all\n", 1
    )
    source = source.replace("ok.all_to_all(", "A2A(")
    report = ok.grading.check_chunked_moe(_build(source, "chunked_moe"))
    assert not report.all_passed
    assert (
        "returned the right outputs, but none of its all-to-alls went through ok.all_to_all"
        in _text(report)
    )


def test_a_moe_without_any_all_to_all_is_told_so():
    source = textwrap.dedent("""
        def chunked_moe(x, expert_of, expert, chunks):
            return expert(x)
    """)
    report = ok.grading.check_chunked_moe(_build(source, "chunked_moe"))
    assert "ran no all-to-all the check saw: each token goes to its expert's rank" in _text(report)


def test_ring_messages_by_names_imported_before_the_check_are_told_how_to_call_them():
    source = AG.replace(
        "import overlapkit as ok\n",
        "import overlapkit as ok\nfrom overlapkit.p2p import isend, irecv\n",
        1,
    )
    source = source.replace("ok.p2p.isend(", "isend(").replace("ok.p2p.irecv(", "irecv(")
    report = ok.grading.check_ag_matmul(_build(source, "ag_matmul"))
    assert not report.all_passed
    assert "none of its messages went through ok.p2p.isend / ok.p2p.irecv" in _text(report)
