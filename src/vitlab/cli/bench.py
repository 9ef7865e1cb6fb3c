"""``vitlab bench attention | models | ladder | tokens``: the benchmarks of vitlab.bench, printed as tables and
optionally written as JSON (atomically) and PNG plots. A batch size or a number of runs below 1 (or a negative
warmup) is refused in one line before anything is built."""

from __future__ import annotations

from vitlab._console import console, say
from vitlab.cli._dataclass_args import device_arg


def _save(module, rows, args) -> None:
    if args.json:
        module.write_json(rows, args.json)
        say(f"wrote {args.json}")
    if args.plot:
        module.plot(rows, args.plot)
        say(f"wrote {args.plot}")


def _bf16_note(args) -> None:
    if args.device == "cpu" and args.dtype == "bf16":
        from vitlab.optimize.cpu import bf16_note

        note = bf16_note()
        if note:
            console.print(f"[yellow]note:[/] {note}")


def cmd_attention(args) -> int:
    from vitlab.bench import attention
    from vitlab.timing import check_counts

    check_counts(args.batch_size, args.warmup, args.runs)  # bench_attention checks runs and warmup, not the batch
    _bf16_note(args)
    rows = attention.bench_attention(device=args.device, batch_size=args.batch_size, dtype=args.dtype,
                                     only=args.only, warmup=args.warmup, runs=args.runs, progress=not args.quiet,
                                     optimize=None if args.no_optimize else "auto")
    console.print(attention.format_table(rows))
    _save(attention, rows, args)
    return 0


def cmd_models(args) -> int:
    from vitlab.bench import models

    _bf16_note(args)
    compare = None if not args.compare else ",".join(args.compare)
    rows = models.bench_models(args.pattern or ["vit_base_patch16_224"], mode=args.mode, device=args.device,
                               dtype=args.dtype, batch_size=args.batch_size, compile=args.compile,
                               channels_last=args.channels_last, compare=compare, warmup=args.warmup,
                               runs=args.runs, progress=not args.quiet, fuse=args.fuse,
                               optimize=not args.no_optimize)
    console.print(models.format_table(rows))
    _save(models, rows, args)
    return 0


def cmd_ladder(args) -> int:
    from vitlab.bench import ladder
    from vitlab.timing import check_counts

    check_counts(args.batch_size, args.warmup, args.runs)  # bench_ladder itself does not check them
    rows = ladder.bench_ladder(args.model, device=args.device, batch_size=args.batch_size, warmup=args.warmup,
                               runs=args.runs, progress=not args.quiet)
    console.print(ladder.format_table(rows))
    _save(ladder, rows, args)
    return 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--r takes comma-separated integers, e.g. 0,4,8,13,16; got {text!r}") from None


def cmd_tokens(args) -> int:
    from vitlab.bench import tokens

    rows = tokens.bench_tokens(args.model, _int_list(args.r), prune=args.prune, checkpoint=args.checkpoint,
                               data=args.data, split=args.split, device=args.device, dtype=args.dtype,
                               batch_size=args.batch_size, warmup=args.warmup, runs=args.runs,
                               progress=not args.quiet)
    console.print(tokens.format_table(rows))
    _save(tokens, rows, args)
    return 0


def _common(p, batch_size: int, runs: int) -> None:
    p.add_argument("--device", default="cpu", type=device_arg, choices=["cpu", "cuda"])
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before timing")
    p.add_argument("--runs", type=int, default=runs, help="timed runs; the median is reported")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _no_optimize(p) -> None:
    p.add_argument("--no-optimize", action="store_true",
                   help="time the models as built (eager), without the speed-ups vitlab.optimize picks")


def register(sub) -> None:
    bench = sub.add_parser("bench")  # its help line is vitlab.cli.COMMANDS's
    bsub = bench.add_subparsers(dest="bench", required=True)

    a = bsub.add_parser("attention", help="speed and cost of one attention layer, for every attention mechanism "
                                          "(laid out as the LITv2 paper's Table IV)")
    _common(a, 64, 10)
    a.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    a.add_argument("--only", help="comma-separated mechanism names")
    _no_optimize(a)
    a.set_defaults(func=cmd_attention)

    m = bsub.add_parser("models", help="how fast whole models run (images/s, memory, share of this machine's "
                                       "peak), optionally against timm")
    m.add_argument("pattern", nargs="*", help="model names or fnmatch patterns (default: vit_base_patch16_224)")
    _common(m, 32, 10)
    m.add_argument("--mode", default="infer", choices=["infer", "train", "both"])
    m.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    m.add_argument("--compile", action="store_true", help="torch.compile both implementations")
    m.add_argument("--channels-last", action="store_true")
    _no_optimize(m)
    m.add_argument("--compare", nargs="+", choices=["timm", "timm-compile"],
                   help="time timm's implementation with the same weights too: eager (timm) and / or "
                        "torch.compile'd (timm-compile: Inductor, freezing on the CPU)")
    m.add_argument("--fuse", action="store_true",
                   help="with --no-optimize: fold our BatchNorms first (LeViT's fuse())")
    m.set_defaults(func=cmd_models)

    tok = bsub.add_parser("tokens", help="fewer tokens for speed: token merging (ToMe) and token pruning, with "
                                         "images/s, GMACs, memory and top-1 per setting")
    tok.add_argument("model", nargs="?", help="a registered model (optional with --checkpoint)")
    _common(tok, 32, 10)
    tok.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    tok.add_argument("--r", default="0,4,8,13,16", help="ToMe merges per block, comma-separated (0 = plain)")
    tok.add_argument("--prune", action="append", metavar="METHOD:KEEP[,KEEP]",
                     help="pruning settings, e.g. evit:0.7,0.5 (repeatable; evit, dynamicvit, topk, adaptive)")
    tok.add_argument("--checkpoint", metavar="RUN", help="a vitlab train run (its weights; top-1 on --data)")
    tok.add_argument("--data", help="data for top-1 (default: the run's own)")
    tok.add_argument("--split", default="test", choices=["train", "val", "test"])
    tok.set_defaults(func=cmd_tokens)

    lad = bsub.add_parser("ladder", help="training speed and memory of one model as speed-ups are added one by "
                                         "one (bf16, fused attention, compile, ..., FSDP)")
    lad.add_argument("model")
    _common(lad, 8, 5)
    lad.set_defaults(func=cmd_ladder)
