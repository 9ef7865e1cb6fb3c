"""Feed-forward layers of the transformer block.

- :class:`Mlp`: Linear -> GELU (exact, or its tanh approximation) -> Linear (ViT, Dosovitskiy 2021).
- :class:`QuickGELU`: ``x * sigmoid(1.702 x)``, the GELU approximation of OpenAI's CLIP (Radford et al., 2021;
  Hendrycks & Gimpel, 2016, Sec. 2), activation ``'quick_gelu'``.
- :class:`SwiGLU`: ``W3(silu(W1 x) * W2 x)`` (Shazeer 2020, "GLU Variants Improve Transformer"; the Llama 2 MLP,
  Touvron et al., 2023), with the hidden size from the Llama rule: 2/3 of ``mlp_ratio * dim``, rounded up to a multiple.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.layers.helpers import by_name, make_divisible


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


_ACTS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
    "relu": nn.ReLU,
    "hardswish": nn.Hardswish,
    "quick_gelu": QuickGELU,
}


def get_act_layer(act: str | Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    return by_name(_ACTS, act, "activation")


class Mlp(nn.Module):
    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 act_layer: str | Callable = "gelu", bias: bool = True, drop: float = 0.0):
        super().__init__()
        hidden_features = hidden_features or in_features
        out_features = out_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = get_act_layer(act_layer)()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


def swiglu_hidden_dim(dim: int, mlp_ratio: float = 4.0, multiple_of: int = 64,
                      ffn_dim_multiplier: float | None = None) -> int:
    """Llama's rule: ``2/3 * mlp_ratio * dim``, times ``ffn_dim_multiplier`` if given, rounded up to
    ``multiple_of`` (keeps params ~ a GELU MLP's). Llama 2 7B: ``swiglu_hidden_dim(4096, multiple_of=256)`` =
    11008; 70B: ``swiglu_hidden_dim(8192, multiple_of=4096, ffn_dim_multiplier=1.3)`` = 28672 (Touvron et al.,
    2023, as in Meta's reference code)."""
    hidden = int(2 * mlp_ratio * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return make_divisible(hidden, multiple_of)


class SwiGLU(nn.Module):
    """SwiGLU feed-forward. The gate and value projections (W1, W2) are packed into one ``fc1`` so a single
    matmul computes both; ``fc1.weight[:hidden]`` is W1 (gate), ``fc1.weight[hidden:]`` is W2 (value)."""

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 bias: bool = True, drop: float = 0.0, multiple_of: int = 64):
        super().__init__()
        out_features = out_features or in_features
        self.hidden_features = hidden_features or swiglu_hidden_dim(in_features, 4.0, multiple_of)
        self.fc1 = nn.Linear(in_features, 2 * self.hidden_features, bias=bias)
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(self.hidden_features, out_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)  # (B, N, hidden) each
        return self.drop2(self.fc2(self.drop1(F.silu(gate) * value)))


def create_mlp(kind: str | Callable[..., nn.Module], dim: int, mlp_ratio: float, act_layer="gelu",
               bias: bool = True, drop: float = 0.0) -> nn.Module:
    """'mlp' (GELU MLP of width ``mlp_ratio * dim``) or 'swiglu' (Llama-rule width), or a callable."""
    if callable(kind):
        return kind(dim, int(dim * mlp_ratio), act_layer=act_layer, bias=bias, drop=drop)
    if kind == "mlp":
        return Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, bias=bias, drop=drop)
    if kind == "swiglu":
        return SwiGLU(dim, swiglu_hidden_dim(dim, mlp_ratio), bias=bias, drop=drop)
    raise ValueError(f"unknown mlp layer {kind!r}; choose from ['mlp', 'swiglu']")
