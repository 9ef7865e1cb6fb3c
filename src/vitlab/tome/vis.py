"""The merged regions of an image, drawn as the ToMe paper's Figure 4 / 5 (Bolya et al., ICLR 2023): every
token after the last block is one region of input patches, painted with the mean colour of its pixels and
outlined, so the patches that ended in the same token read as one segment."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from vitlab._io import png_bytes
from vitlab.tome.merge import unmerge_tokens
from vitlab.tome.patch import info, is_applied


@torch.no_grad()
def merge_regions(model: nn.Module, image: torch.Tensor) -> torch.Tensor:
    """(H', W') token index of every patch of ``image`` (C, H, W) after the model's last block. ``model`` is
    patched with ToMe (its own r); source tracking is switched on for this call."""
    if not is_applied(model):
        raise ValueError("merge_regions needs a model patched with vitlab.tome.apply")
    state = info(model)
    if image.ndim != 3:
        raise ValueError(f"expected one image (C, H, W), got shape {tuple(image.shape)}")
    was_training, trace = model.training, state.trace_source
    state.trace_source = True
    model.eval()
    try:
        model(image[None].to(next(model.parameters()).device))
        source = state.source
    finally:
        state.trace_source = trace
        model.train(was_training)
    gh, gw = model.patch_embed.dynamic_feat_size(image.shape[-2:])
    n0 = gh * gw + state.protected
    if source is None:  # nothing merged: every patch is its own token
        source = torch.eye(n0)[None]
    ids = torch.arange(source.shape[1], device=source.device, dtype=source.dtype)[None, :, None]
    token = unmerge_tokens(ids, source)[0, state.protected:, 0].long()  # (N0 - protected,)
    return token.view(gh, gw).cpu()


def merge_png(model: nn.Module, image: torch.Tensor, display: torch.Tensor | None = None) -> bytes:
    """PNG of the merged regions: left the image, right every region in its mean colour with its outline.
    ``image`` is the model's (normalised) input; ``display`` (3 or 1, H, W in [0, 1]) what to paint, default the
    image rescaled to [0, 1]."""
    from matplotlib.figure import Figure

    regions = merge_regions(model, image)
    shown = image if display is None else display
    shown = shown.detach().float().cpu()
    if display is None:
        shown = (shown - shown.min()) / (shown.max() - shown.min()).clamp_min(1e-12)
    pix = shown.permute(1, 2, 0).numpy()
    if pix.shape[-1] == 1:
        pix = np.repeat(pix, 3, axis=-1)
    H, W = pix.shape[:2]
    gh, gw = regions.shape
    ph, pw = H // gh, W // gw
    label = np.kron(regions.numpy(), np.ones((ph, pw), dtype=np.int64))  # token index of every pixel
    pix = pix[: label.shape[0], : label.shape[1]]
    flat = label.reshape(-1)
    counts = np.bincount(flat)
    means = np.stack([np.bincount(flat, weights=pix[..., c].reshape(-1)) for c in range(3)], axis=1)
    painted = (means / np.maximum(counts, 1)[:, None])[label]
    edge = np.zeros(label.shape, dtype=bool)  # a pixel whose right or lower neighbour is in another region
    edge[:, :-1] |= label[:, :-1] != label[:, 1:]
    edge[:-1, :] |= label[:-1, :] != label[1:, :]
    painted[edge] = 1.0
    fig = Figure(figsize=(8, 4))
    for ax, img, title in zip(fig.subplots(1, 2), (pix, painted),
                              ("input", f"{len(np.unique(flat))} merged regions of {gh * gw} patches"), strict=True):
        ax.imshow(np.clip(img, 0, 1))
        ax.set_title(title)
        ax.axis("off")
    return png_bytes(fig)


