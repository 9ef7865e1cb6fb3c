"""Seed 004's memory estimate beside a measured peak, the analytic activation term (against the live tensors
tracked op by op, and in a slow test against the resident-set peak of ViT-B at batch 64), and seed 001's
complexity table."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.analysis.memory import (
    activation_estimate,
    block_shape,
    complexity_table,
    measure_memory,
    measure_memory_isolated,
    sdpa_kernel_choice,
)


def _shape(name: str, training: bool = False, **kw):
    with torch.device("meta"):  # the architecture only: no memory
        return block_shape(vitlab.create_model(name, **kw), training=training)


def test_complexity_table_matches_seed001():
    rows = complexity_table()  # ViT-B/16: D = 768, 12 heads
    assert [r["tokens"] for r in rows] == [196, 576, 1024, 4096]
    for r in rows:
        assert round(r["scores_per_head_m"], 2) == r["seed001_printed_m"]  # the seed's printed output
        assert r["attention_gmacs_per_layer"] == pytest.approx(2 * r["tokens"] ** 2 * 768 / 1e9)
    assert rows[-1]["attention_map_mb_per_layer"] == pytest.approx(12 * 4096**2 * 4 / 2**20)  # 768 MB
    with pytest.raises(ValueError, match="multiple of the patch size"):
        complexity_table(sizes=(200,))


def test_estimate_beside_measurement():
    t = measure_memory("vit_pico_patch8_32", batch_size=2, mode="train", dtype="bf16")
    est = t["estimate_gb"]
    assert est[32] == pytest.approx(t["params"] * 4 * 1.2 / 1e9) and est[4] == pytest.approx(est[32] / 8)
    assert t["dtype"] == "bf16" and t["estimate_at_dtype_gb"] == est[16]
    assert t["measured_over_estimate"] == pytest.approx(t["measured_peak_gb"] / est[16])


@pytest.mark.slow
def test_measured_cpu_memory_holds_the_weights():
    """In a fresh process (in this one, memory freed by earlier tests would be reused and hide the growth)."""
    r = measure_memory_isolated("vit_small_patch16_224", batch_size=1, mode="infer", img_size=32, depth=2)
    est = r["estimate_gb"]
    assert est[32] == pytest.approx(r["params"] * 4 * 1.2 / 1e9) and est[4] == pytest.approx(est[32] / 8)
    assert r["measured_peak_gb"] >= r["loaded_gb"] >= 0.9 * r["weights_gb"]  # the weights are resident


def test_bad_input():
    with pytest.raises(ValueError, match="mode must be"):
        measure_memory("vit_pico_patch8_32", mode="eval")
    with pytest.raises(ValueError, match="dtype must be"):
        measure_memory_isolated("vit_pico_patch8_32", dtype="int8")
    with pytest.raises(ValueError, match="malloc_mmap_threshold must be"):
        measure_memory_isolated("vit_pico_patch8_32", malloc_mmap_threshold=0)
    with pytest.raises(ValueError, match="sdpa must be one of"):
        measure_memory("vit_pico_patch8_32", sdpa="flash")
    with pytest.raises(ValueError, match="mode must be"):
        activation_estimate(_shape("vit_pico_patch8_32"), 2, "eval")


def test_vit_b_inference_term_is_13_residual_tensors():
    """ViT-B/16 at batch 64, fp32, flash SDPA: the blocks' input + the MLP phase (4 U + 2 x 4 U) = 13 U."""
    s = _shape("vit_base_patch16_224")
    assert (s.depth, s.tokens, s.dim, s.hidden, s.heads, s.token_pool) == (12, 197, 768, 3072, 12, True)
    t = activation_estimate(s, 64, "infer")
    U = 64 * 197 * 768 * 4
    assert t["unit_U"] == U and t["mlp_phase"] == 12 * U and t["peak_bytes"] == 13 * U  # 0.503 GB
    assert t["attention_phase"] == 7 * U + 64 * 12 * 197 * 4  # flash: no N x N map
    # the math kernel: scaled q, the scores and their softmax; at 1024 px (N = 4097) the maps set the peak
    big = _shape("vit_base_patch16_224", img_size=1024)
    m = activation_estimate(big, 2, "infer", materialised=True)
    S = 2 * 12 * 4097**2 * 4
    assert m["unit_S"] == S and m["attention_phase"] == 6 * m["unit_U"] + 2 * S
    assert m["peak_bytes"] == m["unit_U"] + m["attention_phase"] > activation_estimate(big, 2, "infer")["peak_bytes"]


