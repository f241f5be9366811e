"""The checks of lab 08 name each typical mistake (1F1B generators, two-stage GPipe steps)."""

import torch

import overlapkit as ok

ACT = 16


def one_f_one_b(stages, m):
    out = []
    for s in range(stages):
        warm = min(stages - s - 1, m)
        acts = [f"F{k}" for k in range(warm)]
        for k in range(m - warm):
            acts += [f"F{warm + k}", f"B{k}"]
        out.append(acts + [f"B{k}" for k in range(m - warm, m)])
    return out


def _lines(report):
    return "\n".join(m for _, m in report.cases)


def test_1f1b_solution_passes():
    assert ok.grading.check_1f1b_schedule(one_f_one_b).all_passed


def test_1f1b_warm_up_one_too_long_is_named():
    def too_warm(stages, m):
        out = []
        for s in range(stages):
            warm = min(stages - s, m)
            acts = [f"F{k}" for k in range(warm)]
            for k in range(m - warm):
                acts += [f"F{warm + k}", f"B{k}"]
            out.append(acts + [f"B{k}" for k in range(m - warm, m)])
        return out

    lines = _lines(ok.grading.check_1f1b_schedule(too_warm))
    assert "Stage 0 ran 3 forwards before its first backward; 1F1B runs 2 here" in lines
    assert "stage 0 of 2 has 1 stage after it, and there are 4" in lines
    assert "more only hold more activations" in lines
    assert "min(p" not in lines  # the rule is the learner's to derive, not the hint's


def test_1f1b_warm_up_not_capped_by_the_micro_batch_count_is_named():
    def uncapped(stages, m):
        out = []
        for s in range(stages):
            warm = stages - s - 1
            acts = [f"F{k}" for k in range(warm)]
            for k in range(max(m - warm, 0)):
                acts += [f"F{warm + k}", f"B{k}"]
            out.append(acts + [f"B{k}" for k in range(max(m - warm, 0), m)])
        return out

    lines = _lines(ok.grading.check_1f1b_schedule(uncapped))
    assert "4 stages, 2 micro-batches, stage 0" in lines
    assert "not expected ['F2'] — there are only 2 micro-batches (0 to 1)" in lines


def test_1f1b_that_is_really_gpipe_is_named():
    def gpipe(stages, m):
        return [[f"F{k}" for k in range(m)] + [f"B{k}" for k in range(m)] for _ in range(stages)]

    lines = _lines(ok.grading.check_1f1b_schedule(gpipe))
    assert "forwards before its first backward" in lines


def test_1f1b_without_the_drain_is_named():
    def no_drain(stages, m):
        return [
            stage[: m + min(stages - s - 1, m)] for s, stage in enumerate(one_f_one_b(stages, m))
        ]

    assert "missing" in _lines(ok.grading.check_1f1b_schedule(no_drain))


def test_1f1b_backward_before_forward_in_the_steady_state_is_named():
    def swapped(stages, m):
        out = []
        for s in range(stages):
            warm = min(stages - s - 1, m)
            acts = [f"F{k}" for k in range(warm)]
            for k in range(m - warm):
                acts += [f"B{k}", f"F{warm + k}"] if warm else [f"F{k}", f"B{k}"]
            out.append(acts + [f"B{k}" for k in range(m - warm, m)])
        return out

    assert "each steady step runs its forward first, then the oldest backward" in _lines(
        ok.grading.check_1f1b_schedule(swapped)
    )


def _cut(batch, m, how):
    """Micro-batches the way a learner may cut them: the exercise's torch.tensor_split, or
    torch.chunk (also m pieces of at most ⌈batch/m⌉ rows here), or the mistakes."""
    if how == "torch_split":  # chunks OF m rows
        return torch.split(batch, m)
    if how == "torch_split_beyond_1":  # the same, after a special case for m = 1
        return torch.split(batch, m) if m > 1 else [batch]
    if how == "chunk":
        return torch.chunk(batch, m)
    if how == "one_micro_batch":  # micro_batches ignored
        return [batch]
    if how == "lopsided":  # m pieces, but one holds almost everything
        return torch.split(batch, [len(batch) - m + 1] + [1] * (m - 1))
    return torch.tensor_split(batch, m)


