"""Attention maps and attention rollout.

* :func:`capture_attention` runs a model once and returns every token-attention layer's softmax weights,
  ``softmax(q k^T / sqrt(d) + bias + mask)`` as (B, heads, Nq, Nk) with rows summing to 1. The weights are read
  from the explicit attention path, patched in from outside for the duration of one forward (the model's own
  modules are not edited, its fast fused path is what runs otherwise):

  - ``msa``, ``msa_naive`` and HaLViT's attention: their own ``return_attn=True`` explicit-softmax path;
  - Swin's window attention (``local_window`` / ``shifted_window``, Liu et al., ICCV 2021, Section 3.2): q and
    k re-projected with the module's ``qkv``, padded, rolled and partitioned with the module's own helpers,
    masked with its own relative-position bias + shift mask; the per-window (L x L) weights are then *stitched*
    back to the image grid as a dense (N x N) matrix whose off-window entries are 0 (exactly the attention the
    window restriction imposes), so the maps and rollout of global attention apply to it unchanged;
  - LeViT / EfficientFormer offset-bias attention (Graham et al., ICCV 2021, Eq. 1): the module's
    ``_attend(q, k, v)`` swapped for the same product with the weights kept;
  - MobileViT (Mehta & Rastegari, ICLR 2022): its ``msa`` blocks attend across patches once per pixel position
    inside a patch (those sequences are batched); the weights are averaged over the positions;
  - CaiT's class attention (Touvron et al., ICCV 2021, Sec. 3): the class token's query and every token's key
    read from the module's ``q`` and ``k`` projections by forward hooks (one query row per head);
  - CaiT's talking-heads self-attention (Touvron et al., Sec. 2 / Shazeer et al., "Talking-Heads Attention",
    2020, Algorithm "TalkingHeadsAttention"): q and k read from the module's ``qkv`` by a hook, then the
    module's own head mixes: ``P = proj_w(softmax(proj_l(q k^T / sqrt(d))))``, mixed over heads, the map that
    multiplies V (kind ``talking_heads``, the same as timm's weights before ``attn_drop``). Its rows are not
    distributions: row sums are ``sum_h W_w[g, h] + N_k b_w[g]`` for output head g (1 only where proj_w's row
    sums and bias happen to give that) and entries may be negative, so rollout refuses these layers;
  - PVT's spatial-reduction attention (Wang et al., ICCV 2021, Eq. 2-3): q and the reduced k read from the
    module's ``q`` and ``kv`` projections by forward hooks; the keys lie on the reduced grid.

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

_RETURN_ATTN = ("MultiHeadSelfAttention", "NaiveAttention", "HaLViTAttention")
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


def window_positions(H: int, W: int, window: tuple[int, int], shift: tuple[int, int]) -> torch.Tensor:
    """(nW, L) raster index (row * W + col) in the H x W map of each token of each window, in the order the
    window attention sees them (padded to a multiple of the window, rolled by ``-shift``); -1 for padding."""
    from vitlab.attention._window import pad_to_multiple, partition

    (wh, ww), (sh, sw) = window, shift
    idx = torch.arange(H * W).reshape(1, H, W, 1) + 1  # +1: zero padding marks "no token" below
    idx = pad_to_multiple(idx, wh, ww)
    if sh or sw:
        idx = torch.roll(idx, shifts=(-sh, -sw), dims=(1, 2))
    return partition(idx, wh, ww, 1)[0, :, :, 0] - 1  # (nW, L)


def stitch_windows(attn: torch.Tensor, pos: torch.Tensor, heads: int, n: int) -> torch.Tensor:
    """Per-window weights (B, nW * heads, L, L) (windows outer, heads inner) -> dense (B, heads, n, n) over the
    map's raster order: entry (i, j) is the weight of query i on key j when both lie in one window, else 0."""
    B, L = attn.shape[0], attn.shape[-1]
    nW = pos.shape[0]
    a = attn.reshape(B, nW, heads, L, L)
    w, i, j = torch.meshgrid(torch.arange(nW), torch.arange(L), torch.arange(L), indexing="ij")
    qi, kj = pos[w, i], pos[w, j]
    keep = (qi >= 0) & (kj >= 0)  # drop padded queries / keys
    w, i, j, qi, kj = w[keep], i[keep], j[keep], qi[keep], kj[keep]
    dense = attn.new_zeros(B, heads, n, n)
    dense[:, :, qi, kj] = a[:, w, :, i, j].permute(1, 2, 0)  # (B, heads, pairs)
    return dense


def _window_attention(m: nn.Module, x: torch.Tensor, hw) -> torch.Tensor:
    """Dense (B, heads, N, N) weights of a window attention module (local / shifted) on x (B, N, C)."""
    from vitlab.attention._window import grid_size, pad_to_multiple, partition_qkv

    H, W = grid_size(x, hw, m._name)
    B, N, C = x.shape
    (wh, ww), (sh, sw) = m._window, m._shift
    sh, sw = (sh if H > wh else 0), (sw if W > ww else 0)  # as the module's forward: no shift within one window
    qkv = pad_to_multiple(m.qkv(x).reshape(B, H, W, 3 * C), wh, ww)
    if sh or sw:
        qkv = torch.roll(qkv, shifts=(-sh, -sw), dims=(1, 2))
    q, k, _ = partition_qkv(qkv, wh, ww, m.num_heads)  # (B, nW * heads, L, d)
    logits = (q * m.head_dim**-0.5) @ k.transpose(-2, -1)
    mask = m._attn_mask(H, W, sh, sw, q.dtype, x.device)  # (1, nW * heads, L, L): bool, float or None
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    return stitch_windows(logits.softmax(-1), window_positions(H, W, (wh, ww), (sh, sw)), m.num_heads, N)


