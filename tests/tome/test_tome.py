"""vitlab.tome against a literal re-statement of the authors' ToMe (facebookresearch/ToMe: ``tome/merge.py``,
``tome/patch/timm.py``, ``tome/utils.py``) applied to timm's model with the same weights; r=0 equals the
unpatched model; remove() restores it bit for bit; the merge, schedule and bad-input rules."""

from __future__ import annotations

import math

import pytest
import torch

import vitlab
import vitlab.tome as tome

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import Attention as TimmAttention  # noqa: E402
from timm.models.vision_transformer import Block as TimmBlock  # noqa: E402

# ------------------------------------------------------------------ the authors' algorithm, restated literally


def ref_bipartite_soft_matching(metric, r, class_token=False, distill_token=False):
    protected = 0
    if class_token:
        protected += 1
    if distill_token:
        protected += 1
    t = metric.shape[1]
    r = min(r, (t - protected) // 2)
    if r <= 0:
        return lambda x, mode=None: x
    with torch.no_grad():
        metric = metric / metric.norm(dim=-1, keepdim=True)
        a, b = metric[..., ::2, :], metric[..., 1::2, :]
        scores = a @ b.transpose(-1, -2)
        if class_token:
            scores[..., 0, :] = -math.inf
        if distill_token:
            scores[..., :, 0] = -math.inf
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
        unm_idx = edge_idx[..., r:, :]
        src_idx = edge_idx[..., :r, :]
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
        if class_token:
            unm_idx = unm_idx.sort(dim=1)[0]

    def merge(x, mode="mean"):
        src, dst = x[..., ::2, :], x[..., 1::2, :]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
        src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
        dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)
        if distill_token:
            return torch.cat([unm[:, :1], dst[:, :1], unm[:, 1:], dst[:, 1:]], dim=1)
        return torch.cat([unm, dst], dim=1)

    return merge


def ref_merge_wavg(merge, x, size=None):
    if size is None:
        size = torch.ones_like(x[..., 0, None])
    x = merge(x * size, mode="sum")
    size = merge(size, mode="sum")
    return x / size, size


def ref_merge_source(merge, x, source=None):
    if source is None:
        n, t, _ = x.shape
        source = torch.eye(t, device=x.device, dtype=x.dtype)[None, ...].expand(n, t, t)
    return merge(source, mode="amax")


def ref_parse_r(num_layers, r):
    inflect = 0
    if isinstance(r, list):
        if len(r) < num_layers:
            r = r + [0] * (num_layers - len(r))
        return list(r)
    elif isinstance(r, tuple):
        r, inflect = r
    min_val = int(r * (1.0 - inflect))
    max_val = 2 * r - min_val
    step = (max_val - min_val) / (num_layers - 1)
    return [int(min_val + step * i) for i in range(num_layers)]


