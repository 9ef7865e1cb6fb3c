"""Counting: parameters, multiply-accumulates and activation memory of a model, without running it for real.

Convention: **GMACs**, one multiply-add = 1 (as fvcore and the papers report), for batch 1 unless asked. Linear
layers, convolutions, matrix products and fused attention (``scaled_dot_product_attention``, every backend)
are counted; element-wise ops, norms and softmax are not (they are < 0.5% of a ViT and the papers leave them
out). Counting runs on the ``meta`` device by default, so even ViT-G/14 (1.8B parameters) is profiled in
seconds without allocating its weights.

A model that takes more than an image says what one forward pass is given: ``model.profile_inputs(x)`` returns
the arguments (CLIP: the image and one full-context text, so both towers are counted).

The memory estimate of the article "Scaling ViTs across Training Compute" is given as well:
``M = P * 4 B / (32 / Q) * 1.2`` for weights at Q bits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_flop_count, shape_wrapper

from vitlab.layers.helpers import to_2tuple
from vitlab.registry import create_model, get_model_config

aten = torch.ops.aten


def _sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _deform_conv2d_flops(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """``torchvision::deform_conv2d`` as its convolution: k*k*C_in/groups MACs per output channel and position,
    the count of the deformable-conv papers (Dai et al., ICCV 2017; LITv2's ``flops()``); the bilinear
    sampling of the input is left out, as they leave it."""
    c_out, c_in_per_group, kh, kw = weight_shape
    batch, _, h, w = out_shape
    return 2 * batch * c_out * h * w * c_in_per_group * kh * kw


def _extra_formulas() -> dict:
    """Formulas torch lacks, handed to each counter (``custom_mapping``), never registered globally: the CPU
    flash kernel has none upstream, and without it fused attention would count as zero on CPU."""
    op = aten._scaled_dot_product_flash_attention_for_cpu
    return {} if op in flop_registry else {op: _sdpa_cpu_flops}


# Formulas for operators of libraries a model loads on first use (torchvision's, imported lazily because it
# takes seconds), matched by the operator's name when the counter first meets it.
_BY_NAME = {"torchvision::deform_conv2d": _deform_conv2d_flops}


class _Counter(FlopCounterMode):
    """:class:`FlopCounterMode` that also counts the operators of :data:`_BY_NAME`."""

    def _count_flops(self, func_packet, out, args, kwargs):
        formula = _BY_NAME.get(getattr(func_packet, "_qualified_op_name", ""))
        if formula is not None and func_packet not in self.flop_registry:
            self.flop_registry[func_packet] = shape_wrapper(formula)
        return super()._count_flops(func_packet, out, args, kwargs)


@dataclass
class ModelProfile:
    name: str
    input_size: tuple[int, int, int]
    batch_size: int
    params_m: float  # all parameters, millions
    trainable_params_m: float
    gmacs: float  # multiply-accumulates of one forward pass of the batch, billions
    activation_mb: float | None  # tensors saved for backward in one training forward pass (fp32); None: not asked
    weights_mb: float  # fp32 weights
    memory_estimate_gb: dict  # serving estimate M = P*4B/(32/Q)*1.2 for Q = 32, 16, 8, 4

    def to_dict(self) -> dict:
        return asdict(self)


def count_params(model: nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts; a Parameter used twice (HaLViT) counts once."""
    params = list(model.parameters())  # nn.Module.parameters() deduplicates shared tensors
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def memory_estimate_gb(num_params: int, bits: int = 32, overhead: float = 1.2) -> float:
    """GPU memory to serve a model, ``P * 4 bytes / (32 / Q) * 1.2`` in GB (1e9 bytes), the estimate of the
    article "Scaling ViTs across Training Compute"."""
    return num_params * 4 / (32 / bits) * overhead / 1e9


def _run(model, x: torch.Tensor):
    inputs = getattr(model, "profile_inputs", None)
    return model(*inputs(x)) if inputs is not None else model(x)


def count_macs(model: nn.Module, x: torch.Tensor) -> int:
    """Multiply-accumulates of ``model(x)`` (FLOP counter total / 2)."""
    with torch.no_grad(), _Counter(display=False, custom_mapping=_extra_formulas()) as counter:
        _run(model, x)
    return counter.get_total_flops() // 2


def _saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd saves for backward in one training forward (weights excluded)."""
    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key not in param_storages:
            seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())
        return t

    was_training = model.training
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _run(model, x.requires_grad_(False))
    finally:
        model.train(was_training)
    return sum(seen.values())


def profile_model(model_or_name: nn.Module | str, img_size=None, batch_size: int = 1, in_chans: int | None = None,
                  device: str | torch.device = "meta", activations: bool = True, **create_kwargs) -> ModelProfile:
    """Profile a model (instance or registered name) at ``img_size`` (default: the model's own input size).

    A name is built on ``device`` ('meta' by default: shapes only, no memory, no compute). An instance is
    profiled where its parameters live. ``activations=False`` skips the training forward that measures the
    activation memory (``activation_mb`` is then None).
    """
    if isinstance(model_or_name, str):
        name = model_or_name
        cfg = get_model_config(name)
        if img_size is not None:
            create_kwargs["img_size"] = img_size
        if in_chans is not None:
            create_kwargs["in_chans"] = in_chans
        with torch.device(device):
            model = create_model(name, **create_kwargs)
        default_size = cfg.input_size
    else:
        model = model_or_name
        name = type(model).__name__ if getattr(model, "pretrained_cfg", None) is None else model.pretrained_cfg.name
        default_size = model.pretrained_cfg.input_size if getattr(model, "pretrained_cfg", None) else (3, 224, 224)
    h, w = to_2tuple(img_size) if img_size is not None else default_size[1:]
    chans = in_chans or getattr(getattr(model, "patch_embed", None), "in_chans", None) or default_size[0]
    param_device = next(model.parameters()).device
    x = torch.zeros(batch_size, chans, h, w, device=param_device)
    total, trainable = count_params(model)
    model_was_training = model.training
    model.eval()
    try:
        macs = count_macs(model, x)
    finally:
        model.train(model_was_training)
    act = _saved_activation_bytes(model, x) if activations else None
    return ModelProfile(
        name=name, input_size=(chans, h, w), batch_size=batch_size, params_m=total / 1e6,
        trainable_params_m=trainable / 1e6, gmacs=macs / 1e9, activation_mb=None if act is None else act / 2**20,
        weights_mb=total * 4 / 2**20,
        memory_estimate_gb={q: round(memory_estimate_gb(total, q), 3) for q in (32, 16, 8, 4)})


def model_rows(pattern: str | list[str] = "*", task: str | None = None) -> list[dict]:
    """One row per registered model matching ``pattern`` (and ``task``, if given): name, family, task, params (M),
    GMACs at its default input size, input size, and the published figures — what ``vitlab models`` and the
    README table show."""
    from vitlab.registry import list_models

    rows = []
    for name in list_models(pattern, task=task):
        rows.append(profile_row(get_model_config(name), profile_model(name, activations=False)))
    return rows


def profile_row(cfg, prof: ModelProfile) -> dict:
    """One row of ``vitlab models``: a model's ModelConfig record beside its measured profile."""
    return {"name": cfg.name, "family": cfg.family, "task": cfg.task, "params_m": round(prof.params_m, 2),
            "gmacs": round(prof.gmacs, 3), "input_size": list(cfg.input_size),
            "published_params_m": cfg.published_params_m, "published_gmacs": cfg.published_gmacs,
            "published_top1": cfg.published_top1}
