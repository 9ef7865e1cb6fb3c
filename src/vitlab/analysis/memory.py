"""Memory: a weights-only estimate against a measured peak, and the attention-complexity table of ViT.

* The article "Scaling ViTs across Training Compute" ("Choosing the right GPU"): ``M = P * 4 B / (32 / Q) * 1.2``,
  P parameters, 4 bytes a parameter at 32 bits, Q the bits a parameter is loaded with (32, 16, 8, 4), 1.2 for 20%
  overhead (:func:`vitlab.profile.memory_estimate_gb`). :func:`measure_memory` puts it beside what a real run takes:
  on the CPU the growth of the process's peak resident set (Linux ``VmHWM``, reset through
  ``/proc/self/clear_refs``) from just before the model is built to the end of the step, on CUDA
  ``torch.cuda.max_memory_allocated`` over the same span; for inference (``torch.inference_mode``) and for a
  training step (forward, cross-entropy, backward, AdamW step) at a given batch. fp32 is Q = 32, bf16 weights
  are Q = 16; vitlab has no 8- / 4-bit weights, so those two rows are estimates only.
* Attention complexity (ViT, Dosovitskiy et al., 2021): tokens N = (img / patch)^2 and N^2
  attention scores per head at 224 / 384 / 512 / 1024; :func:`complexity_table` adds, for a model of width D
  with h heads, the attention MACs of one layer (``QK^T`` and ``AV``: 2 N^2 D) and the memory of one layer's
  attention maps (h N^2 fp32 values) when they are materialised.
* That M counts the weights only. :func:`activation_estimate` adds what a forward (and a training step)
  keeps alive besides them, derived from the architecture of a plain ViT / DeiT (pre-norm ``msa`` + GELU ``Mlp``
  blocks, :class:`vitlab.attention.block.Block`), with no constant fitted to a measurement. Units, at batch B, N
  tokens (patches + prefix tokens), width D, MLP width F, h heads, b bytes an element: ``U = B N D b`` (one
  residual-stream tensor), ``Hf = B N F b`` (one MLP hidden tensor), ``S = B h N^2 b`` (one layer's attention
  maps). The counts follow who holds a reference in vitlab's code (PyTorch frees a tensor when its last
  reference goes; ``nn.Module.__call__`` keeps its arguments until ``forward`` returns):

  - **inference** (no autograd): ``U`` (the blocks' input, kept by ``forward_features`` for the whole loop)
    plus the largest set alive inside one block, the larger of its MLP phase ``3 U + 2 Hf`` (block input,
    ``x1 = x + y``, ``norm2(x1)``, then ``fc1``'s output and GELU's output together; the attention output
    ``y`` is gone with the attention step that made ``x1``) and its attention phase: ``7 U`` when SDPA's chosen
    kernel is flash (the map is never materialised: block input, ``norm1``, ``qkv`` 3 U, the heads' output,
    the projection; the log-sum-exp, ``B h N`` fp32, lives only inside the SDPA op, when less is alive),
    ``6 U + S + max(U, S)`` when it is the math kernel (scaled queries and keys, then the scores and their
    softmax alive together). ViT-B, B = 64, fp32, flash: ``12 U`` = 0.47 GB. The patch embedding (at most
    3 U) and the head (B x classes) are smaller and do not set the peak.
  - **training step** (forward, cross-entropy, backward, AdamW; the first step, so AdamW's two moments are
    created in it): the larger of (a) the start of the backward pass, weights + input + every saved
    activation ``A`` + the gradients that exist by the last block's GELU backward (head, final norm, that
    block's ``fc2``) + its transient ``U + Hf`` (the residual-stream gradient, and the GELU input's gradient
    replacing the GELU output that ``fc2``'s backward released); checked again at the first block, after
    ``L - 1`` blocks have traded their saved activations for their gradients; and (b) the optimizer step,
    weights + input + gradients (W) + both moments (2 W, and a float32 step count a parameter tensor) + the
    step's temporaries (on the CPU PyTorch's
    AdamW loops over the parameters: ``sqrt(v)`` and its quotient alive at once, 2 x the largest parameter;
    on CUDA its multi-tensor path: one weight-sized ``sqrt(v)`` list). Saved per block: block input, its
    norm, ``qkv`` (3 U), the attention output, ``x1``, its norm (8 U), ``fc1``'s and GELU's outputs (2 Hf),
    the two LayerNorms' float mean and rstd, and flash's log-sum-exp (math kernel instead: scaled q and k
    (2 U) and the softmax (S)); after the blocks, with class-token pooling, the final norm's input and
    output (the head holds a view of it), with mean pooling only the pooled (B, D) tensor and its norm.
    ViT-B: ``16 U`` a block, ``194 U`` in all. (The math-kernel
    terms of a training step are derived from what its autograd graph saves, not measured; the replay below,
    which equals the live tensors of a real step, finds about 2 U a block less there, so for the math kernel in
    training :func:`trace_activations` is the figure to trust.)

  What it leaves out: logits and loss (B x classes), the attention kernels' per-thread scratch, LayerNorm
  statistics at inference (each under 1% at the sizes in docs/analysis.md), and the code pages and kernel
  state a first forward maps (a constant of a few tens of MB on the CPU). :func:`measure_memory` reports the
  allocator-independent peak of live tensor storage as well (``tensor_peak_gb``, tracked op by op), so a
  difference from the resident-set peak splits into formula error and allocator / library overhead.
* Every other family (Swin, CaiT, PVT, LITv2, LeViT, MobileViT, EfficientFormer, HaLViT, ...) mixes
  windows, class-attention, spatial reduction, convolutions and BatchNorm; rather than one formula each,
  :func:`trace_activations` derives the term for any model from its own code: one step replayed on fake
  tensors (``FakeTensorMode``: shapes, dtypes and devices, no storage, so the kernels a real run would pick,
  and nothing allocated at any batch), counting the storages that stay referenced between ops, and, for a
  training step, what autograd saves, by block. It is the activation term :func:`measure_memory` reports for
  every model that is not a plain ViT (``activation_gb``); for a plain ViT, where the closed form above is
  reported, the replay runs beside it (``traced_gb``) and agrees (equal at inference, within 1% for a training
  step with the flash kernel, which the tests check); for every family it equals the live tensors of a real
  step (tested on small configurations). Like the
  closed form it leaves out a kernel's internal scratch (on the CPU, e.g., oneDNN's convolution workspace),
  the allocator's overhead, and the constant code pages and kernel state.
"""

