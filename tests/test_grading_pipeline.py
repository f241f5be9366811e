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

    assert "alternate: one forward, then one backward" in _lines(
        ok.grading.check_1f1b_schedule(swapped)
    )


def gpipe_step(stage, inputs, targets, m, mistake=None):
    if ok.rank() == 0:
        outs, sends = [], []
        for x in torch.tensor_split(inputs, m):
            out = stage(x)
            if mistake == "blocking":
                ok.p2p.send(out.detach(), 1)
            else:
                handle = ok.p2p.isend(out.detach(), 1)
                if mistake == "wait_at_once":
                    handle.wait()
                sends.append(handle)
            outs.append(out)
        for h in sends:
            h.wait()
        for out in outs:
            grad = torch.empty_like(out)
            ok.p2p.recv(grad, 1)
            out.backward(grad)
    else:
        ys = torch.tensor_split(targets, m)
        bufs = [torch.empty(len(y), ACT) for y in ys]
        recvs = [ok.p2p.irecv(b, 0) for b in bufs]
        sends = []
        for buf, handle, y in zip(bufs, recvs, ys, strict=True):
            handle.wait()
            if mistake != "no_requires_grad":
                buf.requires_grad_()
            loss = torch.nn.functional.mse_loss(stage(buf), y)
            if mistake != "unweighted":
                loss = loss * len(y) / len(targets)
            loss.backward()
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
    assert "weight each micro-batch's loss by its share of the batch" in lines


def test_gpipe_step_received_activation_without_requires_grad_is_named():
    lines = _lines(ok.grading.check_gpipe_step(_step("no_requires_grad")))
    assert "requires_grad_()" in lines
