"""DPT against Hugging Face transformers' DPTForDepthEstimation / DPTForSemanticSegmentation (the oracle; dev
only): shared random weights, moved through ``checkpoint_path=`` (the HF key layout), equal predictions."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from vitlab.dense import create

transformers = pytest.importorskip("transformers")


def _hf(kind: str, readout: str, small: bool, num_labels: int = 5):
    from transformers import DPTConfig, DPTForDepthEstimation, DPTForSemanticSegmentation

    kw = dict(readout_type=readout, num_labels=num_labels, use_auxiliary_head=kind == "segment")
    if small:
        kw.update(hidden_size=96, num_hidden_layers=4, num_attention_heads=4, intermediate_size=384, image_size=64,
                  backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[16, 32, 64, 96], fusion_hidden_size=32)
    cls = DPTForDepthEstimation if kind == "depth" else DPTForSemanticSegmentation
    torch.manual_seed(0)
    model = cls(DPTConfig(**kw)).eval()
    with torch.no_grad():  # HF initialises BN to identity: random statistics exercise the mapping
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
            if isinstance(m, nn.Conv2d | nn.ConvTranspose2d) and m.bias is not None:
                m.bias.uniform_(-0.1, 0.1)
    return model


def _compare(hf, ours, size: int, tol: float):
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(pixel_values=x)
        ref = out.predicted_depth[:, None] if hasattr(out, "predicted_depth") else out.logits
        got = ours.eval()(x)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind,readout", [("depth", "project"), ("segment", "ignore"),
                                          pytest.param("segment", "project", marks=pytest.mark.slow),
                                          ("depth", "add")])
def test_dpt_small_equals_transformers(kind, readout, tmp_path):
    hf = _hf(kind, readout, small=True)
    path = tmp_path / "hf.safetensors"
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(path))
    ours = create("dpt", backbone="vit_base_patch16_224", task=kind, num_classes=5, img_size=64,
                  indices=[0, 1, 2, 3], checkpoint_path=str(path),
                  backbone_kwargs=dict(embed_dim=96, depth=4, num_heads=4,
                                       norm_layer=partial(nn.LayerNorm, eps=1e-12)),
                  head_kwargs=dict(hidden=(16, 32, 64, 96), fusion=32, readout=readout))
    _compare(hf, ours, 64, 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["depth", "segment"])
def test_dpt_vit_base_patch16_384_loads_transformers_state_dict(kind, tmp_path):
    """The registered config, the fidelity bar of the issue: ViT-B/16 at 384, within 1e-4."""
    hf = _hf(kind, "project", small=False, num_labels=150)
    path = tmp_path / "hf.safetensors"
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(path))
    name = "dpt_vit_base_patch16_384" + ("_depth" if kind == "depth" else "")
    ours = create(name, checkpoint_path=str(path))
    _compare(hf, ours, 384, 1e-4)


def test_hf_state_dict_for_the_other_task_is_refused(tmp_path):
    from vitlab.convert import CheckpointError

    hf = _hf("depth", "project", small=True)
    path = tmp_path / "hf.safetensors"
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(path))
    with pytest.raises(CheckpointError, match="shape mismatch|missing keys"):
        create("dpt", backbone="vit_base_patch16_224", task="segment", num_classes=5, img_size=64,
               indices=[0, 1, 2, 3], checkpoint_path=str(path),
               backbone_kwargs=dict(embed_dim=96, depth=4, num_heads=4),
               head_kwargs=dict(hidden=(16, 32, 64, 96), fusion=32))


@pytest.mark.slow
def test_dpt_base_param_count_equals_transformers_less_what_dpt_never_runs():
    """``vitlab models`` counts what transformers holds, less the final LayerNorm and the first fusion layer's
    residual unit (both built by transformers, never run by DPT); GMACs are counted too."""
    from transformers import DPTConfig, DPTForDepthEstimation

    from vitlab.profile import model_rows

    with torch.device("meta"):
        hf = DPTForDepthEstimation(DPTConfig())
    unused = sum(p.numel() for n, p in hf.named_parameters()
                 if n.startswith(("dpt.layernorm.", "neck.fusion_stage.layers.0.residual_layer1.")))
    row, = model_rows("dpt_vit_base_patch16_384_depth")
    assert row["params_m"] == pytest.approx((sum(p.numel() for p in hf.parameters()) - unused) / 1e6, abs=0.006)
    assert row["input_size"] == [3, 384, 384] and 100 < row["gmacs"] < 130
