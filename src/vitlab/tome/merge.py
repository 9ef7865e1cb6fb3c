"""Bipartite soft matching, size-weighted merging, source tracking and un-merging: the algorithm of ToMe
(Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023, Section 3 and Appendix).

At a block with ``t`` tokens and a merge budget ``r`` (Sec. 3, "Bipartite Soft Matching"):

1. split the tokens alternately into two sets A (even positions) and B (odd positions);
2. draw one edge from each token of A to its most similar token of B, similarity = cosine of the attention keys
   averaged over heads (Sec. 3, "Token Similarity");
3. keep the ``r`` most similar edges;
4. merge each kept A token into its B token (a size-weighted mean, Sec. 3 "Tracking Token Size": ``x`` and its
   size ``s`` are merged as ``sum(s x) / sum(s)``, sizes add);
5. concatenate the two sets back: the unmerged A tokens, then B.

Protected tokens (class, distillation, register: the first ``protected`` tokens) take part in the alternate
split like the authors' code does (so the split, and every merge, equals theirs for the class and distillation
tokens), but a protected A token never merges (its row of scores is -inf) and a protected B token never receives
one (its column is -inf); they stay first, in their original order.

``r`` is clamped to ``(t - protected) // 2`` per block, as in the authors' code (ViT-B r=16 reaches that bound in
its last blocks); :func:`check_budget` refuses a schedule that would leave no token beside the protected ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class Merge:
    """One block's matching: ``merge(x, mode)`` applies it to any (B, t, C) tensor (features, sizes, sources)."""

    def __init__(self, t: int, r: int, protected: int, unm_idx: torch.Tensor, src_idx: torch.Tensor,
                 dst_idx: torch.Tensor):
        self.t, self.r, self.protected = t, r, protected
        self.unm_idx, self.src_idx, self.dst_idx = unm_idx, src_idx, dst_idx  # (B, *, 1) indices into A / B
        self.pa, self.pb = (protected + 1) // 2, protected // 2  # protected tokens in A (even) and B (odd)

    def merge(self, x: torch.Tensor, mode: str = "mean") -> torch.Tensor:
        src, dst = x[..., ::2, :], x[..., 1::2, :]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=self.unm_idx.expand(n, t1 - self.r, c))
        src = src.gather(dim=-2, index=self.src_idx.expand(n, self.r, c))
        dst = dst.scatter_reduce(-2, self.dst_idx.expand(n, self.r, c), src, reduce=mode)
        if self.protected <= 1:
            return torch.cat([unm, dst], dim=1)  # the class token, if any, is unm[:, 0]
        # protected tokens first, in their original order (position j sits in A when j is even)
        prefix = [(unm if j % 2 == 0 else dst)[:, j // 2: j // 2 + 1] for j in range(self.protected)]
        return torch.cat([*prefix, unm[:, self.pa:], dst[:, self.pb:]], dim=1)


def bipartite_soft_matching(metric: torch.Tensor, r: int, protected: int = 0) -> Merge | None:
    """The matching of one block: ``metric`` (B, t, d) token similarity features (the keys, mean over heads),
    ``r`` merges (clamped to ``(t - protected) // 2``), the first ``protected`` tokens never merged.
    None when nothing merges."""
    t = metric.shape[1]
    r = min(r, (t - protected) // 2)
    if r <= 0:
        return None
    pa, pb = (protected + 1) // 2, protected // 2
    with torch.no_grad():  # the matching is a discrete choice: no gradient flows through it
        metric = metric / metric.norm(dim=-1, keepdim=True)
        a, b = metric[..., ::2, :], metric[..., 1::2, :]
        scores = a @ b.transpose(-1, -2)  # (B, |A|, |B|) cosine similarities
        if pa:
            scores[..., :pa, :] = -math.inf  # protected A tokens are never merged
        if pb:
            scores[..., :, :pb] = -math.inf  # nothing merges into a protected B token
        node_max, node_idx = scores.max(dim=-1)  # each A token's best B token
        edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
        unm_idx = edge_idx[..., r:, :]  # A tokens that stay
        src_idx = edge_idx[..., :r, :]  # A tokens merged away: the r most similar edges
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
        if protected:
            # keep the unmerged A tokens in their original order so the protected ones stay first; without
            # protected tokens the authors' code keeps the order of decreasing similarity, and so do we
            unm_idx = unm_idx.sort(dim=1)[0]
    return Merge(t, r, protected, unm_idx, src_idx, dst_idx)


def merge_wavg(m: Merge, x: torch.Tensor, size: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Size-weighted average merge: (merged x, merged sizes); ``size`` (B, t, 1), None = every token is one patch."""
    if size is None:
        size = torch.ones_like(x[..., 0, None])
    x = m.merge(x * size, mode="sum")
    size = m.merge(size, mode="sum")
    return x / size, size


def merge_source(m: Merge, x: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
    """Source tracking: (B, t', N0) with source[b, i, j] = 1 when input patch j is part of token i."""
    if source is None:
        n, t, _ = x.shape
        source = torch.eye(t, device=x.device, dtype=x.dtype)[None].expand(n, t, t)
    return m.merge(source, mode="amax")


def unmerge_tokens(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Un-merge for dense outputs: (B, t', C) merged tokens -> (B, N0, C), each input position taking the token
    it ended in (``source`` from :func:`merge_source`)."""
    assign = source.argmax(dim=1)  # (B, N0): the token each input position belongs to
    return x.gather(1, assign[..., None].expand(-1, -1, x.shape[-1]))


def parse_r(num_blocks: int, r: int | Sequence[int] | tuple[int, float]) -> list[int]:
    """The merges per block (ToMe's ``parse_r``): an int (the same r in every block), a list (one r per block,
    missing blocks 0), or ``(r, inflect)``: a linear schedule from ``r (1 - inflect)`` to ``r (1 + inflect)``
    (mean r): inflect -1 is the paper's "decreasing schedule" (2r down to 0, Appendix "Merging Schedule"),
    +1 increasing, 0 constant."""
    if isinstance(r, list):
        if len(r) > num_blocks:
            raise ValueError(f"r lists {len(r)} values for a model with {num_blocks} blocks")
        if any(int(v) != v or v < 0 for v in r):
            raise ValueError(f"r must hold non-negative integers, got {r}")
        return [int(v) for v in r] + [0] * (num_blocks - len(r))
    inflect = 0.0
    if isinstance(r, tuple):
        if len(r) != 2:
            raise ValueError(f"a scheduled r is (r, inflect), got {r!r}")
        r, inflect = r
        if not -1.0 <= inflect <= 1.0:
            raise ValueError(f"the schedule's inflect must be in [-1, 1], got {inflect}")
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"r must be a non-negative int, a list of them or (r, inflect), got {r!r}")
    min_val = int(r * (1.0 - inflect))
    max_val = 2 * r - min_val
    step = (max_val - min_val) / max(num_blocks - 1, 1)
    return [int(min_val + step * i) for i in range(num_blocks)]


def check_budget(rs: Sequence[int], num_tokens: int, protected: int) -> None:
    """ValueError when the schedule merges so many tokens that none but the protected ones would remain."""
    total = sum(rs)
    if total > num_tokens - protected - 1:
        raise ValueError(
            f"r merges {total} tokens over {len(rs)} blocks, but the input has {num_tokens} tokens of which "
            f"{protected} are protected (class / distillation / register): at most {num_tokens - protected - 1} "
            f"can merge; lower r")
