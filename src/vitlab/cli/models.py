"""``vitlab models`` and ``vitlab info``: the registry and each model's profile."""

from __future__ import annotations

import json

import vitlab


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def cmd_models(args) -> int:
    rows = vitlab.profile.model_rows(args.pattern or "*", task=args.task)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.table import Table

    from vitlab._console import console

    if not rows:
        task = f" of task {args.task}" if args.task else ""
        console.print(f"no model{task} matches {' '.join(args.pattern) or '*'}")
        return 1
    table = Table(title=f"{len(rows)} models (GMACs: one multiply-add = 1, batch 1, default input)")
    table.add_column("name", no_wrap=True)
    for col in ("family", "task", "params (M)", "GMACs", "input", "paper params", "paper GMACs", "top-1"):
        table.add_column(col, justify="left" if col in ("family", "task") else "right")
    for r in rows:
        table.add_row(r["name"], r["family"], r["task"], f"{r['params_m']:.2f}", f"{r['gmacs']:.2f}",
                      "x".join(map(str, r["input_size"][1:])), _fmt(r["published_params_m"], ".2f"),
                      _fmt(r["published_gmacs"], ".2f"), _fmt(r["published_top1"], ".1f"))
    console.print(table)
    return 0


def _structure(model, max_rows: int = 40):
    from rich.table import Table

    table = Table(title="structure (top-level modules)")
    table.add_column("module")
    table.add_column("type")
    table.add_column("params", justify="right")
    for i, (name, child) in enumerate(model.named_children()):
        if i == max_rows:
            break
        n = sum(p.numel() for p in child.parameters())
        table.add_row(name, type(child).__name__ + (f" x{len(child)}" if hasattr(child, "__len__") else ""),
                      f"{n:,}")
    return table


def cmd_info(args) -> int:
    import torch
    from rich.table import Table

    from vitlab._console import console
    from vitlab.profile import memory_estimate_gb

    cfg = vitlab.get_model_config(args.name)
    with torch.device("meta"):
        model = vitlab.create_model(args.name)
    prof = vitlab.profile_model(args.name, img_size=args.img_size, batch_size=args.batch_size)
    console.print(f"[bold]{cfg.name}[/bold]  family={cfg.family}  task={cfg.task}  paper: {cfg.paper}")
    lm = getattr(model, "config", None)
    if cfg.task == "generate" and lm is not None:  # a language model: tokens, not images
        console.print(f"context {lm.max_seq_len} tokens  vocabulary {lm.vocab_size}  dim {lm.dim}  "
                      f"hub {cfg.hf_hub_id or '-'}")
    else:
        console.print(f"input {cfg.input_size}  mean {cfg.mean}  std {cfg.std}  crop_pct {cfg.crop_pct}  "
                      f"classes {cfg.num_classes}  hub {cfg.hf_hub_id or '-'}")
    console.print(_structure(model))
    t = Table(title=f"profile at {prof.input_size}, batch {prof.batch_size}")
    t.add_column("quantity")
    t.add_column("ours", justify="right")
    t.add_column("published", justify="right")
    t.add_row("params (M)", f"{prof.params_m:.2f}", _fmt(cfg.published_params_m, ".2f"))
    t.add_row("parameters", f"{sum(p.numel() for p in model.parameters()):,}", "")
    t.add_row("trainable params (M)", f"{prof.trainable_params_m:.2f}", "")
    t.add_row("GMACs", f"{prof.gmacs:.3f}", _fmt(cfg.published_gmacs, ".2f"))
    t.add_row("activations saved for backward (MB, fp32)", f"{prof.activation_mb:.1f}", "")
    # the article's rule M = P*4B/(32/Q)*1.2 with our count, and with the paper's size (Llama 2 "7B": 33.6 GB fp32)
    paper = {q: memory_estimate_gb(cfg.published_params_m * 1e6, q) for q in prof.memory_estimate_gb} \
        if cfg.published_params_m else {}
    for q, gb in prof.memory_estimate_gb.items():
        t.add_row(f"serving memory, P*4B/(32/Q)*1.2, {q}-bit (GB)", f"{gb:.3f}", _fmt(paper.get(q), ".4g"))
    console.print(t)
    if cfg.published_params_m and cfg.published_params_m >= 1e3:  # a model known by its size in billions
        console.print(f"serving estimate with the paper's {cfg.published_params_m / 1e3:g}B parameters: "
                      f"{paper[32]:.1f} GB fp32, " + " / ".join(f"{paper[q]:.1f}" for q in (16, 8, 4))
                      + " GB at 16 / 8 / 4 bits")
    return 0


def register(sub) -> None:
    # the commands' help lines are vitlab.cli.COMMANDS's (vitlab --help builds no subcommand)
    m = sub.add_parser("models")
    m.add_argument("pattern", nargs="*", help="fnmatch patterns, e.g. 'deit_*'")
    m.add_argument("--task", default=None,
                   help="only the models of this task: classify, segment, depth, contrastive (or a plugin's)")
    m.add_argument("--json", action="store_true", help="print JSON instead of a table")
    m.set_defaults(func=cmd_models)

    i = sub.add_parser("info")
    i.add_argument("name")
    i.add_argument("--img-size", type=int, default=None)
    i.add_argument("--batch-size", type=int, default=1)
    i.set_defaults(func=cmd_info)
