"""The open registry of self-supervised methods: a method registered by a user (a SimSiam) built through
vitlab.ssl.create, the built-in methods' declared views and trainer-facing members, the one-line errors, MAE's
uniform views contract and the local-crop size rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vitlab.ssl as S
from vitlab.ssl import base
from vitlab.ssl.base import SSLMethod, ViewSpec, views_of
from vitlab.ssl.mae import random_masking


@pytest.fixture
def simsiam(monkeypatch):
    """SimSiam (Chen & He, 2021, "Exploring Simple Siamese Representation Learning", Algorithm 1) registered as
    ``simsiam_test`` for one test: encoder f = backbone + 3-layer projector (BN, output BN without affine),
    predictor h (2-layer bottleneck MLP), symmetric negative cosine with stop-gradient on the targets."""
    from vitlab.train.task import TASKS

    monkeypatch.setattr(base, "_METHODS", dict(base._METHODS))  # the registration ends with the test
    monkeypatch.setattr("vitlab.train.task.TASKS", dict(TASKS))  # and its pre-training task, where one was made

    @S.register_method("simsiam_test")
    class SimSiam(SSLMethod):
        views = ViewSpec(global_views=2)

        def __init__(self, backbone: nn.Module, dim: int = 2048, pred_dim: int = 512):
            super().__init__(backbone)
            d = int(backbone.num_features)
            self.projector = nn.Sequential(
                nn.Linear(d, dim, bias=False), nn.BatchNorm1d(dim), nn.ReLU(inplace=True),
                nn.Linear(dim, dim, bias=False), nn.BatchNorm1d(dim), nn.ReLU(inplace=True),
                nn.Linear(dim, dim, bias=False), nn.BatchNorm1d(dim, affine=False))
            self.predictor = nn.Sequential(nn.Linear(dim, pred_dim, bias=False), nn.BatchNorm1d(pred_dim),
                                           nn.ReLU(inplace=True), nn.Linear(pred_dim, dim))

        def objective(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
            x1, x2 = views_of(views)[:2]
            z1, z2 = self.projector(self.features(x1)), self.projector(self.features(x2))
            p1, p2 = self.predictor(z1), self.predictor(z2)
            loss = -(F.cosine_similarity(p1, z2.detach()).mean() + F.cosine_similarity(p2, z1.detach()).mean()) / 2
            return {"loss": loss, "z1": z1, "z2": z2, "p1": p1, "p2": p2}

    return SimSiam


def test_a_registered_method_builds_trains_and_monitors(simsiam):
    assert "simsiam_test" in S.list_methods() and S.method_class("simsiam_test") is simsiam
    assert S.method_options("simsiam_test") == ["dim", "pred_dim"]
    assert [(p.name, p.annotation, p.default) for p in S.method_parameters("simsiam_test")] == [
        ("dim", int, 2048), ("pred_dim", int, 512)]
    torch.manual_seed(0)
    m = S.create("simsiam_test", "vit_pico_patch8_32", dim=32, pred_dim=8)
    assert isinstance(m, SSLMethod) and m.model.num_classes == 0  # a headless backbone
    x1, x2 = torch.randn(4, 1, 32, 32), torch.randn(4, 1, 32, 32)
    out = m([x1, x2])
    want = -(F.cosine_similarity(out["p1"], out["z2"]).mean() + F.cosine_similarity(out["p2"], out["z1"]).mean()) / 2
    torch.testing.assert_close(out["loss"], want)
    # stop-gradient: z1 gets its gradient through the predictor alone, none as the target of p2
    through_predictor = -F.cosine_similarity(out["p1"], out["z2"].detach()).mean() / 2
    g, g_pred = (torch.autograd.grad(t, out["z1"], retain_graph=True)[0] for t in (out["loss"], through_predictor))
    torch.testing.assert_close(g, g_pred)
    out["loss"].backward()
    for part in (m.model.patch_embed, m.projector, m.predictor):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters())
    # the base class's defaults: no-op hooks, features for the collapse monitors, no run files
    m.before_optimizer_step()
    m.after_step(0, 10, 5)
    mon = m(x1, monitor=True)
    assert set(mon) == {"features"} and mon["features"].shape == (4, m.model.num_features)
    assert m.artifacts(x1, [0.5], [0.5]) == {}
    with pytest.raises(ValueError, match="unknown option.*mask_ratio.*it takes dim, pred_dim"):
        S.create("simsiam_test", "vit_pico_patch8_32", mask_ratio=0.5)


def test_register_method_refuses_bad_classes(simsiam):
    with pytest.raises(ValueError, match="'simsiam_test' is registered twice"):
        S.register_method("simsiam_test")(simsiam)
    with pytest.raises(TypeError, match="subclass of vitlab.ssl.SSLMethod"):
        S.register_method("plain_module")(nn.Linear)
    with pytest.raises(TypeError, match="must be a vitlab.ssl.ViewSpec"):
        S.register_method("bad_views")(type("BadViews", (SSLMethod,), {"views": 2}))
    with pytest.raises(ValueError, match="at least one global view"):
        ViewSpec(global_views=0)
    assert "bad_views" not in S.list_methods()


def test_unknown_method_is_one_line_with_close_matches():
    with pytest.raises(ValueError, match=r"unknown self-supervised method 'dinoo'; close matches: dino, dinov2 "
                                         r"\(choose from mae, simclr, mocov3, dino, dinov2"):
        S.create("dinoo", "vit_pico_patch8_32")


def test_builtin_methods_declare_their_views_and_monitor():
    assert S.list_methods()[:5] == ["mae", "simclr", "mocov3", "dino", "dinov2"]
    views = {name: S.method_class(name).views for name in S.list_methods()[:5]}
    assert views["mae"] == ViewSpec(global_views=1, plain=True)  # one crop + flip, no jitter (MAE, appendix A.1)
    assert views["simclr"] == views["mocov3"] == ViewSpec(global_views=2)
    assert views["dino"] == views["dinov2"] == ViewSpec(global_views=2, local_crops=True)
    assert (S.MAE.monitor, S.MAE.monitor_mode) == ("loss", "min")
    assert all((S.method_class(n).monitor, S.method_class(n).monitor_mode) == ("effective_rank", "max")
               for n in ("simclr", "mocov3", "dino", "dinov2"))
    # DINOv2 passes **kwargs on to DINO: its options are both classes' (its own out_dim once, first)
    dinov2 = [p.name for p in S.method_parameters("dinov2")]
    assert dinov2[0] == "out_dim" and dinov2.count("out_dim") == 1 and {"mask_mode", "teacher_temp"} <= set(dinov2)
    # a method with local crops gets a backbone that takes their size
    assert S.create("dino", "vit_pico_patch8_32", backbone_kwargs=dict(depth=1), out_dim=16, hidden_dim=16,
                    bottleneck_dim=8).model.dynamic_img_size
    assert not S.create("simclr", "vit_pico_patch8_32", backbone_kwargs=dict(depth=1)).model.dynamic_img_size


def test_mae_takes_a_list_of_one_view_and_fixes_its_validation_masks():
    torch.manual_seed(0)
    m = S.create("mae", "vit_pico_patch8_32", backbone_kwargs=dict(depth=1), decoder_dim=16, decoder_depth=1,
                 decoder_heads=2).eval()
    x = torch.randn(3, 1, 32, 32)
    noise = torch.rand(3, 16)
    with torch.no_grad():
        a, b = m([x], noise=noise), m(x, noise=noise)
        torch.testing.assert_close(a["loss"], b["loss"], rtol=0, atol=0)
        v1, v2 = m([x], monitor=True), m([x], monitor=True)
        fixed = torch.rand(3, 16, generator=torch.Generator().manual_seed(0))
        assert torch.equal(v1["mask"], v2["mask"]) and torch.equal(v1["mask"], random_masking(
            torch.zeros(3, 16, 1), 0.75, fixed)[1])
        torch.testing.assert_close(v1["loss"], m([x], noise=fixed)["loss"], rtol=0, atol=0)
        assert v1["features"].shape == (3, m.model.num_features)
    m.before_optimizer_step()
    m.after_step(0, 10, 5)  # MAE has no schedule: the no-op defaults
    files = m.artifacts(x, mean=[0.5], std=[0.5])
    assert list(files) == ["reconstructions.png"] and files["reconstructions.png"][:4] == b"\x89PNG"


@pytest.mark.parametrize("img_size, patch, want", [
    (32, 8, 16),    # vit_pico_patch8_32: 13.7 px -> two patches
    (224, 16, 96),  # DINO's 96-pixel local crops
    (224, 14, 98),  # DINOv2's 98-pixel local crops of a 14-pixel-patch ViT
    (224, 4, 96),   # Swin's 4-pixel patches
    (28, 2, 12),
    (16, 8, 8),     # at least one patch
    (4, 8, 8),
])
def test_default_local_crop_size(img_size, patch, want):
    got = S.default_local_crop_size(img_size, patch)
    assert got == want and got % patch == 0


def test_default_local_crop_size_refuses_sizes_below_one():
    with pytest.raises(ValueError, match="must be positive"):
        S.default_local_crop_size(0, 8)
