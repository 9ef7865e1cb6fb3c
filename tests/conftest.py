"""Shared test helpers: building the small ('smoke') instance of any registered model."""

from __future__ import annotations

import pytest
import torch

import vitlab


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def no_tf32():
    """True fp32 on a GPU, to compare with the CPU: cuBLAS and cuDNN may run fp32 as TF32 (10-bit mantissa)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def smoke_model(name: str, batch_size: int = 2, **kwargs) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model built with its config's ``smoke_kwargs`` (plus ``kwargs``) and a matching random input."""
    cfg = vitlab.get_model_config(name)
    kw = {**cfg.smoke_kwargs, **kwargs}
    model = vitlab.create_model(name, **kw)
    size = kw.get("img_size", cfg.input_size[1:])
    h, w = (size, size) if isinstance(size, int) else size
    x = torch.randn(batch_size, kw.get("in_chans", cfg.input_size[0]), h, w)
    return model, x


def as_logits(out) -> torch.Tensor:
    """A distilled model in train mode returns (cls_logits, dist_logits); reduce to one tensor."""
    return sum(out) / len(out) if isinstance(out, tuple) else out


def timm_pair(name: str, tmp_path, *, timm_name: str | None = None, timm_kwargs: dict | None = None,
              prepare=None, seed: int | None = 0, **kwargs):
    """A timm model (``timm_name``, default ``name``, built with ``timm_kwargs``, default ``kwargs``) with random
    weights, changed in place by ``prepare(ref)`` if given, and ours loaded from its state dict through
    ``create_model(name, checkpoint_path=..., **kwargs)``; both in eval mode."""
    timm = pytest.importorskip("timm")
    if seed is not None:
        torch.manual_seed(seed)
    ref = timm.create_model(timm_name or name, **(kwargs if timm_kwargs is None else timm_kwargs)).eval()
    if prepare is not None:
        prepare(ref)
    path = tmp_path / f"{name}.pth"
    torch.save(ref.state_dict(), path)
    ours = vitlab.create_model(name, checkpoint_path=str(path), **kwargs).eval()
    return ref, ours


def check_published_params(name: str, rel: float = 0.01) -> None:
    """The parameter count alone against the config's published one (built on meta: nothing runs)."""
    cfg = vitlab.get_model_config(name)
    with torch.device("meta"):
        n = sum(p.numel() for p in vitlab.create_model(name).parameters()) / 1e6
    assert n == pytest.approx(cfg.published_params_m, rel=rel)


def check_published(name: str, rel_params: float = 0.01, rel_gmacs: float = 0.01) -> None:
    """The profiled (meta-device) parameter count and GMACs of ``name`` match its config's published ones."""
    cfg = vitlab.get_model_config(name)
    prof = vitlab.profile_model(name)
    assert prof.params_m == pytest.approx(cfg.published_params_m, rel=rel_params)
    assert prof.gmacs == pytest.approx(cfg.published_gmacs, rel=rel_gmacs)