class RefToMeBlock(TimmBlock):
    def forward(self, x, attn_mask=None, is_causal=False):
        attn_size = self._tome_info["size"] if self._tome_info["prop_attn"] else None
        x_attn, metric = self.attn(self.norm1(x), attn_size)
        x = x + self.drop_path1(x_attn)
        r = self._tome_info["r"].pop(0)
        if r > 0:
            merge = ref_bipartite_soft_matching(metric, r, self._tome_info["class_token"],
                                                self._tome_info["distill_token"])
            if self._tome_info["trace_source"]:
                self._tome_info["source"] = ref_merge_source(merge, x, self._tome_info["source"])
            x, self._tome_info["size"] = ref_merge_wavg(merge, x, self._tome_info["size"])
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class RefToMeAttention(TimmAttention):
    def forward(self, x, size=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if size is not None:
            attn = attn + size.log()[:, None, None, :, 0]
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x, k.mean(1)


def ref_apply_patch(model, r, trace_source=False, prop_attn=True):
    base = model.__class__

    class RefToMeVisionTransformer(base):
        def forward(self, *args, **kwargs):
            self._tome_info["r"] = ref_parse_r(len(self.blocks), self.r)
            self._tome_info["size"] = None
            self._tome_info["source"] = None
            return super().forward(*args, **kwargs)

    model.__class__ = RefToMeVisionTransformer
    model.r = r
    model._tome_info = {"r": model.r, "size": None, "source": None, "trace_source": trace_source,
                        "prop_attn": prop_attn, "class_token": model.cls_token is not None,
                        "distill_token": getattr(model, "dist_token", None) is not None}
    for module in model.modules():
        if isinstance(module, TimmBlock):
            module.__class__ = RefToMeBlock
            module._tome_info = model._tome_info
        elif isinstance(module, TimmAttention):
            module.__class__ = RefToMeAttention
    return model


# ------------------------------------------------------------------ the tests

KW = dict(img_size=64, patch_size=8, depth=4)  # 64 patches + prefix tokens, four blocks: every path taken


def _pair(name, tmp_path):
    torch.manual_seed(0)
    ref = timm.create_model(name, **KW).double().eval()
    path = tmp_path / "w.pth"
    torch.save(ref.state_dict(), path)
    ours = vitlab.create_model(name, checkpoint_path=str(path), **KW).double().eval()
    return ref, ours


@pytest.mark.parametrize("name,r,prop_attn", [
    ("deit_tiny_distilled_patch16_224", 6, True),  # class + distillation tokens protected
    ("deit_tiny_patch16_224", (6, -1.0), True),  # the decreasing schedule
    ("deit_tiny_patch16_224", [0, 14, 3, 9], False),  # a list, r clamped in block 1, no proportional attention
])
def test_equals_authors_tome_on_timm(name, r, prop_attn, tmp_path):
    ref, ours = _pair(name, tmp_path)
    x = torch.randn(3, 3, 64, 64, dtype=torch.float64)
    ref_apply_patch(ref, r, trace_source=True, prop_attn=prop_attn)
    tome.apply(ours, r=r, prop_attn=prop_attn, trace_source=True)
    with torch.no_grad():
        want, got = ref(x), ours(x)
        source = ref._tome_info["source"]
        ref._tome_info.update(r=ref_parse_r(len(ref.blocks), ref.r), size=None, source=None)  # as forward() does
        f_ref, f_ours = ref.forward_features(x), ours.forward_features(x)
    assert f_ours.shape == f_ref.shape and f_ours.shape[1] < 64  # tokens were merged
    torch.testing.assert_close(f_ours, f_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert torch.equal(tome.info(ours).source, source)  # the same patches ended in the same tokens


def test_avg_pool_weights_tokens_by_size_as_authors_mae_patch(tmp_path):
    """The authors' MAE patch pools "proportional to token size": sum(s x) over the patch tokens, divided by the
    token count T before fc_norm; restated as the size-weighted mean (a constant that the LayerNorm cancels)."""
    torch.manual_seed(0)
    kw = dict(KW, global_pool="avg")
    ref = timm.create_model("vit_tiny_patch16_224", **kw).double().eval()
    torch.save(ref.state_dict(), tmp_path / "w.pth")
    ours = vitlab.create_model("vit_tiny_patch16_224", checkpoint_path=str(tmp_path / "w.pth"), **kw).double().eval()
    x = torch.randn(3, 3, 64, 64, dtype=torch.float64)
    ref_apply_patch(ref, 8, trace_source=True)
    tome.apply(ours, r=8, trace_source=True)
    with torch.no_grad():
        ref._tome_info.update(r=ref_parse_r(len(ref.blocks), ref.r), size=None, source=None)
        feats = ref.forward_features(x)
        size = ref._tome_info["size"]
        pooled = (feats * size)[:, 1:].sum(dim=1) / size[:, 1:].sum(dim=1)
        want = ref.head(ref.fc_norm(pooled))
        got, got_pooled = ours(x), ours.forward_head(ours.forward_features(x), pre_logits=True)
        # the same vector as the plain mean over every input patch of its token's features (un-merged)
        unmerged = (tome.info(ours).source[:, 1:, 1:].transpose(1, 2) @ ours.forward_features(x)[:, 1:]).mean(dim=1)
    assert feats.shape[1] == 65 - 4 * 8  # tokens were merged
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_pooled, ours.fc_norm(unmerged), rtol=1e-9, atol=1e-9)


def test_r0_equals_unpatched_and_remove_restores_exactly():
    model = vitlab.create_model("deit_tiny_distilled_patch16_224", **KW).eval()
    x = torch.randn(2, 3, 64, 64)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    cls = (type(model), [type(b) for b in model.blocks])
    with torch.no_grad():
        base = model(x)
        tome.apply(model, r=0)
        assert torch.equal(model(x), base)
        tome.apply(model, r=5)
        assert not torch.allclose(model(x), base)
        assert model.state_dict().keys() == sd.keys()  # no new weights, no renamed ones
        tome.remove(model)
        assert torch.equal(model(x), base)
    assert (type(model), [type(b) for b in model.blocks]) == cls
    assert not hasattr(model, "_tome") and not any(hasattr(b, "_tome") for b in model.blocks)
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["halvit_tiny_patch16_224", "cait_xxs24_224", "vit_tiny_patch16_224"])
def test_families_merge_train_and_unmerge(name):
    kw = dict(KW, reg_tokens=2) if name.startswith("vit_") else KW
    model = vitlab.create_model(name, **kw)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        base = model.eval()(x)
        tome.apply(model, r=0)
        assert torch.equal(model(x), base)
    tome.apply(model, r=6, trace_source=True)
    model.train()
    model(x).sum().backward()  # trains: gradients flow through the size-weighted merges
    assert all(p.grad is not None for p in model.blocks[-1].parameters() if p.requires_grad)
    src = tome.info(model).source  # (B, N', N0): every input token in exactly one output token
    assert torch.equal(src.sum(1), torch.ones_like(src.sum(1)))
    p = getattr(model, "num_prefix_tokens", 0) if name != "cait_xxs24_224" else 0
    assert src.shape[1] == 64 + p - 4 * 6
    model.eval()
    with torch.no_grad():
        final, maps = model.forward_intermediates(x, indices=[0, 3])
        torch.testing.assert_close(final, model.forward_features(x))
        tokens = model.forward_intermediates(x, indices=[3], output_fmt="NLC", intermediates_only=True)[0]
    assert [m.shape[-2:] for m in maps] == [(8, 8), (8, 8)] and tokens.shape[1] == 64
    # un-merged: the patches that ended in one token carry that token's vector
    owner = tome.info(model).source[0, :, p:].argmax(0)  # the token each patch ended in
    same = owner[:, None] == owner[None, :]
    assert int(same.sum()) > 64  # some patches share a token
    grid = tokens[0]
    assert torch.equal((grid[:, None] - grid[None]).abs().amax(-1)[same], torch.zeros(int(same.sum())))
    tome.remove(model)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), base)


