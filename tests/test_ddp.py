"""The data-parallel wrappers: same weights as one process on the whole batch, and clear errors."""

import pytest
import torch
import torch.distributed as dist

import overlapkit as ok

STEPS = 5
PER_RANK = 4


class Net(torch.nn.Module):
    """Tied, frozen, unused and sometimes-unused parameters, and a buffer."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.hidden = torch.nn.Linear(8, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.branch = torch.nn.Linear(8, 8)  # used only for inputs whose first value > 0
        self.never = torch.nn.Linear(8, 3)  # never used
        self.dec = torch.nn.Linear(8, 8)
        self.dec.weight = self.inp.weight  # tied: one parameter under two names
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.hidden(h)) + self.frozen(h)
        if x[0, 0] > 0:
            h = h + self.branch(h)
        return self.dec(h) * self.scale


def _model(seed=0):
    torch.manual_seed(seed)
    return Net()


def _batches(world):
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        x = torch.randn(world * PER_RANK, 8, generator=gen)
        # the branch runs on some ranks only, differently each step
        for r in range(world):
            x[r * PER_RANK, 0] = 1.0 if (r + step) % 2 else -1.0
        out.append((x, torch.randn(world * PER_RANK, 8, generator=gen)))
    return out


def _reference(world):
    """One process, the whole batch: each rank's slice is its own mean, as DDP averages."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(world):
        loss = 0.0
        for r in range(world):
            sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
            loss = loss + torch.nn.functional.mse_loss(model(x[sl]), y[sl]) / world
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def _train(wrapper, world, me, log_loss=False, set_to_none=True):
    opt = torch.optim.SGD(wrapper.parameters(), lr=0.1, momentum=0.9)
    sl = slice(me * PER_RANK, (me + 1) * PER_RANK)
    for x, y in _batches(world):
        loss = torch.nn.functional.mse_loss(wrapper(x[sl]), y[sl])
        loss.backward()
        if log_loss:  # the learner's own collective while gradients are in flight
            logged = loss.detach().clone()
            torch.distributed.all_reduce(logged)
        wrapper.finish_gradient_synchronization()
        wrapper.finish_gradient_synchronization()  # idempotent
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


CONFIGS = [
    ("NaiveDDP", {}),
    ("OverlapDDP", {}),
    ("BucketedDDP", {"bucket_mb": 1e-4}),  # ~100 bytes: smaller than most parameters
    ("BucketedDDP", {"bucket_mb": 0.0005}),
    ("BucketedDDP", {}),
    ("BucketedDDP", {"bucket_mb": None}),
]


def _all_configs(all_reduce):
    me, world = ok.rank(), ok.world_size()
    want = _reference(world).state_dict()
    worst = {}
    for name, kwargs in CONFIGS:
        # rank-dependent seed: the broadcast from rank 0 must make them equal
        wrapper = getattr(ok, name)(_model(seed=me), all_reduce=all_reduce, **kwargs)
        # zeroing in place keeps .grad a view into the bucket: the copy-free path
        _train(wrapper, world, me, log_loss=True, set_to_none=len(worst) % 2 == 0)
        got = wrapper.module.state_dict()
        diff = max((got[k] - want[k]).abs().max().item() for k in want)
        worst[f"{name}{kwargs}"] = diff
        assert wrapper.module.never.weight.grad is None  # no rank ever used it
    return worst


@pytest.mark.parametrize(
    "world, all_reduce, link",
    [
        (2, None, None),
        (3, None, None),
        (2, "ring", None),
        (3, "ring", ok.Link(20, 5)),
        (2, "ring", ok.Link(20, 5)),
    ],
)
def test_every_wrapper_trains_like_one_process_on_the_whole_batch(world, all_reduce, link):
    results = ok.launch(_all_configs, all_reduce, world_size=world, link=link, timeout=120)
    for rank, worst in enumerate(results):
        for config, diff in worst.items():
            assert diff < 1e-5, f"rank {rank}, {config}: max |Δweight| = {diff}"


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))


