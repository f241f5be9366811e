"""The checks of labs 06 and 07 name each typical mistake (learners' wrappers and bucketers)."""

import torch
import torch.distributed as dist

import overlapkit as ok

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
        sync = self.mistake == "sync"
        handle = ok.ring_all_reduce(p.grad, async_op=not sync)
        self.pending.append((p, handle))

    def finish_gradient_synchronization(self):
        if self.mistake == "after_backward":
            for p in self.module.parameters():
                if p.requires_grad:
                    ok.ring_all_reduce(p.grad)
                    p.grad /= ok.world_size()
            return
        for p, handle in self.pending:
            if self.mistake != "no_wait" and handle is not None:
                handle.wait()
            if self.mistake != "sum":
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
    assert "divided twice" in _lines(report) or "clear your list" in _lines(report)


def test_hook_ddp_missing_wait_is_named():
    report = ok.grading.check_hook_ddp(_variant("no_wait"))
    assert not report.all_passed
    assert "never waited" in _lines(report) or "not all-reduced" in _lines(report)


# ----------------------------------------------------------------------------- lab 07


def assign_buckets(sizes, bucket_mb):
    limit = float("inf") if bucket_mb is None else bucket_mb * 2**20
    buckets, total = [], 0
    for i, n in enumerate(sizes):
        if buckets and total + n <= limit:
            buckets[-1].append(i)
            total += n
        else:
            buckets.append([i])
            total = n
    return buckets


def test_assign_buckets_solution_passes():
    assert ok.grading.check_assign_buckets(assign_buckets).all_passed


def test_assign_buckets_strict_limit_is_named():
    def strict(sizes, bucket_mb):
        limit = float("inf") if bucket_mb is None else bucket_mb * 2**20
        buckets, total = [], 0
        for i, n in enumerate(sizes):
            if buckets and total + n < limit:
                buckets[-1].append(i)
                total += n
            else:
                buckets.append([i])
                total = n
        return buckets

    assert "(≤, not <)" in _lines(ok.grading.check_assign_buckets(strict))


def test_assign_buckets_megabytes_instead_of_mebibytes_is_named():
    def decimal(sizes, bucket_mb):
        limit = float("inf") if bucket_mb is None else bucket_mb * 1e6
        buckets, total = [], 0
        for i, n in enumerate(sizes):
            if buckets and total + n <= limit:
                buckets[-1].append(i)
                total += n
            else:
                buckets.append([i])
                total = n
        return buckets

    lines = _lines(ok.grading.check_assign_buckets(decimal))
    assert "✘" not in lines or "too early" in lines or "expected" in lines
    assert not ok.grading.check_assign_buckets(decimal).all_passed


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
    assert "got [[], [0]" in lines or "got [[]" in lines


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
        self.buckets = assign_buckets(sizes, bucket_mb)
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
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self._launch(self.next)
            self.next += 1

    def finish_gradient_synchronization(self):
        for b, flat, handle in self.pending:
            handle.wait()
            if b is None:
                p, flat = flat
                p.grad.copy_(flat.view_as(p.grad) / ok.world_size())
                continue
            flat /= ok.world_size()
            offset = 0
            for i in self.buckets[b]:
                g = self.order[i].grad
                if self.mistake != "no_copy_back":
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self.pending.clear()
        self.missing = [len(b) for b in self.buckets]
        self.next = 0


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
    assert "not all-reduced" in _lines(report)
