"""ok.pipeline: schedules as data, and steps whose gradients equal one device's."""

import pytest
import torch

import overlapkit as ok
from overlapkit.pipeline import PipelineError, PipelineStage, format_schedule, make_schedule


def test_gpipe_runs_every_forward_then_every_backward():
    assert format_schedule(make_schedule("gpipe", 2, 3)) == (
        "stage 0: F0 F1 F2 B0 B1 B2\nstage 1: F0 F1 F2 B0 B1 B2"
    )


def test_1f1b_warms_up_alternates_and_drains_as_in_the_textbook():
    assert format_schedule(make_schedule("1f1b", 2, 4)) == (
        "stage 0: F0 F1 B0 F2 B1 F3 B2 B3\nstage 1: F0 B0 F1 B1 F2 B2 F3 B3"
    )
    three = make_schedule("1f1b", 3, 4)
    assert " ".join(map(str, three[0])) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert " ".join(map(str, three[1])) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert " ".join(map(str, three[2])) == "F0 B0 F1 B1 F2 B2 F3 B3"


def test_1f1b_with_fewer_micro_batches_than_stages_is_gpipe():
    assert make_schedule("1f1b", 3, 1) == make_schedule("gpipe", 3, 1)


def test_sequential_is_one_micro_batch():
    assert format_schedule(make_schedule("sequential", 2, 8)) == "stage 0: F0 B0\nstage 1: F0 B0"


def test_an_unknown_schedule_name_is_refused():
    with pytest.raises(ValueError, match="unknown schedule 'zb'.*sequential, gpipe, 1f1b"):
        make_schedule("zb", 2, 4)


BATCH = 10  # divisible by 1 and 2 only of the micro-batch counts below


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )  # fmt: skip


CUTS = {2: [0, 2, 5], 3: [0, 2, 4, 5]}


def _every_schedule():
    """Each schedule, overlap on and off, m ∈ {1, 2, 4, 7, 8}: this stage's gradients
    against one device's on the whole batch."""
    s, p = ok.rank(), ok.world_size()
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)
    full = _model()
    torch.nn.functional.mse_loss(full(x), y).backward()
    lo, hi = CUTS[p][s], CUTS[p][s + 1]
    want = [q.grad for q in full[lo:hi].parameters()]
    worst = {}
    for schedule in ("sequential", "gpipe", "1f1b"):
        for overlap in (False, True):
            for m in (1, 2, 4, 7, 8):
                piece = _model()[lo:hi]
                stage = PipelineStage(piece)
                res = stage.step(x if s == 0 else None, y if s == p - 1 else None,
                                 torch.nn.functional.mse_loss, m, schedule, overlap)  # fmt: skip
                diff = max((q.grad - w).abs().max().item()
                           for q, w in zip(piece.parameters(), want, strict=True))  # fmt: skip
                worst[(schedule, overlap, m)] = (diff, res.peak_activations, res.loss)
    return worst


@pytest.mark.parametrize("stages, link", [(2, None), (2, ok.Link(20, 5)), (3, ok.Link(20, 5))])
def test_every_schedule_gives_one_devices_gradients(stages, link):
    results = ok.launch(_every_schedule, world_size=stages, link=link, timeout=120)
    for s, worst in enumerate(results):
        for (schedule, overlap, m), (diff, peak, _) in worst.items():
            assert diff < 1e-5, f"stage {s}, {schedule}, overlap={overlap}, m={m}: {diff}"
            micro = 1 if schedule == "sequential" else m
            if schedule == "1f1b":  # at most p − s micro-batches held
                assert peak <= min(stages - s, micro), (s, m, peak)
            else:
                assert peak == micro
    loss = results[-1][("gpipe", True, 7)][2]
    full = _model()
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)
    assert loss == pytest.approx(torch.nn.functional.mse_loss(full(x), y).item(), rel=1e-5)


def _too_many_micro_batches():
    s = ok.rank()
    piece = _model()[CUTS[2][s] : CUTS[2][s + 1]]
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    PipelineStage(piece).step(x if s == 0 else None, y if s == 1 else None,
                              torch.nn.functional.mse_loss, micro_batches=5)  # fmt: skip


