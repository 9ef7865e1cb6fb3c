"""Attention maps and attention rollout.

* :func:`capture_attention` runs a model once and returns every token-attention layer's softmax weights,
  ``softmax(q k^T / sqrt(d) + bias + mask)`` as (B, heads, Nq, Nk) with rows summing to 1. The weights come
  from the layers themselves: every mechanism of :mod:`vitlab.attention` that forms attention weights returns
  them when called with ``return_attn=True`` (``has_attention_weights``), and says what they are over
  (``attention_kind``). For one forward, hooks add that keyword to each readable layer's call and take the
  weights off its output (the model's modules are not edited; its fast fused path is what runs otherwise).
  The kinds read here:

  - ``global`` (``msa``, ``msa_naive``, HaLViT's attention): every token over every token;
  - ``window`` (Swin's ``local_window`` / ``shifted_window``, Liu et al., ICCV 2021, Section 3.2): the
    per-window (L x L) weights, bias and shift mask included, stitched back to the image grid as a dense (N x N)
    matrix whose off-window entries are 0 (exactly the attention the window restriction imposes), so the maps
    and rollout of global attention apply to it unchanged;
  - ``offset_bias`` (LeViT / EfficientFormer, Graham et al., ICCV 2021, Eq. 1): queries on the (possibly
    strided) grid over the layer's full-resolution keys;
  - MobileViT (Mehta & Rastegari, ICLR 2022): its ``msa`` blocks attend across patches once per pixel position
    inside a patch (those sequences are batched); the weights are averaged over the positions;
  - ``class_attention`` (CaiT, Touvron et al., ICCV 2021, Sec. 3): the class token's query row per head;
  - ``talking_heads`` (CaiT's self-attention, Touvron et al., Sec. 2 / Shazeer et al., "Talking-Heads
    Attention", 2020): ``P = proj_w(softmax(proj_l(q k^T / sqrt(d))))``, mixed over heads, the map that
    multiplies V (the same as timm's weights before ``attn_drop``). Its rows are not distributions: row sums are
    ``sum_h W_w[g, h] + N_k b_w[g]`` for output head g (1 only where proj_w's row sums and bias happen to give
    that) and entries may be negative, so rollout refuses these layers;
  - ``spatial_reduction`` (PVT, Wang et al., ICCV 2021, Eq. 2-3): keys on the reduced grid.

* :func:`attention_maps`: per-head maps of one query (the class token, the distillation token, or a patch at
  (row, col)) over the patch tokens of one layer, as (B, heads, H, W). Prefix tokens (class, distillation,
  registers) are dropped from the keys; they are never mixed into the spatial map.

* :func:`attention_rollout` (Abnar & Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020,
  Section 3, "attention rollout"): heads fused (mean / max / min, as in Gildenblat's ``vit-explain``), the
  ``discard_ratio`` weakest fused weights zeroed (vit-explain; the class-to-class weight is kept), the residual
  added as ``A' = 0.5 A + 0.5 I`` and rows renormalised, then ``R = A'_L ... A'_1``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from vitlab.analysis._common import eval_forward, pick
from vitlab.attention import has_attention_weights

KINDS = ("global", "window", "offset_bias", "spatial_reduction", "class_attention", "talking_heads")
SUPPORTED_FAMILIES = ("vit*, deit*, halvit*, vit_pico*, swin*, levit*, efficientformer*, pvt*, mobilevit*, "
                      "cait* (talking-heads and class attention)")
HEAD_FUSIONS = ("mean", "max", "min")


@dataclass
class AttentionLayer:
    """One layer's attention weights: ``attn`` (B, heads, Nq, Nk), rows summing to 1 (except ``talking_heads``:
    mixed after the softmax, see the module docstring), tokens in the layer's own order (``num_prefix`` prefix
    tokens first, then the patch grid in raster order)."""

    name: str  # module path in the model
    kind: str  # 'global', 'window' (stitched), 'offset_bias', 'spatial_reduction', 'class_attention', 'talking_heads'
    attn: torch.Tensor
    q_grid: tuple[int, int]  # (H, W) of the query patch tokens ((0, 0): the class token is the only query)
    k_grid: tuple[int, int]  # (H, W) of the key patch tokens
    num_prefix: int = 0  # prefix tokens among the queries and keys (class, distillation, registers)


def _grid_of(n_patches: int) -> tuple[int, int]:
    s = math.isqrt(n_patches)
    if s * s != n_patches:
        raise ValueError(f"cannot infer the token grid of {n_patches} patch tokens (not a square)")
    return s, s


def layer_kind(m: nn.Module) -> str | None:
    """The kind of attention weights module ``m`` returns on request (one of :data:`KINDS`), or None when it
    forms none this tool reads."""
    kind = getattr(m, "attention_kind", None)
    return kind if kind in KINDS and has_attention_weights(m) else None


def find_attention_layers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name, module, kind) of every attention layer :func:`capture_attention` can read, in module order."""
    return [(name, m, kind) for name, m in model.named_modules() if (kind := layer_kind(m)) is not None]


