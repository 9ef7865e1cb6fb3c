"""Token pruning patched into ViT / DeiT / HaLViT from outside, through the models' public token interface
(:class:`vitlab.models.TokenModel`: ``embed``, each block's ``forward_attention`` / ``forward_mlp``,
``finish_tokens``): four methods behind ``apply(model, method, ...)``.

- ``"evit"`` -- EViT (Liang et al., "Not All Patches are What You Need", ICLR 2022, Sec. 3.1-3.2): in the chosen
  blocks, between the attention and the MLP, keep the ``ceil(keep_rate * n)`` tokens the class token attends to
  most (its attention row, mean over heads) and **fuse** the others into one token, their sum weighted by that
  attention (Eq. 3 / the authors' ``extra_token``), placed last. EViT classifies from the class token; a model
  that pools its patch tokens instead ('avg', 'max', 'attn') gets the attention-weighted **mean** of the
  inattentive tokens, counted in the pool as the number of patches it absorbed (as ToMe weights merged tokens: the
  model's ``pool(x, size)``), so the pooled vector stays a mean over the patches (the paper's sum,
  weighted or not, shifts it: measured in docs/benchmarks.md).
- ``"dynamicvit"`` -- DynamicViT (Rao et al., NeurIPS 2021, Sec. 3.2-3.4): before the chosen blocks a prediction
  module (``PredictorLG``: local features and a policy-weighted global mean, an MLP, log-softmax over
  keep / drop) scores the tokens. Training: a Gumbel-softmax hard mask (straight-through) multiplies the
  previous one and every later attention is masked with it (Eq. 6, the authors' ``softmax_with_policy``, the
  attention's ``attn_policy``: a dropped key only attends to itself); the losses (keep-ratio, distillation to the
  full model) are in :mod:`vitlab.prune.losses`. Inference: hard top-k, ``keep_rate ** (s + 1)`` of the patches
  after stage s.
- ``"topk"`` -- top-k pruning by attention: the class token's attention (mean over heads) ranks the
  tokens; the top ``int(keep_rate * n)`` are kept, the rest dropped (EViT without the fused token).
- ``"adaptive"`` -- adaptive pruning: a learned importance ``sigmoid(MLP(x))`` (dim -> dim/4
  -> 1) and a learned threshold. Training: the tokens are scaled by their importance (a soft mask).
  Inference: tokens above ``sigmoid(threshold)`` are kept, at least ``min_keep`` of them; a batch keeps the
  largest such count of its images (each image its most important ones), since one tensor holds the batch. A
  threshold used only at inference gets no gradient from the training path; this one learns it through a
  keep-ratio loss on a soft threshold indicator (:mod:`vitlab.prune.losses`), the DynamicViT way.

Class / distillation / register tokens are never pruned and stay first. ``locations`` are 0-based block indices
(default 3, 6, 9 for 12 blocks -- EViT's "4th, 7th and 10th layers", DynamicViT's stages -- and the same
relative depths for other depths). ``set_keep_rate`` changes the rate of a pruned model in place (for training
forwards only with ``train_only``: :mod:`vitlab.prune.warmup`'s EViT keep-rate warm-up); ``remove`` restores the
model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.models import check_token_model, mix_in, mix_out, mixin_of

METHODS = ("evit", "dynamicvit", "topk", "adaptive")


def default_locations(depth: int) -> list[int]:
    """Blocks 3, 6, 9 of a 12-block model (EViT's and DynamicViT's), at the same relative depths otherwise."""
    return sorted({min(depth - 1, depth * k // 4) for k in (1, 2, 3)})


@dataclass
class PruneInfo:
    """The patch's settings (:func:`pruned_info`) and, after a training forward, what the losses need."""

    method: str
    keep_rate: float
    locations: list[int]
    protected: int
    min_keep: float = 0.5  # adaptive: the least fraction kept at inference
    train_keep_rate: float | None = None  # the rate of training forwards when it differs (a warm-up); else keep_rate
    aux: dict = field(default_factory=dict, repr=False)
    size: torch.Tensor | None = field(default=None, repr=False)  # EViT: (B, N, 1) patches per token, last forward
    fuse_mean: bool = False  # EViT on a patch-pooled model: the fused token is a mean and carries a size

    def rate(self, training: bool) -> float:
        """The keep rate a forward in training (``True``) or inference mode uses."""
        return self.train_keep_rate if training and self.train_keep_rate is not None else self.keep_rate


