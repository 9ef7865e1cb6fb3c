"""Attention masks for ``F.scaled_dot_product_attention`` (boolean, True = may attend).

- causal (Vaswani et al., 2017, Sec. 3.2.3; the decoder mask of Llama 2): token i sees tokens j <= i, the
  upper triangle above the diagonal is masked (an additive mask puts -inf there before the softmax; a boolean mask
  makes SDPA do the same);
- key padding: a (B, N) boolean of the tokens that are real (True) or padding (False); padding is never
  attended to. Combined with causal the mask is (B, 1, N, N) and broadcasts over the heads.
"""

from __future__ import annotations

import torch


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """(N, N) boolean, True on and below the diagonal."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def attention_mask(seq_len: int, causal: bool = False, key_padding: torch.Tensor | None = None,
                   device=None) -> torch.Tensor | None:
    """The boolean SDPA mask of a causal and/or padded sequence of ``seq_len`` tokens; None when neither.

    ``key_padding``: (B, seq_len) boolean, True for real tokens; a sequence needs at least one (a query with every
    key masked has a softmax over nothing)."""
    if key_padding is not None:
        if key_padding.ndim != 2 or key_padding.shape[1] != seq_len:
            raise ValueError(f"key_padding must be (batch, {seq_len}), got shape {tuple(key_padding.shape)}")
        device = key_padding.device
    mask = causal_mask(seq_len, device) if causal else None
    if key_padding is not None:
        keys = key_padding.bool()[:, None, None, :]  # (B, 1, 1, N): the same keys for every query and head
        mask = keys if mask is None else keys & mask
    return mask
