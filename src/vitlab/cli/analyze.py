"""``vitlab analyze TOOL``: the tools of :mod:`vitlab.analysis`, each writing ``TOOL.json`` and ``TOOL.png``
into a folder and printing where: ``--out DIR``; else ``RUN/analysis/`` when ``--checkpoint`` is a file of a
``vitlab train`` run; else ``runs/analysis/MODEL/`` (``runs/analysis/MODEL-NAME/`` for a checkpoint file NAME.pth
from elsewhere; ``runs/analysis/timings/`` for ``timings`` without ``--model``).

    vitlab analyze attention --model deit_small_patch16_224 --checkpoint w.pth   maps, rollout, overlays
    vitlab analyze attention --model swin_tiny_patch4_window7_224 --block 5 --query 7,7
    vitlab analyze spectrum --model litv2_s                 HiLo Hi-Fi / Lo-Fi spectra (LITv2 supplementary Fig. II-III)
    vitlab analyze spectrum --model deit_tiny_patch16_224   relative log-amplitude of every block's output
    vitlab analyze bias --model levit_256                   attention biases by offset (LeViT supplementary, Fig. 1)
    vitlab analyze posembed --model vit_base_patch16_224    position-embedding cosine similarity
    vitlab analyze timings                                  LeViT supplementary, Table 1 (DeiT-tiny vs LeViT-256 block)
    vitlab analyze memory --model vit_base_patch16_224 --batch-size 64   serving-memory estimate vs measured
    vitlab analyze window-study / pooled-queries            LITv2 supplementary, Tables II and III

Images default to scikit-image's bundled photos (astronaut, coffee, chelsea); ``--images`` takes files.
Without ``--checkpoint`` the model has its random initialisation (no download happens).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vitlab._console import console
from vitlab.cli._dataclass_args import device_arg, model_arg_pairs


def _model(args):
    import vitlab

    kw = model_arg_pairs(args.model_arg)
    if args.img_size is not None:
        kw["img_size"] = args.img_size
    model = vitlab.create_model(args.model, checkpoint_path=args.checkpoint, **kw)  # names an unknown --model-arg
    if args.checkpoint is None:
        console.print("[yellow]note:[/] no --checkpoint: random-init weights (maps show an untrained model)")
    return model.eval()


def _query(text: str):
    if text in ("cls", "dist"):
        return text
    try:
        r, c = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--query must be cls, dist or ROW,COL (e.g. 7,7), got {text!r}") from None
    return r, c


ANALYSIS_DIR = Path("runs") / "analysis"  # the default's root: never the working directory itself


def out_dir(args: argparse.Namespace) -> Path:
    """The folder a tool writes into: ``--out``; else the run's ``analysis/`` folder when ``--checkpoint`` lies in
    a ``vitlab train`` run; else ``runs/analysis/MODEL``, with the checkpoint's name appended for weights from
    outside a run (so they do not overwrite the random-init results), or the tool's name without a model."""
    if args.out is not None:
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise ValueError(f"--out {args.out} is a file; give a folder for the JSON and PNG files")
        return Path(args.out)
    name = getattr(args, "model", None) or args.tool
    checkpoint = getattr(args, "checkpoint", None)
    if checkpoint is None:
        return ANALYSIS_DIR / name
    from vitlab.train.evaluate import run_dir_of

    run = run_dir_of(checkpoint)
    if (run / "config.yaml").is_file():  # every run writes its config first
        return run / "analysis"
    return ANALYSIS_DIR / f"{name}-{Path(checkpoint).stem}"


def _write(out: Path, tool: str, data: dict, pngs: dict[str, bytes] | bytes | None) -> None:
    """``TOOL.json`` and the PNGs (``TOOL.png``, or ``TOOL-KEY.png`` for a dict of them) into ``out``, atomically."""
    from vitlab._io import atomic_write, write_json

    paths = [write_json(out / f"{tool}.json", data)]
    if isinstance(pngs, bytes):
        pngs = {"": pngs}
    for key, png in (pngs or {}).items():
        paths.append(atomic_write(out / (f"{tool}-{key}.png" if key else f"{tool}.png"), png))
    console.print("wrote " + "  ".join(str(p) for p in paths), highlight=False, soft_wrap=True)