def check_keep_rate(keep_rate: float) -> float:
    if not isinstance(keep_rate, (int, float)) or isinstance(keep_rate, bool) or not 0.0 < keep_rate <= 1.0:
        raise ValueError(f"keep_rate must be in (0, 1], got {keep_rate!r}")
    return float(keep_rate)


# ------------------------------------------------------------------ prediction modules


class PredictorLG(nn.Module):
    """DynamicViT's prediction module (the authors' ``PredictorLG``): per-token keep / drop log-probabilities
    from the token's local features and the mean of the kept tokens' global features (Eq. 2-4)."""

    def __init__(self, dim: int):
        super().__init__()
        self.in_conv = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
        self.out_conv = nn.Sequential(nn.Linear(dim, dim // 2), nn.GELU(), nn.Linear(dim // 2, dim // 4), nn.GELU(),
                                      nn.Linear(dim // 4, 2), nn.LogSoftmax(dim=-1))

    def forward(self, x: torch.Tensor, policy: torch.Tensor) -> torch.Tensor:
        x = self.in_conv(x)
        B, N, C = x.shape
        local_x = x[:, :, : C // 2]
        # clamped: an image whose every token was dropped would divide 0 by 0 (the authors' code gives NaN there)
        global_x = (x[:, :, C // 2:] * policy).sum(dim=1, keepdim=True) / policy.sum(dim=1, keepdim=True).clamp_min(1)
        return self.out_conv(torch.cat([local_x, global_x.expand(B, N, C // 2)], dim=-1))  # (B, N, 2)


class ImportancePredictor(nn.Module):
    """The scorer of ``"adaptive"`` pruning: ``sigmoid(Linear(ReLU(Linear(x))))`` and a learned threshold."""

    def __init__(self, dim: int):
        super().__init__()
        self.importance_net = nn.Sequential(nn.Linear(dim, dim // 4), nn.ReLU(), nn.Linear(dim // 4, 1))
        self.threshold = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.importance_net(x).squeeze(-1))  # (B, N) in (0, 1)


# ------------------------------------------------------------------ attention pieces


def cls_attention(scale: float, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The class token's attention row, mean over heads: (B, N), from a block's queries and keys (B, h, N, d).
    Only its query's softmax is computed, so the block's own attention stays fused."""
    row = ((q[:, :, :1] * scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, h, 1, N)
    return row[:, :, 0].mean(dim=1)


def select_by_cls_attention(x: torch.Tensor, score: torch.Tensor, keep_rate: float, info: PruneInfo) -> torch.Tensor:
    """EViT / seed top-k between a block's attention and its MLP: keep the tokens with the highest class
    attention ``score`` (B, N) (EViT: ``ceil``, fusing the rest into one token; top-k: ``int``, dropping them)."""
    p = info.protected
    tokens, score = x[:, p:], score[:, p:]
    n, C = tokens.shape[1], x.shape[-1]
    left = math.ceil(keep_rate * n) if info.method == "evit" else int(keep_rate * n)
    left = max(left, 1)
    if left >= n:
        return x
    idx = score.topk(left, dim=1, largest=True, sorted=True).indices  # (B, left)
    kept = tokens.gather(1, idx[..., None].expand(-1, -1, C))
    parts = [x[:, :p], kept]
    if info.method == "evit":
        mask = torch.ones_like(score, dtype=torch.bool).scatter(1, idx, False)  # the inattentive tokens
        w = (score * mask)[..., None]
        fused = (tokens * w).sum(dim=1, keepdim=True)  # sum of a_i x_i over them: one fused token
        if info.fuse_mean:
            fused = fused / w.sum(dim=1, keepdim=True)
            size = x.new_ones(x.shape[0], x.shape[1], 1) if info.size is None else info.size
            rest = size[:, p:]
            info.size = torch.cat([size[:, :p], rest.gather(1, idx[..., None]),
                                   (rest * mask[..., None]).sum(dim=1, keepdim=True)], dim=1)
        parts.append(fused)
    return torch.cat(parts, dim=1)


def prune_block(blk: nn.Module, x: torch.Tensor, hw, info: PruneInfo, keep_rate: float | None = None,
                policy: torch.Tensor | None = None) -> torch.Tensor:
    """One block. ``keep_rate``: prune between the attention and the MLP by class attention (EViT / top-k);
    ``policy`` (B, N, 1): DynamicViT's training mask on the attention (its ``attn_policy``)."""
    if policy is not None:
        x = blk.forward_attention(x, hw, attn_policy=policy)
    elif keep_rate is not None and keep_rate < 1.0:
        x, q, k = blk.forward_attention(x, hw, return_qk=True)
        x = select_by_cls_attention(x, cls_attention(blk.attn.scale, q, k), keep_rate, info)
    else:
        x = blk.forward_attention(x, hw)
    return blk.forward_mlp(x)


def _gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def run_pruned(model: nn.Module, x: torch.Tensor, hw) -> torch.Tensor:
    """The blocks with pruning; after a DynamicViT / adaptive training forward ``pruned_info(model).aux`` holds what
    their losses need (decisions / importances per stage, the final keep mask)."""
    info: PruneInfo = model._prune
    p, B = info.protected, x.shape[0]
    train = model.training
    n0 = x.shape[1] - p
    info.size, info.fuse_mean = None, info.method == "evit" and model.global_pool in ("avg", "max", "attn")
    policy = prev = None
    stages: list[torch.Tensor] = []
    for i, blk in enumerate(model.blocks):
        keep = None
        if i in info.locations:
            s = info.locations.index(i)
            if info.method in ("evit", "topk"):
                keep = info.rate(train)
            elif info.method == "dynamicvit":
                if prev is None:
                    prev = x.new_ones(B, x.shape[1] - p, 1)
                pred = model.prune_predictors[s](x[:, p:], prev)  # (B, N, 2) log-probs of keep / drop
                if train:
                    hard = F.gumbel_softmax(pred, hard=True)[:, :, 0:1] * prev  # straight-through estimator
                    stages.append(hard.reshape(B, -1))
                    policy = torch.cat([hard.new_ones(B, p, 1), hard], dim=1)
                    prev = hard
                else:
                    num_keep = int(n0 * info.keep_rate ** (s + 1))
                    idx = pred[:, :, 0].argsort(dim=1, descending=True)[:, :num_keep]
                    x = torch.cat([x[:, :p], _gather_tokens(x[:, p:], idx)], dim=1)
                    prev = _gather_tokens(prev, idx)
            else:  # adaptive
                pred = model.prune_predictors[s]
                imp = pred(x[:, p:])  # (B, N)
                if train:
                    stages.append((imp, pred.threshold))
                    x = torch.cat([x[:, :p], x[:, p:] * imp[..., None]], dim=1)  # soft mask: scaled by importance
                else:
                    n = imp.shape[1]
                    above = int((imp > torch.sigmoid(pred.threshold)).sum(dim=1).max())
                    num_keep = min(n, max(int(n * info.min_keep), above, 1))
                    idx = imp.topk(num_keep, dim=1).indices
                    x = torch.cat([x[:, :p], _gather_tokens(x[:, p:], idx)], dim=1)
        x = prune_block(blk, x, hw, info, keep, policy)
    if train and info.method in ("dynamicvit", "adaptive"):
        info.aux = {"stages": stages, "mask": prev}
    return x


class Pruned:
    """Token pruning mixed into a ViT / DeiT / HaLViT's class (:func:`apply`)."""

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish_tokens(run_pruned(self, *self.embed(x)))

    def pool(self, x: torch.Tensor, size: torch.Tensor | None = None) -> torch.Tensor:
        """The model's pool, each token weighted by the patches it holds after the last forward (EViT's fused
        token); features of another input than the last forward's pool unweighted."""
        last = self._prune.size
        if size is None and last is not None and last.shape[:2] == x.shape[:2]:
            size = last
        return super().pool(x, size)

    def forward_intermediates(self, *args, **kwargs):
        raise ValueError("a pruned model drops tokens, so it has no dense maps; vitlab.prune.remove(model) first "
                         "(or merge with vitlab.tome, which un-merges)")


def apply(model: nn.Module, method: str = "evit", keep_rate: float = 0.7, locations: list[int] | None = None,
          min_keep: float = 0.5) -> nn.Module:
    """Patch ``model`` in place for token pruning with ``method`` (``evit``, ``dynamicvit``, ``topk``,
    ``adaptive``) at the 0-based blocks ``locations`` (default 3, 6, 9 of 12). DynamicViT and adaptive add their
    prediction modules as ``model.prune_predictors`` (trained with the model). Returns the model."""
    if method not in METHODS:
        raise ValueError(f"unknown pruning method {method!r}; choose from {', '.join(METHODS)}")
    keep_rate = check_keep_rate(keep_rate)
    if not 0.0 < min_keep <= 1.0:
        raise ValueError(f"min_keep must be in (0, 1], got {min_keep}")
    current = mixin_of(model)
    if current is not None:
        raise ValueError(f"the model is already patched ({current.__name__}); remove that patch first")
    check_token_model(model, "token pruning", "return_qk", *(("attn_policy",) if method == "dynamicvit" else ()))
    if not getattr(model, "has_class_token", False):
        raise ValueError("token pruning ranks tokens by the class token's attention or keeps it whole: it needs a "
                         "ViT / DeiT / HaLViT with a class token (CaiT's self-attention stage has none)")
    blocks, protected = model.blocks, model.num_block_prefix_tokens
    locs = sorted(set(default_locations(len(blocks)) if locations is None else (int(i) for i in locations)))
    if not locs or locs[0] < 0 or locs[-1] >= len(blocks):
        raise ValueError(f"locations must be block indices in 0..{len(blocks) - 1}, got {list(locations or [])}")
    info = PruneInfo(method=method, keep_rate=keep_rate, locations=locs, protected=protected, min_keep=min_keep)
    if method in ("dynamicvit", "adaptive"):
        make = PredictorLG if method == "dynamicvit" else ImportancePredictor
        device = next(model.parameters()).device
        with torch.device(device):
            model.prune_predictors = nn.ModuleList([make(model.embed_dim) for _ in locs])
    mix_in(model, Pruned)
    model._prune = info
    return model


def is_applied(model: nn.Module) -> bool:
    """Whether ``model`` is patched with :func:`apply`."""
    return mixin_of(model) is Pruned


def pruned_info(model: nn.Module) -> PruneInfo:
    """The settings of a pruned ``model`` (and what its last training forward left for the losses)."""
    if not is_applied(model):
        raise ValueError("the model is not patched with token pruning; vitlab.prune.apply(model, ...) first")
    return model._prune


def set_keep_rate(model: nn.Module, keep_rate: float, train_only: bool = False) -> nn.Module:
    """Set the keep rate of a pruned ``model`` in place; the next forward uses it (EViT / top-k: the fraction kept
    at each location; DynamicViT: ``keep_rate ** (s + 1)`` at inference and its keep-ratio loss's targets;
    adaptive: its keep-ratio loss's target). ``train_only``: forwards in training mode use it, inference keeps the
    rate the model was pruned with (a warm-up: :class:`vitlab.prune.warmup.KeepRateWarmup`). Returns the model."""
    info = pruned_info(model)
    keep_rate = check_keep_rate(keep_rate)
    if train_only:
        info.train_keep_rate = keep_rate
    else:
        info.keep_rate, info.train_keep_rate = keep_rate, None
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply` (prediction modules included). Returns the model."""
    pruned_info(model)
    mix_out(model, Pruned)
    del model._prune
    if hasattr(model, "prune_predictors"):
        del model.prune_predictors
    return model
