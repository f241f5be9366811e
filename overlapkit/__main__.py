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


def _split(text: str, kind=str) -> list:
    """``"1,2,4"`` → ``[1, 2, 4]`` (with ``kind=int``)."""
    return [kind(x) for x in text.split(",")]


# Each command is a pair of functions: its options (added to its parser) and its run
# (given the parsed arguments; it returns the exit status, None for 0).


def _lab_options(p) -> None:
    p.add_argument("number", help="the lab: 00 … 11")
    p.add_argument("--world-size", type=int, default=2, help="ranks (torchrun's, under it)")


def _lab(args) -> int | None:
    from .labcore import run as run_lab

    try:
        run_lab(args.number, args.world_size)
    except ValueError as exc:  # an unknown lab: say which exist, no traceback
        print(f"python -m overlapkit lab: {exc}", file=sys.stderr)
        return 2
    return None


def _demo_options(p) -> None:
    p.add_argument(
        "--out", default="overlapkit-demo.png", help="where to write the timeline picture"
    )
    p.add_argument("--world-size", type=int, default=4)


def _demo(args) -> None:
    from .demo import run

    run(out=args.out, world=args.world_size)


def _bench_options(p) -> None:
    which = p.add_subparsers(dest="bench", required=True)
    for name, (help_, options, _) in BENCHES.items():
        bench = which.add_parser(name, help=help_)
        options(bench)
        bench.add_argument("--csv", help="also write the rows to this CSV file")
        bench.add_argument("--json", help="also write the rows to this JSON file")


def _bench(args) -> None:
    BENCHES[args.bench][2](args)


def _bench_launch_options(p) -> None:
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--reps", type=int, default=10, help="warm launches")
    p.add_argument("--cold-reps", type=int, default=3, help="cold launches (fresh processes)")
    p.add_argument(
        "--spawn-reps", type=int, default=3, help="torch.multiprocessing.spawn runs (0: skip)"
    )


def _bench_launch(args) -> None:
    from .bench.launch import run

    run(world=args.world_size, reps=args.reps, cold_reps=args.cold_reps,
        spawn_reps=args.spawn_reps, csv_path=args.csv, json_path=args.json)  # fmt: skip


def _bench_collectives_options(p) -> None:
    p.add_argument(
        "--sizes", default="1K,16K,256K,1M,4M,16M,64M", help="comma-separated, e.g. 1K,4M"
    )
    p.add_argument("--world-sizes", default="2,4", help="comma-separated")
    p.add_argument(
        "--algorithms",
        default=None,
        help="naive,ring,ring_async,builtin (default: naive,ring,builtin; no builtin with --link)",
    )
    p.add_argument(
        "--link", default=None, help="emulate a link: LATENCY_US,BANDWIDTH_GBPS, e.g. 50,1"
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)


def _bench_collectives(args) -> None:
    from .bench.collectives import run

    run(sizes=args.sizes.split(","), world_sizes=_split(args.world_sizes, int),
        algorithms=args.algorithms.split(",") if args.algorithms else None,
        link=_parse_link(args.link), reps=args.reps, warmup=args.warmup, csv_path=args.csv,
        json_path=args.json)  # fmt: skip


def _bench_ddp_options(p) -> None:
    p.add_argument("--layers", type=int, default=8, help="Linear+ReLU layers")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--bias", action="store_true", help="layers with biases (tiny gradients)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--link", default=None, help="emulate a link: LATENCY_US,BANDWIDTH_GBPS, e.g. 100,0.25"
    )
    p.add_argument(
        "--buckets", default="0.1,0.25,0.5,1,2,4,8,25,100", help="bucket sizes (MiB) to sweep"
    )
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--batch", type=int, default=None, help="per rank (default: backward ≈ one AllReduce)"
    )
    p.add_argument(
        "--backward-ratio",
        type=float,
        default=1.0,
        help="size the batch so that backward takes this many full-AllReduce times",
    )
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch DDP")


def _bench_ddp(args) -> None:
    from .bench.ddp import run

    run(layers=args.layers, width=args.width, bias=args.bias, world=args.world_size,
        link=_parse_link(args.link), bucket_sweep=_split(args.buckets, float), reps=args.reps,
        warmup=args.warmup, batch=args.batch, backward_ratio=args.backward_ratio,
        torch_ddp=not args.no_torch, csv_path=args.csv, json_path=args.json)  # fmt: skip


