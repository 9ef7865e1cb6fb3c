"""``torch.compile`` for inference, with Inductor's freezing really applied, the module that carries a compiled
model, and :func:`share_copy`, the copy of a model whose modules an optimisation swaps without touching the
caller's (the tensors shared, never duplicated).

Freezing (Inductor turns the weights into constants of the graph, folds what depends only on them and prepacks the
GEMM weights for MKL / oneDNN) is decided when Dynamo traces a call: it reads ``torch._inductor.config.freezing``
then, to hand the parameters to Inductor as constants instead of graph inputs. Passed only as a per-call option
(``torch.compile(m, options={"freezing": True})``) the flag reaches Inductor but not Dynamo, and the weights stay
inputs, never prepacked. :func:`compile_inference` sets the flag around every call, as the option asks.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import torch
import torch.nn as nn


def share_copy(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` sharing its parameters and buffers (module swaps do not touch the
    original)."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def compile_inference(fn: Callable, options: dict | None = None) -> Callable:
    """``torch.compile(fn, options=options)`` whose calls run with Inductor's freezing flag as ``options`` state
    it (``"freezing"``, default off), so that Dynamo traces the weights as constants when it is on."""
    options = dict(options or {})
    freezing = bool(options.get("freezing"))
    compiled = torch.compile(fn, options=options) if options else torch.compile(fn)

    def call(*args, **kwargs):
        with torch._inductor.config.patch(freezing=freezing):
            return compiled(*args, **kwargs)

    return call


class CompiledInference(nn.Module):
    """A compiled model run under ``torch.no_grad()`` (Inductor's freezing applies to inference graphs only).
    ``module`` is the eager model (its state dict, under ``module.``); other attributes are looked up on it."""

    def __init__(self, module: nn.Module, compiled: Callable):
        super().__init__()
        self.module = module
        self.__dict__["compiled"] = compiled  # not a submodule: the parameters are listed once

    def forward(self, *args, **kwargs):
        with torch.no_grad():
            return self.compiled(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)
