"""``vitlab.optimize.compiled``: a compile with freezing on bakes the weights into the graph (Dynamo traces them
as constants), one without it reads them on every call."""

from __future__ import annotations

import pytest
import torch

from vitlab.optimize.compiled import CompiledInference, compile_inference


@pytest.mark.parametrize("freezing", [True, False])
def test_freezing_is_applied_when_the_options_ask(freezing):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    fast = CompiledInference(model, compile_inference(model, {"freezing": freezing}))
    x = torch.randn(4, 8)
    before = fast(x)
    with torch.no_grad():
        model[0].weight.mul_(2)  # frozen: a constant of the compiled graph; else an input read again
    after = fast(x)
    assert torch.equal(after, before) == freezing
    assert fast.module is model and len(list(fast.parameters())) == 2  # the weights listed once