def test_activation_term_scales_with_batch():
    s = _shape("deit_small_patch16_224", training=True)
    for mode in ("infer", "train"):
        t1, t4 = activation_estimate(s, 1, mode), activation_estimate(s, 4, mode)
        key = "peak_bytes" if mode == "infer" else "saved_activations"
        assert t4[key] == 4 * t1[key]  # every activation holds B samples
    t1, t64 = activation_estimate(s, 1, "train"), activation_estimate(s, 64, "train")
    assert t1["step_phase"] == t64["step_phase"]  # gradients and AdamW state do not depend on the batch
    assert t1["peak_bytes"] == t1["step_phase"] and t64["peak_bytes"] == t64["backward_phase"]
    assert t1["gradients"] == s.params * 4 and t1["adamw_state"] == 2 * s.params * 4 + 4 * s.param_tensors
    assert t64["saved_per_block"] == 16 * t64["unit_U"] + 4 * 64 * 197 * 4 + 64 * 6 * 197 * 4  # + LN stats, lse


def test_sdpa_kernel_choice_follows_the_dispatcher():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    assert sdpa_kernel_choice(torch.float32, "cpu", 12, 64) == ("flash_attention", False)
    with sdpa_kernel(SDPBackend.MATH):
        assert sdpa_kernel_choice(torch.float32, "cpu", 12, 64) == ("math", True)
    r = measure_memory("vit_pico_patch8_32", batch_size=4, sdpa="math")  # the step and the term both use it
    assert (r["sdpa"], r["sdpa_kernel"], r["attention_map_materialised"]) == ("math", "math", True)
    t = r["activation_terms_gb"]
    assert t["attention_phase"] == pytest.approx(6 * t["unit_U"] + t["unit_S"] + max(t["unit_U"], t["unit_S"]))


@pytest.mark.parametrize("name,batch,mode,kw", [
    ("vit_pico_patch8_32", 16, "infer", {}),  # average pooling, MLP ratio 2
    ("vit_pico_patch8_32", 64, "train", {}),  # activations set the peak
    ("vit_pico_patch8_32", 64, "train", dict(dtype="bf16")),  # b = 2 bytes; float32 statistics stay 4
    ("vit_pico_patch8_32", 2, "train", {}),  # the AdamW step sets the peak
    ("deit_tiny_distilled_patch16_224", 2, "infer", dict(img_size=32, depth=2)),  # two prefix tokens, two heads
])
def test_activation_term_equals_the_live_tensors(name, batch, mode, kw):
    """Weights + input + the analytic term against the peak of live tensor storage tracked op by op in the same
    run (allocator-independent): equal at inference, within 1% for a training step."""
    r = measure_memory(name, batch_size=batch, mode=mode, **kw)
    assert r["sdpa_kernel"] == "flash_attention"
    if mode == "infer":
        assert r["analytic_gb"] == pytest.approx(r["tensor_peak_gb"], rel=1e-9)
    else:
        assert r["analytic_gb"] == pytest.approx(r["tensor_peak_gb"], rel=0.01)


def test_models_outside_the_term_keep_seed004_and_the_measurement():
    r = measure_memory("swin_tiny_patch4_window7_224", batch_size=1, img_size=32, window_size=4, depths=(1, 1),
                       num_heads=(1, 2), embed_dim=16)
    assert r["activation_gb"] is None and "plain ViT / DeiT" in r["activation_note"]
    assert r["measured_peak_gb"] >= 0 and r["estimate_gb"][32] > 0
    with pytest.raises(ValueError, match="layer scale"):
        _shape("vit_pico_patch8_32", init_values=1e-5)


@pytest.mark.slow
def test_vit_b_batch64_inference_within_25_percent_of_the_analytic_estimate():
    """The issue's check: the measured CPU peak (fresh process, resident-set growth) of ViT-B inference at batch
    64 within 25% of weights + input + the activation term (seed 004's weights-only M is 2.2x off)."""
    r = measure_memory_isolated("vit_base_patch16_224", batch_size=64, mode="infer")
    assert 0.75 <= r["measured_over_analytic"] <= 1.25, r
    assert r["measured_over_estimate"] > 1.25  # the weights-only rule alone misses the activations


@pytest.mark.slow
def test_memory_cli_in_fresh_processes(tmp_path):
    """``vitlab analyze memory`` measures each mode in its own process."""
    import json

    from vitlab.cli import main

    assert main(["analyze", "memory", "--model", "vit_pico_patch8_32", "--batch-size", "2", "--mode", "both",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "memory.json").read_text())
    assert [r["mode"] for r in data["measurements"]] == ["infer", "train"]
    assert data["complexity"][0]["tokens"] == (224 // 8) ** 2  # the table at vit_pico_patch8_32's own patch size



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_within_estimate_at_batch_1():
    r = measure_memory("vit_base_patch16_224", batch_size=1, mode="infer", device="cuda")
    assert 0.75 <= r["measured_over_estimate"] <= 1.25, r
