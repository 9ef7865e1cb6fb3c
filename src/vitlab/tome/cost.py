"""GMACs of a merging schedule in closed form (one multiply-add = 1), from the token count of every block.

With ``N_l`` tokens entering block l (``N_0`` = patches + protected tokens) and ``r_l`` merges (clamped as the
matching clamps them), ToMe merges between the attention and the MLP (Bolya et al., Sec. 3), so block l costs

    attention  4 N_l C^2 + 2 N_l^2 C           (qkv + output projection, q k^T and A v)
    matching   ceil(N_l / 2) floor(N_l / 2) C / h   (cosine scores of the keys, mean over heads: width C / h)
    MLP        2 m N'_l C^2,  N'_l = N_l - r_l  (m: the MLP ratio)

and ``N_{l+1} = N'_l``; plus the patch embedding (``N_patches C 3 p^2``) and the classifier (``C K``). The cost
drops with the token count: roughly quadratically in the attention, linearly elsewhere.
"""

from __future__ import annotations

import torch.nn as nn


def tome_gmacs(model: nn.Module, rs: list[int], img_size: tuple[int, int] | None = None) -> float:
    """Closed-form GMACs (batch 1) of a ViT / DeiT with merges ``rs`` per block (r = 0 everywhere: the plain
    model); ``img_size`` defaults to the model's."""
    pe = model.patch_embed
    ph, pw = pe.patch_size
    H, W = img_size or pe.img_size
    n_patches = (H // ph) * (W // pw)
    p = model.num_prefix_tokens
    C = model.embed_dim
    blk = model.blocks[0]
    heads = blk.attn.num_heads
    m = blk.mlp.fc1.out_features / C
    macs = n_patches * C * pe.proj.in_channels * ph * pw
    n = n_patches + p
    for r in rs:
        r = max(0, min(r, (n - p) // 2))
        macs += 4 * n * C * C + 2 * n * n * C
        if r:
            macs += ((n + 1) // 2) * (n // 2) * (C // heads)
        n -= r
        macs += 2 * m * n * C * C
    macs += C * model.num_classes * (2 if model.head_dist is not None else 1)
    return macs / 1e9
