"""The weights-only memory estimate (Mboya, "Scaling ViTs across Training Compute") beside a measured peak, the
analytic activation term (against the live tensors tracked op by op, and in a slow test against the resident-set
peak of ViT-B at batch 64), and the attention-complexity table (ViT, Dosovitskiy et al., 2021)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitlab
from vitlab.analysis.memory import (
    LiveTensors,
    activation_estimate,
    analytic_memory,
    block_shape,
    complexity_table,
    measure_memory,
    measure_memory_isolated,
    sdpa_kernel_choice,
    trace_activations,
)


def _shape(name: str, training: bool = False, **kw):
    with torch.device("meta"):  # the architecture only: no memory
        return block_shape(vitlab.create_model(name, **kw), training=training)


def test_complexity_table_matches_the_printed_values():
    rows = complexity_table()  # ViT-B/16: D = 768, 12 heads
    assert [r["tokens"] for r in rows] == [196, 576, 1024, 4096]
    for r in rows:
        assert round(r["scores_per_head_m"], 2) == r["reference_scores_m"]  # N^2 in millions, two decimals
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


def test_vit_b_inference_term_is_12_residual_tensors():
    """ViT-B/16 at batch 64, fp32, flash SDPA: the blocks' input + the MLP phase (3 U + 2 x 4 U) = 12 U."""
    s = _shape("vit_base_patch16_224")
    assert (s.depth, s.tokens, s.dim, s.hidden, s.heads, s.token_pool) == (12, 197, 768, 3072, 12, True)
    t = activation_estimate(s, 64, "infer")
    U = 64 * 197 * 768 * 4
    assert t["unit_U"] == U and t["mlp_phase"] == 11 * U and t["peak_bytes"] == 12 * U  # 0.465 GB
    assert t["attention_phase"] == 7 * U  # flash: no N x N map
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


def test_closed_form_is_for_plain_vits_only():
    with pytest.raises(ValueError, match="plain ViT / DeiT"):
        _shape("swin_tiny_patch4_window7_224")
    with pytest.raises(ValueError, match="layer scale"):
        _shape("vit_pico_patch8_32", init_values=1e-5)


def _trace(name: str, batch: int, mode: str, **kw) -> dict:
    with torch.device("meta"):  # the replay reads shapes only
        model = vitlab.create_model(name, **kw)
    chans, size = vitlab.get_model_config(name).input_size[:2]
    return trace_activations(model, (batch, chans, kw.get("img_size", size), kw.get("img_size", size)), mode)


def test_trace_equals_the_vit_closed_form():
    """The replay and the hand derivation agree for a ViT: 12 U at inference exactly (ViT-B, batch 64), and the
    training term within 1% (the closed form leaves out the small gradients of the earlier blocks' tails)."""
    with torch.device("meta"):
        vit_b = vitlab.create_model("vit_base_patch16_224")
    t = trace_activations(vit_b, (64, 3, 224, 224), "infer")
    assert t["peak_bytes"] == 12 * 64 * 197 * 768 * 4 and t["peak_at"].endswith("mlp.act")  # fc1 -> GELU
    a = analytic_memory(vit_b, 64, "infer")
    assert a["activation_source"] == "closed form" and a["activation_gb"] == a["traced_gb"] == t["peak_bytes"] / 1e9
    s = _shape("deit_small_patch16_224", training=True)
    with torch.device("meta"):
        deit_s = vitlab.create_model("deit_small_patch16_224")
    t = trace_activations(deit_s, (8, 3, 224, 224), "train")
    closed = activation_estimate(s, 8, "train")
    assert t["backward_phase"] == pytest.approx(closed["backward_phase"], rel=0.01)
    assert t["step_phase"] == closed["step_phase"]  # the same AdamW count
    # what each block saved for the backward: 16 U + LayerNorm statistics + flash's log-sum-exp, as derived
    assert t["saved_by_unit"]["blocks.5"] == closed["saved_per_block"]