def _accumulate(all_reduce):
    """Two micro-batches per step: the first inside no_sync(), the second synchronised."""
    me, world = ok.rank(), ok.world_size()
    reference = _mlp()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    wrapper = ok.BucketedDDP(_mlp(), bucket_mb=0.0005, all_reduce=all_reduce)
    opt = torch.optim.SGD(wrapper.parameters(), lr=0.1, momentum=0.9)
    half = PER_RANK // 2
    for x, y in _batches(world):
        torch.nn.functional.mse_loss(reference(x), y).backward()
        plain.step()
        plain.zero_grad()
        lo = me * PER_RANK
        with wrapper.no_sync():
            a = slice(lo, lo + half)
            (torch.nn.functional.mse_loss(wrapper(x[a]), y[a]) / 2).backward()
        b = slice(lo + half, lo + PER_RANK)
        (torch.nn.functional.mse_loss(wrapper(x[b]), y[b]) / 2).backward()
        wrapper.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad(set_to_none=True)
    got, want = wrapper.module.state_dict(), reference.state_dict()
    return max((got[k] - want[k]).abs().max().item() for k in want)


@pytest.mark.parametrize("all_reduce", [None, "ring"])
def test_no_sync_accumulation_equals_one_big_batch(all_reduce):
    diffs = ok.launch(_accumulate, all_reduce, world_size=2, timeout=60)
    assert all(d < 1e-5 for d in diffs), diffs


def _two_data_parallel_groups(all_reduce):
    """Four ranks, two replicas of two ranks each ({0, 2} and {1, 3}), each on its group."""
    me = ok.rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes both
    torch.manual_seed(10 + me)  # rank 0 (resp. 1) of each group broadcasts its weights
    model = torch.nn.Linear(4, 2)
    wrapper = ok.BucketedDDP(model, bucket_mb=None, all_reduce=all_reduce, group=groups[me % 2])
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(me))
    wrapper(x).sum().backward()
    wrapper.finish_gradient_synchronization()
    return model.weight.detach().clone(), model.weight.grad.clone(), x


@pytest.mark.parametrize("all_reduce", [None, "ring"])
def test_wrappers_on_two_subgroups_at_once_average_within_their_own(all_reduce):
    """The built-in path must not make a group of the wrapper's ranks alone, a call the
    other group's ranks never join (a hang, or groups cross-wired)."""
    out = ok.launch(_two_data_parallel_groups, all_reduce, world_size=4, timeout=90)
    for members in ([0, 2], [1, 3]):
        # d(sum of outputs)/dW: every row is the sum of the rank's inputs; averaged in-group
        want = sum(out[r][2].sum(0) for r in members) / 2
        for r in members:
            assert torch.equal(out[r][0], out[members[0]][0]), "weights differ in a group"
            assert torch.allclose(out[r][1], want.expand(2, 4), atol=1e-6), (r, out[r][1])
    assert not torch.equal(out[0][0], out[1][0])  # the two groups kept their own weights


def _no_sync_right_after_a_synchronised_backward():
    wrapper = ok.BucketedDDP(torch.nn.Linear(4, 4), bucket_mb=None, all_reduce="ring")
    wrapper(torch.randn(2, 4)).sum().backward()  # its AllReduce launched, not waited
    try:
        with wrapper.no_sync():
            pass
    except RuntimeError as exc:
        said = str(exc)
    else:
        said = "no error"
    wrapper.finish_gradient_synchronization()
    return said


def test_no_sync_while_the_last_backwards_all_reduces_fly_is_refused():
    """A backward inside that block would add into .grad views of buffers the
    communication thread is still reducing: silent garbage."""
    said = ok.launch(_no_sync_right_after_a_synchronised_backward, world_size=2, timeout=60)
    for message in said:
        assert "call finish_gradient_synchronization() first" in message, message


class BatchNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.out = (
            torch.nn.Linear(4, 6),
            torch.nn.BatchNorm1d(6),
            torch.nn.Linear(6, 2),
        )

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x))))


def _batchnorm_beside_torch_ddp(broadcast):
    """The kit's wrapper and PyTorch's DDP side by side, each rank on data of its own."""
    me = ok.rank()
    torch.manual_seed(0)
    ours = BatchNormNet()
    theirs = BatchNormNet()
    theirs.load_state_dict(ours.state_dict())
    kit = ok.BucketedDDP(ours, bucket_mb=None, broadcast_buffers=broadcast)
    ddp = torch.nn.parallel.DistributedDataParallel(theirs, broadcast_buffers=broadcast)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    gen = torch.Generator().manual_seed(me)
    for _ in range(4):
        x = torch.randn(8, 4, generator=gen) * (1 + me) + me  # statistics differ by rank
        y = torch.randn(8, 2, generator=gen)
        torch.nn.functional.mse_loss(kit(x), y).backward()
        kit.finish_gradient_synchronization()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    want = theirs.state_dict()
    return {k: (v - want[k]).abs().max().item() for k, v in ours.state_dict().items()}


