"""SimCLR, MoCo v3, DINO, DINOv2: create(), forward/backward on plain and hierarchical backbones, the EMA and
temperature schedules step by step, the DINO head's weight normalisation."""

from __future__ import annotations

import math

import pytest
import torch

import vitlab
import vitlab.ssl as S
from vitlab.ssl import losses as L
from vitlab.ssl.masking import dinov2_masks, random_patch_mask
from vitlab.ssl.methods import DINOHead, cosine_momentum, ema_update, teacher_temperature, vit_tokens

SMALL = {"simclr": dict(proj_hidden_dim=32, proj_dim=16), "mocov3": dict(dim=16, mlp_dim=32),
         "dino": dict(out_dim=64, hidden_dim=32, bottleneck_dim=16),
         "dinov2": dict(out_dim=64, hidden_dim=32, bottleneck_dim=16)}


def _views(method, n=4):
    g = [torch.randn(n, 1, 32, 32) for _ in range(2)]
    return g + ([torch.randn(n, 1, 16, 16) for _ in range(2)] if method.startswith("dino") else [])


@pytest.mark.parametrize("method", ["simclr", "mocov3", "dino", "dinov2"])
def test_methods_train_a_plain_vit(method):
    m = S.create(method, "vit_pico_patch8_32", backbone_kwargs=dict(depth=1), **SMALL[method])
    out = m(_views(method))
    assert out["loss"].ndim == 0 and torch.isfinite(out["loss"])
    out["loss"].backward()
    grads = [p.grad for n, p in m.model.named_parameters() if p.requires_grad and "head" not in n]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    teacher = getattr(m, "teacher", None) or getattr(m, "momentum_model", None)
    if teacher is not None:
        assert all(p.grad is None for p in teacher.parameters())


HIER = ["swin_tiny_patch4_window7_224", "pvt_tiny", "litv2_s"]
FAST = {("simclr", "swin_tiny_patch4_window7_224"), ("mocov3", "pvt_tiny"), ("dino", "litv2_s")}


@pytest.mark.parametrize("method,name", [
    pytest.param(m, n, marks=() if (m, n) in FAST else pytest.mark.slow)
    for m in ("simclr", "mocov3", "dino") for n in HIER])