def _bench_pipeline_options(p) -> None:
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--micro", default="1,2,4,8", help="micro-batch counts")
    p.add_argument(
        "--schedules",
        default="sequential,gpipe,1f1b,1f1b+1",
        help="1f1b+N: 1F1B with N extra warm-up forwards",
    )
    p.add_argument(
        "--link",
        default=None,
        help="LATENCY_US,BANDWIDTH_GBPS (default: sized so a transfer costs --transfer-share)",
    )
    p.add_argument("--transfer-share", type=float, default=0.3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")


def _bench_pipeline(args) -> None:
    from .bench.pipeline import run

    run(layers=args.layers, width=args.width, batch=args.batch, micro=_split(args.micro, int),
        schedules=args.schedules.split(","), link=_parse_link(args.link),
        transfer_share=args.transfer_share, reps=args.reps, warmup=args.warmup,
        torch_compare=not args.no_torch, csv_path=args.csv, json_path=args.json)  # fmt: skip


def _bench_fsdp_options(p) -> None:
    p.add_argument("--units", type=int, default=8, help="Linear+Tanh blocks, one unit each")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1024, help="per rank")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--link",
        default=None,
        help="LATENCY_US,BANDWIDTH_GBPS (default: sized so a unit's AllGather ≈ its forward)",
    )
    p.add_argument(
        "--gather-share", type=float, default=1.0, help="a unit's AllGather ÷ its forward"
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-torch", action="store_true", help="skip torch's fully_shard")
    p.add_argument("--png", default=None, help="draw the median steps without and with prefetch")


def _bench_fsdp(args) -> None:
    from .bench.fsdp import run

    run(units=args.units, width=args.width, batch=args.batch, world=args.world_size,
        link=_parse_link(args.link), gather_share=args.gather_share, reps=args.reps,
        warmup=args.warmup, torch_compare=not args.no_torch, csv_path=args.csv,
        json_path=args.json, png_path=args.png)  # fmt: skip


def _bench_hybrid_options(p) -> None:
    p.add_argument("--dp", type=int, default=2, help="replicas (data parallel)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--layers", type=int, default=8, help="Linear+Tanh blocks per stage")
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--batch", type=int, default=1024, help="per replica")
    p.add_argument("--micro", default="1,2", help="micro-batch counts to run (1F1B)")
    p.add_argument(
        "--link",
        default=None,
        help="LATENCY_US,BANDWIDTH_GBPS (default: sized so a stage's AllReduce ≈ --share × "
        "the pipeline's cool-down)",
    )
    p.add_argument("--share", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--png", default=None, help="draw the median flush and overlapped steps")
    p.add_argument("--trace", default=None, help="Perfetto trace of the overlapped step")


def _bench_hybrid(args) -> None:
    from .bench.hybrid import run

    run(dp=args.dp, pp=args.pp, layers=args.layers, width=args.width, batch=args.batch,
        micro=_split(args.micro, int), link=_parse_link(args.link), share=args.share,
        reps=args.reps, warmup=args.warmup, csv_path=args.csv, json_path=args.json,
        png_path=args.png, trace_path=args.trace)  # fmt: skip


def _bench_compression_options(p) -> None:
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--hidden", type=int, default=512, help="the task's hidden width")
    p.add_argument("--batch", type=int, default=64, help="per rank")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--link",
        default=None,
        help="LATENCY_US,BANDWIDTH_GBPS (default: sized so a plain AllReduce ≈ "
        "--comm-share × backward)",
    )
    p.add_argument("--comm-share", type=float, default=16.0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--configs", default=None, help="comma-separated (default: all)")


def _bench_compression(args) -> None:
    from .bench.compression import CONFIGS, run

    run(steps=args.steps, hidden=args.hidden, batch=args.batch, world=args.world_size,
        link=_parse_link(args.link), comm_share=args.comm_share, lr=args.lr,
        configs=args.configs.split(",") if args.configs else tuple(CONFIGS),
        csv_path=args.csv, json_path=args.json)  # fmt: skip


def _chunk_sweep_options(p) -> None:
    """The options bench tp and bench moe share (after their own)."""
    p.add_argument(
        "--link",
        default=None,
        help="LATENCY_US,BANDWIDTH_GBPS (default: sized so the transfer ≈ the compute)",
    )
    p.add_argument("--transfer-share", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)


def _chunk_sweep(args) -> dict:
    """The options bench tp and bench moe share."""
    return {"world": args.world_size, "chunks": [int(k) for k in args.chunks.split(",")],
            "link": _parse_link(args.link), "transfer_share": args.transfer_share,
            "reps": args.reps, "warmup": args.warmup, "csv_path": args.csv,
            "json_path": args.json}  # fmt: skip


def _bench_tp_options(p) -> None:
    p.add_argument("--rows", type=int, default=512, help="rows of each rank's shard")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--chunks", default="1,2,4,8,16", help="chunk counts to sweep")
    _chunk_sweep_options(p)


def _bench_tp(args) -> None:
    from .bench.tp import run

    run(rows=args.rows, width=args.width, **_chunk_sweep(args))


def _bench_moe_options(p) -> None:
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-hidden", type=int, default=1024)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--chunks", default="1,2,4,8,16", help="chunk counts (1: serial)")
    _chunk_sweep_options(p)


def _bench_moe(args) -> None:
    from .bench.moe import run

    run(tokens=args.tokens, d_model=args.d_model, d_hidden=args.d_hidden,
        **_chunk_sweep(args))  # fmt: skip


#: name -> (help, its options, its run), in the order ``--help`` lists them
COMMANDS = {
    "lab": ("a lab's core measurement as a script (also under torchrun)", _lab_options, _lab),
    "demo": ("a one-minute tour: ranks, ping-pong, a timeline picture", _demo_options, _demo),
    "bench": ("benchmarks (tables of times and ratios; CSV/JSON)", _bench_options, _bench),
}
#: ``bench NAME``: the same, each with --csv and --json
BENCHES = {
    "launch": ("ok.launch cold/warm against torch.multiprocessing.spawn",
               _bench_launch_options, _bench_launch),
    "collectives": ("naive and ring AllReduce vs the built-in and the model",
                    _bench_collectives_options, _bench_collectives),
    "ddp": ("naive, per-parameter and bucketed DDP vs PyTorch DDP, with predictions",
            _bench_ddp_options, _bench_ddp),
    "pipeline": ("sequential, GPipe and 1F1B on two stages, overlap on/off, vs the model",
                 _bench_pipeline_options, _bench_pipeline),
    "fsdp": ("fully sharded: no/implicit/explicit prefetch vs DDP and fully_shard",
             _bench_fsdp_options, _bench_fsdp),
    "hybrid": ("2-D mesh (dp × pp): the stages' AllReduce after the flush vs overlapped",
               _bench_hybrid_options, _bench_hybrid),
    "compression": ("fp16, top-k and PowerSGD (with/without error feedback) vs plain",
                    _bench_compression_options, _bench_compression),
    "tp": ("decomposed AllGather-matmul and matmul-ReduceScatter vs serial, vs the model",
           _bench_tp_options, _bench_tp),
    "moe": ("pipelined MoE all-to-all vs serial, chunk sweep, vs the model",
            _bench_moe_options, _bench_moe),
}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m overlapkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, options, _) in COMMANDS.items():
        options(sub.add_parser(name, help=help_))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if _quiet_rank():
        # under torchrun every process runs this command; rank 0 alone reports
        for name in ("csv", "json", "out", "png", "trace"):
            if getattr(args, name, None):
                setattr(args, name, os.devnull)
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            return _run(args)
    return _run(args)


def _quiet_rank() -> bool:
    from .torchrun import under_torchrun

    return under_torchrun() and os.environ["RANK"] != "0"


def _run(args) -> int:
    from .torchrun import under_torchrun

    if under_torchrun():
        # under torchrun the ranks are torchrun's: every world size becomes its own
        world = int(os.environ["WORLD_SIZE"])
        for name, value in (("world_sizes", str(world)), ("world_size", world)):
            if getattr(args, name, None) not in (None, value):
                print(f"under torchrun: {world} ranks (--{name.replace('_', '-')} ignored)")
                setattr(args, name, value)
    return COMMANDS[args.command][2](args) or 0


if __name__ == "__main__":
    sys.exit(main())
