"""Joint-embedding self-supervised methods on a vitlab backbone, registered as ``simclr``, ``mocov3``, ``dino`` and
``dinov2``:

- :class:`SimCLR` (Chen et al., 2020, section 2.1): two views, backbone -> projector MLP with BatchNorm
  (Linear-BN-ReLU-Linear) -> :func:`~vitlab.ssl.losses.nt_xent` at T = 0.5.
- :class:`MoCoV3` (Chen, Xie, He, 2021, Algorithm 1 and section 4): query encoder = backbone + 3-layer projector,
  predictor (2 layers); momentum encoder = EMA copy of backbone + projector, ``m`` from 0.99 to 1 on a half
  cosine; symmetric ``ctr(q1, k2) + ctr(q2, k1)`` with ``ctr = 2 T * InfoNCE`` at T = 0.2; optional frozen random
  patch projection (``stop_grad_patch_embed``, section 5.3).
- :class:`DINO` (Caron et al., 2021, Algorithm 1, section 3.1): multi-crop (2 global + N local views; a local view
  goes through the backbone at its own size), DINO head (3-layer MLP 2048 -> bottleneck 256 -> L2 norm ->
  weight-normalised linear, norm fixed to 1), teacher = EMA of the student (0.996 -> 1, cosine), centring
  (momentum 0.9), teacher temperature warmed up linearly 0.04 -> 0.07, student 0.1; the head's last layer gets
  no gradient during the first ``freeze_last_layer`` epochs (1, ``main_dino.py``); the teacher has no stochastic
  depth.
- :class:`DINOv2` (Oquab et al., 2023, section 4): DINO's image-level loss + iBOT's masked-patch loss (student's
  global crops with patch tokens replaced by a learned mask token; the teacher sees them unmasked; only the masked
  tokens enter the loss) + KoLeo (weight 0.1) on the student's class features; Sinkhorn-Knopp centring as an
  option (``sinkhorn``). Masks: DINOv2's block-wise generator (:mod:`vitlab.ssl.masking`: half of the global
  crops, ratios stratified over 0.1-0.5), or iBOT's random patches (``mask_mode="random"``).

Hierarchical backbones (Swin, LITv2, PVT) take part in SimCLR, MoCo v3 and DINO through their pooled features
(``forward_head(forward_features(x), pre_logits=True)``); MAE and DINOv2 need a plain ViT's token sequence.

Every module's ``forward(views)`` returns a dict with ``loss`` (and what the collapse monitors read); after each
optimiser step the caller calls ``after_step(step, total_steps, steps_per_epoch)`` (the Trainer does), which
moves the EMA teacher with the step's momentum and the temperature schedule with the epoch.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from vitlab.ssl import losses as L
from vitlab.ssl.base import SSLMethod, ViewSpec, pooled_features, register_method, views_of
from vitlab.ssl.mae import check_plain_vit
from vitlab.ssl.masking import dinov2_masks, random_patch_mask

# ---------------------------------------------------------------- schedules


def cosine_momentum(step: int, total_steps: int, base: float) -> float:
    """MoCo v3 / DINO / BYOL momentum: ``1 - (1 - base) * (cos(pi * step / total) + 1) / 2``, base -> 1."""
    t = min(max(step, 0), total_steps) / max(total_steps, 1)
    return 1.0 - (1.0 - base) * (math.cos(math.pi * t) + 1.0) / 2.0


def teacher_temperature(epoch: int, warmup_epochs: int, start: float, end: float) -> float:
    """DINO's teacher temperature: ``linspace(start, end, warmup_epochs)[epoch]`` during warm-up, then ``end``."""
    if epoch >= warmup_epochs:
        return end
    if warmup_epochs == 1:
        return start
    return start + (end - start) * epoch / (warmup_epochs - 1)


