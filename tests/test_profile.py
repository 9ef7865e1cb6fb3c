"""Counting: parameters, GMACs (fused attention included), memory estimates, giant models without weights."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vitlab
from vitlab.profile import count_macs, memory_estimate_gb


def test_counts_linear_conv_and_fused_attention():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 2, stride=2)
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            t = self.fc(self.conv(x).flatten(2).transpose(1, 2))  # (1, 16, 8)
            q = t.view(1, 16, 2, 4).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q)

    macs = count_macs(Tiny(), torch.zeros(1, 3, 8, 8))
    conv, fc, attn = 16 * 8 * 3 * 4, 16 * 8 * 8, 2 * 2 * 16 * 16 * 4
    assert macs == conv + fc + attn


def test_vit_base_breakdown():
    # 12 blocks x (197 * 768 * 9216 linear + 2 * 12 * 197^2 * 64 attention) + patch conv + head
    expected = 12 * (197 * 768 * 9216 + 2 * 12 * 197 * 197 * 64) + 196 * 768 * 768 + 768 * 1000
    assert vitlab.profile_model("vit_base_patch16_224").gmacs * 1e9 == pytest.approx(expected, rel=1e-9)


def test_giants_profile_in_seconds_without_weights():
    t0 = time.perf_counter()
    prof = vitlab.profile_model("vit_gigantic_patch14_224")
    assert time.perf_counter() - t0 < 30
    assert prof.params_m == pytest.approx(1844.44, abs=0.01)
    assert prof.memory_estimate_gb[32] == pytest.approx(1844.44e6 * 4 * 1.2 / 1e9, rel=1e-3)


def test_memory_estimate_formula_serving_rule():  # P * 4 bytes / (32 / Q) * 1.2
    assert memory_estimate_gb(7e9, 32) == pytest.approx(33.6)  # the article's Llama-2-7B example
    assert memory_estimate_gb(7e9, 16) == pytest.approx(16.8)


def test_profile_instance_batch_and_activation_memory():
    model = vitlab.create_model("deit_tiny_patch16_224", img_size=64)
    one = vitlab.profile_model(model, img_size=64)
    four = vitlab.profile_model(model, img_size=64, batch_size=4)
    assert four.gmacs == pytest.approx(4 * one.gmacs)
    assert four.activation_mb == pytest.approx(4 * one.activation_mb, rel=0.05)
    assert one.params_m == pytest.approx(sum(p.numel() for p in model.parameters()) / 1e6)
    assert model.training  # profiling leaves the mode as it was


def test_shared_parameters_count_once():
    prof = vitlab.profile_model("halvit_tiny_patch16_224")
    model = vitlab.create_model("halvit_tiny_patch16_224")
    assert prof.params_m * 1e6 == pytest.approx(sum(t.numel() for t in model.state_dict().values()))


@pytest.mark.parametrize("name", ["hilo", "msa"])
def test_cpu_instances_count_like_the_meta_device(name):
    # in CPU inference the layers may run oneDNN's linear and vitlab's C kernels, which FlopCounterMode cannot
    # see: under a counter they must fall back to ATen's ops, so a real module counts what the meta one counts
    from vitlab.attention import create
    from vitlab.bench.attention import _OnGrid, attention_cost

    torch.manual_seed(0)
    layer = _OnGrid(create(name, 128, 4).eval(), (14, 14))
    assert count_macs(layer, torch.randn(1, 196, 128)) == round(attention_cost(name, (14, 14), 128, 4)[1] * 1e6)


def test_activations_can_be_skipped():
    prof = vitlab.profile_model("vit_pico_patch8_32", activations=False)
    assert prof.activation_mb is None and prof.gmacs == vitlab.profile_model("vit_pico_patch8_32").gmacs