def gpipe_step(stage, inputs, targets, m, mistake=None):
    cuts = ("torch_split", "torch_split_beyond_1", "chunk", "one_micro_batch", "lopsided")
    cut = mistake if mistake in cuts else None
    if ok.rank() == 0:
        outs, sends = [], []
        for x in _cut(inputs, m, cut):
            out = stage(x)
            if mistake == "blocking":
                ok.p2p.send(out.detach(), 1)
            elif mistake == "torch_isend":
                sends.append(torch.distributed.isend(out.detach(), 1))
            else:
                handle = ok.p2p.isend(out.detach(), 1)
                if mistake == "wait_at_once":
                    handle.wait()
                sends.append(handle)
            outs.append(out)
        for h in sends:
            h.wait()
        for out in reversed(outs) if mistake == "reversed_grads" else outs:
            grad = torch.empty_like(out)
            if mistake == "torch_isend":
                torch.distributed.recv(grad, 1)
            else:
                ok.p2p.recv(grad, 1)
            out.backward(grad)
    else:
        ys = _cut(targets, m, "torch_split" if mistake == "rank_1_torch_split" else cut)
        bufs = [torch.empty(len(y), ACT) for y in ys]
        if mistake == "torch_isend":
            recvs = [torch.distributed.irecv(b, 0) for b in bufs]
        elif mistake != "blocking_recv":
            recvs = [ok.p2p.irecv(b, 0) for b in bufs]
        else:
            recvs = [None] * len(bufs)
        sends = []
        for buf, handle, y in zip(bufs, recvs, ys, strict=True):
            if handle is None:
                ok.p2p.recv(buf, 0)
            else:
                handle.wait()
            if mistake != "no_requires_grad":
                buf.requires_grad_()
            loss = torch.nn.functional.mse_loss(stage(buf), y)
            if mistake == "by_m":
                loss = loss / m
            elif mistake != "unweighted":
                loss = loss * len(y) / len(targets)
            loss.backward()
            if mistake == "blocking_grad_send":
                ok.p2p.send(buf.grad, 0)
            elif mistake == "torch_isend":
                sends.append(torch.distributed.isend(buf.grad, 0))
            else:
                sends.append(ok.p2p.isend(buf.grad, 0))
        for h in sends:
            h.wait()


def _step(mistake):
    def step(stage, inputs, targets, m):
        return gpipe_step(stage, inputs, targets, m, mistake)

    return step


def test_gpipe_step_solution_passes():
    report = ok.grading.check_gpipe_step(gpipe_step)
    assert report.all_passed, _lines(report)


def test_gpipe_step_blocking_sends_are_named():
    assert "blocking ok.p2p.send" in _lines(ok.grading.check_gpipe_step(_step("blocking")))


def test_gpipe_step_waiting_each_send_at_once_is_named():
    lines = _lines(ok.grading.check_gpipe_step(_step("wait_at_once")))
    assert "waited for each activation's send before the next forward" in lines


def test_gpipe_step_unweighted_micro_batch_losses_are_named():
    lines = _lines(ok.grading.check_gpipe_step(_step("unweighted")))
    assert "adding each micro-batch's mean loss as it is" in lines


def test_gpipe_step_received_activation_without_requires_grad_is_named():
    lines = _lines(ok.grading.check_gpipe_step(_step("no_requires_grad")))
    assert "requires_grad_()" in lines


def test_gpipe_step_built_in_point_to_point_is_named():
    lines = _lines(ok.grading.check_gpipe_step(_step("torch_isend")))
    assert "called torch.distributed." in lines and "use ok.p2p" in lines
    assert "blocking ok.p2p.send" not in lines


def test_gpipe_step_rank_1_blocking_receives_are_named():
    lines = _lines(ok.grading.check_gpipe_step(_step("blocking_recv")))
    assert "rank 1 received the activations with blocking ok.p2p.recv" in lines


def test_gpipe_step_rank_1_blocking_gradient_sends_are_named():
    lines = _lines(ok.grading.check_gpipe_step(_step("blocking_grad_send")))
    assert "rank 1 sent the gradients back with a blocking ok.p2p.send" in lines


def test_gpipe_step_dividing_by_m_on_uneven_micro_batches_is_named():
    lines = _lines(ok.grading.check_gpipe_step(_step("by_m")))
    assert "dividing each micro-batch's mean loss by m" in lines


def test_gpipe_step_gradients_received_in_the_wrong_order_get_an_order_hint():
    lines = _lines(ok.grading.check_gpipe_step(_step("reversed_grads")))
    assert "in the order rank 1 sends them" in lines


def test_1f1b_the_kits_own_schedule_is_not_an_answer():
    def borrowed(stages, m):
        return [[str(a) for a in s] for s in ok.pipeline.make_schedule("1f1b", stages, m)]

    report = ok.grading.check_1f1b_schedule(borrowed)
    assert "ran ok.pipeline.make_schedule" in _lines(report)
    assert report.passed == 0  # the kit's lists earn nothing


def test_1f1b_the_kits_own_schedule_under_another_name_is_not_an_answer():
    from overlapkit.pipeline import make_schedule as schedule  # not ok.pipeline.make_schedule

    def aliased(stages, m):
        return [[str(a) for a in s] for s in schedule("1f1b", stages, m)]

    report = ok.grading.check_1f1b_schedule(aliased)
    assert "ran ok.pipeline.make_schedule" in _lines(report) and report.passed == 0


def test_1f1b_tuples_instead_of_strings_are_named():
    def tuples(stages, m):
        return [[(a[0], int(a[1:])) for a in s] for s in one_f_one_b(stages, m)]

    assert "must be strings like 'F0'" in _lines(ok.grading.check_1f1b_schedule(tuples))


