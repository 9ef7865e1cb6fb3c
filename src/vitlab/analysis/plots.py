"""PNG figures of the analysis tools, drawn with matplotlib's object API (``Figure``, no ``pyplot``). Each
function takes the data a tool returned and gives PNG bytes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

from vitlab._io import png_bytes


def _upsample(maps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(..., h, w) -> (..., H, W) bilinear, for drawing a token map over the pixels it came from."""
    lead = maps.shape[:-2]
    m = maps.reshape(-1, 1, *maps.shape[-2:]).float()
    return F.interpolate(m, size=size, mode="bilinear", align_corners=False).reshape(*lead, *size)


def _normalise(m: torch.Tensor) -> torch.Tensor:
    lo, hi = m.min(), m.max()
    return (m - lo) / (hi - lo).clamp_min(1e-12)


def _photo(ax, img: torch.Tensor) -> None:
    """An (H, W, C) image in [0, 1]; one channel drawn in grey."""
    if img.shape[-1] == 1:
        ax.imshow(img[..., 0].numpy(), cmap="gray", vmin=0, vmax=1)
    else:
        ax.imshow(img.numpy())


def _off(ax) -> None:
    ax.set_xticks([])
    ax.set_yticks([])


def attention_png(display: torch.Tensor, maps: torch.Tensor, rollout: torch.Tensor | None, names: list[str],
                  title: str, alpha: float = 0.6) -> bytes:
    """One row per image: the photo, each head's map and the rollout, overlaid on the photo (``jet``).

    display (N, H, W, 3) in [0, 1]; maps (N, heads, h, w); rollout (N, h, w) or None."""
    n, heads = maps.shape[:2]
    cols = 1 + heads + (rollout is not None)
    w = min(1.6, 14.0 / cols)  # many heads: narrower panels, the figure stays <= 14 inches wide
    fig = Figure(figsize=(w * cols, (w + 0.1) * n + 0.4))
    axes = fig.subplots(n, cols, squeeze=False)
    size = tuple(display.shape[1:3])
    up = _upsample(maps, size)
    roll = _upsample(rollout, size) if rollout is not None else None
    for i in range(n):
        _photo(axes[i][0], display[i])
        axes[i][0].set_ylabel(names[i], fontsize=8)
        for h in range(heads):
            ax = axes[i][1 + h]
            _photo(ax, display[i])
            ax.imshow(_normalise(up[i, h]).numpy(), cmap="jet", alpha=alpha)
            if i == 0:
                ax.set_title(f"head {h}", fontsize=8)
        if roll is not None:
            ax = axes[i][-1]
            _photo(ax, display[i])
            ax.imshow(_normalise(roll[i]).numpy(), cmap="jet", alpha=alpha)
            if i == 0:
                ax.set_title("rollout", fontsize=8)
        for ax in axes[i]:
            _off(ax)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return png_bytes(fig)


