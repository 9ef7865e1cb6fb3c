"""Faster generation with the Llama decoder, from outside the model: :func:`compile_llama` compiles its forward
with Inductor (the prompt's prefill and the one-token decoding steps), for
:meth:`vitlab.models.llama.Llama.generate`'s ``forward=`` argument::

    fast = compile_llama(model)
    model.generate(ids, max_new_tokens=64, forward=fast)

The function is unchanged (the compiled forward computes the same logits within float rounding). Decoding is where
the time goes per token: one token through every layer, many small kernels, each launched from Python in eager
mode; compiled, a step is a few fused C++ kernels and GEMMs with prepacked weights (on the CPU the graph is
compiled with the weights frozen and the SIMD width stated, :func:`vitlab.optimize.cpu.inductor_options`). The
prefill gains less (large GEMMs dominate it); ``prefill=False`` leaves it eager and saves its compile.

The cache is the model's preallocated :class:`~vitlab.models.llama.KVCache`. Shapes are left to Dynamo's automatic
dynamic mode: the first call of a kind (prefill or step, with or without a padding mask) compiles with static
sizes, and the sizes that then change (prompt length, cache position and length, mask length) become symbolic in
the second graph, which serves every later call. The batch size stays static, so Inductor's fp32 GEMMs use MKL's
prepacked weights (for a symbolic batch size, as ``dynamic=True`` would make it, Inductor switches to oneDNN's
linear kernel instead).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from vitlab.optimize import cpu as cpuinfo


def compile_llama(model: nn.Module, prefill: bool = True, options: dict | None = None) -> Callable[..., torch.Tensor]:
    """A forward for ``model.generate(..., forward=...)``: decoding steps compiled, and prompts too unless
    ``prefill=False``. Inference only (``generate`` runs under ``torch.no_grad()``). ``options``: Inductor options
    over the CPU defaults."""
    model.eval()
    if next(model.parameters()).device.type == "cpu":
        cpuinfo.cpp_extension()  # imported quietly before Inductor's C++ build imports it and warns
        options = {**cpuinfo.inductor_options(), **(options or {})}
    compiled = torch.compile(model, options=options)
    if prefill:
        return compiled

    def forward(input_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        one_token = input_ids is not None and input_ids.shape[1] == 1
        return (compiled if one_token else model)(input_ids, **kwargs)

    return forward
