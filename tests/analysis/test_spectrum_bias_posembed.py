"""Spectra (LITv2 / HiLo supplementary, Algorithm 1; Park & Kim's relative log amplitude), LeViT / EfficientFormer
bias maps (LeViT supplementary, Figure 1) and position-embedding similarity (ViT, Dosovitskiy et al., 2021, Fig. 7)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vitlab
from tests.conftest import smoke_model
from vitlab.analysis.bias import bias_maps
from vitlab.analysis.posembed import cosine_similarity_grid, find_pos_embeds, posembed_similarity
from vitlab.analysis.spectrum import (
    block_spectra,
    find_hilo,
    frequency_magnitude,
    hilo_spectra,
    relative_log_amplitude,
)
from vitlab.layers import sincos_2d_pos_embed


def test_constant_image_spectrum_is_a_single_dc_peak():
    mag = frequency_magnitude(torch.full((3, 5, 14, 14), 0.7))
    centre = (7, 7)  # fftshift puts the zero frequency at (H // 2, W // 2)
    for c in range(5):
        m = mag[c]
        assert m.argmax() == centre[0] * 14 + centre[1]
        assert math.isclose(m[centre].item(), math.log(0.7 * 196), rel_tol=1e-5)  # DC = sum of the map
        rest = torch.cat([m.flatten()[: 7 * 14 + 7], m.flatten()[7 * 14 + 8:]])
        assert (rest < m[centre] - 15).all()  # every other amplitude is below 1e-6 of DC: fp32 rounding of zero


def test_algorithm1_literal_restatement():
    """Algorithm 1's code: its bare fftshift also rolls batch and channels by half; spatially it is ours."""
    x = torch.randn(4, 16, 14, 14)
    literal = torch.log(torch.abs(torch.fft.fftshift(torch.fft.fft2(x.float())))).mean(dim=0)
    ours = frequency_magnitude(x)
    torch.testing.assert_close(literal, torch.roll(ours, 8, dims=0), atol=1e-4, rtol=1e-5)


def test_cosine_wave_peaks_at_its_frequency():
    k = 3
    yy, xx = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    x = torch.cos(2 * math.pi * k * xx / 16).float()[None, None]
    mag = frequency_magnitude(x)[0]
    top2 = set(mag.flatten().topk(2).indices.tolist())
    assert top2 == {8 * 16 + 8 + k, 8 * 16 + 8 - k}


def test_relative_log_amplitude_literal():
    """Park & Kim's fourier_analysis code, restated: log(|F|+1e-6), roll by half, batch/channel mean, half diagonal,
    minus the DC value."""
    x = torch.randn(2, 6, 8, 8)
    f = torch.fft.fft2(x).abs().add(1e-6).log()
    f = torch.roll(f, shifts=(4, 4), dims=(2, 3)).mean(dim=(0, 1))
    ref = f.diag()[4:]
    torch.testing.assert_close(relative_log_amplitude(x), ref - ref[0])
    smooth = F.avg_pool2d(F.pad(x, (1, 1, 1, 1), mode="circular"), 3, 1)  # a low-pass filter lowers high freqs
    assert relative_log_amplitude(smooth)[-1] < relative_log_amplitude(x)[-1] - 1


def test_hilo_branches_are_the_layer_output():
    """The recorded Hi-Fi / Lo-Fi maps are the two channel groups of the HiLo layer's own output."""
    model = vitlab.create_model("litv2_s", img_size=64, depths=(1, 1, 1, 1), embed_dim=32, num_heads=(1, 2, 4, 8))
    x = torch.randn(2, 3, 64, 64)
    name, hilo = [(n, m) for n, m in find_hilo(model) if m.h_heads and m.l_heads][-1]
    seen = []
    hilo.register_forward_hook(lambda mod, inp, out: seen.append((out, inp[1])))
    r = hilo_spectra(model, x)
    out, (H, W) = seen[0]
    fmap = out.transpose(1, 2).reshape(2, -1, H, W)
    assert r["layer"] == name and r["grid"] == [H, W]
    torch.testing.assert_close(r["hifi"], frequency_magnitude(fmap[:, : hilo.h_dim])[:8])
    torch.testing.assert_close(r["lofi"], frequency_magnitude(fmap[:, hilo.h_dim:])[:8])
    assert "hifi" not in vars(hilo) and "lofi" not in vars(hilo)  # unpatched afterwards
    with pytest.raises(ValueError, match="no HiLo layer.*litv2_s"):
        hilo_spectra(smoke_model("deit_tiny_patch16_224")[0], torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="out of range"):
        hilo_spectra(model, x, layer=5)