def hilo_spectrum_png(r: dict, title: str) -> bytes:
    """Figures II and III of the LITv2 supplementary: the 8 channel magnitudes of Hi-Fi (top row) and Lo-Fi
    (bottom row)."""
    n = r["hifi"].shape[0]
    fig = Figure(figsize=(1.5 * n, 3.6))
    axes = fig.subplots(2, n, squeeze=False)
    for row, branch in enumerate(("hifi", "lofi")):
        for c in range(n):
            ax = axes[row][c]
            ax.imshow(r[branch][c].numpy())
            _off(ax)
        axes[row][0].set_ylabel({"hifi": "Hi-Fi", "lofi": "Lo-Fi"}[branch], fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return png_bytes(fig)


def block_spectrum_png(r: dict, title: str) -> bytes:
    """Park & Kim's Fig. 2(a): relative log amplitude vs frequency per block, coloured by depth, and the value at
    the highest frequency per block."""
    from matplotlib import colormaps

    rows = r["blocks"]
    fig = Figure(figsize=(10, 3.6))
    a1, a2 = fig.subplots(1, 2)
    cmap = colormaps["plasma"]
    for i, b in enumerate(rows):
        freqs = [2 * k / b["grid"][0] for k in range(len(b["curve"]))]  # entry k: frequency 2 pi k / H
        a1.plot(freqs, b["curve"], color=cmap(i / max(len(rows) - 1, 1)), lw=1)
    a1.set_xlabel("frequency (x pi)")
    a1.set_ylabel("relative log amplitude")
    a1.set_title("each block's output (dark: early, light: late)", fontsize=9)
    a2.plot(range(len(rows)), [b["high"] for b in rows], marker="o", ms=3)
    a2.set_xlabel("block")
    a2.set_ylabel("at the highest frequency")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return png_bytes(fig)


def bias_png(r: dict, title: str, max_layers: int = 8) -> bytes:
    """LeViT supplementary, Figure 1: each layer's per-head bias maps over offsets (the top-left pixel is the query;
    yellow high, dark blue low), one shared colour scale over the model's range."""
    layers = r["layers"][:max_layers]
    heads = max(lay["maps"].shape[0] for lay in layers)
    fig = Figure(figsize=(1.1 * heads + 1.5, 1.2 * len(layers) + 0.6))
    axes = fig.subplots(len(layers), heads, squeeze=False)
    lo, hi = r["range"]
    im = None
    for i, lay in enumerate(layers):
        for h in range(heads):
            ax = axes[i][h]
            _off(ax)
            if h < lay["maps"].shape[0]:
                im = ax.imshow(lay["maps"][h].numpy(), cmap="viridis", vmin=lo, vmax=hi if hi > lo else lo + 1e-6)
                ax.add_patch(_square())
            else:
                ax.axis("off")
        axes[i][0].set_ylabel(lay["name"].replace(".attn", "").replace("stages.", "s"), fontsize=6)
    if im is not None:
        fig.colorbar(im, ax=[a for row in axes for a in row], shrink=0.6)
    fig.suptitle(title, fontsize=9)
    return png_bytes(fig)


def _square():
    from matplotlib.patches import Rectangle

    return Rectangle((-0.5, -0.5), 1, 1, fill=False, edgecolor="red", lw=1)


def posembed_png(r: dict, title: str) -> bytes:
    """An H x W mosaic of H x W maps (one image, tiles split by a blank line): tile (i, j) is the cosine
    similarity of patch (i, j)'s embedding with every patch's."""
    sim = r["similarity"]
    H, W = sim.shape[:2]
    tiles = torch.full((H, H + 1, W, W + 1), float("nan"))  # the extra row / column: a gap between tiles
    tiles[:, :H, :, :W] = sim.permute(0, 2, 1, 3)  # (i, y, j, x)
    mosaic = tiles.reshape(H * (H + 1), W * (W + 1))
    fig = Figure(figsize=(7, 6.4))
    ax = fig.subplots()
    im = ax.imshow(mosaic.numpy(), cmap="viridis", vmin=float(sim.min()), vmax=1, interpolation="nearest")
    _off(ax)
    ax.set_xlabel("input patch column")
    ax.set_ylabel("input patch row")
    fig.colorbar(im, ax=ax, shrink=0.8, label="cosine similarity")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return png_bytes(fig)


def timings_png(r: dict, title: str) -> bytes:
    """LeViT supplementary Table 1 beside the measurement: per component, DeiT-tiny and LeViT-256 (ours: median, and the
    fastest run as a tick; the paper's as hatched bars)."""
    from vitlab.analysis.timings import ROWS

    rows = list(ROWS) + ["Total"]
    fig = Figure(figsize=(9, 5))
    ax = fig.subplots()
    hgt = 0.2
    styles = [("deit_tiny", "ours", "tab:blue", None), ("deit_tiny", "paper", "tab:blue", "//"),
              ("levit_256", "ours", "tab:orange", None), ("levit_256", "paper", "tab:orange", "//")]
    for k, (model, src, color, hatch) in enumerate(styles):
        ys = [i + (k - 1.5) * hgt for i in range(len(rows))]
        if src == "ours":
            vals = [r[model]["total_us"] if row == "Total" else r[model]["components_us"].get(row) for row in rows]
            mins = [r[model]["total_min_us"] if row == "Total" else r[model]["components_min_us"].get(row)
                    for row in rows]
        else:
            vals, mins = [r["paper"][model][row] for row in rows], [None] * len(rows)
        ax.barh(ys, [v or 0 for v in vals], height=hgt, color=color, hatch=hatch, alpha=0.9 if src == "ours" else 0.4,
                edgecolor="black" if hatch else color, label=f"{model} ({src})")
        for y, m in zip(ys, mins):
            if m is not None:
                ax.plot([m, m], [y - hgt / 2, y + hgt / 2], color="black", lw=1.5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("microseconds (log); bars: median, black tick: fastest run")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return png_bytes(fig)


def block_timings_png(r: dict, title: str) -> bytes:
    """Any block: each leaf module's median microseconds, the rest of the block and its total."""
    names = list(r["components_us"]) + ["rest", "Total"]
    vals = list(r["components_us"].values()) + [max(r["rest_us"], 0.0), r["total_us"]]
    fig = Figure(figsize=(8, 0.3 * len(names) + 1.5))
    ax = fig.subplots()
    ax.barh(range(len(names)), vals, color=["tab:blue"] * (len(names) - 2) + ["tab:gray", "tab:red"])
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("microseconds (median)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return png_bytes(fig)


def memory_png(rows: list[dict], table: list[dict], title: str) -> bytes:
    """Left: the serving-memory estimate for Q = 32 / 16 / 8 / 4 beside each measurement (loaded, peak, live tensors)
    and weights + input + the activation term where it applies. Right: the complexity table (attention MACs
    and attention-map memory of one layer vs image size)."""
    fig = Figure(figsize=(11, 4))
    a1, a2 = fig.subplots(1, 2)
    est = rows[0]["estimate_gb"]
    labels = [f"estimate Q={q} (weights)" for q in est]
    vals = list(est.values())
    colors = ["tab:gray"] * len(est)
    for r in rows:
        tag = f"{r['mode']} {r['dtype']} b{r['batch_size']}"
        bars = [("loaded", r["loaded_gb"], "tab:blue"), ("peak (RSS)", r["measured_peak_gb"], "tab:red")]
        if r.get("activation_gb") is not None:
            bars += [("live tensors", r["tensor_peak_gb"], "tab:orange"),
                     ("weights+input+activations", r["analytic_gb"], "tab:green")]
        labels += [f"{tag} {what}" for what, _, _ in bars]
        vals += [v for _, v, _ in bars]
        colors += [c for _, _, c in bars]
    a1.barh(range(len(vals)), vals, color=colors)
    a1.set_yticks(range(len(vals)))
    a1.set_yticklabels(labels, fontsize=8)
    a1.invert_yaxis()
    for i, v in enumerate(vals):
        a1.annotate(f"{v:.3f}", (v, i), xytext=(2, 0), textcoords="offset points", va="center", fontsize=7)
    a1.set_xlim(0, max(vals) * 1.15)
    a1.set_xlabel(f"GB ({rows[0]['device']})")
    a1.set_title(f"{rows[0]['model']}: estimate, the activation term, measured", fontsize=9)
    sizes = [t["img_size"] for t in table]
    a2.plot(sizes, [t["attention_gmacs_per_layer"] for t in table], marker="o", label="attention GMACs / layer")
    a2.plot(sizes, [t["attention_map_mb_per_layer"] / 1024 for t in table], marker="s",
            label="attention maps GB / layer (fp32)")
    for t in table:
        a2.annotate(f"N={t['tokens']}", (t["img_size"], t["attention_gmacs_per_layer"]), fontsize=7)
    a2.set_xscale("log")
    a2.set_yscale("log")
    a2.set_xlabel("image size (px)")
    a2.legend(fontsize=8)
    a2.set_title("attention cost grows with N^2", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return png_bytes(fig)


def window_study_png(r: dict, title: str) -> bytes:
    """LITv2 supplementary Table II: each measured column against the window size, ours (solid, left axis) beside the
    paper's (dashed, right axis: another GPU, batch and dataset)."""
    rows, paper = r["rows"], r["paper"]
    ws = [row["window"] for row in rows]
    cols = [("gmacs", "gflops", "GMACs"), ("img_per_s", "img_per_s", "img/s"),
            ("train_memory_gb", "train_memory_gb", "train memory GB"),
            ("test_memory_gb", "test_memory_gb", "test memory GB"), ("top1", "top1", "top-1 %")]
    cols = [c for c in cols if all(c[0] in row for row in rows)]
    fig = Figure(figsize=(3.2 * len(cols), 3.2))
    axes = fig.subplots(1, len(cols), squeeze=False)[0]
    for ax, (ours, theirs, label) in zip(axes, cols):
        ax.plot(ws, [row[ours] for row in rows], marker="o", label="ours")
        ax.set_xlabel("window size s")
        ax.set_title(label, fontsize=9)
        pw = [s for s in ws if s in paper]
        if pw:
            tw = ax.twinx()
            tw.plot(pw, [paper[s][theirs] for s in pw], ls="--", marker="x", color="tab:gray", label="paper")
            tw.tick_params(labelsize=7, colors="tab:gray")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return png_bytes(fig)


def pooled_queries_png(r: dict, title: str) -> bytes:
    """LITv2 supplementary Table III: params, GMACs and img/s of both variants, ours beside the paper's."""
    rows = r["rows"]
    paper = list(r["paper"].values())
    fig = Figure(figsize=(9, 3))
    axes = fig.subplots(1, 3)
    for ax, (key, pkey, label) in zip(axes, [("params_m", "params_m", "params (M)"), ("gmacs", "gflops", "GMACs"),
                                              ("img_per_s", "img_per_s", "img/s")]):
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [row[key] for row in rows], width=0.4, label="ours")
        if key != "img_per_s":  # throughputs on different hardware are not drawn on one axis
            ax.bar([x + 0.2 for x in xs], [p[pkey] for p in paper], width=0.4, color="tab:gray", alpha=0.6,
                   label="paper")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([row["variant"] for row in rows], fontsize=8)
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return png_bytes(fig)