def _round(t, nd: int = 5):
    return None if t is None else [[round(v, nd) for v in row] for row in t.reshape(-1, t.shape[-1]).tolist()]


def cmd_attention(args) -> int:
    import torch

    from vitlab.analysis import analyze_attention, model_images
    from vitlab.analysis.plots import attention_png

    torch.manual_seed(args.seed)
    model = _model(args)
    imgs = model_images(model, args.images, args.img_size)
    r = analyze_attention(model, imgs.x, block=args.block, query=_query(args.query),
                          head_fusion=args.head_fusion, discard_ratio=args.discard_ratio)
    title = (f"{args.model} {r['layer']} ({r['kind']}), query {r['query']}; rollout over "
             f"{len(r['rollout_layers'])} layers, {args.head_fusion} fusion, discard {args.discard_ratio}")
    png = attention_png(imgs.display, r["maps"], r["rollout"], imgs.names, title)
    data = {k: v for k, v in r.items() if k not in ("maps", "rollout")}
    data.update(model=args.model, checkpoint=args.checkpoint, images=imgs.names,
                maps={n: [_round(m) for m in r["maps"][i]] for i, n in enumerate(imgs.names)},
                rollout=None if r["rollout"] is None else {n: _round(r["rollout"][i])
                                                           for i, n in enumerate(imgs.names)})
    _write(out_dir(args), "attention", data, png)
    return 0


def cmd_spectrum(args) -> int:
    import torch

    from vitlab.analysis import model_images
    from vitlab.analysis.plots import block_spectrum_png, hilo_spectrum_png
    from vitlab.analysis.spectrum import block_spectra, find_hilo, hilo_spectra

    torch.manual_seed(args.seed)
    model = _model(args)
    imgs = model_images(model, args.images, args.img_size)
    data: dict = {"model": args.model, "checkpoint": args.checkpoint, "images": imgs.names}
    pngs = {}
    if find_hilo(model):
        r = hilo_spectra(model, imgs.x, args.block if args.block is not None else -1)
        pngs["hilo"] = hilo_spectrum_png(r, f"{args.model} {r['layer']}: frequency magnitude ({r['grid'][0]}x"
                                            f"{r['grid'][1]}) of 8 Hi-Fi (top) / Lo-Fi (bottom) channels, mean "
                                            f"over {r['num_images']} images")
        data["hilo"] = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in r.items()}
    elif args.block is not None:
        raise ValueError(f"--block picks a HiLo layer; {args.model} has none (models with one: litv2_s, litv2_m, "
                         f"litv2_b)")
    b = block_spectra(model, imgs.x)
    pngs["blocks"] = block_spectrum_png(b, f"{args.model}: relative log amplitude of block outputs (Park & Kim "
                                           f"2022), mean over {len(imgs.names)} images")
    data["blocks"] = b["blocks"]
    _write(out_dir(args), "spectrum", data, pngs)
    return 0


def cmd_bias(args) -> int:
    from vitlab.analysis.bias import bias_maps
    from vitlab.analysis.plots import bias_png

    model = _model(args)
    r = bias_maps(model)
    png = bias_png(r, f"{args.model}: attention bias by offset (query: top-left pixel), range "
                      f"[{r['range'][0]:.2f}, {r['range'][1]:.2f}]")
    data = {"model": args.model, "checkpoint": args.checkpoint, "range": r["range"],
            "layers": [{**{k: v for k, v in lay.items() if k != "maps"}, "maps": lay["maps"].tolist()}
                       for lay in r["layers"]]}
    _write(out_dir(args), "bias", data, png)
    return 0


