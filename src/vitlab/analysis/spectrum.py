"""Frequency spectra of feature maps.

* :func:`frequency_magnitude` is Algorithm 1 of the LITv2 / HiLo supplementary (Section F): 2-D FFT of a
  (B, C, H, W) map, shifted so that the zero frequency sits at the centre, log of the amplitude, mean over the
  batch; the figures show the first 8 channels. Two deliberate details: the shift is over the two spatial axes
  (Algorithm 1's bare ``torch.fft.fftshift(x)`` also rolls the batch and channel axes by half, which only changes
  *which* eight channels are drawn: C/2 .. C/2 + 7 instead of 0 .. 7), and amplitudes are floored at 1e-12 before
  the log so that an exactly-zero frequency gives a finite number (a constant map is a single DC peak above
  a flat floor instead of -inf).
* :func:`hilo_spectra` applies it to the Hi-Fi and Lo-Fi outputs of a HiLo layer of any LITv2 (Figures II
  and III: Hi-Fi keeps high frequencies, Lo-Fi low ones), read by wrapping the layer's ``hifi`` / ``lofi``
  methods from outside for one forward.
* :func:`relative_log_amplitude` is the "MSAs are low-pass filters" measurement of Park & Kim, "How Do Vision
  Transformers Work?", ICLR 2022, Section 2.2 / Fig. 2(a): log amplitude of the 2-D FFT averaged over batch and
  channels, read along the half diagonal from the DC component towards the highest frequency (entry i is the
  frequency 2 pi i / H, the last one (H/2 - 1) / (H/2) pi for even H, as in their code), minus its DC value.
  :func:`block_spectra` does it for every block's output of any model.
"""

from __future__ import annotations

import contextlib
import math
import re

import torch
import torch.nn as nn

from vitlab.analysis._common import eval_forward, pick

NUM_PLOTS = 8  # Algorithm 1: num_plots = 8


def frequency_magnitude(x: torch.Tensor) -> torch.Tensor:
    """Algorithm 1 without the drawing: (B, C, H, W) -> (C, H, W) batch-mean of log |fftshift(fft2(x))|."""
    if x.dim() != 4:
        raise ValueError(f"frequency_magnitude takes (batch, channels, height, width) maps, got {tuple(x.shape)}")
    f = torch.fft.fftshift(torch.fft.fft2(x.float()), dim=(-2, -1))
    return torch.log(f.abs().clamp_min(1e-12)).mean(dim=0)