def find_attention_layers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name, module, kind) of every attention layer :func:`capture_attention` can read, in module order."""
    from vitlab.attention import OffsetBiasAttentionBase, SpatialReductionAttention
    from vitlab.attention.local_window import _WindowAttentionBase
    from vitlab.models.cait import ClassAttn, TalkingHeadAttn

    out = []
    for name, m in model.named_modules():
        if type(m).__name__ in _RETURN_ATTN:
            out.append((name, m, "global"))
        elif isinstance(m, _WindowAttentionBase):
            out.append((name, m, "window"))
        elif isinstance(m, OffsetBiasAttentionBase):
            out.append((name, m, "offset_bias"))
        elif isinstance(m, SpatialReductionAttention):
            out.append((name, m, "spatial_reduction"))
        elif isinstance(m, ClassAttn):
            out.append((name, m, "class_attention"))
        elif isinstance(m, TalkingHeadAttn):
            out.append((name, m, "talking_heads"))
    return out


@contextlib.contextmanager
def _recording(model: nn.Module, records: list[AttentionLayer]):
    """Patch every readable attention layer (instance attributes only) so a forward appends its weights."""
    prefix_default = int(getattr(model, "num_prefix_tokens", 0) or 0)
    patched = []

    def global_fwd(name, m):
        def forward(x, hw=None, *args, **kwargs):
            out, attn = type(m).forward(m, x, hw, *args, return_attn=True, **kwargs)
            n = x.shape[1]
            if hw is not None:
                grid, prefix = (int(hw[0]), int(hw[1])), n - int(hw[0]) * int(hw[1])
            else:
                prefix = prefix_default
                grid = _grid_of(n - prefix)
            records.append(AttentionLayer(name, "global", attn.detach(), grid, grid, prefix))
            return out
        return forward

    def window_fwd(name, m):
        def forward(x, hw=None):
            out = type(m).forward(m, x, hw)
            attn = _window_attention(m, x, hw)
            grid = (int(hw[0]), int(hw[1]))
            records.append(AttentionLayer(name, "window", attn.detach(), grid, grid, 0))
            return out
        return forward

    def bias_attend(name, m):
        def _attend(q, k, v):
            attn = ((q * m.scale) @ k.transpose(-2, -1) + m.get_attention_biases()).softmax(dim=-1)
            H, W = m.resolution
            s = getattr(m, "stride", 1)
            records.append(AttentionLayer(name, "offset_bias", attn.detach(), (-(-H // s), -(-W // s)), (H, W)))
            return attn @ v
        return _attend

    def projections(m, names, *args):
        """Run ``m`` with forward hooks on its projections ``names``; returns (output, {name: output})."""
        seen = {}
        hooks = [getattr(m, n).register_forward_hook(lambda mod, i, o, n=n: seen.__setitem__(n, o)) for n in names]
        try:
            return type(m).forward(m, *args), seen
        finally:
            for h in hooks:
                h.remove()

    def class_fwd(name, m):
        def forward(u):
            out, seen = projections(m, ("q", "k"), u)
            B, N, C = u.shape
            q = seen["q"].reshape(B, 1, m.num_heads, m.head_dim).transpose(1, 2)  # the class token's query
            k = seen["k"].reshape(B, N, m.num_heads, m.head_dim).transpose(1, 2)
            attn = ((q * m.head_dim**-0.5) @ k.transpose(-2, -1)).softmax(-1)  # (B, heads, 1, 1 + H*W)
            records.append(AttentionLayer(name, "class_attention", attn.detach(), (0, 0), _grid_of(N - 1), 1))
            return out
        return forward

    def talking_fwd(name, m):
        def forward(x, hw=None):
            out, seen = projections(m, ("qkv",), x, hw)
            B, N, C = x.shape
            q, k, _ = seen["qkv"].view(B, N, 3, m.num_heads, m.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            logits = (q * m.scale) @ k.transpose(-2, -1)  # (B, h, N, N)
            attn = m._mix_heads(m._mix_heads(logits, m.proj_l).softmax(-1), m.proj_w)  # the module's own mixes
            H, W = (int(hw[0]), int(hw[1])) if hw is not None else _grid_of(N)
            records.append(AttentionLayer(name, "talking_heads", attn.detach(), (H, W), (H, W), N - H * W))
            return out
        return forward

    def reduction_fwd(name, m):
        def forward(x, hw=None):
            out, seen = projections(m, ("q", "kv"), x, hw)
            B, N, C = x.shape
            q = seen["q"].reshape(B, N, m.num_heads, m.head_dim).transpose(1, 2)
            k = seen["kv"][..., :C].reshape(B, -1, m.num_heads, m.head_dim).transpose(1, 2)  # kv packs [k, v]
            attn = ((q * m.head_dim**-0.5) @ k.transpose(-2, -1)).softmax(-1)
            H, W = (int(hw[0]), int(hw[1])) if hw is not None else _grid_of(N - prefix_default)
            prefix = N - H * W
            R = m.sr_ratio
            records.append(AttentionLayer(name, "spatial_reduction", attn.detach(), (H, W),
                                          (-(-H // R), -(-W // R)), prefix))
            return out
        return forward

    try:
        for name, m, kind in find_attention_layers(model):
            if kind != "offset_bias":
                make = {"global": global_fwd, "window": window_fwd, "spatial_reduction": reduction_fwd,
                        "class_attention": class_fwd, "talking_heads": talking_fwd}[kind]
                m.forward = make(name, m)
                patched.append((m, "forward"))
            else:
                m._attend = bias_attend(name, m)
                patched.append((m, "_attend"))
        yield
    finally:
        for m, attr in patched:
            delattr(m, attr)  # the class's own method again


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
