"""MAE: masked autoencoder pre-training of a plain ViT (He et al., 2022, "Masked Autoencoders Are Scalable Vision
Learners", section 3).

- Masking (section 3, "Masking"; the official ``random_masking``): per image, uniform noise is argsorted; the
  first ``(1 - ratio) * N`` patches of that order are kept. ``noise`` can be passed in, so a test fixes it.
- Encoder (section 3, "MAE encoder"): the backbone's own patch embedding, position embedding, prefix tokens,
  blocks and final norm, run on the visible patches only (its token interface, ``embed(imgs, keep=...)``).
- Decoder (section 3, "MAE decoder"): linear to the decoder width, a shared learned mask token for every masked
  patch, tokens unshuffled to image order, fixed 2-D sin-cos positions, ``decoder_depth`` pre-norm blocks
  (default 8 blocks of width 512 with 16 heads, the paper's), norm, linear to ``patch^2 * C`` pixels.
- Loss (section 3, "Reconstruction target"): mean squared error over masked patches only, against the patch's
  pixels normalised by their own mean and (unbiased) variance (``norm_pix_loss``, the paper's better target).

The encoder is any plain ViT of vitlab (ViT, DeiT, HaLViT: a :class:`~vitlab.models.VisionTransformer`); a
hierarchical backbone has no token sequence to drop patches from and is refused. MAE trains on one view, a random
resized crop and a flip (appendix A.1), and is registered as the method ``mae``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from vitlab._io import png_bytes
from vitlab.attention import Block
from vitlab.layers import init_linears_trunc_normal_, sincos_2d_pos_embed
from vitlab.models import VisionTransformer, keep_patches
from vitlab.ssl.base import SSLMethod, ViewSpec, images_of, register_method


def check_plain_vit(backbone: nn.Module, method: str) -> VisionTransformer:
    """The backbone as a plain ViT token model, or a one-line ValueError saying why ``method`` cannot use it."""
    if not isinstance(backbone, VisionTransformer):
        raise ValueError(f"{method} needs a plain ViT backbone (vit, deit, halvit), got "
                         f"{type(backbone).__name__}: it masks tokens of one flat sequence")
    if backbone.pos_embed_type == "rope":
        raise ValueError(f"{method} needs absolute position embeddings; this backbone uses RoPE")
    return backbone


def masking_ids(batch: int, num_patches: int, mask_ratio: float, noise: Tensor | None = None,
                device=None) -> tuple[Tensor, Tensor, Tensor]:
    """MAE's per-sample masking as indices: ``ids_keep`` (B, N_keep), the patches kept in the order they are fed
    (the ``(1 - ratio) * N`` of smallest noise), the binary mask (B, N; 1 = masked) and ``ids_restore`` (B, N),
    the permutation that puts shuffled tokens back in order."""
    keep = int(num_patches * (1 - mask_ratio))
    if noise is None:
        noise = torch.rand(batch, num_patches, device=device)
    ids_shuffle = torch.argsort(noise, dim=1)  # ascending: small noise is kept
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    mask = torch.ones(batch, num_patches, device=noise.device)
    mask[:, :keep] = 0
    return ids_shuffle[:, :keep], torch.gather(mask, 1, ids_restore), ids_restore


def random_masking(x: Tensor, mask_ratio: float, noise: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """MAE's per-sample masking of tokens ``x`` (B, N, D) (the official ``random_masking``): returns the kept tokens
    (B, N_keep, D), the binary mask (B, N; 1 = masked) and ``ids_restore`` (B, N) of :func:`masking_ids`."""
    ids_keep, mask, ids_restore = masking_ids(x.shape[0], x.shape[1], mask_ratio, noise, x.device)
    return keep_patches(x, ids_keep), mask, ids_restore


def patchify(imgs: Tensor, patch: int) -> Tensor:
    """(B, C, H, W) -> (B, H/p * W/p, p*p*C), pixels of a patch in (row, column, channel) order (MAE's)."""
    B, C, H, W = imgs.shape
    x = imgs.reshape(B, C, H // patch, patch, W // patch, patch)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(B, (H // patch) * (W // patch), patch * patch * C)


def unpatchify(x: Tensor, patch: int, hw: tuple[int, int], chans: int) -> Tensor:
    """Inverse of :func:`patchify` for a (h, w) patch grid."""
    B = x.shape[0]
    h, w = hw
    x = x.reshape(B, h, w, patch, patch, chans).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(B, chans, h * patch, w * patch)


@register_method("mae")
class MAE(SSLMethod):
    """``MAE(backbone)``; ``forward(views, noise=None)`` -> dict(loss, pred (B, N, p*p*C), mask (B, N)) of the one
    view (a list of one view, or the image tensor itself).

    ``model`` is the backbone (the run's output weights); the decoder trains beside it and is checkpointed as an
    extra module. The validation loss (fixed masks) picks the best checkpoint."""

    views = ViewSpec(global_views=1, plain=True)
    monitor = "loss"
    monitor_mode = "min"

    def __init__(self, backbone: nn.Module, mask_ratio: float = 0.75, decoder_dim: int = 512, decoder_depth: int = 8,
                 decoder_heads: int = 16, decoder_mlp_ratio: float = 4.0, norm_pix_loss: bool = True):
        if not 0.0 < mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must be in (0, 1), got {mask_ratio}")
        if decoder_dim % decoder_heads or decoder_dim % 4:
            raise ValueError(f"decoder_dim {decoder_dim} must be divisible by decoder_heads {decoder_heads} and by 4")
        super().__init__(check_plain_vit(backbone, "MAE"))
        self.mask_ratio, self.norm_pix_loss = float(mask_ratio), bool(norm_pix_loss)
        pe = backbone.patch_embed
        self.patch = int(pe.patch_size[0])
        self.grid = tuple(int(g) for g in pe.grid_size)
        self.decoder = MAEDecoder(backbone.embed_dim, self.grid, self.patch * self.patch * int(pe.in_chans),
                                  backbone.num_prefix_tokens, decoder_dim, decoder_depth, decoder_heads,
                                  decoder_mlp_ratio)

    def shard_units(self) -> list[nn.Module]:
        return list(self.model.blocks) + list(self.decoder.blocks)

    def encode(self, imgs: Tensor, noise: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(latent (B, prefix + N_keep, D), mask, ids_restore): the backbone on the visible patches, through its
        token interface (the patches kept after their position embedding, the prefix tokens first)."""
        m = self.model
        ids_keep, mask, ids_restore = masking_ids(imgs.shape[0], self.grid[0] * self.grid[1], self.mask_ratio,
                                                  noise, imgs.device)
        x, hw = m.embed(imgs, keep=ids_keep)
        return m.final_norm(m.forward_blocks(x, hw)), mask, ids_restore

    def target(self, imgs: Tensor) -> Tensor:
        t = patchify(imgs, self.patch)
        if self.norm_pix_loss:
            t = (t - t.mean(dim=-1, keepdim=True)) / (t.var(dim=-1, keepdim=True) + 1e-6) ** 0.5
        return t

    def fixed_noise(self, imgs: Tensor) -> Tensor:
        """The masking noise of a validation pass: the same masks at every call (a generator seeded 0)."""
        g = torch.Generator(device=imgs.device).manual_seed(0)
        return torch.rand(imgs.shape[0], self.grid[0] * self.grid[1], device=imgs.device, generator=g)

    def forward(self, views: list[Tensor] | Tensor, monitor: bool = False, *,
                noise: Tensor | None = None) -> dict[str, Tensor]:
        """The loss, predictions and mask of the view. ``monitor=True`` (validation) masks with
        :meth:`fixed_noise` unless ``noise`` is given and adds the backbone's pooled features of the unmasked
        images (what the collapse monitors read)."""
        imgs = images_of(views)
        if monitor and noise is None:
            noise = self.fixed_noise(imgs)
        latent, mask, ids_restore = self.encode(imgs, noise)
        pred = self.decoder(latent, ids_restore)
        loss = ((pred.float() - self.target(imgs).float()) ** 2).mean(dim=-1)
        loss = (loss * mask).sum() / mask.sum()
        out = {"loss": loss, "pred": pred, "mask": mask}
        if monitor:
            out["features"] = self.features(imgs)
        return out

    def artifacts(self, images: Tensor, mean, std) -> dict[str, bytes]:
        """``reconstructions.png``: :func:`reconstruction_png` of the images' reconstructions."""
        rec, mask = self.reconstruct(images)
        return {"reconstructions.png": reconstruction_png(images, rec, mask, mean, std)}

    @torch.no_grad()
    def reconstruct(self, imgs: Tensor, noise: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(reconstruction (B, C, H, W) in the input's units, mask (B, C, H, W), 1 = masked). With the normalised
        pixel target the prediction is mapped back with each patch's own mean and std (as MAE's demo)."""
        out = self.forward(imgs, noise=noise)
        pred, mask = out["pred"].float(), out["mask"]
        if self.norm_pix_loss:
            t = patchify(imgs.float(), self.patch)
            pred = pred * (t.var(dim=-1, keepdim=True) + 1e-6) ** 0.5 + t.mean(dim=-1, keepdim=True)
        C = imgs.shape[1]
        rec = unpatchify(pred, self.patch, self.grid, C)
        m = unpatchify(mask[..., None].expand(-1, -1, self.patch * self.patch * C), self.patch, self.grid, C)
        return rec, m


class MAEDecoder(nn.Module):
    """Lightweight decoder: embed, mask tokens, unshuffle, fixed sin-cos positions (zeros on prefix tokens),
    pre-norm blocks, norm, pixel prediction; returns the patch predictions only (B, N, out_dim)."""

    def __init__(self, embed_dim: int, grid: tuple[int, int], out_dim: int, num_prefix_tokens: int = 1,
                 dim: int = 512, depth: int = 8, heads: int = 16, mlp_ratio: float = 4.0):
        super().__init__()
        self.config = dict(decoder_dim=dim, decoder_depth=depth, decoder_heads=heads, decoder_mlp_ratio=mlp_ratio)
        self.num_prefix_tokens = num_prefix_tokens
        self.embed = nn.Linear(embed_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        pos = sincos_2d_pos_embed(grid, dim)[None]
        pos = torch.cat([pos.new_zeros(1, num_prefix_tokens, dim), pos], dim=1)
        self.register_buffer("pos_embed", pos, persistent=False)  # fixed: not learned, not stored
        self.blocks = nn.ModuleList([Block(dim, heads, mlp_ratio=mlp_ratio, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pred = nn.Linear(dim, out_dim)
        nn.init.normal_(self.mask_token, std=0.02)
        init_linears_trunc_normal_(self)

    def forward(self, latent: Tensor, ids_restore: Tensor) -> Tensor:
        P = self.num_prefix_tokens
        x = self.embed(latent)
        B, D = x.shape[0], x.shape[-1]
        N = ids_restore.shape[1]
        masks = self.mask_token.expand(B, N + P - x.shape[1], -1).to(x.dtype)
        patches = torch.cat([x[:, P:], masks], dim=1)
        patches = torch.gather(patches, 1, ids_restore[..., None].expand(-1, -1, D))  # back to image order
        x = torch.cat([x[:, :P], patches], dim=1) + self.pos_embed.to(x.dtype)
        for blk in self.blocks:
            x = blk(x)
        return self.pred(self.norm(x))[:, P:]


def reconstruction_png(imgs: Tensor, rec: Tensor, mask: Tensor, mean, std, n: int = 8) -> bytes:
    """A PNG grid of up to ``n`` images: original, masked input, reconstruction, reconstruction with the visible
    patches pasted back (rows), from normalised tensors (mapped back with ``mean`` / ``std``)."""
    from matplotlib.figure import Figure

    n = min(n, imgs.shape[0])
    C = imgs.shape[1]
    m = torch.tensor(list(mean), dtype=torch.float32).view(1, C, 1, 1)
    s = torch.tensor(list(std), dtype=torch.float32).view(1, C, 1, 1)
    show = lambda t: (t[:n].float().cpu() * s + m).clamp(0, 1)  # noqa: E731
    mk = mask[:n].float().cpu()
    rows = [("original", show(imgs)), ("masked", show(imgs) * (1 - mk)), ("reconstruction", show(rec)),
            ("reconstruction + visible", show(imgs) * (1 - mk) + show(rec) * mk)]
    fig = Figure(figsize=(1.3 * n, 1.4 * len(rows)))
    for r, (title, t) in enumerate(rows):
        for i in range(n):
            ax = fig.add_subplot(len(rows), n, r * n + i + 1)
            img = t[i].permute(1, 2, 0).numpy()
            ax.imshow(img[..., 0] if C == 1 else img, cmap="gray" if C == 1 else None, vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_ylabel(title, fontsize=7)
    fig.tight_layout()
    return png_bytes(fig, dpi=80)
