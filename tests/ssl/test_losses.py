"""vitlab.ssl.losses against lightly's losses (dev-only oracle) and literal re-statements of the papers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vitlab.ssl import losses as L

lightly_loss = pytest.importorskip("lightly.loss")


@pytest.mark.parametrize("temperature", [0.5, 0.1])
def test_nt_xent_equals_lightly(temperature):
    z1, z2 = torch.randn(8, 16), torch.randn(8, 16)
    ref = lightly_loss.NTXentLoss(temperature=temperature)(z1, z2)
    torch.testing.assert_close(L.nt_xent(z1, z2, temperature), ref, rtol=1e-6, atol=1e-6)


def test_nt_xent_written_out():
    """SimCLR's NT-Xent written out (Chen et al., 2020, Eq. 1): masked_fill the diagonal, labels i+B / i."""
    z_i, z_j, T = torch.randn(5, 7), torch.randn(5, 7), 0.5
    B = 5
    z = torch.cat([F.normalize(z_i, dim=1), F.normalize(z_j, dim=1)])
    sim = (z @ z.t() / T).masked_fill(torch.eye(2 * B, dtype=torch.bool), float("-inf"))
    ref = F.cross_entropy(sim, torch.cat([torch.arange(B) + B, torch.arange(B)]))
    torch.testing.assert_close(L.nt_xent(z_i, z_j, T), ref)


def test_info_nce_is_mocov3_ctr():
    q, k, T = torch.randn(6, 8), torch.randn(6, 8), 0.2
    qn, kn = F.normalize(q, dim=1), F.normalize(k, dim=1)
    want = -sum(torch.log_softmax(qn[i] @ kn.t() / T, 0)[i] for i in range(6)) / 6
    torch.testing.assert_close(L.info_nce(q, k, T), want)


def _dino_literal(s_views, t_views, center, tt, st):
    """Algorithm 1 of DINO: H(t, s) over pairs of different views, averaged."""
    total, n = 0.0, 0
    for ti, t in enumerate(t_views):
        p_t = torch.softmax((t - center) / tt, dim=-1)
        for si, s in enumerate(s_views):
            if si == ti:
                continue
            total = total - (p_t * torch.log_softmax(s / st, dim=-1)).sum(-1).mean()
            n += 1
    return total / n


def test_dino_equals_lightly_and_the_paper_with_centering_steps():
    K, B = 32, 4
    ref = lightly_loss.DINOLoss(output_dim=K, teacher_temp=0.07, student_temp=0.1, center_momentum=0.9)
    center = L.Centering(K, momentum=0.9)
    for step in range(3):  # the centre moves step by step exactly as lightly's
        t_views = [torch.randn(B, K) * 3 for _ in range(2)]
        s_views = [torch.randn(B, K) for _ in range(5)]  # the first two are the global views
        tt = 0.04 + 0.01 * step
        want = ref(t_views, s_views, teacher_temp=tt)
        got = L.dino(s_views, t_views, teacher_temp=tt, student_temp=0.1, center=center.center)
        lit = _dino_literal(s_views, t_views, center.center, tt, 0.1)
        center.update(torch.stack(t_views))
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, lit, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(center.center, ref.center.reshape(1, K), rtol=1e-6, atol=1e-7)


def test_centering_is_the_ema_of_batch_means():
    c = L.Centering(3, momentum=0.9)
    a, b = torch.ones(2, 4, 3), torch.full((5, 3), 2.0)
    c.update(a)
    torch.testing.assert_close(c.center, torch.full((1, 3), 0.1))
    c.update(b)
    torch.testing.assert_close(c.center, torch.full((1, 3), 0.9 * 0.1 + 0.1 * 2.0))
    with pytest.raises(ValueError, match="momentum"):
        L.Centering(3, momentum=1.0)


def test_ibot_patch_equals_lightly_and_the_paper():
    B, H, W, K = 3, 2, 3, 16
    mask = torch.rand(B, H, W) < 0.5
    mask[0] = False  # an image without masked tokens contributes 0 but still counts in the batch mean
    mask[1, 0, 0] = True
    s, t = torch.randn(B, H * W, K), torch.randn(B, H * W, K) * 2
    flat = mask.flatten(1)
    ref = lightly_loss.IBOTPatchLoss(output_dim=K, teacher_temp=0.05, student_temp=0.1)
    want = ref(t[flat], s[flat], mask, teacher_temp=0.05)  # its centre starts at 0
    got = L.ibot_patch(s, t, flat, teacher_temp=0.05, student_temp=0.1, center=torch.zeros(1, K))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # iBOT eq. 2 per image: -sum_{masked i} P_t(i) log P_s(i) / |masked|, averaged over images
    per = []
    for b in range(B):
        idx = flat[b].nonzero().flatten()
        if len(idx) == 0:
            per.append(torch.tensor(0.0))
            continue
        p_t = torch.softmax(t[b, idx] / 0.05, -1)
        per.append(-(p_t * torch.log_softmax(s[b, idx] / 0.1, -1)).sum(-1).mean())
    torch.testing.assert_close(got, torch.stack(per).mean(), rtol=1e-5, atol=1e-6)


def test_koleo_equals_lightly():
    x = torch.randn(16, 8)
    torch.testing.assert_close(L.koleo(x), lightly_loss.KoLeoLoss()(x), rtol=1e-6, atol=1e-6)


def test_koleo_paper_formula():
    x = F.normalize(torch.randn(6, 4), dim=1)
    d = torch.cdist(x, x) + torch.eye(6) * 10
    torch.testing.assert_close(L.koleo(x), -torch.log(d.min(dim=1).values + 1e-8).mean(), rtol=1e-5, atol=1e-5)


def _sinkhorn_dinov2(teacher_output, teacher_temp, n_iterations=3):
    """DINOv2's sinkhorn_knopp_teacher (dinov2/loss/dino_clstoken_loss.py), one process."""
    Q = torch.exp(teacher_output / teacher_temp).t()
    B, K = Q.shape[1], Q.shape[0]
    Q /= torch.sum(Q)
    for _ in range(n_iterations):
        Q /= torch.sum(Q, dim=1, keepdim=True)
        Q /= K
        Q /= torch.sum(Q, dim=0, keepdim=True)
        Q /= B
    Q *= B
    return Q.t()


def test_sinkhorn_knopp():
    logits = torch.randn(12, 5) * 0.1
    q = L.sinkhorn_knopp(logits, 0.05)
    torch.testing.assert_close(q, _sinkhorn_dinov2(logits.clone(), 0.05))
    torch.testing.assert_close(q.sum(1), torch.ones(12))
    # prototypes used (nearly) equally: the column masses converge to B/K
    assert (q.sum(0) - 12 / 5).abs().max() < 0.5


def test_entropy_and_kl():
    K = 8
    u = torch.full((3, K), 1.0 / K)
    torch.testing.assert_close(L.entropy(u), torch.tensor(math.log(K)))
    p = torch.softmax(torch.randn(3, K), -1)
    torch.testing.assert_close(L.kl_div(p, torch.log(p)), torch.tensor(0.0), atol=1e-6, rtol=0)
    q = torch.softmax(torch.randn(3, K), -1)
    torch.testing.assert_close(L.kl_div(p, torch.log(q)), F.kl_div(torch.log(q), p, reduction="batchmean"))
