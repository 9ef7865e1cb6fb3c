"""The Vision Transformer in one page (Dosovitskiy et al., ICLR 2021, Sec. 3.1, Eq. 1-4), written as lucidrains'
``vit-pytorch/vit.py``: cut the image into patches and project each to a token, prepend a learned class token, add
learned position embeddings, run pre-norm blocks of multi-head self-attention and MLP with residuals, normalise,
pool (the class token, or the mean of the patch tokens) and classify.

Read this first: it computes what the registry's plain ``vit_*`` / ``deit_*`` models
(:class:`vitlab.models.vision_transformer.VisionTransformer`) compute, without their options (distillation and
register tokens, layer scale, other attention mechanisms, dynamic image sizes, feature taps). Their weights load
into it through :func:`from_timm_keys`, and the logits are the same (``tests/models/test_simple_vit.py``)::

    reference = vitlab.create_model("deit_tiny_patch16_224")
    vit = ViT(image_size=224, patch_size=16, num_classes=1000, dim=192, depth=12, heads=3, mlp_dim=768)
    vit.load_state_dict(from_timm_keys(reference.state_dict()))
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from einops.layers.torch import Rearrange
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, hidden_dim), nn.GELU(),
                                 nn.Linear(hidden_dim, dim))

    def forward(self, x):
        return self.net(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.to_qkv = nn.Linear(dim, dim * 3)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        qkv = self.to_qkv(self.norm(x))
        q, k, v = rearrange(qkv, "b n (qkv h d) -> qkv b h n d", qkv=3, h=self.heads)
        out = F.scaled_dot_product_attention(q, k, v)  # softmax(q k^T / sqrt(d)) v, every head at once
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_dim: int):
        super().__init__()
        self.attn = Attention(dim, heads)
        self.ff = FeedForward(dim, mlp_dim)

    def forward(self, x):
        x = x + self.attn(x)  # Eq. 2
        return x + self.ff(x)  # Eq. 3


class ViT(nn.Module):
    def __init__(self, *, image_size: int, patch_size: int, num_classes: int, dim: int, depth: int, heads: int,
                 mlp_dim: int, pool: str = "cls", channels: int = 3):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image size {image_size} is not a multiple of the patch size {patch_size}")
        if pool not in ("cls", "mean"):
            raise ValueError(f"pool must be 'cls' (the class token) or 'mean' (of the patch tokens), got {pool!r}")
        num_patches = (image_size // patch_size) ** 2
        self.to_patch_embedding = nn.Sequential(  # Eq. 1: x_p E, one linear map per flattened patch
            Rearrange("b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=patch_size, p2=patch_size),
            nn.Linear(patch_size * patch_size * channels, dim))
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.randn(1, num_patches + 1, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, mlp_dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pool = pool
        self.head = nn.Linear(dim, num_classes)

    def forward(self, img):
        x = self.to_patch_embedding(img)
        cls = repeat(self.cls_token, "1 1 d -> b 1 d", b=x.shape[0])
        x = torch.cat([cls, x], dim=1) + self.pos_embedding
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)[:, 0] if self.pool == "cls" else self.norm(x[:, 1:].mean(dim=1))  # Eq. 4
        return self.head(x)


# registry (timm) module -> this module's, parameter -> this module's; a key of a block keeps its "blocks.i." prefix
_MODULES = {"": "", "patch_embed.proj": "to_patch_embedding.1", "norm1": "attn.norm", "attn.qkv": "attn.to_qkv",
            "attn.proj": "attn.to_out", "norm2": "ff.net.0", "mlp.fc1": "ff.net.1", "mlp.fc2": "ff.net.3",
            "norm": "norm", "fc_norm": "norm", "head": "head"}
_PARAMS = {"weight": "weight", "bias": "bias", "cls_token": "cls_token", "pos_embed": "pos_embedding"}


def from_timm_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A plain ``vit_*`` / ``deit_*`` state dict (the registry's keys, which are timm's) with this module's keys;
    the patch projection's conv kernel becomes the linear map over flattened patches."""
    out = {}
    for key, value in state_dict.items():
        block, module, param = re.fullmatch(r"(blocks\.\d+\.)?(?:(.*)\.)?(\w+)", key).groups()
        if (module or "") not in _MODULES or param not in _PARAMS:
            raise ValueError(f"{key} has no place in the plain ViT (only vit_* / deit_* configs without "
                             "distillation or register tokens, layer scale or q/k norms load)")
        new = (block or "") + ".".join(filter(None, (_MODULES[module or ""], _PARAMS[param])))
        if new == "to_patch_embedding.1.weight":
            value = rearrange(value, "o c p1 p2 -> o (p1 p2 c)")
        out[new] = value
    return out
