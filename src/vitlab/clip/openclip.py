"""OpenCLIP checkpoints (Ilharco et al., 2021, github.com/mlfoundations/open_clip) for vitlab's :class:`CLIP`.

:func:`convert_openclip_state_dict` renames an open_clip ``CLIP`` state dict (ViT image tower, transformer text
tower) to vitlab's modules; the tensors are the same functions' weights, so the embeddings match. What changes:

=====================================================  ======================================================
open_clip                                              vitlab
=====================================================  ======================================================
``visual.conv1.weight``                                ``visual.trunk.patch_embed.proj.weight`` (no bias)
``visual.class_embedding`` (D,)                        ``visual.trunk.cls_token`` (1, 1, D)
``visual.positional_embedding`` (N, D)                 ``visual.trunk.pos_embed`` (1, N, D)
``visual.ln_pre``                                      ``visual.trunk.pos_drop.norm`` (CLIP's pre-norm)
``visual.transformer.resblocks.i``                     ``visual.trunk.blocks.i``
``visual.ln_post``                                     ``visual.trunk.norm``
``visual.proj`` (D, E)                                 ``visual.proj.weight`` (E, D) (transposed)
``token_embedding`` / ``positional_embedding``         ``text.token_embedding`` / ``text.pos_embed``
``transformer.resblocks.i``                            ``text.blocks.i``
``ln_final`` / ``text_projection`` (W, E)              ``text.norm`` / ``text.proj.weight`` (E, W)
``logit_scale`` ()                                     ``logit_scale`` (1,) (FSDP2 shards no scalar)
in a block: ``ln_1``, ``attn.in_proj_{weight,bias}``,  ``norm1``, ``attn.qkv.{weight,bias}``, ``attn.proj``,
``attn.out_proj``, ``ln_2``, ``mlp.c_fc``, ``c_proj``  ``norm2``, ``mlp.fc1``, ``mlp.fc2``
=====================================================  ======================================================

:func:`openclip_config` reads the architecture (widths, depths, patch, context, vocabulary) from the tensors'
shapes; the activation is not stored in a state dict (OpenAI's weights use QuickGELU: say so).
"""

from __future__ import annotations

import re

import torch

_BLOCK = [("ln_1.", "norm1."), ("ln_2.", "norm2."), ("attn.in_proj_weight", "attn.qkv.weight"),
          ("attn.in_proj_bias", "attn.qkv.bias"), ("attn.out_proj.", "attn.proj."), ("mlp.c_fc.", "mlp.fc1."),
          ("mlp.c_proj.", "mlp.fc2."), ("ls_1.gamma", "ls1.gamma"), ("ls_2.gamma", "ls2.gamma")]
_UNSUPPORTED = ("visual.attn_pool", "visual.trunk.", "text.transformer.", "logit_bias", "visual.head")


def is_openclip_state_dict(sd: dict) -> bool:
    return "visual.conv1.weight" in sd and "token_embedding.weight" in sd


def _block_key(rest: str) -> str:
    for old, new in _BLOCK:
        if rest.startswith(old):
            return new + rest[len(old):]
    return rest


def convert_openclip_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An open_clip ViT ``CLIP`` state dict in vitlab's names (see the module table)."""
    bad = [k for k in sd if k.startswith(_UNSUPPORTED)]
    if bad:
        raise ValueError(f"unsupported open_clip model (keys {bad[:3]}): only ViT image towers with a "
                         f"[CLS] token and the transformer text tower convert")
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k == "attn_mask" or k.endswith(".attn_mask"):  # the causal mask buffer of older versions
            continue
        m = re.match(r"(visual\.)?transformer\.resblocks\.(\d+)\.(.*)", k)
        if m:
            tower = "visual.trunk" if m.group(1) else "text"
            out[f"{tower}.blocks.{m.group(2)}.{_block_key(m.group(3))}"] = v
        elif k == "visual.conv1.weight":
            out["visual.trunk.patch_embed.proj.weight"] = v
        elif k == "visual.class_embedding":
            out["visual.trunk.cls_token"] = v.reshape(1, 1, -1)
        elif k == "visual.positional_embedding":
            out["visual.trunk.pos_embed"] = v[None]
        elif k.startswith("visual.ln_pre."):
            out["visual.trunk.pos_drop.norm." + k.split(".")[-1]] = v
        elif k.startswith("visual.ln_post."):
            out["visual.trunk.norm." + k.split(".")[-1]] = v
        elif k == "visual.proj":
            out["visual.proj.weight"] = v.t().contiguous()
        elif k == "token_embedding.weight":
            out["text.token_embedding.weight"] = v
        elif k == "positional_embedding":
            out["text.pos_embed"] = v
        elif k.startswith("ln_final."):
            out["text.norm." + k.split(".")[-1]] = v
        elif k == "text_projection":
            out["text.proj.weight"] = v.t().contiguous()
        elif k == "logit_scale":
            out[k] = v.reshape(1)
        else:  # anything unknown: the strict load names what does not fit
            out[k] = v
    return out


def _depth(sd: dict, prefix: str) -> int:
    idx = {int(m.group(1)) for k in sd if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return max(idx) + 1 if idx else 0


def openclip_config(sd: dict[str, torch.Tensor]) -> dict:
    """The :func:`vitlab.clip.model.build_clip` arguments of an open_clip ViT ``CLIP`` state dict, from shapes.

    Heads follow open_clip's rule: image width / 64; text width / 64 (open_clip's configs: 8 heads at 512,
    12 at 768, 16 at 1024)."""
    if not is_openclip_state_dict(sd):
        raise ValueError("not an open_clip ViT CLIP state dict (no 'visual.conv1.weight' / 'token_embedding.weight')")
    conv = sd["visual.conv1.weight"]
    width, in_chans, patch = conv.shape[0], conv.shape[1], conv.shape[-1]
    grid = int(round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5))
    text_width = sd["token_embedding.weight"].shape[1]
    mlp = sd["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
    text_mlp = sd["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
    image_kwargs = dict(img_size=grid * patch, patch_size=patch, in_chans=in_chans, embed_dim=width,
                        depth=_depth(sd, "visual.transformer.resblocks."), num_heads=max(width // 64, 1),
                        mlp_ratio=mlp / width)
    text_kwargs = dict(vocab_size=sd["token_embedding.weight"].shape[0],
                       context_length=sd["positional_embedding"].shape[0], width=text_width,
                       depth=_depth(sd, "transformer.resblocks."), num_heads=max(text_width // 64, 1),
                       mlp_ratio=text_mlp / text_width)
    return {"embed_dim": sd["visual.proj"].shape[1], "image_kwargs": image_kwargs, "text_kwargs": text_kwargs}