from __future__ import annotations

import gc
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

BITS = (32, 16, 8, 4)
COMPLEXITY_SIZES = (224, 384, 512, 1024)  # the image sizes of the attention-complexity table
# N^2 in millions per size, printed to two decimals: what the table is checked against
REFERENCE_SCORES_M = {224: 0.04, 384: 0.33, 512: 1.05, 1024: 16.78}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"/proc/self/status has no {field}")


def _reset_cpu_peak() -> int:
    """Reset the peak RSS (``VmHWM``) to the current RSS; returns the current RSS in bytes."""
    if not os.path.exists("/proc/self/clear_refs"):
        raise ValueError("measuring the CPU peak needs Linux's /proc/self/clear_refs (VmHWM reset); use --device "
                         "cuda, or estimates only")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # 5: reset the peak resident set size to the current one (Linux >= 4.0)
    return _status_kb("VmRSS") * 1024


class LiveTensors(TorchDispatchMode):
    """Peak bytes of tensor storage alive between ops, counting only storages created inside the ``with``
    (weights, buffers and the input given in ``existing`` are not): the allocator-independent side of a
    measurement. Storage that one op allocates and frees inside itself (a kernel's scratch, the math SDPA
    kernel's maps, which dispatch shows as one op) is not seen."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        # keyed by the storage object (its StorageImpl), not its data pointer: fake and meta tensors have none
        self._skip = {t.untyped_storage()._cdata for t in existing}
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}  # before: addresses get reused
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self._skip and key not in self._live:
                    self._live[key] = (StorageWeakRef(st), st.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self._live.values()))
        return out


def _step(model: nn.Module, x: torch.Tensor, mode: str):
    if mode == "infer":
        model.eval()

        def infer():
            with torch.inference_mode():
                model(x)
        return infer
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    target = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)

    def train():
        out = model(x)
        logits = sum(out) / len(out) if isinstance(out, tuple) else out  # distilled models: two heads
        F.cross_entropy(logits.float(), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return train


SDPA_CHOICES = ("auto", "math")


def _sdpa_context(sdpa: str):
    """'auto': PyTorch's own SDPA kernel choice; 'math': the math kernel forced (it materialises the maps)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH) if sdpa == "math" else contextlib.nullcontext()


