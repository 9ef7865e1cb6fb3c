"""Attention weights through one keyword: every registered mechanism either returns its weights with
``return_attn=True`` (the same output as without, weights that are softmax rows) or says it forms none
(``has_attention_weights = False``) and refuses the keyword with one clear ValueError."""

from __future__ import annotations

import pytest
import torch

import vitlab.attention as A

DIM, HEADS, HW = 48, 6, (13, 17)  # an odd, non-square grid: windows and stripes are cut at the border
N = HW[0] * HW[1]
# (keys per query) of each kind on this grid; None: the keys are the N tokens
KEYS = {"global": N, "window": N, "spatial_reduction": 7 * 9, "projected": 256, "channels": DIM // HEADS,
        "deformable": N}
KINDS = ("global", "window", "spatial_reduction", "projected", "channels", "deformable", "focal", "offset_bias",
         "hilo", "quadtree", "class_attention", "talking_heads")  # docs/CONTRIBUTING.md, "Attention weights"


@pytest.mark.parametrize("name", A.list_attention())
def test_weights_on_request_or_a_clear_refusal(name):
    torch.manual_seed(0)
    m = A.create(name, DIM, HEADS, **A.layout_kwargs(name, num_prefix_tokens=0, grid_size=HW)).eval()
    x = torch.randn(2, N, DIM)
    assert A.accepts_keywords(m, "return_attn"), f"{name}: forward takes no return_attn"
    if not A.has_attention_weights(m):
        with pytest.raises(ValueError, match="forms no attention weights"):
            m(x, HW, return_attn=True)
        return
    with torch.no_grad():
        out, attn = m(x, HW, return_attn=True)
        torch.testing.assert_close(out, m(x, HW), atol=2e-5, rtol=1e-4)  # the same function
    kind = getattr(m, "attention_kind", None)
    assert kind in KINDS, f"{name}: forms weights but declares no documented attention_kind ({kind!r})"
    if kind in KEYS:
        rows = N if kind != "channels" else DIM // HEADS
        assert attn.shape == (2, HEADS, rows, KEYS[kind])
    for a in [attn] if torch.is_tensor(attn) else attn:  # a multi-level mechanism: one softmax per level
        assert a.shape[:2] == (2, HEADS) and (a >= 0).all()
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]), atol=1e-5, rtol=0)


def test_window_weights_are_zero_outside_the_window():
    torch.manual_seed(0)
    m = A.create("local_window", DIM, HEADS, window_size=4).eval()
    with torch.no_grad():
        _, attn = m(torch.randn(1, N, DIM), HW, return_attn=True)
    support = attn[0, 0, 0].reshape(HW) > 0  # query (0, 0): its window is rows 0-3, columns 0-3
    assert support[:4, :4].all() and support.sum() == 16


def test_qkv_attention_extras_and_policy():
    """msa: weights, queries and keys in the documented order; an additive mask as the logits' bias; DynamicViT's
    policy zeroes dropped keys (each token keeps itself)."""
    torch.manual_seed(0)
    m = A.create("msa", DIM, HEADS).eval()
    x = torch.randn(2, 10, DIM)
    out, attn, q, k = m(x, return_attn=True, return_qk=True)
    assert q.shape == k.shape == (2, HEADS, 10, DIM // HEADS)
    torch.testing.assert_close(attn, ((q * m.scale) @ k.transpose(-2, -1)).softmax(-1))
    bias = torch.randn(2, 1, 1, 10)
    fused, (_, masked) = m(x, attn_mask=bias), m(x, attn_mask=bias, return_attn=True)
    torch.testing.assert_close(masked, ((q * m.scale) @ k.transpose(-2, -1) + bias).softmax(-1))
    torch.testing.assert_close(fused, _, atol=1e-5, rtol=1e-4)
    policy = torch.ones(2, 10, 1)
    policy[:, 5:] = 0
    _, w = m(x, attn_policy=policy, return_attn=True)
    off_diagonal = ~torch.eye(10, dtype=torch.bool)
    assert w[:, :, :, 5:][..., off_diagonal[:, 5:]].max() < 1e-5  # a dropped key: only its own query sees it
    assert (w[:, :, 5:, 5:].diagonal(dim1=-2, dim2=-1) > 1e-2).all()
