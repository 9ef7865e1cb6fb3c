"""CLIP's symmetric InfoNCE loss (Radford et al., 2021, Fig. 3; Oord et al., 2018, InfoNCE):

    logits = exp(t) * norm(I) @ norm(T).T          (B, B) over the global batch
    loss   = (CE(logits, arange) + CE(logits.T, arange)) / 2

with the learned temperature ``t`` (``logit_scale``) clipped so the logits are scaled by at most 100 (Sec. 2.5).
Across processes (DDP / FSDP) every rank gathers all ranks' features with ``torch.distributed.nn.all_gather``,
which is differentiable: the gradient of a feature used as a negative on another rank flows back to the rank
that computed it (open_clip's ``gather_with_grad``). Each rank computes the loss of its own rows against the
global batch (``local_loss``); the strategy's gradient averaging then gives the gradient of the global loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

MAX_LOGIT_SCALE = 100.0


def gather_features(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(all ranks' rows concatenated in rank order, this rank's row offset); the identity on one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x, 0
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(x), dim=0), dist.get_rank() * x.shape[0]


def clip_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
              gather: bool = True) -> tuple[torch.Tensor, dict]:
    """Symmetric InfoNCE of unit-norm features (B, E); row i of the images pairs with row i of the texts.
    Returns (loss, logs with the in-batch image->text top-1 accuracy)."""
    scale = logit_scale.clamp(max=MAX_LOGIT_SCALE)
    offset = 0
    all_img, all_txt = image_features, text_features
    if gather:
        all_img, offset = gather_features(image_features)
        all_txt, _ = gather_features(text_features)
    labels = torch.arange(image_features.shape[0], device=image_features.device) + offset
    logits_per_image = scale * image_features @ all_txt.T  # (B, global B)
    logits_per_text = scale * text_features @ all_img.T
    loss = (F.cross_entropy(logits_per_image.float(), labels) + F.cross_entropy(logits_per_text.float(), labels)) / 2
    acc = (logits_per_image.argmax(-1) == labels).float().mean()
    return loss, {"i2t_acc": acc.detach(), "logit_scale": scale.detach()}