def test_more_micro_batches_than_samples_is_refused_on_every_stage_without_a_hang():
    with pytest.raises(PipelineError, match="micro_batches=5 is larger than the batch"):
        ok.launch(_too_many_micro_batches, world_size=2, timeout=30)


def _mismatched_boundary():
    s = ok.rank()
    # stage 0 ends with 16 features; stage 1 expects 12
    piece = torch.nn.Linear(6, 16) if s == 0 else torch.nn.Linear(12, 3)
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    PipelineStage(piece).step(x if s == 0 else None, y if s == 1 else None,
                              torch.nn.functional.mse_loss, micro_batches=2)  # fmt: skip


def test_a_stage_boundary_of_the_wrong_shape_names_the_stage_and_the_shapes():
    with pytest.raises(PipelineError) as info:
        ok.launch(_mismatched_boundary, world_size=2, timeout=30)
    text = str(info.value)
    assert "stage 1: its module failed on micro-batch 0 of shape [2, 16]" in text
    assert "the activation stage 0 sent" in text


class _Pair(torch.nn.Module):
    def forward(self, x):
        return x * 2, x + 1


class _DoubleAfterTheFirst(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.calls = torch.nn.Linear(6, 6), 0

    def forward(self, x):
        self.calls += 1
        out = self.lin(x)
        return out if self.calls == 1 else out.double()


class _IgnoresItsInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(torch.ones_like(x))


def _stage_pair(first, second):
    s = ok.rank()
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    piece = first() if s == 0 else second()
    PipelineStage(piece).step(x if s == 0 else None, y if s == 1 else None,
                              torch.nn.functional.mse_loss, micro_batches=2)  # fmt: skip


def _last():
    return torch.nn.Linear(6, 3)


@pytest.mark.parametrize("first, second, words", [
    (_Pair, _last, "stage 0: its module returned a tuple on micro-batch 0"),
    (_DoubleAfterTheFirst, _last, "micro-batch 1's output is [2, 6] torch.float64"),
    (lambda: torch.nn.Linear(6, 6), _IgnoresItsInput, "stage 1: micro-batch 0's input got no"),
])  # fmt: skip
def test_what_a_stage_cannot_send_is_named_not_crashed_on(first, second, words):
    """A tuple output, a dtype that changes after micro-batch 0 and a stage that ignores
    its input are named, not left to crash deep in the transfers (or send garbage)."""
    with pytest.raises(PipelineError) as info:
        ok.launch(_stage_pair, first, second, world_size=2, timeout=60)
    assert words in str(info.value), str(info.value)


def _items_read_on_the_last_stage():
    s = ok.rank()
    piece = _model()[CUTS[2][s] : CUTS[2][s + 1]]
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    reads, item = [], torch.Tensor.item

    def counted(t):
        reads.append(1)
        return item(t)

    torch.Tensor.item = counted
    try:
        stage = PipelineStage(piece)
        result = stage.step(x if s == 0 else None, y if s == 1 else None,
                            torch.nn.functional.mse_loss, micro_batches=4)  # fmt: skip
    finally:
        torch.Tensor.item = item
    return len(reads), result.loss


def test_the_last_stage_reads_its_loss_from_the_device_once_per_step():
    """loss.item() per micro-batch would make the host wait for a GPU at each."""
    (_, _), (reads, loss) = ok.launch(_items_read_on_the_last_stage, world_size=2, timeout=60)
    assert isinstance(loss, float)
    assert reads <= 1, reads


def _timeline_step():
    s = ok.rank()
    tl = ok.Timeline()
    piece = _model()[CUTS[2][s] : CUTS[2][s + 1]]
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    PipelineStage(piece).step(x if s == 0 else None, y if s == 1 else None,
                              torch.nn.functional.mse_loss, 4, "1f1b", timeline=tl)  # fmt: skip
    return [(sp.name, sp.lane) for sp in tl.spans]


def test_a_step_records_compute_and_send_spans():
    first, last = ok.launch(_timeline_step, world_size=2, link=ok.Link(50, 1), timeout=30)
    assert [n for n, lane in first if lane == "compute"] == "F0 F1 B0 F2 B1 F3 B2 B3".split()
    assert [n for n, lane in first if lane == "comm"] == [f"act {k}" for k in range(4)]
    assert [n for n, lane in last if lane == "comm"] == [f"grad {k}" for k in range(4)]


def _on_cuda():
    s, p = ok.rank(), ok.world_size()
    device = ok.device()
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)
    full = _model()
    torch.nn.functional.mse_loss(full(x), y).backward()
    lo, hi = CUTS[p][s], CUTS[p][s + 1]
    piece = _model()[lo:hi].to(device)
    PipelineStage(piece).step(x.to(device) if s == 0 else None,
                              y.to(device) if s == p - 1 else None,
                              torch.nn.functional.mse_loss, 4, "1f1b", True)  # fmt: skip
    pairs = zip(piece.parameters(), full[lo:hi].parameters(), strict=True)
    return max((q.grad.cpu() - w.grad).abs().max().item() for q, w in pairs)