@pytest.mark.parametrize("name,kw", [
    ("vit_pico_patch4_32", {}),
    ("swin_tiny_patch4_window7_224", dict(img_size=32, window_size=4, depths=(2, 2), num_heads=(3, 6), embed_dim=48)),
    ("cait_xxs24_224", {}),
])
def test_block_spectra_any_model(name, kw):
    model, x = smoke_model(name, **kw)
    rows = block_spectra(model, x)["blocks"]
    assert rows and all(r["curve"][0] == 0.0 and len(r["curve"]) == r["grid"][0] - r["grid"][0] // 2 for r in rows)


def _random_biases(model):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "attention_biases" in n:
                p.normal_(0, 3)
    return model


@pytest.mark.parametrize("name", ["levit_128s", "efficientformer_l1"])
def test_bias_maps_equal_the_gathered_bias(name):
    model = _random_biases(smoke_model(name)[0])
    r = bias_maps(model)
    mods = dict(model.named_modules())
    for lay in r["layers"]:
        m = mods[lay["name"]]
        full = m.get_attention_biases().detach()  # (heads, Nq, Nk), what the model adds to its logits
        H, W = lay["resolution"]
        s = lay["query_stride"]
        qy, qx = torch.meshgrid(torch.arange(0, H, s), torch.arange(0, W, s), indexing="ij")
        ky, kx = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
        dy = (qy.reshape(-1, 1) - ky.reshape(1, -1)).abs()
        dx = (qx.reshape(-1, 1) - kx.reshape(1, -1)).abs()
        torch.testing.assert_close(lay["maps"][:, dy, dx], full)  # every (query, key) pair, by offset
        torch.testing.assert_close(lay["maps"].flatten(1), full[:, 0])  # the top-left query's row
        assert lay["std"] == pytest.approx(lay["maps"].flatten(1).std(1, correction=0).tolist())
        assert lay["range"] == [pytest.approx(float(lay["maps"].min())), pytest.approx(float(lay["maps"].max()))]


def test_bias_on_a_model_without_it():
    with pytest.raises(ValueError, match="no attention bias.*levit"):
        bias_maps(smoke_model("vit_pico_patch8_32")[0])


def test_posembed_similarity():
    model = vitlab.create_model("vit_pico_patch4_32", pos_embed="sincos")  # 8x8 grid, class token
    r = posembed_similarity(model)
    assert r["grid"] == [8, 8] and r["prefix"] == 1 and r["kind"] == "fixed"
    ref = F.cosine_similarity(sincos_2d_pos_embed((8, 8), 64)[:, None], sincos_2d_pos_embed((8, 8), 64)[None], -1)
    torch.testing.assert_close(r["similarity"].reshape(64, 64), ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(r["similarity"][3, 5, 3, 5], torch.tensor(1.0))
    assert r["neighbour_mean"] > r["far_mean"]  # sin-cos: near positions are alike
    learned = vitlab.create_model("deit_tiny_distilled_patch16_224", img_size=64, depth=1)
    (_, pos, prefix, grid), = find_pos_embeds(learned)
    assert prefix == 2 and grid == (4, 4)
    torch.testing.assert_close(cosine_similarity_grid(pos, grid, prefix).reshape(16, 16),
                               F.normalize(pos[0, 2:], dim=-1) @ F.normalize(pos[0, 2:], dim=-1).t())
    with pytest.raises(ValueError, match="no position embedding.*vit_"):
        posembed_similarity(smoke_model("swin_tiny_patch4_window7_224")[0])
