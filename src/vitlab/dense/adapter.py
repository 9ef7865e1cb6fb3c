"""ViT-Adapter (Chen et al., 2023, "Vision Transformer Adapter for Dense Predictions", ICLR, Sec. 3, Fig. 4).

- Spatial prior module (Sec. 3.2): a ResNet-style stem (three 3x3 convs, max-pool) and three stride-2 convs
  give maps at strides 4 / 8 / 16 / 32, each taken to the ViT width D by a 1x1 conv; the stride 8/16/32 maps
  are flattened into the multi-scale feature tokens F_sp (plus a learned level embedding each).
- Spatial feature injector (Eq. 1): F_vit <- F_vit + gamma * Attention(norm(F_vit), norm(F_sp)), gamma a
  learnable vector initialised to 0 (so the pretrained ViT starts unchanged).
- Multi-scale feature extractor (Eq. 2 - 3): F_sp <- F_sp + Attention(norm(F_sp), norm(F_vit)), then
  F_sp <- F_sp + ConvFFN(norm(F_sp)) (Linear, 3x3 depth-wise conv on each scale's grid, GELU, Linear; ratio 1/4).
- Attention is multi-scale deformable attention (Zhu et al., 2021, "Deformable DETR", Eq. 3): each query
  samples ``points`` locations per head and level around its reference point (offsets normalised by the level's
  size), with bilinear interpolation -- written here with ``grid_sample`` (Deformable DETR's PyTorch reference,
  no CUDA extension) -- weighted by a softmax over levels x points.
- Interaction blocks at configurable block ranges (ViT-B: [0, 2], [3, 5], [6, 8], [9, 11]): injector, the ViT
  blocks of the range, extractor. Output (Sec. 3.2 end): c1 = ConvTranspose(c2) + c1, then each level plus the
  ViT's map of the matching interaction resized to its stride (4x, 2x, 1x, 0.5x), BatchNorm: a 4-level pyramid.
Prefix ([CLS]) tokens, when the ViT has them, ride through the blocks untouched by injector and extractor.
``extra_extractors=n`` adds the official implementation's extra extractors to the last interaction (its
``use_extra_extractor``: 2 for the released ViT-Adapter-T/S/B models): n more extractor steps on the last ViT
output before the pyramid is read.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def ms_deform_attn(value: torch.Tensor, shapes: list[tuple[int, int]], locations: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """Deformable DETR's core in plain PyTorch. value (B, S, heads, d) over the levels' flattened grids
    ``shapes``; locations (B, Q, heads, L, P, 2) in [0, 1] (x, y); weights (B, Q, heads, L, P) -> (B, Q, heads*d)."""
    B, _, heads, d = value.shape
    _, Q, _, L, P, _ = locations.shape
    grids = 2 * locations - 1  # grid_sample's [-1, 1] with align_corners=False: pixel centres at (i + 0.5) / W
    sampled = []
    for lvl, (h, w) in enumerate(shapes):
        start = sum(a * b for a, b in shapes[:lvl])
        v = value[:, start:start + h * w].permute(0, 2, 3, 1).reshape(B * heads, d, h, w)
        g = grids[:, :, :, lvl].transpose(1, 2).flatten(0, 1)  # (B*heads, Q, P, 2)
        sampled.append(F.grid_sample(v, g, mode="bilinear", padding_mode="zeros", align_corners=False))
    w_ = weights.transpose(1, 2).reshape(B * heads, 1, Q, L * P)
    out = (torch.stack(sampled, dim=-2).flatten(-2) * w_).sum(-1)  # (B*heads, d, Q)
    return out.view(B, heads * d, Q).transpose(1, 2)


class MSDeformAttn(nn.Module):
    """Multi-scale deformable attention (Deformable DETR Eq. 3) with Deformable DETR's initialisation: offsets
    start on a ring of directions, one per head, growing with the point index; uniform attention weights."""

    def __init__(self, dim: int, num_heads: int = 8, n_levels: int = 1, n_points: int = 4):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.heads, self.levels, self.points = num_heads, n_levels, n_points
        self.sampling_offsets = nn.Linear(dim, num_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(dim, num_heads * n_levels * n_points)
        self.value_proj = nn.Linear(dim, dim)
        self.output_proj = nn.Linear(dim, dim)
        nn.init.zeros_(self.sampling_offsets.weight)
        theta = torch.arange(num_heads, dtype=torch.float32) * (2 * torch.pi / num_heads)
        grid = torch.stack([theta.cos(), theta.sin()], -1)
        grid = (grid / grid.abs().max(-1, keepdim=True)[0]).view(num_heads, 1, 1, 2).repeat(1, n_levels, n_points, 1)
        grid = grid * torch.arange(1, n_points + 1, dtype=torch.float32).view(1, 1, -1, 1)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.flatten())
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)
        nn.init.xavier_uniform_(self.value_proj.weight)
        nn.init.zeros_(self.value_proj.bias)
        nn.init.xavier_uniform_(self.output_proj.weight)
        nn.init.zeros_(self.output_proj.bias)

    def forward(self, query, reference, value, shapes):
        """query (B, Q, D); reference (B or 1, Q, L, 2) in [0, 1]; value (B, S, D) over ``shapes``."""
        B, Q, _ = query.shape
        v = self.value_proj(value).view(B, value.shape[1], self.heads, -1)
        off = self.sampling_offsets(query).view(B, Q, self.heads, self.levels, self.points, 2)
        att = self.attention_weights(query).view(B, Q, self.heads, self.levels * self.points).softmax(-1)
        att = att.view(B, Q, self.heads, self.levels, self.points)
        norm = torch.tensor([[w, h] for h, w in shapes], dtype=query.dtype, device=query.device)
        loc = reference[:, :, None, :, None, :] + off / norm[None, None, None, :, None, :]
        return self.output_proj(ms_deform_attn(v, shapes, loc, att))


def grid_reference(shapes: list[tuple[int, int]], device, dtype) -> torch.Tensor:
    """(1, sum h*w, 2) normalised centres (x, y) of every cell of each grid in ``shapes``."""
    refs = []
    for h, w in shapes:
        y, x = torch.meshgrid(torch.arange(h, device=device, dtype=dtype), torch.arange(w, device=device, dtype=dtype),
                              indexing="ij")
        refs.append(torch.stack([(x.reshape(-1) + 0.5) / w, (y.reshape(-1) + 0.5) / h], -1))
    return torch.cat(refs)[None]


def _conv_bn(cin, cout, stride=1):
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True)]


class SpatialPriorModule(nn.Module):
    def __init__(self, dim: int, inplanes: int = 64, in_chans: int = 3):
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(in_chans, inplanes, 2), *_conv_bn(inplanes, inplanes),
                                  *_conv_bn(inplanes, inplanes), nn.MaxPool2d(3, 2, 1))
        self.conv2 = nn.Sequential(*_conv_bn(inplanes, 2 * inplanes, 2))
        self.conv3 = nn.Sequential(*_conv_bn(2 * inplanes, 4 * inplanes, 2))
        self.conv4 = nn.Sequential(*_conv_bn(4 * inplanes, 4 * inplanes, 2))
        self.fc1, self.fc2 = nn.Conv2d(inplanes, dim, 1), nn.Conv2d(2 * inplanes, dim, 1)
        self.fc3, self.fc4 = nn.Conv2d(4 * inplanes, dim, 1), nn.Conv2d(4 * inplanes, dim, 1)

    def forward(self, x):
        c1 = self.stem(x)
        c2 = self.conv2(c1)
        c3 = self.conv3(c2)
        c4 = self.conv4(c3)
        return self.fc1(c1), self.fc2(c2), self.fc3(c3), self.fc4(c4)


class ConvFFN(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.dwconv = nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden)
        self.act = nn.GELU()

    def forward(self, x, shapes):
        x = self.fc1(x)
        parts, start = [], 0
        for h, w in shapes:  # the depth-wise conv runs on each scale's own grid
            t = x[:, start:start + h * w]
            parts.append(self.dwconv(t.transpose(1, 2).reshape(x.shape[0], -1, h, w)).flatten(2).transpose(1, 2))
            start += h * w
        return self.fc2(self.act(torch.cat(parts, 1)))


class Injector(nn.Module):
    def __init__(self, dim, num_heads, n_points=4, n_levels=3, init_values=0.0):
        super().__init__()
        self.query_norm, self.feat_norm = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = MSDeformAttn(dim, num_heads, n_levels, n_points)
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x, reference, feat, shapes):
        return x + self.gamma * self.attn(self.query_norm(x), reference, self.feat_norm(feat), shapes)


class Extractor(nn.Module):
    def __init__(self, dim, num_heads, n_points=4, cffn_ratio=0.25):
        super().__init__()
        self.query_norm, self.feat_norm = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = MSDeformAttn(dim, num_heads, 1, n_points)
        self.ffn = ConvFFN(dim, int(dim * cffn_ratio))
        self.ffn_norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, c, reference, x, vit_shape, c_shapes):
        c = c + self.attn(self.query_norm(c), reference, self.feat_norm(x), [vit_shape])
        return c + self.ffn(self.ffn_norm(c), c_shapes)


def default_interactions(depth: int, n: int = 4) -> list[list[int]]:
    """Equal block ranges (ViT-B: [[0, 2], [3, 5], [6, 8], [9, 11]])."""
    size = depth // n
    return [[i * size, (i + 1) * size - 1 if i < n - 1 else depth - 1] for i in range(n)]


class ViTAdapter(nn.Module):
    """The adapter around a plain :class:`~vitlab.models.VisionTransformer` ``vit`` (held, not copied):
    ``forward(image) -> [f1, f2, f3, f4]`` at strides 4, 8, 16, 32 (the ViT's patch must be 16)."""

    def __init__(self, vit: nn.Module, interactions: list[list[int]] | None = None, num_heads: int | None = None,
                 n_points: int = 4, inplanes: int = 64, in_chans: int = 3, extra_extractors: int = 0):
        super().__init__()
        dim = vit.embed_dim
        self.vit = vit
        self.interactions = interactions or default_interactions(len(vit.blocks))
        heads = num_heads or vit.blocks[0].attn.num_heads
        self.level_embed = nn.Parameter(torch.zeros(3, dim))
        nn.init.normal_(self.level_embed)
        self.spm = SpatialPriorModule(dim, inplanes, in_chans)
        self.injectors = nn.ModuleList(Injector(dim, heads, n_points) for _ in self.interactions)
        self.extractors = nn.ModuleList(Extractor(dim, heads, n_points) for _ in self.interactions)
        self.extra_extractors = nn.ModuleList(Extractor(dim, heads, n_points) for _ in range(extra_extractors))
        self.up = nn.ConvTranspose2d(dim, dim, 2, 2)
        self.norms = nn.ModuleList(nn.BatchNorm2d(dim) for _ in range(4))

    def forward(self, image: torch.Tensor) -> list[torch.Tensor]:
        vit = self.vit
        B = image.shape[0]
        c1, c2, c3, c4 = self.spm(image)
        c_shapes = [tuple(c.shape[-2:]) for c in (c2, c3, c4)]
        c = torch.cat([m.flatten(2).transpose(1, 2) + self.level_embed[i] for i, m in enumerate((c2, c3, c4))], 1)
        x, hw = vit.embed(image)
        n_pre = vit.num_block_prefix_tokens
        ref_vit = grid_reference([hw], image.device, x.dtype)                     # ViT queries, one level
        ref_inj = ref_vit[:, :, None].expand(-1, -1, 3, -1)                        # ... sampling 3 SPM levels
        ref_ext = grid_reference(c_shapes, image.device, x.dtype)[:, :, None]     # SPM queries, ViT level
        outs = []
        for inj, ext, (a, b) in zip(self.injectors, self.extractors, self.interactions, strict=True):
            pre, t = x[:, :n_pre], x[:, n_pre:]
            x = torch.cat([pre, inj(t, ref_inj, c, c_shapes)], 1)
            x = vit.forward_blocks(x, hw, vit.blocks[a:b + 1])
            t = x[:, n_pre:]
            c = ext(c, ref_ext, t, tuple(hw), c_shapes)
            outs.append(t.transpose(1, 2).reshape(B, -1, *hw))
        for ext in self.extra_extractors:  # the last interaction's extra extractors, on its ViT output
            c = ext(c, ref_ext, t, tuple(hw), c_shapes)
        n2, n3 = c_shapes[0][0] * c_shapes[0][1], c_shapes[1][0] * c_shapes[1][1]
        maps = [c[:, :n2], c[:, n2:n2 + n3], c[:, n2 + n3:]]
        c2, c3, c4 = (m.transpose(1, 2).reshape(B, -1, *s) for m, s in zip(maps, c_shapes, strict=True))
        c1 = self.up(c2) + c1
        feats = []
        for i, (cm, xm) in enumerate(zip((c1, c2, c3, c4), outs, strict=True)):
            xm = F.interpolate(xm, size=cm.shape[-2:], mode="bilinear", align_corners=False)
            feats.append(self.norms[i](cm + xm))
        return feats
