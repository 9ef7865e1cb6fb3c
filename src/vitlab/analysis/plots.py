"""PNG figures of the analysis tools, drawn with matplotlib's object API (``Figure``, no ``pyplot``; the
helpers of :mod:`vitlab.train.plots`). Each function takes the data a tool returned and gives PNG bytes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vitlab.train.plots import _figure, _png


def _upsample(maps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(..., h, w) -> (..., H, W) bilinear, for drawing a token map over the pixels it came from."""
    lead = maps.shape[:-2]
    m = maps.reshape(-1, 1, *maps.shape[-2:]).float()
    return F.interpolate(m, size=size, mode="bilinear", align_corners=False).reshape(*lead, *size)


def _normalise(m: torch.Tensor) -> torch.Tensor:
    lo, hi = m.min(), m.max()
    return (m - lo) / (hi - lo).clamp_min(1e-12)


def _off(ax) -> None:
    ax.set_xticks([])
    ax.set_yticks([])


def attention_png(display: torch.Tensor, maps: torch.Tensor, rollout: torch.Tensor | None, names: list[str],
                  title: str, alpha: float = 0.6) -> bytes:
    """One row per image: the photo, each head's map and the rollout, overlaid on the photo (``jet``).

    display (N, H, W, 3) in [0, 1]; maps (N, heads, h, w); rollout (N, h, w) or None."""
    n, heads = maps.shape[:2]
    cols = 1 + heads + (rollout is not None)
    fig = _figure((1.6 * cols, 1.7 * n + 0.4))
    axes = fig.subplots(n, cols, squeeze=False)
    size = tuple(display.shape[1:3])
    up = _upsample(maps, size)
    roll = _upsample(rollout, size) if rollout is not None else None
    for i in range(n):
        axes[i][0].imshow(display[i].numpy())
        axes[i][0].set_ylabel(names[i], fontsize=8)
        for h in range(heads):
            ax = axes[i][1 + h]
            ax.imshow(display[i].numpy())
            ax.imshow(_normalise(up[i, h]).numpy(), cmap="jet", alpha=alpha)
            if i == 0:
                ax.set_title(f"head {h}", fontsize=8)
        if roll is not None:
            ax = axes[i][-1]
            ax.imshow(display[i].numpy())
            ax.imshow(_normalise(roll[i]).numpy(), cmap="jet", alpha=alpha)
            if i == 0:
                ax.set_title("rollout", fontsize=8)
        for ax in axes[i]:
            _off(ax)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _png(fig)