@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_follow_torch_ddps_broadcast_buffers(broadcast):
    """Buffers broadcast at construction only would let BatchNorm's running statistics
    drift apart; PyTorch's DDP broadcasts them before every forward by default."""
    for rank, diffs in enumerate(ok.launch(_batchnorm_beside_torch_ddp, broadcast, world_size=2,
                                           timeout=90)):  # fmt: skip
        assert all(d < 1e-5 for d in diffs.values()), (rank, diffs)


class SometimesZero(torch.nn.Module):
    """``gate`` is used with a gradient of zeros on rank 0 and not used at all on rank 1."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.gate = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        out = self.lin(x)
        return out + 0.0 * self.gate if ok.rank() == 0 else out


def _zeros_here_unused_there(all_reduce):
    torch.manual_seed(0)
    model = SometimesZero()
    wrapper = ok.BucketedDDP(model, bucket_mb=None, all_reduce=all_reduce)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)
    wrapper(torch.randn(2, 3)).sum().backward()
    wrapper.finish_gradient_synchronization()
    has_grad = model.gate.grad is not None
    opt.step()
    return has_grad, model.gate.detach().clone()


@pytest.mark.parametrize("all_reduce", [None, "ring"])
def test_a_parameter_used_with_zero_gradient_on_one_rank_has_a_gradient_on_every_rank(all_reduce):
    """Use read from the values (part.any()) would give zeros here, None there, and weight
    decay would move one replica's parameter only. As PyTorch's used-parameter bitmap
    (find_unused_parameters=True), a parameter any rank used has a gradient on every rank."""
    (grad0, gate0), (grad1, gate1) = ok.launch(_zeros_here_unused_there, all_reduce,
                                               world_size=2, timeout=60)  # fmt: skip
    assert grad0 and grad1, (grad0, grad1)
    assert torch.equal(gate0, gate1), (gate0, gate1)


class UsedOutOfOrder(torch.nn.Module):
    """Registered a, c, b, extra; used a, b, c, extra (extra on rank 0 only)."""

    def __init__(self):
        super().__init__()
        self.a, self.c, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.extra = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return h + self.extra(h) if ok.rank() == 0 else h


def _buckets_before_and_after_a_step():
    torch.manual_seed(0)
    model = UsedOutOfOrder()
    wrapper = ok.OverlapDDP(model)
    layers = lambda: [
        name.split(".")[0] for row in wrapper.bucket_table() for name in row["params"]
    ]  # noqa: E731
    before = layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(ok.rank())
    for _ in range(3):
        wrapper(torch.randn(2, 4, generator=gen)).sum().backward()
        wrapper.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    return before, layers(), [p.detach().clone() for p in model.parameters()]


def test_buckets_follow_the_order_gradients_arrived_in_after_the_first_step():
    """Reverse registration order alone would forever hold c's AllReduce behind b's, whose
    gradients come later; PyTorch's reducer rebuilds its buckets from the arrival
    order after the first iteration (rank 0's, so that every rank issues the same)."""
    (before, after0, weights0), (_, after1, weights1) = ok.launch(
        _buckets_before_and_after_a_step, world_size=2, timeout=60)  # fmt: skip
    assert before == ["extra"] * 2 + ["b"] * 2 + ["c"] * 2 + ["a"] * 2
    assert after0 == after1 == ["extra"] * 2 + ["c"] * 2 + ["b"] * 2 + ["a"] * 2, (after0, after1)
    assert all(torch.equal(p, q) for p, q in zip(weights0, weights1, strict=True))


def _torch_ddp_with_kit_hook():
    me = ok.rank()
    ours, theirs = _mlp(), _mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(theirs, bucket_cap_mb=0.0002)
    ddp.register_comm_hook(None, ok.ddp_comm_hook())
    kit = ok.BucketedDDP(ours, bucket_mb=0.0002, all_reduce="ring")
    gen = torch.Generator().manual_seed(me)
    for _ in range(3):
        x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        torch.nn.functional.mse_loss(kit(x), y).backward()
        kit.finish_gradient_synchronization()
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), (p.grad - q.grad).abs().max()
            p.grad = q.grad = None
    return True


