"""vitlab.prune: EViT and DynamicViT against literal re-statements of the authors' forward passes (youweiliang/evit
``evit.py``, raoyongming/DynamicViT ``models/dyvit.py``) on the same weights, the seed's top-k and adaptive rules,
training through the Trainer, remove(), bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vitlab
import vitlab.prune as prune
from vitlab.data import DataConfig
from vitlab.train import TrainConfig, evaluate, fit

KW = dict(img_size=64, patch_size=8, depth=6)  # 64 patches, six blocks


def _model(name="deit_tiny_patch16_224", **kw):
    torch.manual_seed(0)
    return vitlab.create_model(name, **{**KW, **kw}).double().eval()


def _explicit_attention(attn, x):
    """timm-style attention with its weights: (output, weights (B, h, N, N))."""
    B, N, C = x.shape
    qkv = attn.qkv(x).reshape(B, N, 3, attn.num_heads, C // attn.num_heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    a = ((q @ k.transpose(-2, -1)) * attn.scale).softmax(dim=-1)
    return attn.proj((a @ v).transpose(1, 2).reshape(B, N, C)), a


def ref_evit_features(model, x, keep_rate, locs, fuse_mean=False):
    """The authors' EViT block (fuse_token=True) on our model's modules; ``fuse_mean``: the fused token divided by
    its attention mass (our variant for patch-pooled models)."""
    x = model.embed(x)[0]
    for i, blk in enumerate(model.blocks):
        B, N, C = x.shape
        tmp, attn = _explicit_attention(blk.attn, blk.norm1(x))
        x = x + tmp
        if i in locs:
            left_tokens = math.ceil(keep_rate * (N - 1))
            cls_attn = attn[:, :, 0, 1:].mean(dim=1)
            _, idx = torch.topk(cls_attn, left_tokens, dim=1, largest=True, sorted=True)
            index = idx.unsqueeze(-1).expand(-1, -1, C)
            non_cls = x[:, 1:]
            x_others = torch.gather(non_cls, dim=1, index=index)
            compl = torch.ones(B, N - 1, dtype=torch.bool).scatter(1, idx, False)
            compl = torch.stack([row.nonzero().flatten() for row in compl])  # complement_idx
            non_topk = torch.gather(non_cls, dim=1, index=compl.unsqueeze(-1).expand(-1, -1, C))
            non_topk_attn = torch.gather(cls_attn, dim=1, index=compl)
            extra_token = torch.sum(non_topk * non_topk_attn.unsqueeze(-1), dim=1, keepdim=True)
            if fuse_mean:
                extra_token = extra_token / non_topk_attn.sum(dim=1)[:, None, None]
            x = torch.cat([x[:, 0:1], x_others, extra_token], dim=1)
        x = x + blk.mlp(blk.norm2(x))
    return model.norm(x)


def test_evit_equals_authors_forward():
    model = _model()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        want = ref_evit_features(model, x, 0.7, [1, 3])
        prune.apply(model, "evit", keep_rate=0.7, locations=[1, 3])
        got = model.forward_features(x)
    assert got.shape[1] == 1 + math.ceil(0.7 * (math.ceil(0.7 * 64) + 1)) + 1
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_evit_on_an_avg_pooled_model_fuses_a_mean_counted_by_size():
    model = _model("vit_tiny_patch16_224", global_pool="avg")
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        want = ref_evit_features(model, x, 0.7, [1, 3], fuse_mean=True)
        prune.apply(model, "evit", keep_rate=0.7, locations=[1, 3])
        got = model.forward_features(x)
        pooled = model.forward_head(got, pre_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    size = prune.pruned_info(model).size
    kept = math.ceil(0.7 * (math.ceil(0.7 * 64) + 1))
    assert size.shape == (2, 1 + kept + 1, 1) and torch.all(size[:, 1:].sum(dim=1) == 64)  # every patch counted once
    torch.testing.assert_close(pooled, model.fc_norm((got[:, 1:] * size[:, 1:]).sum(dim=1) / 64))


def ref_dynamicvit(model, x, locs, ratios, train, policy_hook=None):
    """The authors' VisionTransformerDiffPruning forward (class token only) on our modules and predictors."""
    x = model.embed(x)[0]
    B = x.shape[0]
    init_n = x.shape[1] - 1
    prev_decision = torch.ones(B, init_n, 1, dtype=x.dtype)
    policy, p_count, out_pred_prob = None, 0, []

    def softmax_with_policy(attn, policy, eps=1e-6):
        B, N, _ = policy.size()
        attn_policy = policy.reshape(B, 1, 1, N)
        eye = torch.eye(N, dtype=attn_policy.dtype).view(1, 1, N, N)
        attn_policy = attn_policy + (1.0 - attn_policy) * eye
        max_att = torch.max(attn, dim=-1, keepdim=True)[0]
        attn = attn - max_att
        attn = attn.to(torch.float32).exp_() * attn_policy.to(torch.float32)
        attn = (attn + eps / N) / (attn.sum(dim=-1, keepdim=True) + eps)
        return attn.type_as(max_att)

    def block(blk, x, policy):
        h = blk.norm1(x)
        Bq, N, C = h.shape
        a = blk.attn
        qkv = a.qkv(h).reshape(Bq, N, 3, a.num_heads, C // a.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * a.scale
        attn = attn.softmax(dim=-1) if policy is None else softmax_with_policy(attn, policy)
        x = x + a.proj((attn @ v).transpose(1, 2).reshape(Bq, N, C))
        return x + blk.mlp(blk.norm2(x))

    for i, blk in enumerate(model.blocks):
        if i in locs:
            spatial_x = x[:, 1:]
            pred_score = model.prune_predictors[p_count](spatial_x, prev_decision).reshape(B, -1, 2)
            if train:
                hard_keep_decision = policy_hook(pred_score) * prev_decision
                out_pred_prob.append(hard_keep_decision.reshape(B, init_n))
                policy = torch.cat([torch.ones(B, 1, 1, dtype=x.dtype), hard_keep_decision], dim=1)
                x = block(blk, x, policy)
                prev_decision = hard_keep_decision
            else:
                score = pred_score[:, :, 0]
                num_keep_node = int(init_n * ratios[p_count])
                keep_policy = torch.argsort(score, dim=1, descending=True)[:, :num_keep_node]
                now_policy = torch.cat([torch.zeros(B, 1, dtype=keep_policy.dtype), keep_policy + 1], dim=1)
                x = x.gather(1, now_policy[..., None].expand(-1, -1, x.shape[-1]))
                prev_decision = prev_decision.gather(1, keep_policy[..., None])
                x = block(blk, x, None)
            p_count += 1
        else:
            x = block(blk, x, policy if train else None)
    return model.norm(x), out_pred_prob, prev_decision


@pytest.mark.parametrize("train", [False, True])
def test_dynamicvit_equals_authors_forward(train):
    model = _model()
    prune.apply(model, "dynamicvit", keep_rate=0.7, locations=[1, 3])
    model.double().train(train)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    torch.manual_seed(1)
    got = model.forward_features(x)
    torch.manual_seed(1)  # the same Gumbel noise for the reference
    want, probs, mask = ref_dynamicvit(model, x, [1, 3], [0.7, 0.49], train,
                                       lambda s: F.gumbel_softmax(s, hard=True)[:, :, 0:1])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    if train:
        assert got.shape[1] == 65  # training masks, it does not drop
        torch.testing.assert_close(torch.stack(prune.pruned_info(model).aux["stages"]), torch.stack(probs))
        torch.testing.assert_close(prune.pruned_info(model).aux["mask"], mask)
    else:
        assert got.shape[1] == 1 + int(64 * 0.49)


def test_topk_and_adaptive_follow_the_seed():
    model = _model("deit_tiny_distilled_patch16_224")
    x = torch.randn(3, 3, 64, 64, dtype=torch.float64)
    prune.apply(model, "topk", keep_rate=0.7, locations=[2])
    with torch.no_grad():
        assert model.forward_features(x).shape[1] == 2 + int(0.7 * 64)  # class + distillation kept, rest int()
    prune.remove(model)
    prune.apply(model, "adaptive", keep_rate=0.7, locations=[2], min_keep=0.5)
    model.double()
    pred = model.prune_predictors[0]
    with torch.no_grad():
        pred.threshold.fill_(10.0)  # sigmoid ~ 1: nothing above it, the floor keeps half
        assert model.forward_features(x).shape[1] == 2 + 32
        pred.threshold.fill_(-10.0)  # everything above it: all kept
        assert model.forward_features(x).shape[1] == 2 + 64
    model.train()
    model.forward_features(x)
    imp, thr = prune.pruned_info(model).aux["stages"][0]
    assert imp.shape == (3, 64) and thr is pred.threshold


def test_remove_restores_and_bad_input():
    model = _model()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    keys = set(model.state_dict())
    with torch.no_grad():
        base = model(x)
        prune.apply(model, "dynamicvit", keep_rate=0.5)
        assert any(k.startswith("prune_predictors.") for k in model.state_dict())
        prune.remove(model)
        assert torch.equal(model(x), base) and set(model.state_dict()) == keys
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"keep_rate must be in \(0, 1\]"):
            prune.apply(model, "evit", keep_rate=bad)
    with pytest.raises(ValueError, match="unknown pruning method"):
        prune.apply(model, "magic", keep_rate=0.5)
    with pytest.raises(ValueError, match="block indices"):
        prune.apply(model, "evit", keep_rate=0.5, locations=[6])
    with torch.device("meta"), pytest.raises(ValueError, match="hierarchical"):
        prune.apply(vitlab.create_model("swin_tiny_patch4_window7_224"), "evit", keep_rate=0.5)
    with pytest.raises(ValueError, match="class token"):
        prune.apply(vitlab.create_model("cait_xxs24_224", **KW), "evit", keep_rate=0.5)


