"""The checks of labs 06 and 07 name each typical mistake (learners' wrappers and bucketers)."""

import operator

import torch
import torch.distributed as dist

import overlapkit as ok

from .conftest import soak_runs

#: a race must fail every run: repeated 20 times under `make soak`
RACE_RUNS = soak_runs(3)

# ----------------------------------------------------------------------------- lab 06


class HookDDP(torch.nn.Module):
    """The lab 06 solution, with switches for the mistakes learners make."""

    mistake = None

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.pending = []
        for t in module.state_dict().values():
            dist.broadcast(t, src=0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args):
        return self.module(*args)

    def _on_grad_ready(self, p):
        if self.mistake == "after_backward":
            return
        if self.mistake == "builtin":
            self.pending.append((p, dist.all_reduce(p.grad, async_op=True)))
            return
        sync = self.mistake == "sync"
        handle = ok.ring_all_reduce(p.grad, async_op=not sync)
        if self.mistake == "divide_before_wait":
            p.grad /= ok.world_size()  # races with the ring still reading and writing it
        if self.mistake == "wait_in_hook":
            handle.wait()
        self.pending.append((p, handle))

    def finish_gradient_synchronization(self):
        if self.mistake == "after_backward":
            for p in self.module.parameters():
                if p.requires_grad:
                    ok.ring_all_reduce(p.grad)
                    p.grad /= ok.world_size()
            return
        if self.mistake == "every_parameter":
            for _, handle in self.pending:
                handle.wait()
            for p in self.module.parameters():  # the frozen layer's grad is None
                p.grad /= ok.world_size()
            self.pending.clear()
            return
        for p, handle in self.pending:
            if self.mistake != "no_wait" and handle is not None:
                handle.wait()
            if self.mistake == "divide_by_two":
                p.grad /= 2
            elif self.mistake not in ("sum", "divide_before_wait"):
                p.grad /= ok.world_size()
        if self.mistake != "keep_pending":
            self.pending.clear()


def _variant(name):
    return type(f"HookDDP_{name}", (HookDDP,), {"mistake": name})


def _lines(report):
    return "\n".join(m for _, m in report.cases)


def test_hook_ddp_solution_passes():
    report = ok.grading.check_hook_ddp(HookDDP)
    assert report.all_passed, _lines(report)


def test_hook_ddp_summed_gradients_are_named():
    report = ok.grading.check_hook_ddp(_variant("sum"))
    assert not report.all_passed
    assert "summed, not averaged" in _lines(report)


def test_hook_ddp_sync_all_reduce_in_the_hook_is_named():
    report = ok.grading.check_hook_ddp(_variant("sync"))
    assert "the hook all-reduces synchronously" in _lines(report)


def test_hook_ddp_all_reduce_after_backward_is_named_naive():
    report = ok.grading.check_hook_ddp(_variant("after_backward"))
    assert "that is NaiveDDP" in _lines(report)


def test_hook_ddp_pending_list_never_cleared_is_named():
    report = ok.grading.check_hook_ddp(_variant("keep_pending"))
    assert any(w in _lines(report) for w in ("divided twice", "clear your list", "not cleared"))


def test_hook_ddp_missing_wait_is_named():
    report = ok.grading.check_hook_ddp(_variant("no_wait"))
    assert not report.all_passed
    assert "never waited" in _lines(report) or "not all-reduced" in _lines(report)


def test_hook_ddp_builtin_all_reduce_is_named_not_mistaken_for_naive():
    report = ok.grading.check_hook_ddp(_variant("builtin"))
    assert "called torch.distributed.all_reduce" in _lines(report)
    assert "NaiveDDP" not in _lines(report)


def test_hook_ddp_waiting_inside_the_hook_is_named_not_told_to_pass_async_op():
    text = _lines(ok.grading.check_hook_ddp(_variant("wait_in_hook")))
    assert "handle.wait() inside the hook?" in text and "Pass async_op=True" not in text


def test_hook_ddp_dividing_the_frozen_layers_missing_grad_is_explained():
    text = _lines(ok.grading.check_hook_ddp(_variant("every_parameter")))
    assert "NoneType" in text and "frozen layer" in text


def test_hook_ddp_a_hard_coded_two_is_named_on_three_ranks():
    report = ok.grading.check_hook_ddp(_variant("divide_by_two"))
    assert not report.all_passed
    assert "divide by 2 instead of by ok.world_size()" in _lines(report)


def test_hook_ddp_dividing_a_gradient_before_its_wait_fails_every_time_as_a_race():
    for _ in range(RACE_RUNS):
        report = ok.grading.check_hook_ddp(_variant("divide_before_wait"))
        assert not report.all_passed
        assert "RaceError" in _lines(report) and "was changed while ring_all_reduce" in _lines(
            report
        ), _lines(report)


def test_a_gradient_whose_elements_disagree_by_different_factors_is_called_a_race():
    from overlapkit.grading.lab06_ddp import _hint

    right = torch.ones(4)
    got = torch.tensor([1.0, 1.0, 2.0, 0.5])  # some pieces reduced, some not: a race
    res = {"trace": [({}, {}, {"w": right}, {"w": got})], "names": ["w"], "buckets": None,
           "events": [{"calls": [(4, True)]}], "unwaited": []}  # fmt: skip
    hint = _hint([(res, None)], 0, 0, "w", 2, 2)
    assert "while its AllReduce was still running" in hint


