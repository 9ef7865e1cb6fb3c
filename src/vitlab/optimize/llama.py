"""Faster generation with the Llama decoder (Touvron et al., 2023, "Llama 2"), from outside the model:
:func:`compile_llama` compiles its forward with Inductor (the prompt's prefill and the one-token decoding steps),
for :meth:`vitlab.models.llama.Llama.generate`'s ``forward=`` argument::

    fast = compile_llama(model)
    model.generate(ids, max_new_tokens=64, forward=fast)

or through :func:`vitlab.optimize.optimize`, which returns a :class:`CompiledLlama` whose ``generate`` decodes
through the compiled forward (for a vision-language model with a Llama ``language_model``, a copy of that model
sharing its weights, whose language model is the compiled one: :func:`compile_language_model`)::

    fast = vitlab.optimize.optimize(model)       # backend "auto" or "compile"
    fast.generate(ids, max_new_tokens=64)

The function is unchanged (the compiled forward computes the same logits within float rounding). Decoding is where
the time goes per token: one token through every layer, many small kernels, each launched from Python in eager mode;
compiled, a step is a few fused C++ kernels and GEMMs with prepacked weights (on the CPU the graph is compiled with
the weights frozen and the SIMD width stated, :func:`vitlab.optimize.cpu.inductor_options`). Freezing is what turns
the weights into constants that Inductor prepacks (for MKL or oneDNN, below), a packed GEMM beating the plain one
against a row-major ``nn.Linear`` weight for a few one-token rows. On the CPU the graph's wrapper is C++ as well
(``cpp_wrapper``), and the model's attributes are not guarded: a one-token step is short, so launching a hundred
kernels from Python, or checking a guard per parameter before each call, is a visible share of it. The prefill gains
less (large GEMMs, already near the CPU's peak, dominate it); ``prefill=False`` leaves it eager and saves its
compile.

The cache is the model's preallocated :class:`~vitlab.models.llama.KVCache`. Shapes are left to Dynamo's automatic
dynamic mode: the first call of a kind (prefill or step, with or without a padding mask) compiles with static
sizes, and the sizes that then change (prompt length, cache position and length, mask length) become symbolic in
the second graph, which serves every later call. Each batch size has a compiled function of its own, whose at most
eight graphs stay within Dynamo's recompilation limit (eight per code object); a function of its own per model too,
since the graphs are unguarded snapshots of one model's weights.

Which GEMM runs the fp32 linears is chosen by measurement (``gemm="auto"``). Inductor packs a frozen fp32 weight
for one of two library kernels, by the row count of the product: a static count gets MKL's packed sgemm, a symbolic
one oneDNN's matmul. Which is faster depends on the CPU: on AMD's Zen 4, where MKL does not take its AVX-512 paths,
oneDNN's GEMMs took 16 ms of a ``llama_100m`` batch-8 decoding step where MKL's took 43, and 584 ms of a batch-8
prompt where MKL's took 642 (a similar lead under an AVX2 cap); on Intel's Xeons MKL's is fast. The third
candidate is vitlab's own :func:`vitlab.optimize.kernels.packed_linear` (:class:`PackedLinear`, where the kernels
build), a register-blocked GEMM against a weight packed once; it runs a prompt's large AVX2 products nearer the
FMA peak than either library on that AMD CPU. :func:`packed_gemm_times` times the candidates on the model's own
weight shapes at the call's row count (the first prefill and the first decoding step of each batch size, once per
process). Where oneDNN's wins, the call's batch and sequence sizes are marked dynamic, which hands its GEMMs to
oneDNN; where vitlab's wins, the call runs a snapshot whose linear layers are :class:`PackedLinear`.
"""

from __future__ import annotations

import functools
import statistics
import types
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn

from vitlab.layers.mlp import SwiGLU
from vitlab.models.llama import KVCache, Llama, LlamaAttention, check_sampling
from vitlab.optimize import cpu as cpuinfo
from vitlab.optimize import kernels
from vitlab.optimize.compiled import CompiledInference, compile_inference, share_copy
from vitlab.timing import round_robin_times

GEMMS = ("auto", "mkl", "onednn", "vitlab")  # compile_llama's gemm=
GEMM_MARGIN = 0.03  # another GEMM is chosen when faster than MKL's by this fraction (MKL: Inductor's default)
GEMM_MAX_ROWS = 256  # rows timed at most: beyond, both kernels run at their large-product rate


