"""Command line: ``python -m overlapkit demo`` and ``python -m overlapkit bench NAME``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys


def _parse_link(text: str | None):
    """``LATENCY_US,BANDWIDTH_GBPS`` → an ``ok.Link`` (None when not given)."""
    if not text:
        return None
    from .p2p import Link

    latency, bandwidth = (float(x) for x in text.split(","))
    return Link(latency, bandwidth)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m overlapkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    lab = sub.add_parser("lab", help="a lab's core measurement as a script (also under torchrun)")
    lab.add_argument("number", help="the lab: 00 … 11")
    lab.add_argument("--world-size", type=int, default=2, help="ranks (torchrun's, under it)")
    demo = sub.add_parser("demo", help="a one-minute tour: ranks, ping-pong, a timeline picture")
    demo.add_argument(
        "--out", default="overlapkit-demo.png", help="where to write the timeline picture"
    )
    demo.add_argument("--world-size", type=int, default=4)

    bench = sub.add_parser("bench", help="benchmarks (tables of times and ratios; CSV/JSON)")
    which = bench.add_subparsers(dest="bench", required=True)
    bl = which.add_parser("launch", help="ok.launch cold/warm against torch.multiprocessing.spawn")
    bl.add_argument("--world-size", type=int, default=4)
    bl.add_argument("--reps", type=int, default=10, help="warm launches")
    bl.add_argument("--cold-reps", type=int, default=3, help="cold launches (fresh processes)")
    bl.add_argument(
        "--spawn-reps", type=int, default=3, help="torch.multiprocessing.spawn runs (0: skip)"
    )
    bc = which.add_parser(
        "collectives", help="naive and ring AllReduce vs the built-in and the model"
    )
    bc.add_argument(
        "--sizes", default="1K,16K,256K,1M,4M,16M,64M", help="comma-separated, e.g. 1K,4M"
    )
    bc.add_argument("--world-sizes", default="2,4", help="comma-separated")
    bc.add_argument(
        "--algorithms",
        default=None,
        help="naive,ring,ring_async,builtin (default: naive,ring,builtin; no builtin with --link)",
    )
    bc.add_argument(
        "--link", default=None, help="emulate a link: LATENCY_US,BANDWIDTH_GBPS, e.g. 50,1"
    )
    bc.add_argument("--reps", type=int, default=5)
    bc.add_argument("--warmup", type=int, default=1)
    bd = which.add_parser(
        "ddp", help="naive, per-parameter and bucketed DDP vs PyTorch DDP, with predictions"
    )
    bd.add_argument("--layers", type=int, default=8, help="Linear+ReLU layers")
    bd.add_argument("--width", type=int, default=512)
    bd.add_argument("--bias", action="store_true", help="layers with biases (tiny gradients)")
    bd.add_argument("--world-size", type=int, default=2)
    bd.add_argument(
        "--link", default=None, help="emulate a link: LATENCY_US,BANDWIDTH_GBPS, e.g. 100,0.25"
    )
    bd.add_argument(
        "--buckets", default="0.1,0.25,0.5,1,2,4,8,25,100", help="bucket sizes (MiB) to sweep"
    )
    bd.add_argument("--reps", type=int, default=10)
    bd.add_argument("--warmup", type=int, default=2)
    bd.add_argument(
        "--batch", type=int, default=None, help="per rank (default: backward ≈ one AllReduce)"
    )
    bd.add_argument(
        "--backward-ratio",
        type=float,
        default=1.0,
        help="size the batch so that backward takes this many full-AllReduce times",
    )
    bd.add_argument("--no-torch", action="store_true", help="skip PyTorch DDP")
    bp = which.add_parser(
        "pipeline", help="sequential, GPipe and 1F1B on two stages, overlap on/off, vs the model"
    )
    bp.add_argument("--layers", type=int, default=8)
    bp.add_argument("--width", type=int, default=512)
    bp.add_argument("--batch", type=int, default=512)
    bp.add_argument("--micro", default="1,2,4,8", help="micro-batch counts")
    bp.add_argument(
        "--schedules",
        default="sequential,gpipe,1f1b,1f1b+1",
        help="1f1b+N: 1F1B with N extra warm-up forwards",
    )
    bp.add_argument(
        "--link",
        default=None,
        help="LATENCY_US,BANDWIDTH_GBPS (default: sized so a transfer costs --transfer-share)",
    )
    bp.add_argument("--transfer-share", type=float, default=0.3)
    bp.add_argument("--reps", type=int, default=5)
    bp.add_argument("--warmup", type=int, default=1)
    bp.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    bf = which.add_parser(
        "fsdp", help="fully sharded: no/implicit/explicit prefetch vs DDP and fully_shard"
    )
    bf.add_argument("--units", type=int, default=8, help="Linear+Tanh blocks, one unit each")
    bf.add_argument("--width", type=int, default=1024)
    bf.add_argument("--batch", type=int, default=1024, help="per rank")
    bf.add_argument("--world-size", type=int, default=2)
    bf.add_argument(
        "--link",
        default=None,
        help="LATENCY_US,BANDWIDTH_GBPS (default: sized so a unit's AllGather ≈ its forward)",
    )
    bf.add_argument(
        "--gather-share", type=float, default=1.0, help="a unit's AllGather ÷ its forward"
    )
    bf.add_argument("--reps", type=int, default=5)
    bf.add_argument("--warmup", type=int, default=2)
    bf.add_argument("--no-torch", action="store_true", help="skip torch's fully_shard")
    bf.add_argument("--png", default=None, help="draw the median steps without and with prefetch")
    bh = which.add_parser(
        "hybrid", help="2-D mesh (dp × pp): the stages' AllReduce after the flush vs overlapped"
    )
    bh.add_argument("--dp", type=int, default=2, help="replicas (data parallel)")
    bh.add_argument("--pp", type=int, default=2, help="pipeline stages")
    bh.add_argument("--layers", type=int, default=8, help="Linear+Tanh blocks per stage")
    bh.add_argument("--width", type=int, default=768)
    bh.add_argument("--batch", type=int, default=1024, help="per replica")
    bh.add_argument("--micro", default="1,2", help="micro-batch counts to run (1F1B)")
    bh.add_argument(
        "--link",
        default=None,
        help="LATENCY_US,BANDWIDTH_GBPS (default: sized so a stage's AllReduce ≈ --share × "
        "the pipeline's cool-down)",
    )
    bh.add_argument("--share", type=float, default=1.0)
    bh.add_argument("--reps", type=int, default=5)
    bh.add_argument("--warmup", type=int, default=2)
    bh.add_argument("--png", default=None, help="draw the median flush and overlapped steps")
    bh.add_argument("--trace", default=None, help="Perfetto trace of the overlapped step")
    bz = which.add_parser(
        "compression", help="fp16, top-k and PowerSGD (with/without error feedback) vs plain"
    )
    bz.add_argument("--steps", type=int, default=200)
    bz.add_argument("--hidden", type=int, default=512, help="the task's hidden width")
    bz.add_argument("--batch", type=int, default=64, help="per rank")
    bz.add_argument("--world-size", type=int, default=2)
    bz.add_argument(
        "--link",
        default=None,
        help="LATENCY_US,BANDWIDTH_GBPS (default: sized so a plain AllReduce ≈ "
        "--comm-share × backward)",
    )
    bz.add_argument("--comm-share", type=float, default=16.0)
    bz.add_argument("--lr", type=float, default=0.05)
    bz.add_argument("--configs", default=None, help="comma-separated (default: all)")
    bt = which.add_parser(
        "tp", help="decomposed AllGather-matmul and matmul-ReduceScatter vs serial, vs the model"
    )
    bt.add_argument("--rows", type=int, default=512, help="rows of each rank's shard")
    bt.add_argument("--width", type=int, default=1024)
    bt.add_argument("--world-size", type=int, default=2)
    bt.add_argument("--chunks", default="1,2,4,8,16", help="chunk counts to sweep")
    bm = which.add_parser(
        "moe", help="pipelined MoE all-to-all vs serial, chunk sweep, vs the model"
    )
    bm.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    bm.add_argument("--d-model", type=int, default=256)
    bm.add_argument("--d-hidden", type=int, default=1024)
    bm.add_argument("--world-size", type=int, default=2)
    bm.add_argument("--chunks", default="1,2,4,8,16", help="chunk counts (1: serial)")
    for p in (bt, bm):
        p.add_argument(
            "--link",
            default=None,
            help="LATENCY_US,BANDWIDTH_GBPS (default: sized so the transfer ≈ the compute)",
        )
        p.add_argument("--transfer-share", type=float, default=1.0)
        p.add_argument("--reps", type=int, default=5)
        p.add_argument("--warmup", type=int, default=1)
    for p in (bl, bc, bd, bp, bf, bh, bz, bt, bm):
        p.add_argument("--csv", help="also write the rows to this CSV file")
        p.add_argument("--json", help="also write the rows to this JSON file")

    args = parser.parse_args(argv)
    if _quiet_rank():
        # under torchrun every process runs this command; rank 0 alone reports
        for name in ("csv", "json", "out", "png", "trace"):
            if getattr(args, name, None):
                setattr(args, name, os.devnull)
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            return _run(args)
    return _run(args)


def _chunk_sweep(args) -> dict:
    """The options bench tp and bench moe share."""
    return {"world": args.world_size, "chunks": [int(k) for k in args.chunks.split(",")],
            "link": _parse_link(args.link), "transfer_share": args.transfer_share,
            "reps": args.reps, "warmup": args.warmup, "csv_path": args.csv,
            "json_path": args.json}  # fmt: skip


def _quiet_rank() -> bool:
    from .launcher import _under_torchrun

    return _under_torchrun() and os.environ["RANK"] != "0"


def _run(args) -> int:
    from .launcher import _under_torchrun

    if _under_torchrun():
        # under torchrun the ranks are torchrun's: every world size becomes its own
        world = int(os.environ["WORLD_SIZE"])
        for name, value in (("world_sizes", str(world)), ("world_size", world)):
            if getattr(args, name, None) not in (None, value):
                print(f"under torchrun: {world} ranks (--{name.replace('_', '-')} ignored)")
                setattr(args, name, value)
    if args.command == "lab":
        from .labcore import run as run_lab

        try:
            run_lab(args.number, args.world_size)
        except ValueError as exc:  # an unknown lab: say which exist, no traceback
            print(f"python -m overlapkit lab: {exc}", file=sys.stderr)
            return 2
    elif args.command == "demo":
        from .demo import run

        run(out=args.out, world=args.world_size)
    elif args.bench == "collectives":
        from .bench.collectives import run

        link = _parse_link(args.link)
        run(
            sizes=args.sizes.split(","),
            world_sizes=[int(w) for w in args.world_sizes.split(",")],
            algorithms=args.algorithms.split(",") if args.algorithms else None,
            link=link,
            reps=args.reps,
            warmup=args.warmup,
            csv_path=args.csv,
            json_path=args.json,
        )
    elif args.bench == "ddp":
        from .bench.ddp import run

        link = _parse_link(args.link)
        run(
            layers=args.layers,
            width=args.width,
            bias=args.bias,
            world=args.world_size,
            link=link,
            bucket_sweep=[float(b) for b in args.buckets.split(",")],
            reps=args.reps,
            warmup=args.warmup,
            batch=args.batch,
            backward_ratio=args.backward_ratio,
            torch_ddp=not args.no_torch,
            csv_path=args.csv,
            json_path=args.json,
        )
    elif args.bench == "pipeline":
        from .bench.pipeline import run

        run(
            layers=args.layers,
            width=args.width,
            batch=args.batch,
            micro=[int(m) for m in args.micro.split(",")],
            schedules=args.schedules.split(","),
            link=_parse_link(args.link),
            transfer_share=args.transfer_share,
            reps=args.reps,
            warmup=args.warmup,
            torch_compare=not args.no_torch,
            csv_path=args.csv,
            json_path=args.json,
        )
    elif args.bench == "fsdp":
        from .bench.fsdp import run

        run(units=args.units, width=args.width, batch=args.batch, world=args.world_size,
            link=_parse_link(args.link), gather_share=args.gather_share, reps=args.reps,
            warmup=args.warmup, torch_compare=not args.no_torch, csv_path=args.csv,
            json_path=args.json, png_path=args.png)  # fmt: skip
    elif args.bench == "hybrid":
        from .bench.hybrid import run

        run(dp=args.dp, pp=args.pp, layers=args.layers, width=args.width, batch=args.batch,
            micro=[int(m) for m in args.micro.split(",")], link=_parse_link(args.link),
            share=args.share, reps=args.reps,
            warmup=args.warmup, csv_path=args.csv, json_path=args.json, png_path=args.png,
            trace_path=args.trace)  # fmt: skip
    elif args.bench == "compression":
        from .bench.compression import CONFIGS, run

        run(steps=args.steps, hidden=args.hidden, batch=args.batch, world=args.world_size,
            link=_parse_link(args.link), comm_share=args.comm_share, lr=args.lr,
            configs=args.configs.split(",") if args.configs else tuple(CONFIGS),
            csv_path=args.csv, json_path=args.json)  # fmt: skip
    elif args.bench == "tp":
        from .bench.tp import run

        run(rows=args.rows, width=args.width, **_chunk_sweep(args))
    elif args.bench == "moe":
        from .bench.moe import run

        run(tokens=args.tokens, d_model=args.d_model, d_hidden=args.d_hidden,
            **_chunk_sweep(args))  # fmt: skip
    elif args.bench == "launch":
        from .bench.launch import run

        run(
            world=args.world_size,
            reps=args.reps,
            cold_reps=args.cold_reps,
            spawn_reps=args.spawn_reps,
            csv_path=args.csv,
            json_path=args.json,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