@torch.no_grad()
def ema_update(teacher: nn.Module, student: nn.Module, momentum: float) -> None:
    """``teacher <- m * teacher + (1 - m) * student`` over parameters (buffers, e.g. BN statistics, copied)."""
    t_params, s_params = list(teacher.parameters()), list(student.parameters())
    torch._foreach_mul_(t_params, momentum)
    torch._foreach_add_(t_params, s_params, alpha=1.0 - momentum)
    for tb, sb in zip(teacher.buffers(), student.buffers(), strict=True):
        tb.copy_(sb)


# ---------------------------------------------------------------- heads


def mlp(num_layers: int, in_dim: int, hidden_dim: int, out_dim: int, last_bn: bool) -> nn.Sequential:
    """MoCo v3's ``_build_mlp``: (Linear without bias, BN, ReLU) x (n - 1), Linear, BN without affine if
    ``last_bn``; with ``num_layers = 2`` and ``last_bn = False`` the layout of SimCLR's projector (+ bias)."""
    layers: list[nn.Module] = []
    for i in range(num_layers):
        d_in = in_dim if i == 0 else hidden_dim
        d_out = out_dim if i == num_layers - 1 else hidden_dim
        layers.append(nn.Linear(d_in, d_out, bias=False))
        if i < num_layers - 1:
            layers += [nn.BatchNorm1d(d_out), nn.ReLU(inplace=True)]
        elif last_bn:
            layers.append(nn.BatchNorm1d(d_out, affine=False))
    return nn.Sequential(*layers)


class SimCLRProjector(nn.Module):
    """SimCLR's projection head g (section 2.1): Linear -> BatchNorm1d -> ReLU -> Linear."""

    def __init__(self, in_dim: int, hidden_dim: int = 2048, out_dim: int = 128):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU(inplace=True),
                                 nn.Linear(hidden_dim, out_dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class DINOHead(nn.Module):
    """DINO's projection head: MLP (Linear-GELU x2, Linear to the bottleneck), L2 normalisation, weight-normalised
    linear to ``out_dim`` prototypes. ``norm_last_layer`` keeps the weight norm g fixed at 1 (a buffer), so each
    prototype is a unit vector (DINO's default for ViTs)."""

    def __init__(self, in_dim: int, out_dim: int = 65536, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 nlayers: int = 3, norm_last_layer: bool = True):
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (nlayers - 1)
        layers: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:], strict=True):
            layers += [nn.Linear(a, b), nn.GELU()]
        layers.append(nn.Linear(dims[-1], bottleneck_dim))
        self.mlp = nn.Sequential(*layers)
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.weight_v = nn.Parameter(torch.empty(out_dim, bottleneck_dim))
        nn.init.kaiming_uniform_(self.weight_v, a=math.sqrt(5))  # nn.Linear's initialisation of the direction
        g = torch.ones(out_dim, 1)
        if norm_last_layer:
            self.register_buffer("weight_g", g)
        else:
            self.weight_g = nn.Parameter(g)

    def last_layer_parameters(self) -> list[nn.Parameter]:
        """The weight-normalised last layer's parameters (``v``, and ``g`` unless fixed): what
        ``freeze_last_layer`` holds still."""
        return [p for p in (self.weight_v, self.weight_g) if isinstance(p, nn.Parameter)]

    def last_layer_weight(self) -> Tensor:
        """Weight normalisation (Salimans & Kingma, 2016): ``w = g * v / ||v||`` per output row."""
        return self.weight_g * self.weight_v / self.weight_v.norm(dim=1, keepdim=True)

    def forward(self, x: Tensor) -> Tensor:
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        return F.linear(x, self.last_layer_weight())


# ---------------------------------------------------------------- shared machinery


