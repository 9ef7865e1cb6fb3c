"""The compiled decoding step of the Llama decoder: the same tokens as eager generation, with padding or without,
a few graphs shared across prompt lengths and decoding steps."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.optimize.llama import compile_llama


@pytest.mark.slow  # Inductor compiles C++ (about a minute on two cores)
def test_compiled_generation_equals_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = vitlab.create_model("llama_tiny").eval()
    fast = compile_llama(model)
    ids = torch.randint(3, 512, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    assert torch.equal(model.generate(ids, 10, attention_mask=mask, forward=fast),
                       model.generate(ids, 10, attention_mask=mask))
    for n, new in ((13, 12), (20, 3), (9, 5)):  # other prompt lengths: no new graph after the second
        other = torch.randint(3, 512, (2, n))
        assert torch.equal(model.generate(other, new, forward=fast), model.generate(other, new))
    from torch._dynamo.utils import counters

    # prefill and step, with and without a padding mask: each compiled static, then once with symbolic sizes
    assert counters["stats"]["unique_graphs"] <= 8 and not counters["graph_break"]
    steps_only = compile_llama(model, prefill=False)
    assert torch.equal(model.generate(ids, 4, forward=steps_only), model.generate(ids, 4))