def _check(mode: str, dtype: str, device: str = "cpu", sdpa: str = "auto") -> None:
    if sdpa not in SDPA_CHOICES:
        raise ValueError(f"sdpa must be one of {', '.join(SDPA_CHOICES)}, got {sdpa!r}")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    if mode not in ("infer", "train"):
        raise ValueError(f"mode must be 'infer' or 'train', got {mode!r}")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be fp32 or bf16 (Q = 32 or 16), got {dtype!r}")


def measure_memory(name: str, batch_size: int = 64, mode: str = "infer", device: str = "cpu",
                   dtype: str = "fp32", img_size: int | None = None, sdpa: str = "auto", **create_kwargs) -> dict:
    """Build ``name`` on ``device`` and run one ``mode`` step ('infer' or 'train') at ``batch_size``; return the
    measured peak growth beside the weights-only estimate, and ``loaded_gb``, the growth once the model and the input
    batch are in memory, before the step (what the estimate's "loading" covers); the live-tensor peak
    (``tensor_peak_gb``) and weights + input + the activation term (``analytic_gb``, :func:`analytic_memory`,
    traced on a 'meta' copy before the measured span). ``sdpa='math'`` forces SDPA's math kernel for the step
    and the term. Random-init weights (memory does not depend on the values)."""
    import vitlab
    from vitlab.profile import count_params, memory_estimate_gb

    _check(mode, dtype, device, sdpa)
    dev = torch.device(device)
    cfg = vitlab.get_model_config(name)
    size = img_size or cfg.input_size[1]
    if img_size is not None:
        create_kwargs["img_size"] = img_size
    tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    with torch.device("meta"):  # the estimate first, outside the measured span: its imports take memory too
        shape_only = vitlab.create_model(name, **create_kwargs).to(tdtype)
    with _sdpa_context(sdpa):
        act = analytic_memory(shape_only, batch_size, mode, tdtype, device, (cfg.input_size[0], size, size))
    del shape_only
    with LiveTensors([]):  # its first use imports dispatch machinery (tens of MB): not the step's memory
        torch.ones(2, device=dev) + 1
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        base = _reset_cpu_peak()
    x = torch.randn(batch_size, cfg.input_size[0], size, size, device=dev, dtype=tdtype)
    with torch.device(dev):
        model = vitlab.create_model(name, **create_kwargs).to(tdtype)
    if dev.type == "cuda":
        loaded = torch.cuda.memory_allocated(dev) - base
    else:
        loaded = _status_kb("VmRSS") * 1024 - base
    existing = [x, *model.parameters(), *model.buffers()]
    step = _step(model, x, mode)
    with _sdpa_context(sdpa), LiveTensors(existing) as live:
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
    else:
        peak = _status_kb("VmHWM") * 1024 - base
    params = count_params(model)[0]
    input_bytes = x.numel() * x.element_size()
    q = 32 if dtype == "fp32" else 16
    weights = params * (q // 8)
    del model, x, step, existing
    est = {b: memory_estimate_gb(params, b) for b in BITS}
    r = {"model": name, "mode": mode, "device": device, "dtype": dtype, "sdpa": sdpa, "batch_size": batch_size,
         "img_size": size, "params": params, "weights_gb": weights / 1e9, "input_gb": input_bytes / 1e9,
         "loaded_gb": loaded / 1e9, "measured_peak_gb": peak / 1e9,
         "tensor_peak_gb": (weights + input_bytes + live.peak) / 1e9,
         "estimate_gb": est, "estimate_at_dtype_gb": est[q], "measured_over_estimate": peak / 1e9 / est[q], **act}
    if act["activation_gb"] is not None:
        total = weights + input_bytes + act["activation_gb"] * 1e9
        r.update(analytic_gb=total / 1e9, measured_over_analytic=peak / total)
    return r


def analytic_memory(model: nn.Module, batch_size: int, mode: str, dtype: torch.dtype = torch.float32,
                    device: str = "cpu", input_size: tuple[int, int, int] | None = None) -> dict:
    """The activation term of any model, in GB (``activation_gb``): for a plain ViT / DeiT the closed form
    :func:`activation_estimate` (``activation_source`` 'closed form'; its terms in ``activation_terms_gb``), for
    any other model :func:`trace_activations`, one step replayed on fake tensors ('traced'). The replay runs for
    a ViT too (``traced_gb``, ``activation_trace``: where the peak is, what each block saved): the two agree,
    which the tests check. ``input_size`` (C, H, W) defaults to the model's own. ``activation_gb`` None and the
    reason in ``activation_note`` where the replay cannot run."""
    input_size = input_size or _model_input_size(model)
    try:
        trace = trace_activations(model, (batch_size, *input_size), mode, dtype, device)
    except (RuntimeError, NotImplementedError) as e:  # a forward that needs values (.item()) cannot be replayed
        return {"activation_gb": None, "activation_note": f"the fake-tensor replay of {type(model).__name__} "
                                                          f"failed: {type(e).__name__}: {str(e).splitlines()[0]}"}
    r = {"traced_gb": trace["peak_bytes"] / 1e9, "activation_trace": {
        k: {u: n / 1e9 for u, n in v.items()} if isinstance(v, dict) else v / 1e9 if isinstance(v, int) else v
        for k, v in trace.items()}}
    try:
        shape = block_shape(model, training=mode == "train")
    except ValueError as e:
        return {**r, "activation_gb": r["traced_gb"], "activation_source": "traced", "closed_form_note": str(e)}
    kernel, materialised = sdpa_kernel_choice(dtype, device, shape.heads, shape.dim // shape.heads)
    terms = activation_estimate(shape, batch_size, mode, torch.finfo(dtype).bits // 8, materialised, device)
    return {**r, "activation_gb": terms["peak_bytes"] / 1e9, "activation_source": "closed form",
            "sdpa_kernel": kernel, "attention_map_materialised": materialised, "block_shape": asdict(shape),
            "activation_terms_gb": {k: v / 1e9 for k, v in terms.items()}}


def _model_input_size(model: nn.Module) -> tuple[int, int, int]:
    """(C, H, W) a model was built for: its ``in_chans`` and ``img_size`` (or its patch embedding's)."""
    size = getattr(model, "img_size", None) or getattr(getattr(model, "patch_embed", None), "img_size", None)
    if size is None:
        raise ValueError(f"{type(model).__name__} does not say its input size: pass input_size")
    h, w = (size, size) if isinstance(size, int) else size
    return getattr(model, "in_chans", 3), int(h), int(w)


def _unit(path: str, model: nn.Module) -> str:
    """The top-level part of ``model`` a module path belongs to: ``blocks.3`` for an entry of a ModuleList /
    Sequential child (blocks, stages, layers), else the child's name (``patch_embed``, ``head``)."""
    parts = path.split(".")
    child = getattr(model, parts[0], None) if parts[0] else None
    if len(parts) > 1 and isinstance(child, (nn.ModuleList, nn.Sequential)):
        return ".".join(parts[:2])
    return parts[0] or "(model)"


class _LocatedLiveTensors(LiveTensors):
    """:class:`LiveTensors` that also records where its peak happened (``where()`` at that op)."""

    def __init__(self, existing: list[torch.Tensor], where):
        super().__init__(existing)
        self._where = where
        self.peak_at = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.peak
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.peak > before:
            self.peak_at = self._where()
        return out


def trace_activations(model: nn.Module, input_shape: tuple[int, ...], mode: str, dtype: torch.dtype = torch.float32,
                      device: str = "cpu") -> dict:
    """The activation term of any model, in bytes, from one step replayed on fake tensors.

    ``model`` (built on any device, 'meta' included: only shapes are read) runs one inference forward
    (``mode='infer'``) or forward + cross-entropy + backward (``'train'``) under PyTorch's ``FakeTensorMode``:
    its weights, buffers and input are replaced (``torch.func.functional_call``) by fake ``device`` tensors,
    which carry shape, dtype, stride and device but no storage, so every op dispatches to the kernel a real run
    on ``device`` would use (SDPA's flash kernel on the CPU, say) and nothing is allocated, at any batch. Its
    code runs as written, so the Python references that keep a tensor alive (a module's arguments until it
    returns, a local until it is rebound, autograd's saved tensors until their backward) act as in the real
    step; :class:`LiveTensors` counts the storages alive between ops. Returned (bytes unless named otherwise):

    - ``peak_bytes``: the activation term. Inference: the peak of live storage besides weights, buffers and
      input. Training: the larger of that peak over forward and backward (``backward_phase``: saved activations,
      the gradients made so far, the backward's transients) and the AdamW step (``step_phase``,
      :func:`adamw_step_bytes`: gradients, both moments, the step's temporaries; the replay stops before it).
    - ``peak_at``: the module running when the peak was reached (its dotted path, or 'backward').
    - ``saved_bytes`` and ``saved_by_unit``: training only; what autograd saved for the backward (distinct
      storages, weights and input excluded), in all and by the top-level part of the model that saved it first
      (``blocks.3``, ``stages.1``, ``patch_embed``): what each block keeps alive for the backward.

    Not seen, as in :class:`LiveTensors`: storage a kernel allocates and frees inside one op (its scratch; on
    the CPU, e.g., oneDNN's convolution workspace), and the allocator's own overhead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if mode not in ("infer", "train"):
        raise ValueError(f"mode must be 'infer' or 'train', got {mode!r}")
    dev = torch.device(device)
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    # the dotted paths of the module calls in progress; through the global hooks (for the replay only), since a
    # hook on a module can change its path (PatchEmbed runs a hooked projection as a conv, not as its GEMM)
    paths = {id(m): p for p, m in model.named_modules() if p}
    stack: list[str] = []

    def enter(m, _a) -> None:
        if id(m) in paths:
            stack.append(paths[id(m)])

    def leave(m, _a, _o) -> None:  # returns None: a forward hook's return value would replace the output
        if id(m) in paths:
            stack.pop()

    hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    saved: dict[int, tuple[str, int]] = {}
    # a module may cache tensors in plain attributes (Swin's window masks): the replay must neither use a real
    # cache (it would not be counted, nor rebuilt) nor leave fake ones behind, so each module's own attributes
    # are set aside and put back afterwards (dicts copied, as a cache may be filled in place)
    internal = set(vars(nn.Module()))
    state = [(m, {k: v.copy() if type(v) is dict else v for k, v in vars(m).items() if k not in internal})
             for m in model.modules()]
    was_training = model.training
    try:
        for m, own in state:
            for k, v in own.items():
                if type(v) is dict and any(isinstance(t, torch.Tensor) for t in tree_flatten(v)[0]):
                    setattr(m, k, {})  # a cache of tensors starts empty, as in a fresh model
        with FakeTensorMode(allow_non_fake_inputs=True):  # other real tensors (constants) are read as fake
            def fake(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
                return torch.empty_strided(t.shape, t.stride(), dtype=dt, device=dev)

            params = {k: fake(p, p.dtype).requires_grad_(p.requires_grad) for k, p in model.named_parameters()}
            buffers = {k: fake(b, b.dtype) for k, b in model.named_buffers()}
            x = torch.empty(input_shape, dtype=dtype, device=dev)
            existing = [x, *params.values(), *buffers.values()]
            skip = {t.untyped_storage()._cdata for t in existing}

            def pack(t: torch.Tensor):
                key = t.untyped_storage()._cdata
                if key not in skip and key not in saved:
                    saved[key] = (_unit(stack[-1] if stack else "", model), t.untyped_storage().nbytes())
                return t

            model.train(mode == "train")
            live = _LocatedLiveTensors(existing, lambda: stack[-1] if stack else "backward")
            with live:
                if mode == "infer":
                    # no_grad, not inference_mode: the same tensors live, but a composite op (SDPA's math
                    # kernel) is then seen as the ops it runs, its N x N maps included, not as one opaque op
                    with torch.no_grad():
                        torch.func.functional_call(model, {**params, **buffers}, (x,))
                else:
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        out = torch.func.functional_call(model, {**params, **buffers}, (x,))
                    logits = sum(out) / len(out) if isinstance(out, tuple) else out  # distilled: two heads
                    # the target inline: its last reference is then the loss's graph, as in a training loop
                    F.cross_entropy(logits.float(), torch.zeros(len(logits), dtype=torch.long, device=dev)).backward()
    finally:
        for h in hooks:
            h.remove()
        for m, own in state:
            for k in set(vars(m)) - internal - set(own):
                delattr(m, k)
            for k, v in own.items():
                setattr(m, k, v)
        model.train(was_training)
    if mode == "infer":
        return {"peak_bytes": live.peak, "peak_at": live.peak_at}
    by_unit: dict[str, int] = {}
    for unit, n in saved.values():
        by_unit[unit] = by_unit.get(unit, 0) + n
    ps = list(model.parameters())
    step = adamw_step_bytes(sum(p.numel() for p in ps), max(p.numel() for p in ps), len(ps),
                            torch.finfo(dtype).bits // 8, device)["step_phase"]
    return {"peak_bytes": max(live.peak, step), "peak_at": live.peak_at if live.peak >= step else "AdamW step",
            "backward_phase": live.peak, "step_phase": step, "saved_bytes": sum(by_unit.values()),
            "saved_by_unit": by_unit}


def adamw_step_bytes(params: int, largest: int, tensors: int, bytes_per: int = 4, device: str = "cpu") -> dict:
    """Bytes alive in the first AdamW step besides weights and input, for ``params`` parameters in ``tensors``
    tensors, the largest of ``largest``: the gradients (``gradients``, W), exp_avg and exp_avg_sq and a float32
    step count a tensor (``adamw_state``, 2 W + 4 B a tensor), and the step's temporaries
    (``step_temporaries``: on the CPU PyTorch's per-parameter loop, ``sqrt(v)`` and its quotient alive at once,
    2 x the largest parameter; on CUDA its multi-tensor path, one weight-sized ``sqrt(v)`` list); their sum is
    ``step_phase``."""
    grads = params * bytes_per
    tmp = grads if torch.device(device).type == "cuda" else 2 * largest * bytes_per
    moments = 2 * grads + 4 * tensors
    return {"gradients": grads, "adamw_state": moments, "step_temporaries": tmp, "step_phase": grads + moments + tmp}


@dataclass(frozen=True)
class BlockShape:
    """What the activation term needs of a plain ViT: ``depth`` blocks over ``tokens`` tokens of width ``dim``,
    MLP width ``hidden``, ``heads`` heads; ``token_pool`` (the head reads the class token, a view that keeps the
    final norm's output); parameter counts of one block, of the largest tensor and of the tail whose gradients
    exist when the last block's backward starts (head, final norms, last ``fc2``)."""

    depth: int
    tokens: int
    dim: int
    hidden: int
    heads: int
    token_pool: bool
    block_params: int
    tail_params: int
    largest_param: int
    params: int
    param_tensors: int


def block_shape(model: nn.Module, training: bool = False) -> BlockShape:
    """Read :class:`BlockShape` from a vitlab ViT / DeiT; ValueError naming what is not covered otherwise."""
    from vitlab.attention import Block, MultiHeadSelfAttention
    from vitlab.layers import Mlp
    from vitlab.models import VisionTransformer

    name = type(model).__name__
    if not isinstance(model, VisionTransformer):
        raise ValueError(f"the activation term is derived for plain ViT / DeiT models (vit_*, deit_*); {name} "
                         f"is not one (the weights-only estimate and the measurement still apply)")
    why = None
    for blk in model.blocks:
        if type(blk) is not Block or blk.post_norm:
            why = "a block other than the pre-norm Block"
        elif type(blk.attn) is not MultiHeadSelfAttention or not isinstance(blk.attn.q_norm, nn.Identity):
            why = "attention other than plain msa"
        elif type(blk.mlp) is not Mlp or not isinstance(blk.mlp.act, nn.GELU):
            why = "an MLP other than fc1 -> GELU -> fc2"
        elif not (isinstance(blk.ls1, nn.Identity) and isinstance(blk.ls2, nn.Identity)):
            why = "layer scale"
        elif training and (not isinstance(blk.drop_path1, nn.Identity) or blk.attn.attn_drop > 0
                           or any(m.p > 0 for m in blk.modules() if isinstance(m, nn.Dropout))):
            why = "dropout / drop-path in training"
        if why:
            raise ValueError(f"the activation term is derived for pre-norm msa + GELU-MLP blocks without layer "
                             f"scale or dropout; this {name} has {why}")
    if model.rope is not None or model.attn_pool is not None:
        raise ValueError(f"the activation term does not cover RoPE or attention pooling ({name})")
    blk = model.blocks[-1]
    grid = model.patch_embed.grid_size
    tail = [model.norm, model.fc_norm, model.head, getattr(model, "head_dist", None), blk.mlp.fc2]
    return BlockShape(depth=len(model.blocks), tokens=grid[0] * grid[1] + model.num_prefix_tokens,
                      dim=model.embed_dim, hidden=blk.mlp.fc1.out_features, heads=blk.attn.num_heads,
                      token_pool=model.global_pool == "token" or getattr(model, "head_dist", None) is not None,
                      block_params=sum(p.numel() for p in blk.parameters()),
                      tail_params=sum(p.numel() for m in tail if m is not None for p in m.parameters()),
                      largest_param=max(p.numel() for p in model.parameters()),
                      params=sum(p.numel() for p in model.parameters()),
                      param_tensors=len(list(model.parameters())))


def sdpa_kernel_choice(dtype: torch.dtype, device: str, heads: int, head_dim: int) -> tuple[str, bool]:
    """(name, materialises the map) of the kernel ``F.scaled_dot_product_attention`` picks for (B, h, N, d)
    inputs of this dtype on this device without mask or dropout (PyTorch's own dispatcher decides; on the CPU
    fp32 / bf16 take the flash kernel, which never builds the N x N map; the math kernel does)."""
    from torch.nn.attention import SDPBackend

    q = torch.zeros(1, heads, 8, head_dim, dtype=dtype, device=device)
    backend = SDPBackend(torch._fused_sdp_choice(q, q, q))
    return backend.name.lower(), backend == SDPBackend.MATH


def activation_estimate(shape: BlockShape, batch_size: int, mode: str, bytes_per: int = 4,
                        materialised: bool = False, device: str = "cpu") -> dict:
    """The activation term of the module docstring, in bytes: for ``mode='infer'`` the peak live activations
    (``peak_bytes``, besides weights and input); for ``mode='train'`` the larger of the backward phase and the
    optimizer step phase, *including* gradients and AdamW's moments (``peak_bytes``, besides weights and input),
    with each term itemised."""
    if mode not in ("infer", "train"):
        raise ValueError(f"mode must be 'infer' or 'train', got {mode!r}")
    B, N, D, F_, h, L = batch_size, shape.tokens, shape.dim, shape.hidden, shape.heads, shape.depth
    U, Hf, S = B * N * D * bytes_per, B * N * F_ * bytes_per, B * h * N * N * bytes_per
    lse = B * h * N * 4  # flash's log-sum-exp, float32
    if mode == "infer":
        mlp_phase = 3 * U + 2 * Hf
        attn_phase = 6 * U + S + max(U, S) if materialised else 7 * U  # flash's lse lives inside its op only
        return {"unit_U": U, "unit_Hf": Hf, "unit_S": S, "residual_stream": U, "mlp_phase": mlp_phase,
                "attention_phase": attn_phase, "peak_bytes": U + max(mlp_phase, attn_phase)}
    ln_stats = 2 * 2 * B * N * 4  # two LayerNorms, float mean and rstd each
    saved_block = 8 * U + 2 * Hf + ln_stats + (2 * U + S if materialised else lse)
    if shape.token_pool:  # the final norm over every token: its input, its output (the head's view) and stats
        saved_head = 2 * U + B * N * 2 * 4
    else:  # the patch tokens' mean, then fc_norm on (B, D): its input, its output (the head's input) and stats
        saved_head = 2 * B * D * bytes_per + B * 2 * 4
    saved = L * saved_block + saved_head
    transient = U + Hf
    g_block, g_tail = shape.block_params * bytes_per, shape.tail_params * bytes_per
    # (a) at the last block's GELU backward; again at the first block's, L - 1 blocks later
    backward = max(saved + g_tail + transient,
                   saved - (L - 1) * saved_block + g_tail + (L - 1) * g_block + transient)
    step = adamw_step_bytes(shape.params, shape.largest_param, shape.param_tensors, bytes_per, device)  # (b)
    return {"unit_U": U, "unit_Hf": Hf, "unit_S": S, "saved_per_block": saved_block,
            "saved_after_blocks": saved_head, "saved_activations": saved, "backward_transient": transient,
            "backward_phase": backward, **step, "peak_bytes": max(backward, step["step_phase"])}


def complexity_table(embed_dim: int = 768, num_heads: int = 12, patch_size: int = 16,
                     sizes: tuple[int, ...] = COMPLEXITY_SIZES) -> list[dict]:
    """The complexity table, one row per image size: tokens, N^2 scores per head (and its rounded value),
    attention MACs of one layer (2 N^2 D: ``QK^T`` and ``AV``), one layer's fp32 attention maps (h N^2 x 4 B)."""
    rows = []
    for s in sizes:
        if s % patch_size:
            raise ValueError(f"image size {s} is not a multiple of the patch size {patch_size}")
        n = (s // patch_size) ** 2
        rows.append({"img_size": s, "tokens": n, "scores_per_head_m": n * n / 1e6,
                     "reference_scores_m": REFERENCE_SCORES_M.get(s) if patch_size == 16 else None,
                     "attention_gmacs_per_layer": 2 * n * n * embed_dim / 1e9,
                     "attention_map_mb_per_layer": num_heads * n * n * 4 / 2**20})
    return rows


def measure_memory_isolated(name: str, malloc_mmap_threshold: int | None = None, **kwargs) -> dict:
    """:func:`measure_memory` in a fresh Python process, so that memory the allocator kept from earlier work in
    this process cannot hide part of the peak (and one measurement cannot feed the next).

    ``malloc_mmap_threshold`` (bytes) fixes glibc's ``MALLOC_MMAP_THRESHOLD_`` in that process. By default glibc
    raises the threshold (up to 32 MiB) each time a mapped block is freed, so later tensors under it come from
    the heap, whose freed holes stay resident: the resident peak then exceeds the live tensors by the heap's
    fragmentation. With a fixed threshold every tensor above it gets its own mapping, returned to the system
    when freed, and the resident peak follows the live tensors."""
    import json
    import subprocess
    import sys

    _check(kwargs.get("mode", "infer"), kwargs.get("dtype", "fp32"), kwargs.get("device", "cpu"),
           kwargs.get("sdpa", "auto"))
    code = ("import json, sys; from vitlab.analysis.memory import measure_memory; "
            "a = json.loads(sys.argv[1]); print(json.dumps(measure_memory(a.pop('name'), **a)))")
    env = dict(os.environ)
    if malloc_mmap_threshold is not None:
        if malloc_mmap_threshold <= 0:
            raise ValueError(f"malloc_mmap_threshold must be a positive number of bytes, got {malloc_mmap_threshold}")
        env["MALLOC_MMAP_THRESHOLD_"] = str(malloc_mmap_threshold)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps({"name": name, **kwargs})], capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["no output"]
        raise ValueError(f"memory measurement of {name} failed: {lines[-1]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["estimate_gb"] = {int(k): v for k, v in r["estimate_gb"].items()}
    r["malloc_mmap_threshold"] = malloc_mmap_threshold
    return r
