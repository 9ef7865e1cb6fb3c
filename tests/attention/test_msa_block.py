"""Multi-head self-attention (``msa``), the pluggable pre-norm Block and the registry, all in vitlab.attention;
vitlab.layers knows no attention."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import vitlab
from vitlab.attention import Block, MultiHeadSelfAttention, accepts_prefix_tokens, create_attention

SRC = Path(vitlab.__file__).resolve().parent


def test_fused_and_explicit_attention_agree_and_weights_are_stochastic():
    attn = MultiHeadSelfAttention(32, 4, qk_norm=True).eval()
    x = torch.randn(2, 10, 32)
    out, weights = attn(x, return_attn=True)
    torch.testing.assert_close(attn(x), out, rtol=1e-5, atol=1e-5)
    assert weights.shape == (2, 4, 10, 10)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 10))


def test_attention_dim_not_divisible():
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        MultiHeadSelfAttention(30, 4)


def test_block_builds_attention_by_name_and_rejects_unknown():
    blk = Block(32, 4, attn_layer="msa", mlp_layer="swiglu", norm_layer="rmsnorm", init_values=1e-5)
    assert blk(torch.randn(2, 5, 32), (2, 2)).shape == (2, 5, 32)
    with pytest.raises(ValueError, match="unknown attention 'msaa'; close matches: msa"):
        create_attention("msaa", 32, 4)


def test_package_aliases():
    assert vitlab.attention.create is create_attention
    assert isinstance(vitlab.attention.create("msa", 32, 4), MultiHeadSelfAttention)
    assert "msa" in vitlab.attention.list_attention()
    assert accepts_prefix_tokens("msa") and accepts_prefix_tokens("sra")
    assert not accepts_prefix_tokens("hilo") and not accepts_prefix_tokens("local_window")


def _vitlab_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.split(".")[0] == "vitlab"}


def test_layers_import_no_attention_and_no_model():
    """layers <- attention <- models: vitlab.layers imports only itself (and torch / einops / stdlib)."""
    for path in (SRC / "layers").glob("*.py"):
        bad = {m for m in _vitlab_imports(path) if not m.startswith("vitlab.layers")}
        assert not bad, f"{path.name} imports {sorted(bad)}"
    for path in (SRC / "attention").glob("*.py"):
        bad = {m for m in _vitlab_imports(path) if not m.startswith(("vitlab.layers", "vitlab.attention"))}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_no_private_torch_api_or_tracing_queries_in_models():
    """Models are plain PyTorch: no torch._C, torch.ops, dynamo or tracing / compiling queries."""
    words = ("torch._C", "torch.ops", "is_compiling", "is_tracing", "_dynamo")
    for sub in ("layers", "attention", "models"):
        for path in (SRC / sub).glob("*.py"):
            text = path.read_text()
            assert not [w for w in words if w in text], path