def test_hierarchical_backbones_through_pooled_features(method, name):
    kw = dict(vitlab.get_model_config(name).smoke_kwargs)
    kw["depths"] = (1,) * len(kw.get("depths", (1, 1, 1, 1)))
    m = S.create(method, name, backbone_kwargs=kw, **SMALL[method])
    s = kw["img_size"]
    views = [torch.randn(2, 3, s, s) for _ in range(2)]
    if method == "dino" and name != "swin_tiny_patch4_window7_224":  # Swin takes one size only: no local crops
        views += [torch.randn(2, 3, s // 2, s // 2)]
    out = m(views)
    out["loss"].backward()
    assert torch.isfinite(out["loss"])


def test_create_bad_input():
    with pytest.raises(ValueError, match="unknown self-supervised method 'byol'"):
        S.create("byol", "vit_pico_patch8_32")
    with pytest.raises(ValueError, match="plain ViT"):
        S.create("mae", "swin_tiny_patch4_window7_224", backbone_kwargs=vitlab.get_model_config(
            "swin_tiny_patch4_window7_224").smoke_kwargs)
    with pytest.raises(ValueError, match="plain ViT"):
        S.create("dinov2", "pvt_tiny", backbone_kwargs=dict(img_size=64))
    with pytest.raises(ValueError, match="unknown option"):
        S.create("simclr", "vit_pico_patch8_32", mask_ratio=0.5)
    with pytest.raises(ValueError, match="two views"):
        S.create("simclr", "vit_pico_patch8_32")(torch.randn(2, 1, 32, 32))


def test_cosine_momentum_and_teacher_temperature_schedules():
    assert cosine_momentum(0, 100, 0.996) == pytest.approx(0.996)
    assert cosine_momentum(50, 100, 0.996) == pytest.approx(0.998)
    assert cosine_momentum(100, 100, 0.99) == pytest.approx(1.0)
    # DINO: np.linspace(0.04, 0.07, 30) per epoch, then 0.07
    want = [0.04 + 0.03 * e / 29 for e in range(30)] + [0.07] * 5
    assert [teacher_temperature(e, 30, 0.04, 0.07) for e in range(35)] == pytest.approx(want)


def test_dino_teacher_ema_step_by_step():
    """after_step(k) moves the teacher with m_k = 1 - (1 - 0.996)(cos(pi k / K) + 1) / 2 and advances the epoch."""
    m = S.create("dino", "vit_pico_patch8_32", backbone_kwargs=dict(depth=1), warmup_teacher_temp_epochs=3,
                 **SMALL["dino"])
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
    total, per_epoch = 6, 2
    for k in range(total):
        t_before = [p.detach().clone() for p in m.teacher.parameters()]
        assert m.teacher_temp() == pytest.approx(teacher_temperature(k // per_epoch, 3, 0.04, 0.07))
        m(_views("dino"))["loss"].backward()
        opt.step()
        opt.zero_grad()
        s_after = [p.detach().clone() for p in m.model.parameters()]
        m.after_step(k, total, per_epoch)
        mk = 1 - (1 - 0.996) * (math.cos(math.pi * k / total) + 1) / 2
        for tb, sa, ta in zip(t_before, s_after, m.teacher.parameters(), strict=True):
            torch.testing.assert_close(ta, mk * tb + (1 - mk) * sa)
    assert int(m.progress.step) == total and m.progress.epoch == 3


def test_dino_centre_moves_by_the_teacher_batch_mean():
    m = S.create("dino", "vit_pico_patch8_32", backbone_kwargs=dict(depth=1), **SMALL["dino"]).eval()
    views = _views("dino")
    with torch.no_grad():
        t = m.teacher_head(S.methods.pooled_features(m.teacher, torch.cat(views[:2])))
        m(views)
    torch.testing.assert_close(m.center.center, 0.1 * t.mean(0, keepdim=True), rtol=1e-5, atol=1e-7)


def test_mocov3_momentum_encoder_and_stop_grad_patch_embed():
    m = S.create("mocov3", "vit_pico_patch8_32", backbone_kwargs=dict(depth=1), stop_grad_patch_embed=True,
                 **SMALL["mocov3"])
    assert not any(p.requires_grad for p in m.model.patch_embed.parameters())
    with torch.no_grad():
        for p in m.model.parameters():
            p.add_(1.0)
    before = [p.clone() for p in m.momentum_model.parameters()]
    m.after_step(0, 10, 5)
    mk = cosine_momentum(1, 10, 0.99)  # MoCo v3 moves the key encoder with the next iteration's momentum
    for b, s, t in zip(before, m.model.parameters(), m.momentum_model.parameters(), strict=True):
        torch.testing.assert_close(t, mk * b + (1 - mk) * s)
    q, k = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(m.ctr(q, k), L.info_nce(q, k, 0.2) * 0.4)


def test_ema_update_copies_buffers():
    a, b = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    b.running_mean.fill_(2.0)
    b.weight.data.fill_(3.0)
    ema_update(a, b, 0.5)
    torch.testing.assert_close(a.running_mean, torch.full((3,), 2.0))
    torch.testing.assert_close(a.weight, torch.full((3,), 2.0))


def test_dino_head_weight_norm():
    h = DINOHead(8, out_dim=5, hidden_dim=16, bottleneck_dim=4)
    w = h.last_layer_weight()
    torch.testing.assert_close(w.norm(dim=1), torch.ones(5))
    assert "weight_g" not in dict(h.named_parameters())  # the norm is fixed (norm_last_layer)
    free = DINOHead(8, out_dim=5, hidden_dim=16, bottleneck_dim=4, norm_last_layer=False)
    assert dict(free.named_parameters())["weight_g"].requires_grad


def test_dinov2_objective_parts_and_mask():
    torch.manual_seed(1)
    mask = random_patch_mask(400, 16, (0.1, 0.5), 0.5)
    frac_images = mask.any(1).float().mean().item()
    assert 0.4 < frac_images < 0.6
    ratios = mask.float().mean(1)[mask.any(1)]
    assert ratios.min() >= 1 / 16 and ratios.max() <= 0.5
    m = S.create("dinov2", "vit_pico_patch8_32", backbone_kwargs=dict(depth=1), mask_probability=1.0,
                 **SMALL["dinov2"])
    out = m(_views("dinov2"))
    torch.testing.assert_close(out["loss"], out["dino_loss"] + out["ibot_loss"] + 0.1 * out["koleo_loss"])
    assert out["ibot_loss"] > 0
    s = S.create("dinov2", "vit_pico_patch8_32", backbone_kwargs=dict(depth=1), sinkhorn=True, **SMALL["dinov2"])
    assert torch.isfinite(s(_views("dinov2"))["loss"])
    assert torch.equal(s.center.center, torch.zeros_like(s.center.center))  # Sinkhorn replaces the centre


@pytest.mark.parametrize("norm_last_layer", [True, False])
def test_dino_freeze_last_layer_step_by_step(norm_last_layer):
    """DINO's cancel_gradients_last_layer: with 2 steps an epoch and freeze_last_layer=1, the last layer (v, and g
    when trained) has no gradient and stays put at steps 0-1 (AdamW with weight decay leaves it), moves from step 2;
    the rest of the head moves at every step."""
    torch.manual_seed(0)
    m = S.create("dino", "vit_pico_patch8_32", backbone_kwargs=dict(depth=1), norm_last_layer=norm_last_layer,
                 **SMALL["dino"])
    assert m.freeze_last_layer == 1  # DINO's default
    last = m.head.last_layer_parameters()
    assert len(last) == (1 if norm_last_layer else 2)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    total, per_epoch = 4, 2
    for k in range(total):
        before = [p.detach().clone() for p in last]
        mlp_before = m.head.mlp[0].weight.detach().clone()
        m(_views("dino"))["loss"].backward()
        assert all(p.grad is not None for p in last)
        m.before_optimizer_step()
        frozen = k < per_epoch
        assert all((p.grad is None) == frozen for p in last)
        opt.step()
        opt.zero_grad(set_to_none=True)
        m.after_step(k, total, per_epoch)
        for b, p in zip(before, last, strict=True):
            assert torch.equal(b, p) == frozen, (k, frozen)
        assert not torch.equal(mlp_before, m.head.mlp[0].weight)
    never = S.create("dino", "vit_pico_patch8_32", backbone_kwargs=dict(depth=1), freeze_last_layer=0, **SMALL["dino"])
    never(_views("dino"))["loss"].backward()
    never.before_optimizer_step()
    assert never.head.weight_v.grad is not None
    with pytest.raises(ValueError, match="freeze_last_layer must be >= 0"):
        S.create("dino", "vit_pico_patch8_32", freeze_last_layer=-1, **SMALL["dino"])


def test_dinov2_freezes_both_heads_last_layers():
    m = S.create("dinov2", "vit_pico_patch8_32", backbone_kwargs=dict(depth=1), ibot_separate_head=True,
                 mask_probability=1.0, **SMALL["dinov2"])
    m(_views("dinov2"))["loss"].backward()
    m.before_optimizer_step()
    assert m.head.weight_v.grad is None and m.ibot_head.weight_v.grad is None
    assert m.ibot_head.mlp[0].weight.grad is not None


@pytest.mark.parametrize("method", ["dino", "mocov3"])
def test_teacher_has_no_stochastic_depth(method):
    """The teacher / momentum encoder gives deterministic targets in train mode even when the student drops
    paths (DINO and MoCo v3 build it without drop_path_rate)."""
    m = S.create(method, "vit_pico_patch8_32", backbone_kwargs=dict(depth=2, drop_path_rate=0.5),
                 **SMALL[method]).train()
    teacher = m.teacher if method == "dino" else m.momentum_model
    x = torch.randn(4, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(teacher(x), teacher(x), rtol=0, atol=0)
        assert not torch.equal(m.model(x), m.model(x))  # the student still drops paths
        ref = teacher.eval()(x)
        torch.testing.assert_close(teacher.train()(x), ref)


def test_dinov2_uses_block_masks_and_only_masked_tokens_in_ibot():
    """The default masks are DINOv2's block-wise ones; the iBOT term equals a literal restatement of iBOT eq. 2 as
    DINOv2 averages it (per image over its masked tokens, then over the 2B global crops) on the masked tokens alone,
    and an all-visible batch adds no iBOT loss."""
    torch.manual_seed(0)
    m = S.create("dinov2", "vit_pico_patch8_32", backbone_kwargs=dict(depth=1), dino_weight=0.0, koleo_weight=0.0,
                 **SMALL["dinov2"])
    assert m.mask_mode == "block"
    torch.manual_seed(3)
    got = m.make_masks(8, (4, 4))
    torch.manual_seed(3)
    assert torch.equal(got, dinov2_masks(8, (4, 4)))
    views = _views("dinov2")
    g = torch.cat(views[:2])
    mask = torch.zeros(8, 16, dtype=torch.bool)
    mask[0, :5] = True
    mask[3, [1, 6, 7]] = True
    mask[6, 15] = True
    m.make_masks = lambda b, grid, device=None: mask
    out = m(views)
    with torch.no_grad():
        s_tok = vit_tokens(m.model, g, mask, m.mask_token)[:, 1:] if m.model.num_prefix_tokens else \
            vit_tokens(m.model, g, mask, m.mask_token)
        t_tok = vit_tokens(m.teacher, g)
        t_tok = t_tok[:, m.model.num_prefix_tokens:]
        total = 0.0
        for i in range(8):
            idx = mask[i].nonzero().flatten()
            if len(idx) == 0:
                continue
            p_t = torch.softmax(m.teacher_head(t_tok[i, idx]) / 0.04, dim=-1)  # centre 0 before the first update
            log_s = torch.log_softmax(m.head(s_tok[i, idx]) / 0.1, dim=-1)
            total += float(-(p_t * log_s).sum(-1).mean())
    assert out["ibot_loss"].item() == pytest.approx(total / 8, rel=1e-5)
    assert out["loss"].item() == pytest.approx(out["ibot_loss"].item(), rel=1e-6)
    m.make_masks = lambda b, grid, device=None: torch.zeros(8, 16, dtype=torch.bool)
    assert m(views)["ibot_loss"].item() == 0.0
    with pytest.raises(ValueError, match="mask_mode must be"):
        S.create("dinov2", "vit_pico_patch8_32", mask_mode="grid", **SMALL["dinov2"])