def cmd_posembed(args) -> int:
    from vitlab.analysis.plots import posembed_png
    from vitlab.analysis.posembed import posembed_similarity

    model = _model(args)
    r = posembed_similarity(model, args.table)
    png = posembed_png(r, f"{args.model} {r['name']} ({r['kind']}): cosine similarity, neighbours "
                          f"{r['neighbour_mean']:.2f}, far {r['far_mean']:.2f}")
    data = {"model": args.model, "checkpoint": args.checkpoint, **r, "similarity": _round(r["similarity"], 4)}
    _write(out_dir(args), "posembed", data, png)
    return 0


def _timings_table(r: dict):
    from rich.table import Table

    from vitlab.analysis.timings import ROWS

    t = Table(title="LeViT supplementary, Table 1: microseconds per component, batch 1, 14x14 (median; fastest run)")
    for col in ("component", "DeiT-tiny ours", "DeiT-tiny paper", "LeViT-256 ours", "LeViT-256 paper"):
        t.add_column(col, justify="left" if col == "component" else "right")

    def cell(model, row):
        if row == "Total":
            return f"{r[model]['total_us']:.0f} ({r[model]['total_min_us']:.0f})"
        v = r[model]["components_us"].get(row)
        return "n/a" if v is None else f"{v:.0f} ({r[model]['components_min_us'][row]:.0f})"

    for row in (*ROWS, "Total"):
        paper = r["paper"]
        t.add_row(row, cell("deit_tiny", row), str(paper["deit_tiny"][row] or "n/a"), cell("levit_256", row),
                  str(paper["levit_256"][row] or "n/a"))
    t.add_row("sum / total", f"{r['deit_tiny']['sum_over_total']:.2f} ({r['deit_tiny']['sum_over_total_min']:.2f})",
              "", f"{r['levit_256']['sum_over_total']:.2f} ({r['levit_256']['sum_over_total_min']:.2f})", "")
    return t


def cmd_timings(args) -> int:
    import torch

    from vitlab.analysis import timings
    from vitlab.analysis.plots import block_timings_png, timings_png

    torch.manual_seed(args.seed)
    if args.model is None:
        r = timings.levit_table1(warmup=args.warmup, runs=args.runs, threads=args.threads, seed=args.seed)
        console.print(_timings_table(r))
        png = timings_png(r, f"LeViT supplementary Table 1 here ({args.threads} thread, batch 1, {args.runs} runs) "
                             f"vs the paper (Xeon E5-2698 core)")
        _write(out_dir(args), "timings", r, png)
        return 0
    model = _model(args)
    cfg = getattr(model, "pretrained_cfg", None)
    size = args.img_size or (model.img_size[0] if hasattr(model, "img_size") else cfg.input_size[1] if cfg else 224)
    x = torch.randn(1, cfg.input_size[0] if cfg else 3, size, size)
    r = timings.block_timings(model, x, block=args.block, warmup=args.warmup, runs=args.runs, threads=args.threads)
    for k, v in r["components_us"].items():
        console.print(f"{k:<24} {v:9.0f} us", highlight=False)
    console.print(f"{'rest':<24} {r['rest_us']:9.0f} us\n{'total':<24} {r['total_us']:9.0f} us", highlight=False)
    png = block_timings_png(r, f"{args.model} {r['block']}: {args.threads} thread, batch 1, {size}px, median of "
                               f"{args.runs}")
    _write(out_dir(args), "timings", {"model": args.model, **r}, png)
    return 0


def _vit_shape(name: str, extra: dict) -> dict:
    """embed_dim, num_heads and patch_size of a plain ViT (built on 'meta': no memory); ViT-B/16's for any other
    family."""
    import torch

    import vitlab

    with torch.device("meta"):
        m = vitlab.create_model(name, **extra)
    attn = getattr(getattr(m, "blocks", [None])[0], "attn", None)
    if getattr(m, "patch_embed", None) is None or not hasattr(attn, "num_heads"):
        return {}
    return dict(embed_dim=m.embed_dim, num_heads=attn.num_heads, patch_size=m.patch_embed.patch_size[0])


