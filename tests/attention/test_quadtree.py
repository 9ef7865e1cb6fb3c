"""QuadTree attention against direct per-query references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vitlab.attention import create


def _grids(m, x, hw, f):
    """Padded q, k, v grids (B, C, Hp, Wp) and the validity map (Hp, Wp)."""
    B, N, C = x.shape
    H, W = hw
    Hp, Wp = -(-H // f) * f, -(-W // f) * f
    g = F.pad(m.qkv(x).transpose(1, 2).reshape(B, 3 * C, H, W), (0, Wp - W, 0, Hp - H))
    valid = F.pad(torch.ones(H, W), (0, Wp - W, 0, Hp - H)).bool()
    return (*g.split(C, 1), valid)


def _pool_valid(t, valid):
    """Mean over the valid children of each 2x2 cell; coarse validity."""
    num = F.avg_pool2d(t * valid, 2)
    cnt = F.avg_pool2d(valid[None, None].float(), 2)[0, 0]
    return num / cnt.clamp_min(1e-6), cnt > 0


def _heads(t, nh):  # (B, C, H, W) -> (B, nh, H*W, d), row-major positions
    B, C = t.shape[:2]
    return t.reshape(B, nh, C // nh, -1).transpose(-2, -1)


@pytest.mark.parametrize("hw", [(6, 8), (5, 7)])
def test_two_levels_match_per_query_reference(hw):
    torch.manual_seed(0)
    H, W = hw
    m = create("quadtree", 32, 2, topk=3).eval()
    torch.nn.init.normal_(m.level_weight)
    x = torch.randn(1, H * W, 32)
    with torch.no_grad():
        out = m(x, hw)
        q, k, v, valid = _grids(m, x, hw, 2)
        Hp, Wp = valid.shape
        qc, validc = _pool_valid(q, valid)
        kc, _ = _pool_valid(k, valid)
        vc = m.value_branches[0](v)
        lepe_c, lepe_f = m.lepe[1](vc), m.lepe[0](v)
        w = m.level_weight.softmax(0)
        Qc, Kc, Vc = _heads(qc, 2)[0], _heads(kc, 2)[0], _heads(vc, 2)[0]  # (nh, Lc, d)
        Qf, Kf, Vf = _heads(q, 2)[0], _heads(k, 2)[0], _heads(v, 2)[0]
        Lc_w, scale = Wp // 2, 16**-0.5
        ref = torch.zeros(Hp * Wp, 32)
        for h in range(2):
            logits = (Qc[h] @ Kc[h].T * scale).masked_fill(~validc.flatten(), float("-inf"))
            msg_c = logits.softmax(-1) @ Vc[h]
            top = logits.topk(3, dim=-1).indices
            for y in range(Hp):
                for xx in range(Wp):
                    p = (y // 2) * Lc_w + xx // 2
                    cand = [(2 * (c // Lc_w) + dy) * Wp + 2 * (c % Lc_w) + dx
                            for c in top[p].tolist() for dy in (0, 1) for dx in (0, 1)]
                    cand = [c for c in cand if valid.flatten()[c]]
                    a = (Kf[h, cand] @ Qf[h, y * Wp + xx] * scale).softmax(-1)
                    msg_f = a @ Vf[h, cand]
                    sl = slice(h * 16, (h + 1) * 16)
                    ref[y * Wp + xx, sl] = (w[1] * (msg_c[p] + lepe_c[0, sl, y // 2, xx // 2])
                                            + w[0] * (msg_f + lepe_f[0, sl, y, xx]))
        ref = m.proj(ref.reshape(Hp, Wp, 32)[:H, :W].reshape(1, H * W, 32))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("hw", [(8, 8), (7, 10)])
def test_three_levels_with_all_keys_is_full_attention_per_level(hw):
    """With top-k at least the number of keys, every level sees all its keys: full attention per level."""
    torch.manual_seed(0)
    H, W = hw
    m = create("quadtree", 32, 2, num_levels=3, topk=10_000).eval()
    torch.nn.init.normal_(m.level_weight)
    x = torch.randn(2, H * W, 32)
    with torch.no_grad():
        out = m(x, hw)
        q, k, v, valid = _grids(m, x, hw, 4)
        Hp, Wp = valid.shape
        w = m.level_weight.softmax(0)
        acc = 0
        for lvl in range(3):
            if lvl:
                q, _ = _pool_valid(q, valid)
                k, valid = _pool_valid(k, valid)
                v = m.value_branches[lvl - 1](v)
            mask = valid.flatten()[None, None, None]
            msg = F.scaled_dot_product_attention(_heads(q, 2), _heads(k, 2), _heads(v, 2), attn_mask=mask)
            msg = msg.transpose(-2, -1).reshape(v.shape) + m.lepe[lvl](v)  # (B, C, h, w)
            acc = acc + w[lvl] * F.interpolate(msg, scale_factor=2**lvl, mode="nearest")
        ref = m.proj(acc[:, :, :H, :W].flatten(2).transpose(1, 2))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_prefix_tokens_are_refused():
    m = create("quadtree", 32, 2)
    with pytest.raises(ValueError, match="prefix"):
        m(torch.randn(1, 1 + 16, 32), (4, 4))


@pytest.mark.parametrize("hw", [(6, 8), (13, 17)])
@pytest.mark.parametrize("levels", [2, 3])
def test_attention_weights_give_each_level_message(hw, levels):
    """return_attn: one (B, heads, N_l, N_l) map per level, finest first, rows summing to 1, at most 4 topk
    non-zeros per row below the coarsest level; without LePE the output is the projection of the level-weighted
    sum of A_l v_l, upsampled (nearest) to the token grid."""
    torch.manual_seed(0)
    H, W = hw
    m = create("quadtree", 32, 2, topk=3, num_levels=levels, lepe=False).eval()
    torch.nn.init.normal_(m.level_weight)
    x = torch.randn(2, H * W, 32)
    with torch.no_grad():
        out, attn = m(x, hw, return_attn=True)
        torch.testing.assert_close(out, m(x, hw))
        f = 2 ** (levels - 1)
        _, _, v, _ = _grids(m, x, hw, f)
        vs = [v]
        for branch in m.value_branches:
            vs.append(branch(vs[-1]))
        w = m.level_weight.softmax(0)
        total = torch.zeros(2, H, W, 32)
        for lvl, (a, vl) in enumerate(zip(attn, vs)):
            h, wd = -(-H // 2**lvl), -(-W // 2**lvl)
            assert a.shape == (2, 2, h * wd, h * wd)
            torch.testing.assert_close(a.sum(-1), torch.ones(2, 2, h * wd))
            if lvl < levels - 1:
                assert ((a > 0).sum(-1) <= 4 * 3).all()
            msg = a @ _heads(vl[:, :, :h, :wd], 2)  # (B, heads, h*wd, d)
            msg = msg.transpose(1, 2).reshape(2, h, wd, 32)
            up = msg.repeat_interleave(2**lvl, 1).repeat_interleave(2**lvl, 2)[:, :H, :W]
            total += w[lvl] * up
        torch.testing.assert_close(m.proj(total.reshape(2, H * W, 32)), out, rtol=1e-4, atol=1e-5)
