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
    other = torch.randint(3, 512, (2, 13))
    assert torch.equal(model.generate(other, 12, forward=fast), model.generate(other, 12))
    from torch._dynamo.utils import counters

    # per mask variant: the first step static, then one graph with the cache sizes symbolic
    assert counters["stats"]["unique_graphs"] <= 4