def test_1f1b_warm_up_hint_counts_the_steady_states_first_forward():
    def gpipe(stages, m):
        return [[f"F{k}" for k in range(m)] + [f"B{k}" for k in range(m)] for _ in range(stages)]

    lines = _lines(ok.grading.check_1f1b_schedule(gpipe))
    assert "Stage 0 ran 4 forwards before its first backward; 1F1B runs 2 here" in lines


def test_gpipe_step_torch_split_chunks_of_m_rows_are_named():
    lines = _lines(ok.grading.check_gpipe_step(_step("torch_split")))
    assert "rank 0 sent 10 activations" in lines and "micro_batches=1 asks for 1" in lines
    assert "torch.split(x, 1) cuts chunks OF 1 row (10 of them), not 1 chunk" in lines
    assert "torch.tensor_split(inputs, 1)" in lines


def test_gpipe_step_torch_split_is_named_at_every_micro_batch_count():
    # the batch of 10 is no square: chunks of m rows never come out as m chunks
    for m in (2, 3, 4, 5, 6):
        report = ok.grading.check_gpipe_step(_step("torch_split_beyond_1"), micro_batches=m)
        lines = _lines(report)
        assert f"torch.split(x, {m}) cuts chunks OF {m} rows" in lines, (m, lines)
        assert f"not {m} chunks: torch.tensor_split(inputs, {m})" in lines, (m, lines)


def test_gpipe_step_ignoring_micro_batches_is_named():
    report = ok.grading.check_gpipe_step(_step("one_micro_batch"))
    lines = _lines(report)
    assert "rank 0 sent 1 activation (10 rows) where micro_batches=4 asks for 4" in lines
    assert "The whole batch went as one micro-batch" in lines
    assert "waited for each" not in lines and not report.all_passed


def test_gpipe_step_ranks_that_cut_the_batch_differently_are_named():
    lines = _lines(ok.grading.check_gpipe_step(_step("rank_1_torch_split")))
    assert "The two ranks cut the batch differently: rank 1 expected 1 row, rank 0 sent 10" in lines


def test_gpipe_step_lopsided_micro_batches_are_named():
    lines = _lines(ok.grading.check_gpipe_step(_step("lopsided")))
    assert "rank 0's 4 activations have 7, 1, 1, 1 rows" in lines
    assert "about batch/m = 2.5 rows (at most 3)" in lines


def test_gpipe_step_with_torch_chunk_passes():
    # torch.chunk(10 rows, m) gives m pieces of at most ⌈10/m⌉ rows for m = 1, 3, 4
    report = ok.grading.check_gpipe_step(_step("chunk"))
    assert report.all_passed, _lines(report)
    assert "4 activations of 3, 3, 3, 1 rows out, 4 gradients back" in _lines(report)


def test_gpipe_step_solution_counts_its_messages():
    lines = _lines(ok.grading.check_gpipe_step(gpipe_step))
    assert "m=4: 4 activations of 3, 3, 2, 2 rows out, 4 gradients back" in lines
    assert "m=3: 3 activations of 4, 3, 3 rows out, 3 gradients back" in lines


def test_1f1b_last_stage_with_a_warm_up_is_told_it_is_the_last():
    def last_warm(stages, m):
        plan = one_f_one_b(stages, m)
        plan[-1] = [f"F{k}" for k in range(m)] + [f"B{k}" for k in range(m)]
        return plan

    lines = _lines(ok.grading.check_1f1b_schedule(last_warm))
    assert "Stage 1 ran 4 forwards before its first backward; 1F1B runs 1 here" in lines
    assert "stage 1 is the last, so each micro-batch's backward can follow its forward" in lines


def test_gpipe_step_cases_after_the_first_failure_count_as_failed():
    """Wrong gradients at m=4 end the check: the m=3 and overlap cases are not reached and
    count as failed (1 of 4 cases, 1.25 of 5 points; it scored 1 of the 2 it ran)."""
    report = ok.grading.check_gpipe_step(_step("unweighted"))
    assert (report.passed, report.total) == (1, 4), _lines(report)
    assert [m for _, m in report.cases[2:]] == [
        "gpipe_step with 3 micro-batch(es) on 2 ranks: not reached: the check stops at its "
        "first failure (above)",
        "overlap (rank 0's sends in flight during its next forwards, nothing blocking): not "
        "reached: the check stops at its first failure (above)",
    ]


def test_1f1b_cases_after_an_unfinished_one_count_as_failed():
    def unfinished_beyond_three_stages(stages, m):
        if stages > 3:
            raise NotImplementedError
        return one_f_one_b(stages, m)

    report = ok.grading.check_1f1b_schedule(unfinished_beyond_three_stages)
    assert (report.passed, report.total) == (3, 6), _lines(report)
    assert report.cases[3] == (False, "4 stages, 6 micro-batches: not implemented yet (still "
                               "raises NotImplementedError)")  # fmt: skip
    assert report.cases[4:] == [
        (False, "4 stages, 2 micro-batches: not reached: the check stops at its first failure "
         "(above)"),
        (False, "2 stages, 7 micro-batches: not reached: the check stops at its first failure "
         "(above)"),
    ]  # fmt: skip