def cmd_memory(args) -> int:
    from vitlab.analysis.memory import complexity_table, measure_memory_isolated
    from vitlab.analysis.plots import memory_png

    modes = ["infer", "train"] if args.mode == "both" else [args.mode]
    extra = model_arg_pairs(args.model_arg)
    rows = []
    for b in args.batch_size:
        if b < 1:
            raise ValueError(f"--batch-size must be positive, got {b}")
    for b in args.batch_size:
        for mode in modes:
            console.print(f"measuring {args.model} {mode} at batch {b} on {args.device} ({args.dtype}) in a fresh "
                          f"process ...", highlight=False)
            rows.append(measure_memory_isolated(args.model, batch_size=b, mode=mode, device=args.device,
                                                dtype=args.dtype, img_size=args.img_size, sdpa=args.sdpa,
                                                malloc_mmap_threshold=args.malloc_mmap_threshold, **extra))
    size = {"img_size": args.img_size} if args.img_size else {}
    table = complexity_table(**_vit_shape(args.model, {**extra, **size}))
    for r in rows:
        est = "  ".join(f"Q={q}: {v:.3f}" for q, v in r["estimate_gb"].items())
        console.print(f"{r['mode']:>5} b{r['batch_size']}: estimate (weights only) GB {est} | measured: loaded "
                      f"{r['loaded_gb']:.3f}, peak {r['measured_peak_gb']:.3f} GB = {r['measured_over_estimate']:.2f} "
                      f"x the estimate at its dtype", highlight=False)
        if r["activation_gb"] is None:
            console.print(f"       no activation term: {r['activation_note']}", highlight=False)
            continue
        how = (f"closed form, SDPA {r['sdpa_kernel']}, map materialised: {r['attention_map_materialised']}; "
               f"traced: {r['traced_gb']:.3f}" if r["activation_source"] == "closed form" else "traced")
        console.print(f"       weights {r['weights_gb']:.3f} + input {r['input_gb']:.3f} + activations "
                      f"{r['activation_gb']:.3f} ({how}; peak in {r['activation_trace']['peak_at']}) = "
                      f"{r['analytic_gb']:.3f} GB; measured / that = {r['measured_over_analytic']:.2f}; live "
                      f"tensors peaked at {r['tensor_peak_gb']:.3f} GB", highlight=False)
    for t in table:
        console.print(f"{t['img_size']:>5} px: N = {t['tokens']:>5}, {t['scores_per_head_m']:.2f} M scores/head "
                      f"(rounded: {t['reference_scores_m']}), {t['attention_gmacs_per_layer']:.3f} GMACs/layer, "
                      f"{t['attention_map_mb_per_layer']:.1f} MB maps/layer", highlight=False)
    batches = ", ".join(str(b) for b in args.batch_size)
    png = memory_png(rows, table, f"{args.model}: memory at batch {batches} ({args.device}, {args.dtype}"
                                  + (f", MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}"
                                     if args.malloc_mmap_threshold else "")
                                  + (f", SDPA {args.sdpa}" if args.sdpa != "auto" else "") + ")")
    _write(out_dir(args), "memory", {"measurements": rows, "complexity": table, "model": args.model}, png)
    return 0


