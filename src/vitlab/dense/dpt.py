"""DPT (Ranftl et al., 2021, "Vision Transformers for Dense Prediction", Sec. 3, Fig. 1).

Reassemble (Eq. 3 - 5): at four hooks (ViT-B: blocks 2, 5, 8, 11) the tokens are read out -- the [CLS] token
``ignore``d, ``add``ed to every patch token, or ``project``ed (concatenated to each patch token, Linear(2D, D) +
GELU) -- put back on the grid, projected by a 1x1 conv to (96, 192, 384, 768) channels and resampled to strides
4 / 8 / 16 / 32 (transposed conv 4x / 2x, identity, 3x3 stride-2 conv). A 3x3 conv takes each to 256 channels.
Fusion (Fig. 1, right): coarse to fine, each block adds the residual-conv-unit'd skip to the running map, a
second residual conv unit, 2x bilinear (align_corners) upsampling and a 1x1 projection. A residual conv unit is
ReLU-conv3x3-ReLU-conv3x3 plus identity. Heads (supplementary, Sec. A): depth -- conv3x3 (256 -> 128), 2x
upsampling, conv3x3 (-> 32), ReLU, conv1x1 (-> 1), ReLU; segmentation -- conv3x3 + BN + ReLU, dropout 0.1,
1x1 to classes, 2x upsampling.

Module names follow Hugging Face transformers' ``DPTForDepthEstimation`` / ``DPTForSemanticSegmentation`` so
their state dicts load through :func:`convert_hf_state_dict` (the ViT's q, k, v become one qkv).
For a backbone whose maps already come at several strides (hierarchical), the resampling factor of each level is
its stride / (4, 8, 16, 32), i.e. 1 for a 4/8/16/32 pyramid; readout needs prefix tokens unless ``ignore``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

READOUTS = ("ignore", "add", "project")


class ReassembleLayer(nn.Module):
    def __init__(self, in_dim: int, channels: int, factor: float):
        super().__init__()
        self.projection = nn.Conv2d(in_dim, channels, 1)
        if factor > 1:
            self.resize = nn.ConvTranspose2d(channels, channels, int(factor), stride=int(factor))
        elif factor == 1:
            self.resize = nn.Identity()
        else:
            self.resize = nn.Conv2d(channels, channels, 3, stride=int(round(1 / factor)), padding=1)

    def forward(self, x):
        return self.resize(self.projection(x))


class ReassembleStage(nn.Module):
    def __init__(self, in_channels: list[int], strides: list[int], hidden: list[int], readout: str):
        super().__init__()
        if readout not in READOUTS:
            raise ValueError(f"unknown DPT readout {readout!r}; choose from {list(READOUTS)}")
        self.readout = readout
        targets = [4 * 2 ** i for i in range(len(hidden))]
        self.layers = nn.ModuleList(ReassembleLayer(c, h, s / t)
                                    for c, s, h, t in zip(in_channels, strides, hidden, targets, strict=True))
        if readout == "project":
            self.readout_projects = nn.ModuleList(nn.Sequential(nn.Linear(2 * c, c), nn.GELU()) for c in in_channels)

    def forward(self, maps, prefix):
        out = []
        for i, x in enumerate(maps):
            if self.readout != "ignore":
                if prefix is None:
                    raise ValueError(f"DPT readout {self.readout!r} needs a class token; use readout='ignore'")
                cls = prefix[i][:, 0]
                B, C, H, W = x.shape
                if self.readout == "project":
                    t = x.flatten(2).transpose(1, 2)
                    t = self.readout_projects[i](torch.cat([t, cls[:, None].expand_as(t)], dim=-1))
                    x = t.transpose(1, 2).reshape(B, C, H, W)
                else:
                    x = x + cls[:, :, None, None]
            out.append(self.layers[i](x))
        return out


class PreActResidualLayer(nn.Module):
    """Residual conv unit: x + conv(relu(conv(relu(x)))), optional BN after each conv (then without biases)."""

    def __init__(self, channels: int, batch_norm: bool = False):
        super().__init__()
        self.use_batch_norm = batch_norm
        self.activation1, self.activation2 = nn.ReLU(), nn.ReLU()
        self.convolution1 = nn.Conv2d(channels, channels, 3, padding=1, bias=not batch_norm)
        self.convolution2 = nn.Conv2d(channels, channels, 3, padding=1, bias=not batch_norm)
        if batch_norm:
            self.batch_norm1, self.batch_norm2 = nn.BatchNorm2d(channels), nn.BatchNorm2d(channels)

    def forward(self, x):
        y = self.convolution1(self.activation1(x))
        if self.use_batch_norm:
            y = self.batch_norm1(y)
        y = self.convolution2(self.activation2(y))
        if self.use_batch_norm:
            y = self.batch_norm2(y)
        return x + y


class FeatureFusionLayer(nn.Module):
    """The first (coarsest) layer has no skip input, hence no ``residual_layer1`` (transformers builds one it
    never runs; :func:`convert_hf_state_dict` drops its weights)."""

    def __init__(self, channels: int, batch_norm: bool = False, first: bool = False):
        super().__init__()
        self.projection = nn.Conv2d(channels, channels, 1)
        self.residual_layer1 = None if first else PreActResidualLayer(channels, batch_norm)
        self.residual_layer2 = PreActResidualLayer(channels, batch_norm)

    def forward(self, x, skip=None):
        if skip is not None:
            if skip.shape != x.shape:
                skip = F.interpolate(skip, size=x.shape[-2:], mode="bilinear", align_corners=False)
            x = x + self.residual_layer1(skip)
        x = self.residual_layer2(x)
        x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True)
        return self.projection(x)


class FeatureFusionStage(nn.Module):
    def __init__(self, n: int, channels: int, batch_norm: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(FeatureFusionLayer(channels, batch_norm, first=i == 0) for i in range(n))

    def forward(self, feats):
        fused = None
        for x, layer in zip(feats[::-1], self.layers, strict=True):
            fused = layer(x) if fused is None else layer(fused, x)
        return fused


class DPTNeck(nn.Module):
    """Reassemble + 3x3 convs to ``fusion`` channels + fusion: the stride-2 map the heads read."""

    def __init__(self, in_channels: list[int], strides: list[int], hidden=(96, 192, 384, 768), fusion: int = 256,
                 readout: str = "project", batch_norm: bool = False):
        super().__init__()
        if len(in_channels) != len(hidden):
            raise ValueError(f"DPT takes {len(hidden)} hooks, got {len(in_channels)} feature maps")
        self.reassemble_stage = ReassembleStage(in_channels, strides, list(hidden), readout)
        self.convs = nn.ModuleList(nn.Conv2d(h, fusion, 3, padding=1, bias=False) for h in hidden)
        self.fusion_stage = FeatureFusionStage(len(hidden), fusion, batch_norm)

    def forward(self, maps, prefix):
        feats = self.reassemble_stage(maps, prefix)
        return self.fusion_stage([conv(f) for conv, f in zip(self.convs, feats, strict=True)])


class DPTDepthHead(nn.Module):
    def __init__(self, fusion: int = 256):
        super().__init__()
        self.head = nn.Sequential(
            nn.Conv2d(fusion, fusion // 2, 3, padding=1),
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
            nn.Conv2d(fusion // 2, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 1, 1), nn.ReLU())

    def forward(self, x):
        return self.head(x)


class DPTSegHead(nn.Module):
    def __init__(self, num_classes: int, fusion: int = 256, dropout: float = 0.1):
        super().__init__()
        self.head = nn.Sequential(
            nn.Conv2d(fusion, fusion, 3, padding=1, bias=False), nn.BatchNorm2d(fusion), nn.ReLU(), nn.Dropout(dropout),
            nn.Conv2d(fusion, num_classes, 1), nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True))

    def forward(self, x):
        return self.head(x)


class DPT(nn.Module):
    """DPT neck + depth head (``num_classes=0``... use ``task='depth'``) or segmentation head."""

    def __init__(self, in_channels: list[int], strides: list[int], num_classes: int = 0, task: str = "segment",
                 hidden=(96, 192, 384, 768), fusion: int = 256, readout: str = "project", batch_norm: bool = False):
        super().__init__()
        self.neck = DPTNeck(in_channels, strides, hidden, fusion, readout, batch_norm)
        self.head = DPTDepthHead(fusion) if task == "depth" else DPTSegHead(num_classes, fusion)

    def forward(self, maps, prefix=None):
        return self.head(self.neck(maps, prefix))


# the auxiliary segmentation head (training only), the final norm and pooler DPT never reads, and the residual
# unit transformers builds in the first fusion layer but never runs
_HF_UNUSED = ("auxiliary_head.", "dpt.layernorm.", "dpt.pooler.", "neck.fusion_stage.layers.0.residual_layer1.")


def convert_hf_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers ``DPTFor{DepthEstimation,SemanticSegmentation}`` state dict (non-hybrid) -> vitlab's
    ``DenseModel(DPT)`` keys: the ViT to timm names (q, k, v concatenated), neck and head kept, the auxiliary
    segmentation head (training only) and the unused final LayerNorm dropped. Keys already in vitlab's layout
    pass through."""
    if not any(k.startswith("dpt.") for k in sd):
        return sd
    out: dict[str, torch.Tensor] = {}
    emb = "dpt.embeddings."
    for k, v in sd.items():
        if k.startswith(_HF_UNUSED):
            continue
        if k.startswith("neck.") or k.startswith("head."):
            out[f"decoder.{k}"] = v
        elif k == emb + "cls_token":
            out["backbone.cls_token"] = v
        elif k == emb + "position_embeddings":
            out["backbone.pos_embed"] = v
        elif k.startswith(emb + "patch_embeddings.projection."):
            out["backbone.patch_embed.proj." + k.rsplit(".", 1)[1]] = v
    layers = sorted({int(k.split(".")[3]) for k in sd if k.startswith("dpt.encoder.layer.")})
    ren = {"attention.output.dense": "attn.proj", "layernorm_before": "norm1", "layernorm_after": "norm2",
           "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2"}
    for i in layers:
        p = f"dpt.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            qkv = [sd.get(f"{p}attention.attention.{n}.{kind}") for n in ("query", "key", "value")]
            if all(t is not None for t in qkv):
                out[f"backbone.blocks.{i}.attn.qkv.{kind}"] = torch.cat(qkv, dim=0)
            for src, dst in ren.items():
                if f"{p}{src}.{kind}" in sd:
                    out[f"backbone.blocks.{i}.{dst}.{kind}"] = sd[f"{p}{src}.{kind}"]
    return out