# ----------------------------------------------------------------------------- lab 07


def _bucketer(unit, fits=operator.le):
    """The greedy bucket loop with a limit of ``bucket_mb * unit`` bytes, a gradient joining
    the bucket while ``fits(total, limit)``."""

    def assign(sizes, bucket_mb):
        limit = float("inf") if bucket_mb is None else bucket_mb * unit
        buckets, total = [], 0
        for i, n in enumerate(sizes):
            if buckets and fits(total + n, limit):
                buckets[-1].append(i)
                total += n
            else:
                buckets.append([i])
                total = n
        return buckets

    return assign


assign_buckets = _bucketer(2**20)


def test_assign_buckets_solution_passes():
    assert ok.grading.check_assign_buckets(assign_buckets).all_passed


def test_assign_buckets_strict_limit_is_named():
    strict = _bucketer(2**20, operator.lt)
    assert "(≤, not <)" in _lines(ok.grading.check_assign_buckets(strict))


def test_assign_buckets_megabytes_instead_of_mebibytes_is_named():
    lines = _lines(ok.grading.check_assign_buckets(_bucketer(1e6)))
    assert "1 020 000 bytes in a 1 MiB bucket, bucket_mb=1" in lines
    assert "Are these buckets of 1 × 10**6 bytes? bucket_mb counts MiB" in lines


def test_assign_buckets_kibibytes_instead_of_mebibytes_is_named_on_every_line():
    """A limit in KiB was told 10**6 bytes or '<' on its first line, nothing on the rest."""
    report = ok.grading.check_assign_buckets(_bucketer(2**10))
    wrong = [m for passed, m in report.cases if not passed]
    assert len(wrong) == 4 and all(
        "bucket_mb counts MiB, 1 MiB = 2**20 = 1048576 bytes, 1024 times as many." in m
        for m in wrong
    ), wrong
    assert wrong[0].endswith(
        "These are buckets of 2 KiB (2 × 2**10 = 2048 bytes): bucket_mb "
        "counts MiB, 1 MiB = 2**20 = 1048576 bytes, 1024 times as many."
    )
    decimal = [m for passed, m in ok.grading.check_assign_buckets(_bucketer(10**6)).cases
               if not passed]  # fmt: skip
    assert not any("KiB" in m for m in decimal), decimal
    assert "2 × 10**6 bytes?" in decimal[0]  # its first line: the same buckets as 2 KiB


def test_assign_buckets_empty_first_bucket_for_a_big_gradient_is_named():
    def empty_first(sizes, bucket_mb):
        limit = float("inf") if bucket_mb is None else bucket_mb * 2**20
        buckets, current, total = [], [], 0
        for i, n in enumerate(sizes):
            if total + n > limit:
                buckets.append(current)
                current, total = [], 0
            current.append(i)
            total += n
        return buckets + [current]

    lines = _lines(ok.grading.check_assign_buckets(empty_first))
    assert "Bucket 0 is empty" in lines and "(≤, not <)" not in lines


def test_assign_buckets_none_as_a_default_size_is_named():
    def default_25(sizes, bucket_mb):
        return assign_buckets(sizes, 25 if bucket_mb is None else bucket_mb)

    assert "bucket_mb=None means no limit" in _lines(ok.grading.check_assign_buckets(default_25))


def test_assign_buckets_a_flat_list_is_a_clear_failure_not_a_crash():
    def flat_for_none(sizes, bucket_mb):
        return list(range(len(sizes))) if bucket_mb is None else assign_buckets(sizes, bucket_mb)

    lines = _lines(ok.grading.check_assign_buckets(flat_for_none))
    assert "Return a list of buckets" in lines and "whose items are ints" in lines


def test_assign_buckets_sorted_by_size_is_named():
    def by_size(sizes, bucket_mb):
        order = sorted(range(len(sizes)), key=lambda i: sizes[i])
        return [[i] for i in order] if bucket_mb is not None else [order]

    assert "consecutive gradients in the order given" in _lines(
        ok.grading.check_assign_buckets(by_size)
    )