def test_protected_tokens_stay_first_and_untouched():
    model = vitlab.create_model("vit_tiny_patch16_224", reg_tokens=3, **KW).eval()
    tome.apply(model, r=10, trace_source=True)
    with torch.no_grad():
        model(torch.randn(2, 3, 64, 64))
    src = tome.info(model).source
    p = model.num_prefix_tokens  # 4: class + 3 registers
    assert torch.equal(src[:, :p, :p], torch.eye(p).expand(2, p, p))  # each one alone, in its place
    assert src[:, :p, p:].sum() == 0


def test_schedules_and_bad_input():
    assert tome.parse_r(4, 3) == [3, 3, 3, 3]
    assert tome.parse_r(4, (4, -1.0)) == [8, 5, 2, 0]  # the paper's decreasing schedule
    assert tome.parse_r(4, [1, 2]) == [1, 2, 0, 0]
    model = vitlab.create_model("deit_tiny_patch16_224", **KW)
    with pytest.raises(ValueError, match="at most 63 can merge"):  # 65 tokens, 1 protected
        tome.apply(model, r=16)
    for name in ("swin_tiny_patch4_window7_224", "levit_128s"):
        with torch.device("meta"), pytest.raises(ValueError, match="hierarchical"):
            tome.apply(vitlab.create_model(name), r=2)
    with pytest.raises(ValueError, match="rope"):
        tome.apply(vitlab.create_model("vit_tiny_patch16_224", pos_embed="rope", **KW), r=2)
    with pytest.raises(ValueError, match="non-negative"):
        tome.apply(model, r=-1)
    with pytest.raises(ValueError, match="not patched"):
        tome.remove(model)


def test_merge_png(tmp_path):
    model = vitlab.create_model("deit_tiny_patch16_224", **KW).eval()
    tome.apply(model, r=8)
    img = torch.rand(3, 64, 64)
    regions = tome.merge_regions(model, img)
    assert regions.shape == (8, 8) and len(regions.unique()) == 64 - 4 * 8
    assert tome.merge_png(model, img)[:4] == b"\x89PNG"
    assert model._tome.trace_source is False  # switched on for the drawing only


@pytest.mark.slow
def test_compile_matches_eager():
    torch._dynamo.reset()
    model = vitlab.create_model("deit_tiny_distilled_patch16_224", **KW).eval()
    tome.apply(model, r=6)
    x = torch.randn(2, 3, 64, 64)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    model.train()
    out = torch.compile(model)(x)
    sum(out).sum().backward()