def _own_entry(model: nn.Module, tag: str) -> Callable[..., torch.Tensor]:
    """``model(...)`` through a function with a code object of its own. Dynamo keeps its compiled graphs, and
    counts recompilations against its limit, per code object: graphs that are snapshots of one model's frozen
    weights, unguarded, must never be found for another model through the shared ``Llama.forward``."""

    def call(*args, **kwargs):
        return model(*args, **kwargs)

    code = call.__code__.replace(co_name=f"llama_forward_{tag}")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


class KernelLlamaAttention(LlamaAttention):
    """:class:`~vitlab.models.llama.LlamaAttention` whose causal prompt attention (a prompt from position 0, no
    padding mask) runs vitlab's fused fp32 CPU kernel, :func:`vitlab.optimize.kernels.causal_attention`; every
    other call (a decoding step against the cache, a padded batch, another dtype or device, a prompt beyond the
    kernel's length) goes to its parent's SDPA. Made by :func:`compile_llama` in its snapshot of the model, never
    built directly."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool) -> torch.Tensor:
        if (causal and q.shape[2] == k.shape[2] and kernels.causal_supported(q.shape[3], q.shape[2])
                and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, v))):
            return torch.ops.vitlab_kernels.causal_attention(q, k, v, q.shape[3]**-0.5, kernels.isa_code())
        return super().attend(q, k, v, mask, causal)


def with_fused_attention(model: nn.Module) -> nn.Module:
    """A snapshot of ``model`` (its module tree copied, its tensors shared) whose Llama attention layers are
    :class:`KernelLlamaAttention`; ``model`` itself unchanged. ``model`` as it is where the kernels are not
    available here (:func:`vitlab.optimize.kernels.status` says why)."""
    if not kernels.available():
        return model
    snapshot = share_copy(model)
    for m in snapshot.modules():
        if type(m) is LlamaAttention:
            m.__class__ = KernelLlamaAttention
    return snapshot


class PackedLinear(nn.Linear):
    """:class:`torch.nn.Linear` computed by :func:`vitlab.optimize.kernels.packed_linear` from ``packed``, a copy of
    its weight packed once for it (a non-persistent buffer; ``weight`` stays, shared with the model the snapshot
    was made from). Made by :func:`with_packed_linears` in a snapshot, never built directly; fp32 CPU inference."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.vitlab_kernels.packed_linear(x, self.packed, self.bias, self.out_features,
                                                      kernels.isa_code())


class PackedSwiGLU(SwiGLU):
    """:class:`~vitlab.layers.mlp.SwiGLU` whose first layer and gate are one
    :func:`vitlab.optimize.kernels.packed_linear` call with ``glu=True`` on ``packed``, a packed copy of ``fc1``'s
    weight: ``silu(gate) * value`` comes out of the GEMM's registers, the (tokens, 2 hidden) pre-activations never
    written. ``fc2`` is a :class:`PackedLinear`. Made by :func:`with_packed_linears`, never built directly."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.vitlab_kernels.packed_linear(x, self.packed, self.fc1.bias, self.hidden_features,
                                                   kernels.isa_code(), True)
        return self.drop2(self.fc2(self.drop1(h)))


def _fp32_cpu(linear: nn.Linear) -> bool:
    """Whether a linear layer's weight is one the packed CPU kernels take."""
    return linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"


def with_packed_linears(model: nn.Module) -> nn.Module:
    """A snapshot of ``model`` (its module tree copied, its tensors shared) whose fp32 CPU linear layers are
    :class:`PackedLinear` and whose SwiGLU layers are :class:`PackedSwiGLU`, each holding a packed copy of its
    weight (as much memory again as those weights); ``model`` itself unchanged. Needs the kernels
    (:func:`vitlab.optimize.kernels.available`)."""
    snapshot = share_copy(model)
    gated = set()  # SwiGLU first layers, packed with their gate
    for m in snapshot.modules():
        if type(m) is SwiGLU and _fp32_cpu(m.fc1):
            m.__class__ = PackedSwiGLU
            m.register_buffer("packed", kernels.pack_linear_weight(m.fc1.weight.detach(), glu=True),
                              persistent=False)
            gated.add(m.fc1)
    for m in snapshot.modules():
        if type(m) is nn.Linear and _fp32_cpu(m) and m not in gated:
            m.__class__ = PackedLinear
            m.register_buffer("packed", kernels.pack_linear_weight(m.weight.detach()), persistent=False)
    return snapshot


