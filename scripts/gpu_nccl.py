"""scripts/gpu_check.sh's NCCL and CUDA-stream checks, one mode per run:

    python scripts/gpu_nccl.py nccl-log DIR   NCCL ranks (as many as GPUs, at most 8) all-reduce
                                              1 Ki and 16 Mi floats with NCCL_DEBUG=INFO; NCCL's
                                              lines land in DIR/nccl_debug.log, to be read as
                                              lab 10's section 5 reads the shipped one
    python scripts/gpu_nccl.py streams DIR    two CUDA streams ordered by events, a tensor kept
                                              for the side stream by record_stream, the result
                                              against one stream
    python scripts/gpu_nccl.py overlap DIR    one NCCL rank in this process: an all_reduce on
                                              its own stream beneath matmuls on the compute
                                              stream (what `nsys profile` records)

Each prints "backend=... devices=... (world N)" from where its work ran, as the other checks
do, and exits non-zero on a wrong result.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch


def _where(backend: str, devices: list[str], world: int) -> None:
    print(f"backend={backend} devices={','.join(devices)} (world {world})", flush=True)


def _reduce_twice():
    import torch.distributed as dist

    import overlapkit as ok

    sums = []
    for n in (1024, 16 * 2**20):
        t = torch.ones(n, device=ok.device())
        dist.all_reduce(t)
        sums.append(t[0].item())
    return str(ok.backend()), str(ok.device()), sums


def nccl_log(out: Path) -> int:
    """NCCL's own account of a set-up and two AllReduces, one file per process, joined."""
    import overlapkit as ok

    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,COLL,NET",
                      NCCL_DEBUG_FILE=str(out / "nccl_debug.%h.%p.part"))  # fmt: skip
    world = max(1, min(torch.cuda.device_count(), 8))
    got = ok.launch(_reduce_twice, world_size=world, timeout=120)
    _where(",".join(sorted({b for b, _, _ in got})), [d for _, d, _ in got], world)
    parts = sorted(out.glob("nccl_debug.*.part"))
    lines = [line for p in parts for line in p.read_text(errors="replace").splitlines()]
    (out / "nccl_debug.log").write_text("\n".join(lines) + "\n")
    for p in parts:
        p.unlink()
    network = [line.split("NCCL INFO ", 1)[-1] for line in lines if "Using network" in line]
    print(f"{len(lines)} NCCL lines in {out / 'nccl_debug.log'}; network: {network[:1]}")
    wrong = [s for _, _, sums in got for s in sums if s != world]
    if wrong or not lines:
        print(f"wrong: sums {wrong} (expected {world}); {len(lines)} NCCL lines", file=sys.stderr)
        return 1
    return 0


def _two_streams():
    """x @ x on a side stream, ordered after x is made and before its result is read."""
    import overlapkit as ok

    device = ok.device()
    x = torch.randn(2048, 2048, device=device)
    made = torch.cuda.Event()
    made.record()  # x is complete on the current stream from here
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        side.wait_event(made)
        y = x @ x
        done = torch.cuda.Event()
        done.record(side)
    # x was used on `side`: without this the caching allocator could hand x's memory to a
    # new tensor as soon as x is freed here, while side still reads it
    x.record_stream(side)
    torch.cuda.current_stream().wait_event(done)
    right = torch.allclose(y, x @ x, rtol=1e-3, atol=1e-3)
    return str(ok.backend()), str(device), right


def streams(out: Path) -> int:
    import overlapkit as ok

    backend, device, right = ok.launch(_two_streams, world_size=1, timeout=60)[0]
    _where(backend, [device], 1)
    print(f"two streams, ordered by events: {'the same as one stream' if right else 'WRONG'}")
    return 0 if right else 1


def overlap(out: Path) -> int:
    """One NCCL rank in this process (nsys follows one process best): AllReduces on a
    stream of their own while matmuls run on the compute stream."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        device = torch.device("cuda:0")
        a, grads = torch.randn(4096, 4096, device=device), torch.ones(32 * 2**20, device=device)
        comm = torch.cuda.Stream(device)
        for _ in range(5):
            ready = torch.cuda.Event()
            ready.record()
            with torch.cuda.stream(comm):
                comm.wait_event(ready)
                dist.all_reduce(grads)
            for _ in range(4):
                a = torch.tanh(a @ a)  # compute meanwhile, on the default stream
            torch.cuda.current_stream().wait_stream(comm)
        torch.cuda.synchronize()
        _where(dist.get_backend(), [str(device)], 1)
        right = grads[0].item() == 1.0
        print(f"overlap run done; all_reduce result {'right' if right else 'WRONG'}")
        return 0 if right else 1
    finally:
        dist.destroy_process_group()


MODES = {"nccl-log": nccl_log, "streams": streams, "overlap": overlap}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in MODES:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        print("no CUDA device here", file=sys.stderr)
        sys.exit(2)
    sys.exit(MODES[sys.argv[1]](Path(sys.argv[2])))