class Progress(nn.Module):
    """The step the schedules are at (buffers, so a resumed run continues the schedules where it stopped)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.register_buffer("steps_per_epoch", torch.ones((), dtype=torch.long))

    @property
    def epoch(self) -> int:
        return int(self.step) // max(int(self.steps_per_epoch), 1)


class JointEmbedding(SSLMethod):
    """Base of the joint-embedding methods: ``embed_dim`` is the backbone's feature width, ``progress`` the step
    the schedules are at, ``teacher_pairs()`` the (teacher, student) modules moved by EMA after each optimiser
    step."""

    base_momentum = 0.0

    def __init__(self, backbone: nn.Module):
        super().__init__(backbone)
        self.progress = Progress()
        self.embed_dim = int(backbone.num_features)

    def teacher_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return []

    def momentum_at(self, step: int, total_steps: int) -> float:
        """The EMA momentum used after optimiser step ``step`` (0-based)."""
        return cosine_momentum(step, total_steps, self.base_momentum)

    @torch.no_grad()
    def after_step(self, step: int, total_steps: int, steps_per_epoch: int) -> None:
        """After optimiser step ``step`` (0-based) of ``total_steps``: EMA the teachers, advance the schedules."""
        m = self.momentum_at(step, total_steps)
        for teacher, student in self.teacher_pairs():
            ema_update(teacher, student, m)
        self.progress.step.fill_(step + 1)
        self.progress.steps_per_epoch.fill_(steps_per_epoch)


def frozen_copy(module: nn.Module) -> nn.Module:
    """The EMA teacher / momentum encoder: a copy without gradients and without stochastic depth or dropout (DINO
    and MoCo v3 build the teacher without ``drop_path_rate``: its targets are deterministic even though the
    student, in train mode, drops paths)."""
    from vitlab.layers.drop import DropPath

    t = copy.deepcopy(module)
    t.requires_grad_(False)
    for m in t.modules():
        if isinstance(m, (DropPath, nn.Dropout)):
            m.p = 0.0
    return t


# ---------------------------------------------------------------- SimCLR


@register_method("simclr")
class SimCLR(JointEmbedding):
    def __init__(self, backbone: nn.Module, proj_hidden_dim: int = 2048, proj_dim: int = 128,
                 temperature: float = 0.5):
        super().__init__(backbone)
        self.temperature = temperature
        self.projector = SimCLRProjector(self.embed_dim, proj_hidden_dim, proj_dim)

    def objective(self, views: list[Tensor]) -> dict[str, Tensor]:
        v1, v2 = views_of(views)[:2]
        h = self.features(torch.cat([v1, v2]))  # one pass: BatchNorm sees both views, as SimCLR's big batch
        z1, z2 = self.projector(h).chunk(2)
        return {"loss": L.nt_xent(z1, z2, self.temperature), "features": h[: v1.shape[0]]}


# ---------------------------------------------------------------- MoCo v3


@register_method("mocov3")
class MoCoV3(JointEmbedding):
    def __init__(self, backbone: nn.Module, dim: int = 256, mlp_dim: int = 4096, temperature: float = 0.2,
                 momentum: float = 0.99, stop_grad_patch_embed: bool = False):
        super().__init__(backbone)
        self.temperature, self.base_momentum = temperature, momentum
        if stop_grad_patch_embed:
            if not hasattr(backbone, "patch_embed"):
                raise ValueError("stop_grad_patch_embed needs a backbone with a patch_embed")
            backbone.patch_embed.requires_grad_(False)  # random patch projection, fixed (section 5.3)
        self.projector = mlp(3, self.embed_dim, mlp_dim, dim, last_bn=True)
        self.predictor = mlp(2, dim, mlp_dim, dim, last_bn=False)
        self.momentum_model = frozen_copy(backbone)
        self.momentum_projector = frozen_copy(self.projector)

    def teacher_pairs(self):
        return [(self.momentum_model, self.model), (self.momentum_projector, self.projector)]

    def momentum_at(self, step: int, total_steps: int) -> float:
        # MoCo v3 moves the momentum encoder at the start of iteration k with m_k; after step k that is m_{k+1}
        return cosine_momentum(step + 1, total_steps, self.base_momentum)

    def ctr(self, q: Tensor, k: Tensor) -> Tensor:
        return L.info_nce(q, k, self.temperature) * 2 * self.temperature

    def objective(self, views: list[Tensor]) -> dict[str, Tensor]:
        v1, v2 = views_of(views)[:2]
        B = v1.shape[0]
        h = self.features(torch.cat([v1, v2]))
        q1, q2 = self.predictor(self.projector(h)).split(B)
        with torch.no_grad():
            k1, k2 = self.momentum_projector(pooled_features(self.momentum_model, torch.cat([v1, v2]))).split(B)
        return {"loss": self.ctr(q1, k2) + self.ctr(q2, k1), "features": h[:B]}


# ---------------------------------------------------------------- DINO


@register_method("dino")
class DINO(JointEmbedding):
    views = ViewSpec(global_views=2, local_crops=True)

    def __init__(self, backbone: nn.Module, out_dim: int = 65536, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 norm_last_layer: bool = True, momentum: float = 0.996, center_momentum: float = 0.9,
                 warmup_teacher_temp: float = 0.04, teacher_temp: float = 0.07, warmup_teacher_temp_epochs: int = 30,
                 student_temp: float = 0.1, sinkhorn: bool = False, freeze_last_layer: int = 1):
        super().__init__(backbone)
        if freeze_last_layer < 0:
            raise ValueError(f"freeze_last_layer must be >= 0 epochs, got {freeze_last_layer}")
        self.base_momentum = momentum
        self.freeze_last_layer = int(freeze_last_layer)
        self.temps = (warmup_teacher_temp, teacher_temp, int(warmup_teacher_temp_epochs))
        self.student_temp, self.sinkhorn = student_temp, sinkhorn
        self.head = DINOHead(self.embed_dim, out_dim, hidden_dim, bottleneck_dim, norm_last_layer=norm_last_layer)
        self.teacher = frozen_copy(backbone)
        self.teacher_head = frozen_copy(self.head)
        self.center = L.Centering(out_dim, center_momentum)

    def teacher_pairs(self):
        return [(self.teacher, self.model), (self.teacher_head, self.head)]

    def shard_units(self) -> list[nn.Module]:
        from vitlab.train.strategy import shard_units

        return shard_units(self.model) + shard_units(self.teacher)

    def heads(self) -> list[DINOHead]:
        """The student's DINO heads (DINOv2 adds a separate iBOT head when asked)."""
        return [self.head]

    def before_optimizer_step(self) -> None:
        """DINO's ``cancel_gradients_last_layer`` (``main_dino.py``; ``freeze_last_layer`` 1 epoch by default):
        during the first ``freeze_last_layer`` epochs the heads' last layers get no gradient (``grad = None``, so
        the optimiser leaves them, weight decay and moments included); "typically doing so during the first epoch
        helps training" (``main_dino.py``, ``--freeze_last_layer``). Called after backward (and gradient clipping),
        before the step."""
        if self.progress.epoch < self.freeze_last_layer:
            for head in self.heads():
                for p in head.last_layer_parameters():
                    p.grad = None

    def teacher_temp(self) -> float:
        start, end, warm = self.temps
        return teacher_temperature(self.progress.epoch, warm, start, end)

    def student_outputs(self, views: list[Tensor]) -> list[Tensor]:
        """The head's logits of every view; views of one size go through the backbone together."""
        out: list[Tensor | None] = [None] * len(views)
        groups: dict[tuple, list[int]] = {}
        for i, v in enumerate(views):
            groups.setdefault(tuple(v.shape[-2:]), []).append(i)
        for idx in groups.values():
            f = self.features(torch.cat([views[i] for i in idx]))
            for i, part in zip(idx, f.split([views[i].shape[0] for i in idx]), strict=True):
                out[i] = part
        h = self.head(torch.cat(out))
        return list(h.split([v.shape[0] for v in views]))

    def monitor_outputs(self, x: Tensor) -> dict[str, Tensor]:
        """Features, and the teacher's entropy and KL(teacher || student) on the same images (batch means)."""
        f = self.features(x)
        p_t = L.teacher_probs(self.teacher_head(pooled_features(self.teacher, x)), self.teacher_temp(),
                              self.center.center, self.sinkhorn)
        log_s = F.log_softmax(self.head(f).float() / self.student_temp, dim=-1)
        return {"features": f, "teacher_entropy": L.entropy(p_t), "teacher_student_kl": L.kl_div(p_t, log_s)}

    def monitors(self, s_out: list[Tensor], t_out: list[Tensor], teacher_temp: float) -> dict[str, Tensor]:
        """Teacher entropy (log K = uniform collapse, 0 = one-hot collapse) and KL(teacher || student)."""
        with torch.no_grad():
            p_t = L.teacher_probs(torch.stack(t_out), teacher_temp, self.center.center, self.sinkhorn)
            log_p_s = F.log_softmax(torch.stack(s_out[: len(t_out)]).float() / self.student_temp, dim=-1)
            return {"teacher_entropy": L.entropy(p_t), "teacher_student_kl": L.kl_div(p_t, log_p_s.flip(0))}

    def objective(self, views: list[Tensor]) -> dict[str, Tensor]:
        views = views_of(views)
        n_global = self.views.global_views
        tt = self.teacher_temp()
        s_out = self.student_outputs(views)
        with torch.no_grad():
            g = torch.cat(views[:n_global])
            t_out = list(self.teacher_head(pooled_features(self.teacher, g)).chunk(n_global))
        loss = L.dino(s_out, t_out, tt, self.student_temp, self.center.center, self.sinkhorn)
        mon = self.monitors(s_out, t_out, tt)
        if not self.sinkhorn:
            self.center.update(torch.stack(t_out), all_reduce_mean())
        return {"loss": loss, "teacher_temp": torch.tensor(tt), **mon}