def cmd_window_study(args) -> int:
    import torch

    from vitlab.analysis.plots import window_study_png
    from vitlab.analysis.studies import window_study

    torch.manual_seed(args.seed)
    r = window_study(windows=args.windows, model=args.model, img_size=args.img_size or 224,
                     batch_size=args.batch_size, warmup=args.warmup, runs=args.runs, memory=not args.no_memory,
                     epochs=args.epochs, dataset=args.data, train_img_size=args.train_img_size,
                     train_batch_size=args.train_batch_size, lr=args.lr, output_dir=str(out_dir(args) / "runs"),
                     model_kwargs=model_arg_pairs(args.model_arg),
                     progress=lambda msg: console.print(msg, highlight=False))
    for row in r["rows"]:
        console.print("  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                      highlight=False)
    png = window_study_png(r, f"{args.model}, HiLo window s (stage 3): {r['settings']['img_size']}px, batch "
                              f"{args.batch_size}, {torch.get_num_threads()} threads (paper: dashed)")
    _write(out_dir(args), "window-study", r, png)
    return 0


def cmd_pooled_queries(args) -> int:
    import torch

    from vitlab.analysis.plots import pooled_queries_png
    from vitlab.analysis.studies import pooled_queries_study

    torch.manual_seed(args.seed)
    r = pooled_queries_study(model=args.model, img_size=args.img_size or 224, batch_size=args.batch_size,
                             warmup=args.warmup, runs=args.runs, model_kwargs=model_arg_pairs(args.model_arg))
    for row in r["rows"]:
        console.print(f"{row['variant']:>15}: {row['params_m']:.2f} M params, {row['gmacs']:.3f} GMACs, "
                      f"{row['img_per_s']:.2f} img/s", highlight=False)
    console.print(f"pooled / standard throughput: {r['speed_ratio']:.2f} (paper, RTX 3090: {1084 / 1471:.2f})",
                  highlight=False)
    png = pooled_queries_png(r, f"{args.model} with and without pooled queries ({r['settings']['img_size']}px, "
                                f"batch {args.batch_size}, {torch.get_num_threads()} threads)")
    _write(out_dir(args), "pooled-queries", r, png)
    return 0


def _study_args(p, batch_size: int, runs: int) -> None:
    p.add_argument("--model", default="litv2_s", help="a LITv2 (default: litv2_s)")
    p.add_argument("--img-size", type=int, default=None, help="input size (default 224)")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE", help="a create_model argument, repeatable")
    p.add_argument("--batch-size", type=int, default=batch_size, help="batch of the timing and memory runs")
    p.add_argument("--runs", type=int, default=runs, help="timed round-robin runs (median)")
    p.add_argument("--warmup", type=int, default=1)


def _common(p, model: str | None = "deit_tiny_patch16_224", images: bool = True) -> None:
    if model is not None:
        p.add_argument("--model", default=model, help=f"a registered model name (default: {model})")
        p.add_argument("--checkpoint", default=None, metavar="PATH", help="weights to load (timm or vitlab format)")
        p.add_argument("--img-size", type=int, default=None, help="input size (default: the model's own)")
        p.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                       help="a create_model argument, repeatable (e.g. pos_embed=sincos)")
    if images:
        p.add_argument("--images", nargs="+", default=None, metavar="IMAGE",
                       help="image files (default: the bundled astronaut, coffee, chelsea)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder (default: RUN/analysis for a --checkpoint of a vitlab run, else "
                        "runs/analysis/MODEL)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")


