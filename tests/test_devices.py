"""Which devices and backends the ranks get, and that the process forking them never
touches a GPU: the choices are plain data, tested here with the GPUs' facts injected."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# What a GPU machine's torch would do when asked about its accelerator, made to fail here:
# any of these called while the forkserver preloads would initialise CUDA (or MPS) in the
# process every rank is forked from.
_DEVICE_PROBES = textwrap.dedent(
    """
    import functools
    import torch

    def refuse(owner, name):
        @functools.wraps(getattr(owner, name))  # torch's compiler reads __wrapped__ at import
        def probe(*args, **kwargs):
            raise AssertionError(f"the preload touched the accelerator: {name}")
        return probe

    for owner, names in (
        (torch.cuda, ["_lazy_init", "is_available", "device_count", "current_stream",
                      "current_device", "set_device", "init"]),
        (torch._C, ["_cuda_init", "_cuda_getDeviceCount"]),
        (getattr(torch, "accelerator", None),  # torch >= 2.6
         ["current_accelerator", "current_stream", "device_count", "is_available",
          "current_device_index"]),
        (torch.backends.mps, ["is_available"]),
    ):
        for name in names:
            if owner is not None and hasattr(owner, name):
                setattr(owner, name, refuse(owner, name))
    """
)


def test_the_forkserver_preload_never_asks_for_an_accelerator():
    code = _DEVICE_PROBES + "\nimport overlapkit._preload\nprint('preloaded')\n"
    env_clean = {k: v for k, v in __import__("os").environ.items() if k != "OVERLAPKIT_NO_WARMUP"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env_clean
    )
    assert done.returncode == 0 and "preloaded" in done.stdout, done.stderr[-3000:]


# --------------------------------------------------------------------------- backends

import pytest  # noqa: E402

from overlapkit import runtime  # noqa: E402

MIXED = "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize(
    ("asked", "ranks", "gpus", "chosen"),
    [
        ("auto", 2, 0, "gloo"),  # a laptop
        ("auto", 2, 1, "gloo"),  # a hosted notebook's one GPU: ranks on the CPU
        ("auto", 2, 2, MIXED),  # a GPU per rank: CUDA tensors by NCCL, CPU ones by gloo
        ("auto", 4, 8, MIXED),
        ("auto", 1, 1, MIXED),
        ("nccl", 2, 2, MIXED),  # a lab's CPU tensors still have a backend
        ("gloo", 2, 8, "gloo"),
        ("cpu:gloo,cuda:nccl", 2, 2, MIXED),
    ],
)
def test_the_default_group_serves_cpu_and_cuda_tensors_where_every_rank_has_a_gpu(
    asked, ranks, gpus, chosen
):
    assert runtime.choose_backend(asked, ranks, gpus) == chosen


def test_asking_for_nccl_with_too_few_gpus_is_an_error_that_names_the_counts():
    with pytest.raises(RuntimeError, match=r"3 ranks on this machine but 2 usable CUDA"):
        runtime.choose_backend("nccl", 3, 2)


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="'ncl'"):
        runtime.choose_backend("ncl", 2, 2)


@pytest.mark.parametrize("asked", ["auto", "nccl"])
def test_every_torchrun_worker_of_a_machine_makes_the_same_choice(asked):
    """Four workers on a machine with two GPUs: all gloo (auto) or all refused (nccl),
    never NCCL for local ranks 0-1 and gloo for 2-3."""
    outcomes = set()
    for local in range(4):
        environ = {"LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}
        try:
            outcomes.add(runtime.torchrun_backend(asked, environ, gpus=2))
        except RuntimeError:
            outcomes.add("refused")
    assert outcomes == ({"gloo"} if asked == "auto" else {"refused"})


@pytest.mark.parametrize(
    ("config", "cpu", "cuda"),
    [("gloo", "gloo", "gloo"), ("nccl", None, "nccl"), (MIXED, "gloo", "nccl")],
)
def test_backends_say_which_backend_moves_each_kind_of_tensor(config, cpu, cuda):
    parsed = runtime.parse_backends(config)
    assert (parsed.get("cpu"), parsed.get("cuda")) == (cpu, cuda)


def test_on_a_cpu_run_the_backend_and_device_say_gloo_and_cpu():
    import overlapkit as ok

    def where():
        return ok.backend(), str(ok.device()), ok.backends()

    for backend, device, backends in ok.launch(where, world_size=2, timeout=120):
        assert (backend, device) == ("gloo", "cpu")
        assert backends["cpu"] == "gloo"


def test_a_rank_sees_the_callers_cuda_visible_devices_of_this_launch(monkeypatch):
    """The GPUs a rank may take are the ones the caller allows at the launch, also after
    the caller changed or unset the variable (the forkserver keeps its first environment)."""
    import os

    import overlapkit as ok

    def visible():
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    ok.launcher.shutdown()  # the next forkserver starts with the variable set
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: keeps this test on the CPU
    assert ok.launch(visible, world_size=1, timeout=120) == [""]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert ok.launch(visible, world_size=1, timeout=120) == [None]


# --------------------------------------------------------------------------- streams


def test_each_group_has_one_communication_stream_per_device_made_once(monkeypatch):
    """As NCCL gives each communicator its own stream: FSDP's AllGather and ReduceScatter
    groups, or a hybrid's dp and pp groups, never queue behind each other on one stream."""
    import torch

    from overlapkit import ordering

    made = []

    class Stream:  # torch.cuda.Stream stand-in: no GPU here
        def __init__(self, device):
            made.append(device)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(ordering, "_cuda_streams", {})
    ag0 = ordering.comm_stream("all_gather", "cuda:0")
    assert ordering.comm_stream("all_gather", torch.device("cuda", 0)) is ag0
    rs0 = ordering.comm_stream("reduce_scatter", "cuda:0")
    ag1 = ordering.comm_stream("all_gather", "cuda:1")
    assert len({id(ag0), id(rs0), id(ag1)}) == 3
    assert made == [torch.device("cuda", 0), torch.device("cuda", 0), torch.device("cuda", 1)]