class BucketDDP(torch.nn.Module):
    """The lab 07 solution, with switches for mistakes."""

    mistake = None

    def __init__(self, module, bucket_mb):
        super().__init__()
        self.module = module
        for t in module.state_dict().values():
            dist.broadcast(t, src=0)
        params = [p for p in module.parameters() if p.requires_grad]
        self.order = list(reversed(params))
        sizes = [p.numel() * p.element_size() for p in self.order]
        bucketer = strict_buckets if self.mistake == "strict_buckets" else assign_buckets
        self.buckets = bucketer(sizes, bucket_mb)
        self.bucket_of = {id(self.order[i]): b for b, idx in enumerate(self.buckets) for i in idx}
        self.missing = [len(b) for b in self.buckets]
        self.next, self.pending = 0, []
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args):
        return self.module(*args)

    def _launch(self, b):
        flat = torch.cat([self.order[i].grad.reshape(-1) for i in self.buckets[b]])
        self.pending.append((b, flat, ok.ring_all_reduce(flat, async_op=True)))

    def _on_grad_ready(self, p):
        b = self.bucket_of[id(p)]
        self.missing[b] -= 1
        if self.mistake == "per_param":
            flat = p.grad.reshape(-1).clone()
            self.pending.append((None, (p, flat), ok.ring_all_reduce(flat, async_op=True)))
            return
        if self.mistake == "out_of_order":
            if self.missing[b] == 0:
                self._launch(b)
            return
        if self.mistake == "if_not_while":
            if self.next < len(self.buckets) and self.missing[self.next] == 0:
                self._launch(self.next)
                self.next += 1
            return
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self._launch(self.next)
            self.next += 1

    def finish_gradient_synchronization(self):
        for b, flat, handle in self.pending:
            if self.mistake == "divide_before_wait":
                flat /= ok.world_size()  # races with the ring still reading and writing it
                handle.wait()
                self._copy_back(b, flat)
                continue
            if self.mistake == "copy_back_before_wait":
                self._copy_back(b, flat / ok.world_size())  # reads it while in flight
                handle.wait()
                continue
            handle.wait()
            if b is None:
                p, flat = flat
                p.grad.copy_(flat.view_as(p.grad) / ok.world_size())
                continue
            flat /= 2 if self.mistake == "divide_by_two" else ok.world_size()
            offset = 0
            for i in self.buckets[b]:
                g = self.order[i].grad
                if self.mistake != "no_copy_back":
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        if self.mistake != "keep_pending":
            self.pending.clear()
        if self.mistake != "no_reset":
            self.missing = [len(b) for b in self.buckets]
            self.next = 0

    def _copy_back(self, b, flat):
        offset = 0
        for i in self.buckets[b]:
            g = self.order[i].grad
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def strict_buckets(sizes, bucket_mb):
    limit = bucket_mb * 2**20
    buckets, total = [], 0
    for i, n in enumerate(sizes):
        if buckets and total + n < limit:
            buckets[-1].append(i)
            total += n
        else:
            buckets.append([i])
            total = n
    return buckets


def _bucket_variant(name):
    return type(f"BucketDDP_{name}", (BucketDDP,), {"mistake": name})


def test_bucketed_ddp_solution_passes():
    report = ok.grading.check_bucketed_ddp(BucketDDP)
    assert report.all_passed, _lines(report)


def test_bucketed_ddp_one_all_reduce_per_parameter_is_named():
    report = ok.grading.check_bucketed_ddp(type("PerParam", (BucketDDP,), {"mistake": "per_param"}))
    assert "one per bucket" in _lines(report)


def test_bucketed_ddp_result_never_copied_back_is_named():
    report = ok.grading.check_bucketed_ddp(
        type("NoCopy", (BucketDDP,), {"mistake": "no_copy_back"})
    )
    assert "Copy each slice of it back" in _lines(report)


def test_bucketed_ddp_if_instead_of_while_is_named():
    report = ok.grading.check_bucketed_ddp(_bucket_variant("if_not_while"))
    assert "a while loop, not an if" in _lines(report)


def test_bucketed_ddp_buckets_out_of_order_are_named():
    report = ok.grading.check_bucketed_ddp(_bucket_variant("out_of_order"))
    assert "out of order" in _lines(report)


def test_bucketed_ddp_pending_never_cleared_is_named():
    report = ok.grading.check_bucketed_ddp(_bucket_variant("keep_pending"))
    assert "self.pending still held" in _lines(report)


def test_bucketed_ddp_state_never_reset_is_named():
    report = ok.grading.check_bucketed_ddp(_bucket_variant("no_reset"))
    assert "no AllReduce was issued at all" in _lines(report)


def test_bucketed_ddp_wrong_buckets_point_to_assign_buckets():
    report = ok.grading.check_bucketed_ddp(_bucket_variant("strict_buckets"))
    assert "check assign_buckets first" in _lines(report)


def test_bucketed_ddp_a_hard_coded_two_is_named_on_three_ranks():
    report = ok.grading.check_bucketed_ddp(_bucket_variant("divide_by_two"))
    assert not report.all_passed
    assert "divide by 2 instead of by ok.world_size()" in _lines(report)


def test_bucketed_ddp_dividing_the_bucket_before_its_wait_fails_every_time_as_a_race():
    for _ in range(RACE_RUNS):
        report = ok.grading.check_bucketed_ddp(_bucket_variant("divide_before_wait"))
        assert not report.all_passed
        assert "was changed while ring_all_reduce" in _lines(report), _lines(report)


def test_bucketed_ddp_reading_the_bucket_before_its_wait_fails_every_time_as_nan():
    for _ in range(RACE_RUNS):
        report = ok.grading.check_bucketed_ddp(_bucket_variant("copy_back_before_wait"))
        assert not report.all_passed
        assert "It is NaN" in _lines(report) and "before its handle's wait()" in _lines(report)