@pytest.mark.parametrize("name,kw", [
    ("swin_tiny_patch4_window7_224", dict(img_size=32, window_size=4, depths=(1, 1), num_heads=(1, 2), embed_dim=16)),
    pytest.param("levit_128s", dict(img_size=64), marks=pytest.mark.slow),
])
def test_trace_scales_with_the_batch(name, kw):
    """What autograd saves holds B samples each, apart from what does not depend on the batch (Swin's masks
    and gathered relative-position biases, one a layer): a + b B exactly, a zero second difference (from B = 2:
    at B = 1 some reshapes of permuted tensors are views, not copies). The peak is the largest of such sums over
    the step, so convex in B; the AdamW phase does not depend on B."""
    t1, t2, t3 = (_trace(name, b, "train", **kw) for b in (2, 3, 4))
    assert t3["saved_bytes"] - t2["saved_bytes"] == t2["saved_bytes"] - t1["saved_bytes"] > 0
    assert t3["backward_phase"] - t2["backward_phase"] >= t2["backward_phase"] - t1["backward_phase"] > 0
    assert t1["step_phase"] == t3["step_phase"]


def test_trace_leaves_the_model_as_it_was():
    """The replay runs the model's own code on fake tensors: its caches are set aside and put back, no hook is
    left, and its training flag is restored."""
    model = vitlab.create_model("swin_tiny_patch4_window7_224", img_size=32, window_size=4, depths=(2, 1),
                                num_heads=(1, 2), embed_dim=16).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.inference_mode():
        ref = model(x)
    attn = model.layers[0].blocks[1].attn  # the shifted window: it caches its mask
    cache = dict(attn._mask_cache)
    assert cache
    trace_activations(model, (2, 3, 32, 32), "train")
    assert not model.training and attn._mask_cache == cache
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with torch.inference_mode():
        assert torch.equal(model(x), ref)


def test_a_forward_that_reads_values_has_no_traced_term():
    class ReadsValues(torch.nn.Module):
        def forward(self, x):
            return x * float(x.mean().item())  # data-dependent: a fake tensor has no value

    r = analytic_memory(ReadsValues(), 2, "infer", input_size=(3, 8, 8))
    assert r["activation_gb"] is None and "replay of ReadsValues failed" in r["activation_note"]


TRACED = [
    ("swin_tiny_patch4_window7_224", dict(img_size=32, window_size=4, depths=(1, 1), num_heads=(1, 2), embed_dim=16)),
    ("litv2_s", dict(img_size=32, embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8))),
    pytest.param("pvt_tiny", dict(img_size=64, depths=(1, 1, 1, 1)), marks=pytest.mark.slow),
    pytest.param("cait_xxs24_224", dict(img_size=32, depth=2), marks=pytest.mark.slow),
    pytest.param("levit_128s", dict(img_size=64), marks=pytest.mark.slow),
    pytest.param("mobilevit_xxs", dict(img_size=64), marks=pytest.mark.slow),
    pytest.param("efficientformer_l1", dict(img_size=64), marks=pytest.mark.slow),
    pytest.param("halvit_tiny_patch16_224", dict(img_size=32), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,kw", TRACED)
def test_trace_equals_the_live_tensors_of_a_real_step(name, kw):
    """Each family: the replay on fake tensors against the live tensor storage tracked op by op in a real step
    of the same model (weights, buffers and input excluded in both): equal, for inference and for a training
    step's forward and backward (the AdamW phase is counted, not replayed; its count is checked above)."""
    torch.manual_seed(0)
    model = vitlab.create_model(name, **kw)
    chans = vitlab.get_model_config(name).input_size[0]
    x = torch.randn(4, chans, kw["img_size"], kw["img_size"])
    existing = [x, *model.parameters(), *model.buffers()]
    t = trace_activations(model, tuple(x.shape), "infer")
    model.eval()
    with LiveTensors(existing) as live, torch.inference_mode():
        model(x)
    assert t["peak_bytes"] == live.peak > 0
    t = trace_activations(model, tuple(x.shape), "train")
    model.train()
    with LiveTensors(existing) as live:
        out = model(x)
        logits = sum(out) / len(out) if isinstance(out, tuple) else out
        F.cross_entropy(logits, torch.zeros(4, dtype=torch.long)).backward()  # the target held by the graph only
    assert t["backward_phase"] == live.peak
    assert 0 < t["saved_bytes"] < live.peak


@pytest.mark.slow
def test_vit_b_batch64_inference_within_25_percent_of_the_analytic_estimate():
    """The measured CPU peak (fresh process, resident-set growth) of ViT-B inference at batch 64 lies within 25%
    of weights + input + the activation term; the weights-only M alone falls well short of it."""
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
