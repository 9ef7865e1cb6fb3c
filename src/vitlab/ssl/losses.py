"""Self-supervised losses, each written from its paper:

- :func:`nt_xent` -- SimCLR's normalised-temperature cross-entropy (Chen et al., 2020, "A Simple Framework for
  Contrastive Learning of Visual Representations", eq. 1): for each of the 2B views, cross-entropy of its cosine
  similarities / T against its positive, the other view of the same image, every other view a negative.
- :func:`info_nce` -- MoCo's contrastive loss (Chen, Xie, He, 2021, "An Empirical Study of Training
  Self-Supervised Vision Transformers", Algorithm 1 ``ctr``): queries against the batch's keys, the positive on
  the diagonal.
- :func:`dino` -- DINO's cross-entropy between a sharpened, centred teacher distribution and the student's
  (Caron et al., 2021, "Emerging Properties in Self-Supervised Vision Transformers", Algorithm 1 and eq. 3),
  summed over every (teacher global view, student view) pair of different views.
- :func:`ibot_patch` -- iBOT's masked-patch self-distillation (Zhou et al., 2022, eq. 2) as DINOv2 computes it
  (Oquab et al., 2023, section 4): per masked token cross-entropy, averaged over each image's masked tokens,
  then over images.
- :func:`koleo` -- the KoLeo regulariser (Sablayrolles et al., 2019, "Spreading vectors for similarity search",
  eq. 6; DINOv2 section 4): minus the mean log distance of each L2-normalised feature to its nearest neighbour.
- :func:`sinkhorn_knopp` -- DINOv2's Sinkhorn-Knopp centring of teacher outputs (from SwAV, Caron et al., 2020,
  section 3.1): three row/column normalisations of exp(logits / T).
- :class:`Centering` -- DINO's centre ``c <- m c + (1 - m) mean(teacher outputs)`` (eq. 4), momentum 0.9.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


def nt_xent(z1: Tensor, z2: Tensor, temperature: float = 0.5) -> Tensor:
    """SimCLR's NT-Xent of two views' projections ``z1``, ``z2`` (B, D): mean over the 2B anchors."""
    B = z1.shape[0]
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = (z @ z.t()).float() / temperature
    sim.fill_diagonal_(float("-inf"))  # a view is not its own negative (the 1[k != i] of eq. 1)
    targets = torch.cat([torch.arange(B, 2 * B), torch.arange(0, B)]).to(z.device)
    return F.cross_entropy(sim, targets)


def info_nce(q: Tensor, k: Tensor, temperature: float = 0.2) -> Tensor:
    """MoCo v3's ``ctr(q, k)`` without its ``2 * tau`` factor: cross-entropy of ``q_i . k_j / T`` (unit vectors)
    with the positive ``j = i``; every other key of the batch is a negative."""
    q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
    logits = (q @ k.t()).float() / temperature
    return F.cross_entropy(logits, torch.arange(q.shape[0], device=q.device))


@torch.no_grad()
def sinkhorn_knopp(logits: Tensor, temperature: float, n_iterations: int = 3) -> Tensor:
    """Soft assignments (B, K) of teacher ``logits`` (B, K) whose K prototypes are used equally (DINOv2's
    ``sinkhorn_knopp_teacher``): Q = exp(logits / T), then alternately normalise prototypes (rows of Q^T) to
    mass 1/K and samples to mass 1/B; each returned row sums to 1."""
    Q = torch.exp(logits.float() / temperature).t()  # (K, B)
    K, B = Q.shape
    Q /= Q.sum()
    for _ in range(n_iterations):
        Q /= Q.sum(dim=1, keepdim=True)
        Q /= K
        Q /= Q.sum(dim=0, keepdim=True)
        Q /= B
    return (Q * B).t()


def teacher_probs(teacher_out: Tensor, teacher_temp: float, center: Tensor | None = None,
                  sinkhorn: bool = False) -> Tensor:
    """The teacher's targets over the last dim: softmax((t - c) / T) (DINO eq. 3-4), or Sinkhorn-Knopp."""
    if sinkhorn:
        flat = teacher_out.reshape(-1, teacher_out.shape[-1])
        return sinkhorn_knopp(flat, teacher_temp).reshape(teacher_out.shape)
    if center is not None:
        teacher_out = teacher_out - center
    return F.softmax(teacher_out.float() / teacher_temp, dim=-1)