def relative_log_amplitude(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (H - H // 2,) Park & Kim's relative log amplitude on the half diagonal: entry i at the
    frequency 2 pi i / H (the DC component first, 0 by construction)."""
    if x.dim() != 4 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"relative_log_amplitude takes square (B, C, H, W) maps, got {tuple(x.shape)}")
    h = x.shape[-1]
    f = torch.log(torch.fft.fft2(x.float()).abs() + 1e-6)  # Park & Kim's code: log(|F| + 1e-6)
    f = torch.roll(f, shifts=(h // 2, h // 2), dims=(2, 3)).mean(dim=(0, 1))  # DC to the centre
    diag = f.diagonal()[h // 2:]
    return diag - diag[0]


def find_hilo(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from vitlab.attention.hilo import HiLo

    return [(n, m) for n, m in model.named_modules() if isinstance(m, HiLo)]


@contextlib.contextmanager
def _hilo_recording(m: nn.Module, out: dict):
    """Wrap one HiLo layer's ``hifi`` and ``lofi`` (instance attributes, removed afterwards) to keep their
    outputs as (B, C, H, W) maps."""
    def hifi(qkv, H, W):
        o = type(m).hifi(m, qkv, H, W)
        out["hifi"] = m.place_hifi(None, o, H, W).permute(0, 3, 1, 2).detach()
        return o

    def lofi(x, q=None):
        o = type(m).lofi(m, x, q)
        out["lofi"] = o.permute(0, 3, 1, 2).detach()
        return o

    m.hifi, m.lofi = hifi, lofi
    try:
        yield
    finally:
        del m.hifi, m.lofi


def hilo_spectra(model: nn.Module, x: torch.Tensor, layer: int = -1) -> dict:
    """Figures II-III: the Algorithm 1 magnitude (first 8 channels) of the Hi-Fi and Lo-Fi outputs of the
    ``layer``-th HiLo layer that has both branches (default: the last, i.e. the end of LITv2's stage 3).

    Returns {'layer', 'grid', 'num_images', 'hifi' (8, H, W), 'lofi' (8, H, W), 'hifi_channels', 'lofi_channels',
    'high_minus_low': per branch, mean magnitude of the outer half of frequencies minus the inner half}."""
    layers = [(n, m) for n, m in find_hilo(model) if m.h_heads > 0 and m.l_heads > 0]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no HiLo layer with both Hi-Fi and Lo-Fi heads; models with "
                         f"one: litv2_s, litv2_m, litv2_b")
    name, m = pick(layers, layer, "HiLo layer", "HiLo layers with both branches")
    rec: dict = {}
    eval_forward(model, x, _hilo_recording(m, rec))
    out = {"layer": name, "grid": list(rec["hifi"].shape[-2:]), "num_images": x.shape[0]}
    for branch in ("hifi", "lofi"):
        mag = frequency_magnitude(rec[branch])
        out[branch] = mag[:NUM_PLOTS]
        out[f"{branch}_channels"] = rec[branch].shape[1]
        out[f"{branch}_high_minus_low"] = high_minus_low(mag)
    return out


def high_minus_low(mag: torch.Tensor) -> float:
    """Mean centred log magnitude (C, H, W) at radii above half the Nyquist radius minus the mean below it: > 0
    where a map keeps relatively more high frequencies (a one-number summary of Figures II-III)."""
    H, W = mag.shape[-2:]
    yy, xx = torch.meshgrid(torch.arange(H) - H // 2, torch.arange(W) - W // 2, indexing="ij")
    r = (yy.float() ** 2 + xx.float() ** 2).sqrt()
    edge = min(H, W) / 4
    mag = mag - mag[:, H // 2, W // 2][:, None, None]  # relative to each channel's DC
    return float(mag[:, r > edge].mean() - mag[:, (r <= edge) & (r > 0)].mean())


_BLOCK = re.compile(r"(^|\.)blocks\.\d+$")


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module called ``blocks.<i>`` (the transformer / conv blocks of every family), in module order."""
    return [(n, m) for n, m in model.named_modules() if _BLOCK.search(n)]


def _as_map(y: torch.Tensor, num_prefix: int) -> torch.Tensor | None:
    """A block output as (B, C, H, W): tokens (B, N, C) with prefix tokens dropped (square grids), NCHW maps
    as they are, NHWC maps (Swin) transposed. None for an output that is no square spatial map."""
    if isinstance(y, (tuple, list)):
        y = y[0]
    if y.dim() == 3:
        for k in dict.fromkeys((num_prefix, 0)):  # the model's prefix tokens; blocks of patches alone (CaiT, PVT)
            s = math.isqrt(max(y.shape[1] - k, 0))
            if s * s == y.shape[1] - k:
                return y[:, k:].transpose(1, 2).reshape(y.shape[0], y.shape[2], s, s)
        return None
    if y.dim() == 4:
        if y.shape[-1] == y.shape[-2]:
            return y
        if y.shape[1] == y.shape[2]:
            return y.permute(0, 3, 1, 2)
    return None


def block_spectra(model: nn.Module, x: torch.Tensor) -> dict:
    """Park & Kim's relative log amplitude of every block's output (forward hooks, removed afterwards).

    Returns {'blocks': [{'name', 'grid', 'channels', 'curve' (list; entry i at 2 pi i / H), 'high' (the last
    entry, the highest frequency)}]}."""
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no modules named blocks.<i> to read")
    prefix = int(getattr(model, "num_prefix_tokens", 0) or 0)
    outs: list[tuple[str, torch.Tensor]] = []
    handles = [m.register_forward_hook(lambda mod, inp, y, n=n: outs.append((n, y))) for n, m in blocks]
    try:
        eval_forward(model, x)
    finally:
        for h in handles:
            h.remove()
    rows = []
    for name, y in outs:
        fmap = _as_map(y, prefix)
        if fmap is None or fmap.shape[-1] < 4:  # fewer than 2 frequencies on the half diagonal
            continue
        curve = relative_log_amplitude(fmap)
        rows.append(dict(name=name, grid=list(fmap.shape[-2:]), channels=fmap.shape[1],
                         curve=[round(float(v), 5) for v in curve], high=round(float(curve[-1]), 5)))
    if not rows:
        raise ValueError(f"no block of {type(model).__name__} gives a square spatial map to transform")
    return {"blocks": rows}
