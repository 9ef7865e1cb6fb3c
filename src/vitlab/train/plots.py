"""Training plots, drawn with matplotlib's object API (``Figure``): no ``pyplot``, no backend switch, no global
state; each returns PNG bytes. matplotlib is imported on the first plot, not with the trainer."""

from __future__ import annotations

from vitlab._io import png_bytes


def curves_png(metrics: list[dict], monitor: str = "top1") -> bytes:
    """Training and validation loss, and the validation ``monitor`` metric (raw and EMA), per epoch."""
    from matplotlib.figure import Figure

    ep = [m["epoch"] for m in metrics]
    fig = Figure(figsize=(10, 3.6))
    a1, a2 = fig.subplots(1, 2)
    a1.plot(ep, [m["train_loss"] for m in metrics], label="train loss")
    if all("val_loss" in m for m in metrics):
        a1.plot(ep, [m["val_loss"] for m in metrics], label="val loss")
    a1.set_xlabel("epoch")
    a1.legend()
    a2.plot(ep, [m[f"val_{monitor}"] for m in metrics], label=f"val {monitor}")
    if any(f"ema_val_{monitor}" in m for m in metrics):
        a2.plot(ep, [m.get(f"ema_val_{monitor}", float("nan")) for m in metrics], label=f"EMA val {monitor}")
    a2.set_xlabel("epoch")
    a2.set_ylabel("%" if monitor.startswith("top") else monitor)
    a2.legend()
    fig.tight_layout()
    return png_bytes(fig)


def confusion_png(conf, names: list[str], title: str) -> bytes:
    """A confusion matrix (rows: true class), with counts in the cells for up to 20 classes."""
    from matplotlib.figure import Figure

    k = conf.shape[0]
    size = min(4 + 0.35 * k, 30)
    fig = Figure(figsize=(size, size * 0.9))
    ax = fig.subplots()
    im = ax.imshow(conf.numpy(), cmap="Blues")
    fig.colorbar(im, ax=ax, fraction=0.046)
    if k <= 40:
        ax.set_xticks(range(k), names, rotation=90 if k > 10 else 0)
        ax.set_yticks(range(k), names)
        if k <= 20:
            for i in range(k):
                for j in range(k):
                    v = int(conf[i, j])
                    if v:
                        ax.text(j, i, str(v), ha="center", va="center", fontsize=8,
                                color="white" if v > conf.max().item() / 2 else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title)
    fig.tight_layout()
    return png_bytes(fig)