@pytest.mark.parametrize("spec", [
    {"prune": "dynamicvit:0.7"},
    {"prune": "dynamicvit:0.7", "prune_shrink_epochs": 1},  # a warm-up child checkpointed beside the predictors
    pytest.param({"prune": "evit:0.5"}, marks=pytest.mark.slow),
    pytest.param({"prune": "adaptive:0.7"}, marks=pytest.mark.slow),
    pytest.param({"tome_r": 2}, marks=pytest.mark.slow),
])
def test_trains_through_the_trainer_and_evaluates(spec, tmp_path):
    data = DataConfig("fake", fake_num_samples=64, fake_num_classes=4, fake_img_size=16)
    cfg = TrainConfig(model="vit_pico_patch8_32", model_kwargs=dict(depth=4, embed_dim=32, num_heads=2, patch_size=4),
                      data=data, epochs=1, batch_size=32, quiet=True, output_dir=str(tmp_path / "run"), task_args=spec)
    summary = fit(cfg)
    # the run's model rebuilt from its checkpoint alone: patched again, predictor weights loaded
    r = evaluate(summary["run_dir"], split="val", optimize=False)
    assert r["top1"] == pytest.approx(summary["best_val_top1"])


def test_cli_bad_prune_spec_is_one_line(capsys):
    from vitlab.cli import main

    assert main(["train", "--prune", "evit:1.5", "--epochs", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "keep_rate must be in (0, 1]" in err[0]