@pytest.mark.gpu
def test_on_two_gpus_1f1b_gives_one_devices_gradients():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: one stage per GPU")
    assert all(d < 1e-5 for d in ok.launch(_on_cuda, world_size=2, timeout=120))


def test_an_extra_warm_up_adds_forwards_on_every_stage_but_the_last():
    plan = make_schedule("1f1b", 2, 4, extra_warmup=1)
    assert (
        format_schedule(plan)
        == "stage 0: F0 F1 F2 B0 F3 B1 B2 B3\nstage 1: F0 B0 F1 B1 F2 B2 F3 B3"
    )


def test_an_extra_warm_up_hides_the_round_trip_of_slow_transfers_in_the_model():
    args = ([1.4, 1.4], [2.7, 2.7], 1.23, True)
    plain = ok.costmodel.pipeline_step(make_schedule("1f1b", 2, 8), *args)["step"]
    extra = ok.costmodel.pipeline_step(make_schedule("1f1b", 2, 8, extra_warmup=1), *args)["step"]
    assert extra < 0.9 * plain


@pytest.mark.parametrize("schedule", ["sequential", "gpipe", "1f1b"])
@pytest.mark.parametrize("stages, m", [(2, 1), (2, 4), (3, 7), (3, 8)])
def test_every_stage_on_one_device_gives_the_same_gradients(schedule, stages, m):
    from overlapkit.pipeline import run_on_one_device

    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)
    full = _model()
    loss = torch.nn.functional.mse_loss(full(x), y)
    loss.backward()
    split = _model()
    pieces = [split[CUTS[stages][s] : CUTS[stages][s + 1]] for s in range(stages)]
    res = run_on_one_device(pieces, x, y, torch.nn.functional.mse_loss, m, schedule)
    for q, w in zip(split.parameters(), full.parameters(), strict=True):
        assert torch.allclose(q.grad, w.grad, atol=1e-6)
    assert res.loss == pytest.approx(loss.item(), rel=1e-5)
    micro = 1 if schedule == "sequential" else m
    assert res.peak_activations == (min(stages, micro) if schedule == "1f1b" else micro)


def test_one_device_issues_actions_in_a_dependency_order():
    from overlapkit.pipeline import run_on_one_device

    pieces = [_model()[0:2], _model()[2:5]]
    res = run_on_one_device(pieces, torch.randn(8, 6), torch.randn(8, 3),
                            torch.nn.functional.mse_loss, 2, "gpipe")  # fmt: skip
    assert res.actions == ["0:F0", "0:F1", "1:F0", "1:F1", "1:B0", "0:B0", "1:B1", "0:B1"]


def _cuda_streams():
    from overlapkit.pipeline import run_on_one_device

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)
    full = _model()
    torch.nn.functional.mse_loss(full(x), y).backward()
    split = _model().to(device)
    pieces = [split[0:2], split[2:5]]
    tl = ok.Timeline()
    run_on_one_device(pieces, x.to(device), y.to(device), torch.nn.functional.mse_loss, 4,
                      "1f1b", timeline=tl)  # fmt: skip
    pairs = zip(split.parameters(), full.parameters(), strict=True)
    return max((q.grad.cpu() - w.grad).abs().max().item() for q, w in pairs), tl.lanes


@pytest.mark.gpu
def test_on_one_gpu_two_streams_give_one_devices_gradients():
    diff, lanes = _cuda_streams()
    assert diff < 1e-5 and {"stage 0", "stage 1"} <= set(lanes)
