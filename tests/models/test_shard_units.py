"""Every family declares its FSDP shard units (``model.shard_units()``): non-empty, disjoint submodules in forward
order that hold most of the parameters (the FSDP strategy wraps each, then the root)."""

from __future__ import annotations

import pytest
import torch

import vitlab

NAMES = vitlab.list_models(task="classify")  # CLIP: tests/clip/test_model.py


@pytest.mark.parametrize("name", NAMES)
def test_shard_units(name):
    cfg = vitlab.get_model_config(name)
    with torch.device("meta"):  # shapes only: nothing to allocate or run
        model = vitlab.create_model(name, **{**cfg.smoke_kwargs, "num_classes": 10})
    units = model.shard_units()
    assert units and all(isinstance(u, torch.nn.Module) for u in units)
    mods = {id(m): n for n, m in model.named_modules()}
    assert all(id(u) in mods and u is not model for u in units), "every unit is a proper submodule"
    names = [mods[id(u)] for u in units]
    for i, a in enumerate(names):  # disjoint: no unit inside another
        for b in names[i + 1:]:
            assert not (a.startswith(b + ".") or b.startswith(a + ".") or a == b), (a, b)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    assert [order[n] for n in names] == sorted(order[n] for n in names), "units in forward (definition) order"
    params = {id(p) for u in units for p in u.parameters()}
    covered = sum(p.numel() for p in model.parameters() if id(p) in params)
    total = sum(p.numel() for p in model.parameters())
    assert covered >= 0.5 * total, f"{name}: shard units hold {covered / total:.0%} of the parameters"


def test_cait_units_include_class_attention_blocks():
    with torch.device("meta"):
        model = vitlab.create_model("cait_xxs24_224", depth=2)
    units = model.shard_units()
    assert units == [*model.blocks, *model.blocks_token_only] and len(units) == 4