def dino(student_out: Tensor | list[Tensor], teacher_out: Tensor | list[Tensor], teacher_temp: float = 0.04,
         student_temp: float = 0.1, center: Tensor | None = None, sinkhorn: bool = False) -> Tensor:
    """DINO's loss: ``student_out`` (S, B, K) logits of all S views, ``teacher_out`` (T, B, K) logits of the T
    global views, which come first among the student's views in the same order. The mean over the pairs
    (teacher view t, student view s != t) of ``H(P_t, P_s) = -sum P_t log P_s`` averaged over the batch."""
    s = torch.stack(list(student_out)) if isinstance(student_out, (list, tuple)) else student_out
    t = torch.stack(list(teacher_out)) if isinstance(teacher_out, (list, tuple)) else teacher_out
    p_t = teacher_probs(t.detach(), teacher_temp, center, sinkhorn)
    log_p_s = F.log_softmax(s.float() / student_temp, dim=-1)
    ce = -torch.einsum("tbk,sbk->ts", p_t, log_p_s) / s.shape[1]  # (T, S): batch-mean cross-entropies
    same = torch.eye(t.shape[0], s.shape[0], dtype=torch.bool, device=ce.device)  # a view is not its own target
    n_pairs = ce.numel() - int(same.sum())
    if n_pairs == 0:
        raise ValueError("the DINO loss needs at least two views")
    return ce.masked_fill(same, 0.0).sum() / n_pairs


def ibot_patch(student_patch: Tensor, teacher_patch: Tensor, mask: Tensor, teacher_temp: float = 0.04,
               student_temp: float = 0.1, center: Tensor | None = None, sinkhorn: bool = False) -> Tensor:
    """iBOT's masked-patch loss: ``student_patch`` / ``teacher_patch`` (B, N, K) patch logits, ``mask`` (B, N)
    bool (True = masked in the student's input). Per image, the mean over its masked tokens of
    ``-sum P_t log P_s``; then the mean over the B images (an image without masked tokens adds 0)."""
    m = mask.bool()
    t = teacher_patch.detach()[m]  # (M, K): only masked tokens are distilled
    p_t = teacher_probs(t, teacher_temp, center, sinkhorn)
    ce = -(p_t * F.log_softmax(student_patch[m].float() / student_temp, dim=-1)).sum(dim=-1)  # (M,)
    per_image = m.sum(dim=1, keepdim=True).clamp(min=1).expand_as(m)[m]
    return (ce / per_image).sum() / mask.shape[0]


def koleo(x: Tensor, eps: float = 1e-8) -> Tensor:
    """KoLeo: ``-mean_i log(||x_i - x_nn(i)|| + eps)`` over the L2-normalised rows of ``x`` (B, D), where nn(i) is
    the row nearest to i (largest cosine similarity, itself excluded)."""
    x = F.normalize(x.float(), p=2, dim=-1, eps=eps)
    with torch.no_grad():
        sim = x @ x.t()
        sim.fill_diagonal_(-2.0)  # below any cosine, so a row is never its own neighbour
        nn_idx = sim.argmax(dim=1)
    dist = F.pairwise_distance(x, x[nn_idx], p=2, eps=eps)
    return -torch.log(dist + eps).mean()


class Centering(nn.Module):
    """DINO's centre of the teacher outputs (a buffer, checkpointed with the module it belongs to):
    ``update(t)`` sets ``c <- momentum * c + (1 - momentum) * mean over views and batch of t`` (eq. 4)."""

    def __init__(self, dim: int, momentum: float = 0.9):
        super().__init__()
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"center momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.register_buffer("center", torch.zeros(1, dim))

    @torch.no_grad()
    def update(self, teacher_out: Tensor, all_reduce=None) -> None:
        """``teacher_out`` (..., K); ``all_reduce`` (optional) averages the batch mean over processes."""
        batch_center = teacher_out.detach().float().reshape(-1, teacher_out.shape[-1]).mean(dim=0, keepdim=True)
        if all_reduce is not None:
            batch_center = all_reduce(batch_center)
        self.center.mul_(self.momentum).add_(batch_center, alpha=1.0 - self.momentum)


def entropy(p: Tensor) -> Tensor:
    """Mean entropy (nats) of the distributions ``p`` (..., K): log K for a uniform teacher, 0 for a one-hot."""
    return -(p * torch.log(p.clamp_min(1e-12))).sum(dim=-1).mean()


def kl_div(p: Tensor, log_q: Tensor) -> Tensor:
    """Mean KL(p || q) over the rows, from probabilities ``p`` and log-probabilities ``log_q``."""
    return (p * (torch.log(p.clamp_min(1e-12)) - log_q)).sum(dim=-1).mean()


__all__ = ["Centering", "dino", "entropy", "ibot_patch", "info_nce", "kl_div", "koleo", "nt_xent",
           "sinkhorn_knopp", "teacher_probs"]
