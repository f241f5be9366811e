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

    assert "min(p − s − 1, m)" in _lines(ok.grading.check_1f1b_schedule(too_warm))


def test_1f1b_that_is_really_gpipe_is_named():
    def gpipe(stages, m):
        return [[f"F{k}" for k in range(m)] + [f"B{k}" for k in range(m)] for _ in range(stages)]

    lines = _lines(ok.grading.check_1f1b_schedule(gpipe))
    assert "forward(s) before its first backward" in lines


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


def gpipe_step(stage, inputs, targets, m, mistake=None):
    if ok.rank() == 0:
        outs, sends = [], []
        for x in torch.tensor_split(inputs, m):
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
        ys = torch.tensor_split(targets, m)
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

    assert "called ok.pipeline.make_schedule" in _lines(ok.grading.check_1f1b_schedule(borrowed))


def test_1f1b_tuples_instead_of_strings_are_named():
    def tuples(stages, m):
        return [[(a[0], int(a[1:])) for a in s] for s in one_f_one_b(stages, m)]

    assert "must be strings like 'F0'" in _lines(ok.grading.check_1f1b_schedule(tuples))


def test_1f1b_warm_up_hint_counts_the_steady_states_first_forward():
    def gpipe(stages, m):
        return [[f"F{k}" for k in range(m)] + [f"B{k}" for k in range(m)] for _ in range(stages)]

    lines = _lines(ok.grading.check_1f1b_schedule(gpipe))
    assert "Stage 0 ran 4 forward(s) before its first backward; 1F1B runs 2" in lines