def register(sub) -> None:
    from vitlab.analysis.attention import HEAD_FUSIONS

    an = sub.add_parser("analyze")  # its help line is vitlab.cli.COMMANDS's
    asub = an.add_subparsers(dest="tool", required=True)

    a = asub.add_parser("attention", help="where each attention head looks: per-head maps, the rollout through the "
                                          "layers, overlays on the images")
    _common(a)
    a.add_argument("--block", type=int, default=-1, help="attention layer index (default: -1, the last)")
    a.add_argument("--query", default="cls", help="cls, dist, or a query patch ROW,COL (default: cls; the centre "
                                                 "patch for models without a class token)")
    a.add_argument("--head-fusion", default="mean", choices=HEAD_FUSIONS, help="rollout head fusion")
    a.add_argument("--discard-ratio", type=float, default=0.9, help="rollout: fraction of weakest weights zeroed")
    a.set_defaults(func=cmd_attention)

    s = asub.add_parser("spectrum", help="which spatial frequencies each block passes on (for LITv2 also its "
                                         "high- and low-frequency attention branches)")
    _common(s, model="litv2_s")
    s.add_argument("--block", type=int, default=None, help="HiLo layer with both branches (default: -1, the last)")
    s.set_defaults(func=cmd_spectrum)

    b = asub.add_parser("bias", help="the learned attention biases of LeViT / EfficientFormer, as maps over the "
                                     "distance between query and key")
    _common(b, model="levit_256", images=False)
    b.set_defaults(func=cmd_bias)

    pe = asub.add_parser("posembed", help="how alike the position embeddings are: each one's cosine similarity "
                                          "with all others")
    _common(pe, model="vit_base_patch16_224", images=False)
    pe.add_argument("--table", type=int, default=0, help="which position-embedding table (PVT has one a stage)")
    pe.set_defaults(func=cmd_posembed)

    t = asub.add_parser("timings", help="where a block's time goes (attention, MLP, norms, reshapes): DeiT-tiny "
                                        "against LeViT-256 as in the LeViT paper, or a block of --model")
    _common(t, model=None, images=False)
    t.add_argument("--model", default=None, help="time this model's block instead of Table 1's two blocks")
    t.add_argument("--img-size", type=int, default=None, help="input size with --model (default: the model's own)")
    t.add_argument("--model-arg", action="append", metavar="KEY=VALUE", help="a create_model argument, repeatable")
    t.add_argument("--block", type=int, default=0, help="with --model: which blocks.<i> module (default 0)")
    t.add_argument("--runs", type=int, default=100, help="timed runs, median reported (>= 50 for Table 1)")
    t.add_argument("--warmup", type=int, default=10)
    t.add_argument("--threads", type=int, default=1, help="torch threads while timing (Table 1: 1)")
    t.set_defaults(func=cmd_timings, checkpoint=None)  # timing does not depend on the weights

    m = asub.add_parser("memory", help="how much memory a model needs to serve or train at a batch size: the "
                                       "usual estimate against the measured peak")
    _common(m, model="vit_base_patch16_224", images=False)
    m.add_argument("--batch-size", type=int, nargs="+", default=[64], help="one or more batch sizes")
    m.add_argument("--mode", default="infer", choices=["infer", "train", "both"])
    m.add_argument("--device", default="cpu", type=device_arg, choices=["cpu", "cuda"])
    m.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="fp32 is Q = 32, bf16 Q = 16")
    m.add_argument("--sdpa", default="auto", choices=["auto", "math"],
                   help="SDPA kernel: PyTorch's choice (flash on the CPU) or the math kernel, which builds the maps")
    m.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="run the measurements with glibc's MALLOC_MMAP_THRESHOLD_ fixed (e.g. 131072: every "
                        "tensor over 128 KiB gets its own mapping, returned when freed)")
    m.set_defaults(func=cmd_memory)

    w = asub.add_parser("window-study", help="LITv2's speed, memory and accuracy for each window size of its "
                                             "attention (LITv2 supplementary, Table II)")
    _study_args(w, batch_size=8, runs=5)
    _common(w, model=None, images=False)
    w.add_argument("--windows", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7], help="window sizes (default 2..7)")
    w.add_argument("--no-memory", action="store_true", help="skip the train / test memory columns")
    w.add_argument("--epochs", type=int, default=0, help="train each for this many epochs for top-1 (0: no)")
    w.add_argument("--data", default="digits", help="dataset of the top-1 column (vitlab train's --data)")
    w.add_argument("--train-img-size", type=int, default=None, help="training image size (a multiple of 32)")
    w.add_argument("--train-batch-size", type=int, default=32)
    w.add_argument("--lr", type=float, default=None, help="learning rate at batch 512 (default: vitlab train's)")
    w.set_defaults(func=cmd_window_study)

    pq = asub.add_parser("pooled-queries", help="LITv2's speed and memory with and without pooling the attention "
                                               "queries (LITv2 supplementary, Table III)")
    _study_args(pq, batch_size=8, runs=10)
    _common(pq, model=None, images=False)
    pq.set_defaults(func=cmd_pooled_queries)