def packed_gemms_available() -> bool:
    """Whether Inductor can pack a frozen fp32 CPU linear for both MKL's and oneDNN's kernels (an x86 build of
    torch with both libraries); elsewhere there is no choice to make."""
    return bool(torch._C.has_mkl) and torch.backends.mkldnn.is_available()


def packed_gemm_times(weights: list[torch.Tensor], rows: int | list[int], runs: int = 7,
                      counts: list[int] | None = None) -> dict[str, float]:
    """Seconds per pass over ``weights`` ((out, in) fp32 CPU matrices): ``counts[i]`` products (default one) with
    ``weights[i]`` of an input of ``rows`` rows (or ``rows[i]``; at most :data:`GEMM_MAX_ROWS`), by each packed
    kernel a frozen fp32 linear may run: ``"mkl"`` (``mkl._mkl_linear``) and ``"onednn"``
    (``mkldnn._linear_pointwise``), Inductor's, and where the kernels are available ``"vitlab"``
    (:func:`vitlab.optimize.kernels.packed_linear`). Each product is timed on its own, ``runs`` round-robin runs
    after one warm-up, and its median counted ``counts[i]`` times: a model's many block layers weigh as much as
    they take, its one output layer no more."""
    rows = [rows] * len(weights) if isinstance(rows, int) else rows
    counts = counts or [1] * len(weights)
    fns = {}
    with torch.no_grad():
        for i, (w, r) in enumerate(zip(weights, rows)):
            r = max(1, min(r, GEMM_MAX_ROWS))
            x = torch.randn(r, w.shape[1])
            mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, r)
            dnn = torch.ops.mkldnn._reorder_linear_weight(w, r)
            fns[f"mkl:{i}"] = functools.partial(torch.ops.mkl._mkl_linear, x, mkl, w, None, r)
            fns[f"onednn:{i}"] = functools.partial(torch.ops.mkldnn._linear_pointwise, x, dnn, None, "none", [], "")
            if kernels.available():  # the operator itself, as a compiled graph calls it
                own = kernels.pack_linear_weight(w.detach())
                fns[f"vitlab:{i}"] = functools.partial(torch.ops.vitlab_kernels.packed_linear, x, own, None,
                                                       w.shape[0], kernels.isa_code())
        times = round_robin_times(fns, torch.device("cpu"), warmup=1, runs=runs)
    total: dict[str, float] = {}
    for key, t in times.items():
        library, i = key.split(":")
        total[library] = total.get(library, 0.0) + counts[int(i)] * statistics.median(t)
    return total


# (weight shapes, their rows and counts, threads) -> "mkl" | "onednn" | "vitlab", measured in this process
_GEMM_CHOICES: dict[tuple, str] = {}


def faster_gemm(model: nn.Module, rows: int, head_rows: int | None = None) -> str:
    """``"mkl"``, ``"onednn"`` or ``"vitlab"``: the packed kernel that runs ``model``'s fp32 linear layers fastest
    on this machine (:func:`packed_gemm_times`, each weight shape as often as the model has it) for inputs of
    ``rows`` rows, its output layer ``lm_head`` of ``head_rows`` (a prompt whose logits are wanted for its last
    position only: the batch size); MKL's, Inductor's own choice, unless another is faster by
    :data:`GEMM_MARGIN`. Measured once per process for each set of shapes, row counts and thread count."""
    products: dict[tuple, list] = {}  # (shape, rows) -> [weight, count]
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and _fp32_cpu(m):
            r = max(1, min(head_rows if head_rows and name.split(".")[-1] == "lm_head" else rows, GEMM_MAX_ROWS))
            products.setdefault((tuple(m.weight.shape), r), [m.weight.detach(), 0])[1] += 1
    if not products:
        return "mkl"
    key = (tuple((k, c) for k, (_, c) in products.items()), torch.get_num_threads())
    if key not in _GEMM_CHOICES:
        t = packed_gemm_times([w for w, _ in products.values()], [r for _, r in products],
                              counts=[c for _, c in products.values()])
        best = min(t, key=t.get)
        _GEMM_CHOICES[key] = best if t[best] < t["mkl"] * (1 - GEMM_MARGIN) else "mkl"
    return _GEMM_CHOICES[key]