def all_reduce_mean():
    """A function averaging a tensor over processes when torch.distributed runs (the centre's batch mean)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None

    def reduce(t: Tensor) -> Tensor:
        dist.all_reduce(t)
        return t / dist.get_world_size()

    return reduce


# ---------------------------------------------------------------- DINOv2


def vit_tokens(backbone: nn.Module, x: Tensor, mask: Tensor | None = None, mask_token: Tensor | None = None) -> Tensor:
    """All tokens (B, prefix + N, D) after the backbone's final norm; patches where ``mask`` (B, N) is True are
    replaced by ``mask_token`` before the position embedding (iBOT / DINOv2's masked image modelling), through the
    backbone's token interface (:class:`vitlab.models.TokenModel`)."""
    t, hw = backbone.embed(x, mask, mask_token)
    return backbone.final_norm(backbone.forward_blocks(t, hw))


@register_method("dinov2")
class DINOv2(DINO):
    def __init__(self, backbone: nn.Module, out_dim: int = 65536, patch_out_dim: int | None = None,
                 ibot_separate_head: bool = False, dino_weight: float = 1.0, ibot_weight: float = 1.0,
                 koleo_weight: float = 0.1, mask_ratio: tuple[float, float] = (0.1, 0.5),
                 mask_probability: float = 0.5, mask_mode: str = "block", **kwargs):
        check_plain_vit(backbone, "DINOv2")
        if not 0.0 < mask_ratio[0] <= mask_ratio[1] < 1.0:
            raise ValueError(f"mask_ratio must be a range inside (0, 1), got {mask_ratio}")
        if mask_mode not in ("block", "random"):
            raise ValueError(f"mask_mode must be 'block' (DINOv2's block-wise masks) or 'random', got {mask_mode!r}")
        self.mask_mode = mask_mode
        super().__init__(backbone, out_dim=out_dim, **kwargs)
        self.weights = (dino_weight, ibot_weight, koleo_weight)
        self.mask_ratio, self.mask_probability = tuple(mask_ratio), mask_probability
        self.mask_token = nn.Parameter(torch.zeros(1, 1, self.embed_dim))
        if ibot_separate_head:
            self.ibot_head = DINOHead(self.embed_dim, patch_out_dim or out_dim, kwargs.get("hidden_dim", 2048),
                                      kwargs.get("bottleneck_dim", 256))
            self.teacher_ibot_head = frozen_copy(self.ibot_head)
        else:
            self.ibot_head = self.teacher_ibot_head = None
        self.patch_center = L.Centering(patch_out_dim if ibot_separate_head and patch_out_dim else out_dim,
                                        kwargs.get("center_momentum", 0.9))

    def heads(self) -> list[DINOHead]:
        return [self.head] + ([self.ibot_head] if self.ibot_head is not None else [])

    def make_masks(self, batch: int, grid: tuple[int, int], device=None) -> Tensor:
        """(batch, H * W) bool masks of the student's global crops (True = replaced by the mask token)."""
        if self.mask_mode == "block":
            return dinov2_masks(batch, grid, self.mask_ratio, self.mask_probability).to(device)
        return random_patch_mask(batch, grid[0] * grid[1], self.mask_ratio, self.mask_probability, device=device)

    def teacher_pairs(self):
        pairs = super().teacher_pairs()
        if self.ibot_head is not None:
            pairs.append((self.teacher_ibot_head, self.ibot_head))
        return pairs

    def _cls(self, tokens: Tensor) -> Tensor:
        m = self.model
        return tokens[:, 0] if m.num_prefix_tokens else tokens.mean(dim=1)

    def objective(self, views: list[Tensor]) -> dict[str, Tensor]:
        views = views_of(views)
        n_global = self.views.global_views
        g = torch.cat(views[:n_global])
        P = self.model.num_prefix_tokens
        B2, grid = g.shape[0], tuple(self.model.patch_embed.dynamic_feat_size(g.shape[-2:]))
        N = grid[0] * grid[1]
        mask = self.make_masks(B2, grid, g.device)
        tt = self.teacher_temp()
        s_tok = vit_tokens(self.model, g, mask, self.mask_token)
        s_cls = self._cls(s_tok)
        s_out = list(self.head(s_cls).chunk(n_global)) + (self.student_outputs(views[n_global:])
                                                           if len(views) > n_global else [])
        ibot_s = self.ibot_head or self.head
        ibot_t = self.teacher_ibot_head or self.teacher_head
        with torch.no_grad():
            t_tok = vit_tokens(self.teacher, g)
            t_out = list(self.teacher_head(self._cls(t_tok)).chunk(n_global))
            t_patch = ibot_t(t_tok[:, P:][mask]) if mask.any() else None
        # the DINO loss pairs the teacher's view i with the student's other views; global-global terms included
        dino_loss = L.dino(s_out, t_out, tt, self.student_temp, self.center.center, self.sinkhorn)
        if t_patch is not None:
            s_patch = ibot_s(s_tok[:, P:][mask])
            full_s = s_tok.new_zeros(B2, N, s_patch.shape[-1]).masked_scatter(mask[..., None], s_patch.float())
            full_t = s_tok.new_zeros(B2, N, t_patch.shape[-1]).masked_scatter(mask[..., None], t_patch.float())
            ibot_loss = L.ibot_patch(full_s, full_t, mask, tt, self.student_temp, self.patch_center.center,
                                     self.sinkhorn)
        else:
            ibot_loss = s_cls.sum() * 0.0
        koleo_loss = sum(L.koleo(c) for c in s_cls.chunk(n_global)) / n_global
        wd, wi, wk = self.weights
        loss = wd * dino_loss + wi * ibot_loss + wk * koleo_loss
        mon = self.monitors(s_out, t_out, tt)
        if not self.sinkhorn:
            self.center.update(torch.stack(t_out), all_reduce_mean())
            if t_patch is not None:
                self.patch_center.update(t_patch, all_reduce_mean())
        return {"loss": loss, "dino_loss": dino_loss.detach(), "ibot_loss": ibot_loss.detach(),
                "koleo_loss": koleo_loss.detach(), "teacher_temp": torch.tensor(tt), **mon}