def test_torch_ddp_with_the_kit_comm_hook_averages_like_bucketed_ddp():
    assert ok.launch(_torch_ddp_with_kit_hook, world_size=2, link=ok.Link(20, 5), timeout=60)


def _torch_ddp_with_kit_hook_on_a_gpu():
    device = torch.device("cuda", ok.rank() % torch.cuda.device_count())
    ours, theirs = _mlp().to(device), _mlp().to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(theirs, bucket_cap_mb=0.0002)
    ddp.register_comm_hook(None, ok.ddp_comm_hook())
    kit = ok.BucketedDDP(ours, bucket_mb=0.0002, all_reduce="ring")
    gen = torch.Generator().manual_seed(ok.rank())
    worst = 0.0
    for _ in range(3):
        x, y = torch.randn(64, 8, generator=gen), torch.randn(64, 8, generator=gen)
        x, y = x.to(device), y.to(device)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        torch.nn.functional.mse_loss(kit(x), y).backward()
        kit.finish_gradient_synchronization()
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            worst = max(worst, (p.grad - q.grad).abs().max().item())
            p.grad = q.grad = None
    return worst


@pytest.mark.gpu
def test_on_a_gpu_the_kit_comm_hooks_future_orders_the_reducers_copy_after_the_op():
    """With a CPU future, the hook's then() and the reducer's copy back could run before
    the ring's last GPU work ends."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    assert all(d < 1e-5 for d in ok.launch(_torch_ddp_with_kit_hook_on_a_gpu, world_size=2,
                                           timeout=120))  # fmt: skip


# --------------------------------------------------------------------------- bad input


def _no_trainable():
    m = torch.nn.Linear(3, 3)
    m.requires_grad_(False)
    ok.BucketedDDP(m)


def test_a_model_without_trainable_parameters_is_refused():
    with pytest.raises(ValueError, match="no trainable parameters"):
        ok.launch(_no_trainable, world_size=2, timeout=30)


def _bad_bucket(size):
    ok.BucketedDDP(torch.nn.Linear(3, 3), bucket_mb=size)


@pytest.mark.parametrize("size", [0, -1])
def test_a_bucket_size_that_is_not_positive_is_refused(size):
    with pytest.raises(ValueError, match="bucket_mb must be positive"):
        ok.launch(_bad_bucket, size, world_size=2, timeout=30)


def _different_models():
    width = 4 if ok.rank() == 1 else 3
    ok.OverlapDDP(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, width)))


def test_ranks_with_different_models_get_an_error_naming_rank_and_parameter():
    with pytest.raises(ValueError) as info:
        ok.launch(_different_models, world_size=2, timeout=30)
    text = str(info.value)
    assert "rank 1's model differs from rank 0's" in text
    assert "'1.weight' of shape [3, 3]" in text and "[4, 3]" in text


def _finish_before_backward():
    model = ok.BucketedDDP(torch.nn.Linear(3, 3))
    model(torch.randn(2, 3)).sum()
    model.finish_gradient_synchronization()


def test_finishing_before_backward_is_a_clear_error():
    with pytest.raises(RuntimeError, match="before any backward"):
        ok.launch(_finish_before_backward, world_size=2, timeout=30)


def _forgot_to_finish():
    model = ok.OverlapDDP(torch.nn.Linear(3, 3))
    model(torch.randn(2, 3)).sum().backward()
    model(torch.randn(2, 3)).sum().backward()


def test_a_second_step_without_synchronising_is_a_clear_error():
    with pytest.raises(RuntimeError, match="never synchronised"):
        ok.launch(_forgot_to_finish, world_size=2, timeout=30)


# --------------------------------------------------------------------------- timeline


def _timeline_step():
    tl = ok.Timeline()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    ddp = ok.BucketedDDP(model, bucket_mb=0.02, all_reduce="ring", timeline=tl)
    for _ in range(2):
        ddp(torch.randn(16, 64)).square().mean().backward()
        ddp.finish_gradient_synchronization()
    return tl, len(ddp.buckets)


def test_the_wrapper_records_forward_backward_and_one_comm_span_per_bucket():
    (tl, buckets), _ = ok.launch(_timeline_step, world_size=2, link=ok.Link(50, 1), timeout=60)
    names = [s.name for s in tl.spans]
    assert names.count("forward") == 2 and names.count("backward") == 2
    comm = [s for s in tl.spans if s.lane == "comm"]
    assert len(comm) == 2 * buckets and buckets > 1
    backward = [s for s in tl.spans if s.name == "backward"]
    # the first bucket starts during backward: that is the overlap
    assert backward[0].start < comm[0].start < backward[0].end
    assert tl.hidden_fraction() > 0


# --------------------------------------------------------------------------- CUDA (gpu)


def _cuda_wrappers():
    """Each wrapper on the rank's GPU (NCCL for the built-in, the kit's ring with CUDA
    streams and events), and PyTorch's DDP with the kit's comm hook, against one process."""
    me, world = ok.rank(), ok.world_size()
    device = ok.device()
    want = {k: v.to(device) for k, v in _accumulate_reference(world).items()}
    worst = {}
    for name, kwargs in [("NaiveDDP", {}), ("OverlapDDP", {"all_reduce": "ring"}),
                         ("BucketedDDP", {"bucket_mb": 0.0005}),
                         ("BucketedDDP", {"bucket_mb": 0.0005, "all_reduce": "ring"})]:  # fmt: skip
        wrapper = getattr(ok, name)(_mlp().to(device), **kwargs)
        opt = torch.optim.SGD(wrapper.parameters(), lr=0.1, momentum=0.9)
        sl = slice(me * PER_RANK, (me + 1) * PER_RANK)
        for x, y in _batches(world):
            x, y = x.to(device), y.to(device)
            torch.nn.functional.mse_loss(wrapper(x[sl]), y[sl]).backward()
            wrapper.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad(set_to_none=True)
        got = wrapper.module.state_dict()
        worst[f"{name}{kwargs}"] = max((got[k] - want[k]).abs().max().item() for k in want)
    ids = [device] if device.type == "cuda" else None
    torch_ddp = torch.nn.parallel.DistributedDataParallel(_mlp().to(device), device_ids=ids)
    torch_ddp.register_comm_hook(None, ok.ddp_comm_hook())
    opt = torch.optim.SGD(torch_ddp.parameters(), lr=0.1, momentum=0.9)
    sl = slice(me * PER_RANK, (me + 1) * PER_RANK)
    for x, y in _batches(world):
        x, y = x.to(device), y.to(device)
        torch.nn.functional.mse_loss(torch_ddp(x[sl]), y[sl]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = torch_ddp.module.state_dict()
    worst["torch DDP + kit hook"] = max((got[k] - want[k]).abs().max().item() for k in want)
    return worst


def _accumulate_reference(world):
    reference = _mlp()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(world):
        torch.nn.functional.mse_loss(reference(x), y).backward()
        plain.step()
        plain.zero_grad()
    return reference.state_dict()


@pytest.mark.gpu
def test_on_cuda_every_wrapper_and_torch_ddp_with_the_kit_hook_train_like_one_process():
    world = 2 if torch.cuda.device_count() >= 2 else 1  # one GPU: the single-rank path
    for rank, worst in enumerate(ok.launch(_cuda_wrappers, world_size=world, timeout=300)):
        for config, diff in worst.items():
            assert diff < 1e-4, f"rank {rank}, {config}: max |Δweight| = {diff}"


def _fails(tensor, group=None, async_op=True):
    def boom():
        raise ValueError("this all_reduce fails on purpose")

    return ok.collectives.run_async(boom, group)


def torch_ddp_backward_error(**hook):
    """What one backward of PyTorch's DDP through ``ok.ddp_comm_hook(**hook)`` raised, in
    words ("no error" if nothing): also used by test_compression."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    ddp = DistributedDataParallel(torch.nn.Linear(8, 8))
    ddp.register_comm_hook(None, ok.ddp_comm_hook(**hook))
    try:
        ddp(torch.randn(4, 8)).sum().backward()
    except Exception as exc:  # noqa: BLE001 - what the learner would see
        return str(exc)
    return "no error"


def test_a_kit_collective_that_fails_inside_torchs_ddp_fails_its_backward_with_the_reason():
    """The hook's callback reads the result first: one that ignored it passed a failed
    reduction on to PyTorch as a finished one (the gradients left unreduced, no error)."""
    for said in ok.launch(torch_ddp_backward_error, all_reduce=_fails, world_size=2, timeout=60):
        assert "this all_reduce fails on purpose" in said