def _symbolic_rows(kwargs: dict) -> None:
    """Mark the batch size and the number of new tokens of a call (its keyword arguments, the prompt among them)
    dynamic on every tensor that carries them (sizes of 1 stay static: Dynamo specialises them), so that the rows
    of its GEMMs are symbolic and Inductor gives them oneDNN's kernel. The caller's tensors are marked through
    views (its own are left as they were); the cache's are marked themselves (written in place, they are the
    graph's inputs)."""
    x = kwargs["input_ids"] if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
    b, n = x.shape[:2]
    dims = ([0] if b > 1 else []) + ([1] if n > 1 else [])
    # (B, N) or (B, N, dim); the mask is (B, cached + N), its length following N in a prompt
    for name in ("input_ids", "inputs_embeds", "position_ids", "logits_at", "attention_mask"):
        if kwargs.get(name) is not None:
            kwargs[name] = t = kwargs[name].view(kwargs[name].shape)
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
    if kwargs.get("cache") is not None and b > 1:
        for t in kwargs["cache"].k + kwargs["cache"].v:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def compile_llama(model: nn.Module, prefill: bool = True, options: dict | None = None,
                  gemm: str = "auto", fused_attention: bool = True) -> Callable[..., torch.Tensor]:
    """A forward for ``model.generate(..., forward=...)``: decoding steps compiled, and prompts too unless
    ``prefill=False``. Inference only (``generate`` runs under ``torch.no_grad()``), and a snapshot: the weights
    are frozen into the graph and the model's attributes are not checked again, so a model changed afterwards
    needs a new ``compile_llama``. Each batch size gets its own compiled function (its graphs: prefill and step,
    with and without a padding mask; one more where prompt and step run different GEMMs, below), compiled at its
    first call; other models' compiled forwards never share them. ``options``: ``torch.compile`` options over the
    defaults. ``gemm`` (fp32 on the CPU): the GEMM of the linear layers, ``"mkl"`` or ``"onednn"`` (Inductor's
    packed kernels for frozen weights), ``"vitlab"`` (:class:`PackedLinear`, vitlab's kernel) or ``"auto"`` (the
    fastest here, :func:`faster_gemm`, measured at the first prefill and the first decoding step of each batch
    size, so that a prompt and a decoding step may run different ones). ``"mkl"`` holds where the row count is
    static: once prompts of several lengths have made the prompt's length symbolic, Inductor gives that graph's
    GEMMs to oneDNN whatever the choice. ``fused_attention`` (fp32 on the CPU): the prompt's causal attention by
    vitlab's fused kernel (:class:`KernelLlamaAttention`, where the kernels build here), else by SDPA.

    The returned function's ``gemms`` says what ran: ``{(batch size, prompt): "mkl" | "onednn" | "vitlab"}``, a
    prompt's calls under ``True`` and the decoding steps' under ``False``, filled in at their first calls."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
    model.eval()
    # no guards on the model's attributes and parameters, checked before every call (a sizeable share of a small
    # decoding step): the compiled forward is a snapshot of the model, its weights constants of the graph
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, **(options or {})}
    if next(model.parameters()).device.type == "cpu":
        cpuinfo.cpp_extension()  # imported quietly before Inductor's C++ build imports it and warns
        # the graph's wrapper in C++ too: a decoding step is some hundred small calls, each launched from Python
        # otherwise
        options = {**cpuinfo.inductor_options(), "cpp_wrapper": True, **options}
    weight = next(model.parameters())
    fp32_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
    if fp32_cpu and gemm == "vitlab" and not kernels.available():
        raise ValueError(f"gemm='vitlab' needs vitlab's CPU kernels, which are not available here: "
                         f"{kernels.status()}")
    choose = fp32_cpu and (packed_gemms_available() or gemm == "vitlab")
    # what runs: the model, or a snapshot of it with the fused prompt attention (the caller's model stays as it is),
    # and for the calls that run vitlab's GEMM a snapshot of that with packed linears, made when first needed
    targets = {False: with_fused_attention(model) if fp32_cpu and fused_attention else model}
    compiled: dict[tuple[int, bool], Callable[..., torch.Tensor]] = {}  # (batch size, packed) -> its function
    libraries: dict[tuple[int, bool], str] = {}  # (batch size, prompt or step) -> the GEMM of its graphs

    def forward(input_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if not prefill and (input_ids is None or input_ids.shape[1] != 1):
            return targets[False](input_ids, **kwargs)
        b, n = (input_ids if input_ids is not None else kwargs["inputs_embeds"]).shape[:2]
        library = "mkl"
        if choose:
            kind = (b, n > 1)
            if kind not in libraries:
                head = b if kwargs.get("logits_to_keep") == 1 else None  # generate's prompt: the last logits only
                libraries[kind] = faster_gemm(model, b * n, head) if gemm == "auto" else gemm
            library = libraries[kind]
            if library == "onednn":
                kwargs["input_ids"] = input_ids
                _symbolic_rows(kwargs)
                input_ids = kwargs.pop("input_ids")
        key = (b, library == "vitlab")
        if key not in compiled:
            if key[1] and True not in targets:
                targets[True] = with_packed_linears(targets[False])
            tag = f"b{b}_packed" if key[1] else f"b{b}"
            compiled[key] = compile_inference(_own_entry(targets[key[1]], tag), options)
        with warnings.catch_warnings():
            # RoPE's complex product stays one ATen call inside the graph, which Inductor says when it compiles
            warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex")
            return compiled[key](input_ids, **kwargs)

    forward.gemms = libraries
    return forward


class CompiledLlama(CompiledInference):
    """A Llama whose forward is :func:`compile_llama`'s (run under ``no_grad``); :meth:`generate` decodes through
    it. ``module`` is the eager model; its other attributes (``config``, ``embed_tokens``, ``new_cache``...) are
    looked up there.

    :meth:`generate` keeps its KV cache between calls, as a serving loop or transformers' static cache does: a
    call that fits the last cache (same batch size, no longer) refills it instead of allocating a new one. A new
    cache costs more than its allocation: the operating system hands its pages over zeroed at their first write,
    some 15,000 page faults inside the prefill for ``llama_100m`` at batch 8. :meth:`release_cache` frees it."""

    def __init__(self, module: nn.Module, compiled: Callable):
        super().__init__(module, compiled)
        self.cache: KVCache | None = None

    def release_cache(self) -> None:
        """Free the kept KV cache (the next :meth:`generate` allocates one)."""
        self.cache = None

    def generate(self, input_ids: torch.Tensor | None = None, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                 **kwargs) -> torch.Tensor:
        """:meth:`vitlab.models.llama.Llama.generate` through the compiled forward and the kept cache."""
        check_sampling(max_new_tokens, temperature, top_k, top_p)  # refused before any cache is touched
        kwargs.setdefault("forward", self.compiled)
        embeds = kwargs.get("inputs_embeds")
        if "cache" not in kwargs and (input_ids is None) != (embeds is None):
            prompt = input_ids if input_ids is not None else embeds
            b, need = prompt.shape[0], prompt.shape[1] + max_new_tokens
            if need <= self.module.config.max_seq_len:  # else generate refuses the call
                try:
                    self.module.check_cache(self.cache, b, need)
                except ValueError:  # none yet, or not this batch size, or too short
                    self.cache = None  # the old one freed before the new one is allocated
                    self.cache = self.module.new_cache(b, need)
                kwargs["cache"] = self.cache
        return self.module.generate(input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, **kwargs)


def compile_language_model(model: nn.Module) -> nn.Module | None:
    """What :func:`vitlab.optimize.optimize` makes of a model holding a Llama for its ``"auto"`` and ``"compile"``
    backends, ``model`` itself left as it is. A Llama becomes a :class:`CompiledLlama` around it. A model whose
    ``language_model`` is a Llama (a LLaVA-style model) gives an inference snapshot: a copy of the model, of the
    same class, holding the very same parameter and buffer tensors (nothing is duplicated: a 7B model stays one 7B
    model in memory), whose ``language_model`` is a :class:`CompiledLlama`, so that its ``forward`` and
    ``generate`` run through the compiled decoder and everything else as the original's. The original keeps its
    eager language model, hence its state dict keys, its gradients and its eager ``generate``, which sees later
    changes of its weights (the compiled graphs do not: they freeze the weights at their first call). None for any
    other model."""
    if isinstance(model, Llama):
        return CompiledLlama(model, compile_llama(model))
    if isinstance(getattr(model, "language_model", None), Llama):
        snapshot = share_copy(model)  # the module tree copied, the tensors shared: the swap stays on the copy
        lm = snapshot.language_model
        snapshot.language_model = CompiledLlama(lm, compile_llama(lm))
        return snapshot
    return None