def _grids(m: nn.Module, kind: str, x: torch.Tensor, hw, prefix_default: int):
    """(q_grid, k_grid, num_prefix) of a layer's weights for input ``x`` on grid ``hw``."""
    N = x.shape[1]
    if kind == "offset_bias":
        H, W = m.resolution
        s = getattr(m, "stride", 1)
        return (-(-H // s), -(-W // s)), (H, W), 0
    if kind == "class_attention":
        return (0, 0), _grid_of(N - 1), 1
    if hw is not None:
        grid, prefix = (int(hw[0]), int(hw[1])), N - int(hw[0]) * int(hw[1])
    else:
        prefix = prefix_default if kind in ("global", "spatial_reduction") else 0
        grid = _grid_of(N - prefix)
    if kind == "spatial_reduction":
        R = m.sr_ratio
        return grid, (-(-grid[0] // R), -(-grid[1] // R)), prefix
    return grid, grid, prefix


@contextlib.contextmanager
def _recording(model: nn.Module, records: list[AttentionLayer]):
    """Hooks on every readable attention layer: its call gets ``return_attn=True`` and a forward appends its
    weights, the caller receiving the output it asked for."""
    prefix_default = int(getattr(model, "num_prefix_tokens", 0) or 0)
    handles = []
    asked: dict[int, list[bool]] = {}  # per module, whether each call in flight asked for the weights itself

    def add_keyword(m, args, kwargs):
        asked.setdefault(id(m), []).append(bool(kwargs.get("return_attn", False)))
        return args, {**kwargs, "return_attn": True}

    def record(name, kind):
        def hook(m, args, kwargs, out):
            x = args[0]
            hw = args[1] if len(args) > 1 else kwargs.get("hw")
            q_grid, k_grid, prefix = _grids(m, kind, x, hw, prefix_default)
            records.append(AttentionLayer(name, kind, out[1].detach(), q_grid, k_grid, prefix))
            if asked[id(m)].pop():
                return out
            return out[0] if len(out) == 2 else (out[0], *out[2:])
        return hook

    try:
        for name, m, kind in find_attention_layers(model):
            handles.append(m.register_forward_pre_hook(add_keyword, with_kwargs=True))
            handles.append(m.register_forward_hook(record(name, kind), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def capture_attention(model: nn.Module, x: torch.Tensor) -> list[AttentionLayer]:
    """Every readable attention layer's weights for input ``x``, in forward order (eval mode, no grad).

    ValueError naming the models that have one when ``model`` has no attention layer this can read."""
    if not find_attention_layers(model):
        raise ValueError(f"{type(model).__name__} has no token-attention layer the attention tool reads "
                         f"(msa / window / offset-bias / spatial-reduction attention); models with one: "
                         f"{SUPPORTED_FAMILIES}")
    records: list[AttentionLayer] = []
    eval_forward(model, x, _recording(model, records))
    B = x.shape[0]
    for r in records:
        if r.attn.shape[0] != B:  # MobileViT: one sequence per pixel position in a patch, batched (b, ph, pw)
            r.attn = r.attn.reshape(B, -1, *r.attn.shape[1:]).mean(1)  # the mean over those positions
    return records


def pick_layer(layers: list[AttentionLayer], index: int) -> AttentionLayer:
    """``layers[index]`` (negative counts from the end), or a ValueError giving the valid range."""
    return pick(layers, index, "block", "attention layers")


def query_index(layer: AttentionLayer, query: str | tuple[int, int]) -> int:
    """Token index of ``query``: 'cls' (token 0), 'dist' (token 1 of a distilled model) or a patch (row, col)."""
    if query in ("cls", "dist"):
        need = 1 if query == "cls" else 2
        if layer.num_prefix < need:
            raise ValueError(f"layer {layer.name} has no {query} token ({layer.num_prefix} prefix tokens): give "
                             f"a query patch as ROW,COL instead")
        return need - 1
    r, c = query
    H, W = layer.q_grid
    if H * W == 0:
        raise ValueError(f"layer {layer.name} is class attention: its only query is the class token (--query cls)")
    if not (0 <= r < H and 0 <= c < W):
        raise ValueError(f"query patch ({r}, {c}) lies outside layer {layer.name}'s {H}x{W} query grid")
    return layer.num_prefix + r * W + c


def attention_maps(layer: AttentionLayer, query: str | tuple[int, int] = "cls") -> torch.Tensor:
    """(B, heads, H, W): each head's weights from ``query`` onto the patch tokens of the key grid (prefix-token
    keys dropped, so a map sums to 1 minus what the query gave the prefix tokens)."""
    i = query_index(layer, query)
    H, W = layer.k_grid
    return layer.attn[:, :, i, layer.num_prefix:].reshape(*layer.attn.shape[:2], H, W)


def fuse_heads(attn: torch.Tensor, head_fusion: str = "mean") -> torch.Tensor:
    """(B, heads, N, N) -> (B, N, N) by the mean, max or min over heads."""
    if head_fusion == "mean":
        return attn.mean(1)
    if head_fusion == "max":
        return attn.amax(1)
    if head_fusion == "min":
        return attn.amin(1)
    raise ValueError(f"unknown head fusion {head_fusion!r}; choose from {', '.join(HEAD_FUSIONS)}")


def attention_rollout(attns: list[torch.Tensor], head_fusion: str = "mean", discard_ratio: float = 0.0
                      ) -> torch.Tensor:
    """Abnar & Zuidema's rollout of layers (B, heads, N, N), first layer first -> (B, N, N) ``R = A'_L ... A'_1``.

    Per layer: heads fused, the ``discard_ratio`` fraction of smallest fused weights of each sample set to 0
    (never the weight of token 0 on itself), ``A' = (A + I) / 2`` with rows renormalised to sum 1."""
    if not attns:
        raise ValueError("attention rollout needs at least one layer")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must lie in [0, 1), got {discard_ratio}")
    n = attns[0].shape[-1]
    if any(a.shape[-2:] != (n, n) for a in attns):
        raise ValueError("attention rollout needs every layer to attend over the same tokens (N x N); got "
                         f"{sorted({tuple(a.shape[-2:]) for a in attns})}")
    eye = torch.eye(n, dtype=attns[0].dtype, device=attns[0].device)
    result = eye.expand(attns[0].shape[0], n, n)
    for a in attns:
        fused = fuse_heads(a, head_fusion)
        if discard_ratio > 0:
            flat = fused.flatten(1).clone()
            k = int(flat.shape[1] * discard_ratio)
            low = flat.topk(k, dim=1, largest=False).indices  # (B, k)
            keep0 = flat[:, :1].clone()
            flat.scatter_(1, low, 0.0)
            flat[:, :1] = keep0  # vit-explain keeps the class token's weight on itself
            fused = flat.view_as(fused)
        a2 = (fused + eye) / 2
        a2 = a2 / a2.sum(dim=-1, keepdim=True)
        result = a2 @ result
    return result


def rollout_layers(layers: list[AttentionLayer], upto: int = -1) -> list[AttentionLayer]:
    """The layers a rollout ending at ``layers[upto]`` runs over: the consecutive layers before it (itself
    included) that attend over the same tokens (all of a ViT; one stage of Swin)."""
    end = len(layers) + upto if upto < 0 else upto
    last = pick_layer(layers, upto)
    start = end
    while start > 0 and layers[start - 1].attn.shape[-2:] == last.attn.shape[-2:] and \
            layers[start - 1].attn.shape[-1] == layers[start - 1].attn.shape[-2]:
        start -= 1
    if last.attn.shape[-1] != last.attn.shape[-2]:
        raise ValueError(f"layer {last.name} is not self-attention over one token set (queries {last.q_grid}, "
                         f"keys {last.k_grid}): no rollout")
    run = layers[start:end + 1]
    mixed = [lay.name for lay in run if lay.kind == "talking_heads"]
    if mixed:
        raise ValueError(f"rollout needs rows that are distributions; {mixed[0]} mixes its heads after the softmax "
                         f"(CaiT's talking heads): no rollout")
    return run


def rollout_map(layers: list[AttentionLayer], query: str | tuple[int, int] = "cls", head_fusion: str = "mean",
                discard_ratio: float = 0.9, upto: int = -1) -> torch.Tensor:
    """(B, H, W) rollout of ``query`` over the patch grid, normalised to a maximum of 1 per image."""
    run = rollout_layers(layers, upto)
    r = attention_rollout([lay.attn for lay in run], head_fusion, discard_ratio)
    last = run[-1]
    H, W = last.k_grid
    m = r[:, query_index(last, query), last.num_prefix:].reshape(-1, H, W)
    return m / m.flatten(1).amax(1).clamp_min(1e-12)[:, None, None]


def analyze_attention(model: nn.Module, x: torch.Tensor, block: int = -1, query: str | tuple[int, int] = "cls",
                      head_fusion: str = "mean", discard_ratio: float = 0.9) -> dict:
    """The ``attention`` tool: per-head maps of ``query`` in layer ``block``, their rollout through the layers
    up to it, and per-layer facts. Returns {'layer', 'kind', 'maps' (B, heads, H, W), 'rollout' (B, H, W),
    'rollout_layers', 'layers': [{name, kind, heads, q_grid, k_grid, num_prefix, row_sum_max_err}]}."""
    layers = capture_attention(model, x)
    layer = pick_layer(layers, block)
    if query == "cls" and layer.num_prefix == 0:
        H, W = layer.q_grid
        query = (H // 2, W // 2)  # no class token: the centre patch
    maps = attention_maps(layer, query)
    upto = layers.index(layer)
    try:
        run = rollout_layers(layers, upto)
        roll = rollout_map(layers, query, head_fusion, discard_ratio, upto)
    except ValueError:  # a shrinking (LeViT downsampling) layer: maps only
        run, roll = [], None
    return {
        "layer": layer.name, "kind": layer.kind, "query": query if isinstance(query, str) else list(query),
        "maps": maps, "rollout": roll, "rollout_layers": [lay.name for lay in run],
        "head_fusion": head_fusion, "discard_ratio": discard_ratio,
        "layers": [dict(name=lay.name, kind=lay.kind, heads=lay.attn.shape[1], q_grid=list(lay.q_grid),
                        k_grid=list(lay.k_grid), num_prefix=lay.num_prefix,
                        row_sum_max_err=float((lay.attn.sum(-1) - 1).abs().max()))
                   for lay in layers],
    }
