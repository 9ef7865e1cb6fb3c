"""The pre-training tasks through the Trainer: run directory, collapse monitors, exact resume (teacher, centre and
schedules included), fine-tuning with --init and layer-wise lr decay, probes, and the CLI's bad-input lines."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.train.test_distributed import world_of_one  # noqa: F401  (the env of a one-process torchrun)
from vitlab.cli import main
from vitlab.data import DataConfig
from vitlab.train import TrainConfig, fit, read_metrics
from vitlab.train import checkpoint as ck
from vitlab.train.recipe import layer_decay_groups
from vitlab.train.trainer import TIME_KEYS

TINY = {"depth": 1, "embed_dim": 32, "num_heads": 2}
ARGS = {"mae": dict(decoder_dim=16, decoder_depth=1, decoder_heads=2),
        "simclr": dict(proj_hidden_dim=32, proj_dim=16), "mocov3": dict(dim=16, mlp_dim=32),
        "dino": dict(out_dim=64, hidden_dim=32, bottleneck_dim=16, local_crops=2, local_crop_size=8,
                     warmup_teacher_temp_epochs=2),
        "dinov2": dict(out_dim=64, hidden_dim=32, bottleneck_dim=16, local_crops=1, local_crop_size=8)}


def cfg_for(method, tmp_path, **kw) -> TrainConfig:
    data = DataConfig("fake", fake_num_samples=32, fake_num_classes=4, fake_img_size=16)
    base = dict(task=method, task_args=dict(ARGS[method]), model="vit_pico_patch8_32", model_kwargs=dict(TINY),
                data=data, epochs=2, batch_size=16, lr=5e-3, warmup_epochs=1, quiet=True,
                output_dir=str(tmp_path / "run"))
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("method", ["mae", "dino", pytest.param("simclr", marks=pytest.mark.slow),
                                    pytest.param("mocov3", marks=pytest.mark.slow),
                                    pytest.param("dinov2", marks=pytest.mark.slow)])
def test_pretrain_run_dir_and_monitors(method, tmp_path):
    s = fit(cfg_for(method, tmp_path, epochs=1))
    run = tmp_path / "run"
    rows = read_metrics(run, "epoch")
    assert {"val_feature_std", "val_effective_rank"} <= rows[0].keys()
    if method.startswith("dino"):
        assert {"val_teacher_entropy", "val_teacher_student_kl"} <= rows[0].keys()
        assert 0 < rows[0]["val_teacher_entropy"] <= torch.log(torch.tensor(64.0)).item() + 1e-6
        # the Trainer drops the last layer's gradients in the first epoch (freeze_last_layer 1): the student's last
        # layer is still the teacher's (EMA of equal weights), the MLP before it trained
        st = ck.load_trainer_state(run / "last")
        torch.testing.assert_close(st["head"]["weight_v"], st["teacher_head"]["weight_v"], rtol=0, atol=1e-6)
        assert not torch.allclose(st["head"]["mlp.0.weight"], st["teacher_head"]["mlp.0.weight"], rtol=0, atol=1e-6)
    sd = load_file(str(run / "last" / "model.safetensors"))
    assert not any(k.startswith(("teacher", "decoder", "head.", "projector")) for k in sd)  # the backbone only
    meta = json.loads((run / "last" / "meta.json").read_text())
    assert meta["ssl_method"] == method and meta["num_classes"] == 0
    assert s["finished"] and (run / "curves.png").is_file()
    if method == "mae":
        assert (run / "reconstructions.png").read_bytes()[:4] == b"\x89PNG"
    # vitlab eval of a pre-training run: k-NN on its data, from the run record alone
    import vitlab.train

    r = vitlab.train.evaluate(run, split="val", output_dir=tmp_path / "eval")
    assert r["task"] == method and r["protocol"] == "knn" and 0 <= r["knn_top1"] <= r["knn_top5"] <= 100
    assert "k-NN top-1" in r["summary"] and (tmp_path / "eval" / "eval-val.json").is_file()


def _weights(run, name="model.safetensors"):
    return load_file(str(run / "last" / name))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dino", "mocov3"])
def test_resume_is_exact(method, tmp_path):
    fit(cfg_for(method, tmp_path / "a"))
    fit(cfg_for(method, tmp_path / "b", stop_after=1))
    b = tmp_path / "b" / "run"
    fit(cfg_for(method, tmp_path / "b", resume=str(b), output_dir=str(b)))
    a = tmp_path / "a" / "run"
    wa, wb = _weights(a), _weights(b)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)
    sa, sb = ck.load_trainer_state(a / "last"), ck.load_trainer_state(b / "last")
    teacher = "teacher" if method == "dino" else "momentum_model"
    for k in sa[teacher]:
        torch.testing.assert_close(sa[teacher][k], sb[teacher][k], rtol=0, atol=1e-6)
    assert int(sa["progress"]["step"]) == int(sb["progress"]["step"]) == 4
    if method == "dino":
        torch.testing.assert_close(sa["center"]["center"], sb["center"]["center"], rtol=0, atol=1e-7)
    ma = read_metrics(a, "epoch")
    mb = read_metrics(b, "epoch")
    strip = lambda r: {k: v for k, v in r.items() if k not in TIME_KEYS}  # noqa: E731
    assert [strip(r) for r in ma] == [strip(r) for r in mb]


@pytest.mark.slow
def test_init_fine_tunes_the_backbone_with_layer_decay(tmp_path, capsys):
    fit(cfg_for("mae", tmp_path / "pre", epochs=1))
    pre = tmp_path / "pre" / "run"
    from vitlab.train.trainer import Trainer

    cfg = TrainConfig(model="vit_pico_patch8_32", model_kwargs=dict(TINY), task_args={"init": str(pre)}, epochs=1,
                      batch_size=16,
                      data=DataConfig("fake", fake_num_samples=32, fake_num_classes=4, fake_img_size=16),
                      quiet=True, output_dir=str(tmp_path / "ft"))
    tr = Trainer(cfg)
    tr.strategy = __import__("vitlab.train.strategy", fromlist=["x"]).create_strategy("none", "cpu")
    tr.setup()
    backbone = _weights(pre)
    for k, v in tr.task.model.state_dict().items():
        if not k.startswith("head"):
            torch.testing.assert_close(v, backbone[k])
    scales = sorted({g["lr_scale"] for g in tr.optimizer.param_groups})
    assert scales == pytest.approx([0.65 ** 2, 0.65, 1.0])  # embeddings, block 0, norm + head (MAE's 0.65)
    lrs = {g["lr_scale"]: g["lr"] for g in tr.optimizer.param_groups}
    assert lrs[0.65] == pytest.approx(0.65 * lrs[1.0])


def test_layer_decay_groups_ids():
    import vitlab

    m = vitlab.create_model("vit_pico_patch8_32", depth=3)
    groups = layer_decay_groups(m, 0.05, 0.5)
    by_name = {id(p): n for n, p in m.named_parameters()}
    scale = {by_name[id(p)]: g["lr_scale"] for g in groups for p in g["params"]}
    assert scale["pos_embed"] == scale["patch_embed.proj.weight"] == 0.5 ** 4
    assert scale["blocks.0.attn.qkv.weight"] == 0.5 ** 3 and scale["blocks.2.mlp.fc1.bias"] == 0.5
    assert scale["head.weight"] == 1.0
    wd = {by_name[id(p)]: g["weight_decay"] for g in groups for p in g["params"]}
    assert wd["blocks.0.attn.qkv.weight"] == 0.05 and wd["blocks.0.attn.qkv.bias"] == 0.0 and wd["pos_embed"] == 0.0


COMMON = ["--model", "vit_pico_patch8_32", "--model_kwargs.depth", "1", "--model_kwargs.embed_dim", "32",
          "--model_kwargs.num_heads", "2", "--data", "digits", "--img_size", "16", "--epochs", "1",
          "--batch_size", "128", "--quiet"]


@pytest.mark.slow
def test_cli_pretrain_then_probe(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["pretrain", "--method", "simclr", *COMMON, "--output_dir", str(run),
                 "--task_args.proj_hidden_dim", "32", "--task_args.proj_dim", "16"]) == 0
    assert main(["probe", "--checkpoint", str(run), "--protocol", "knn"]) == 0
    out = capsys.readouterr().out
    assert "knn probe (k=20, T=0.07) on digits test: top-1" in out
    r = json.loads((run / "probe-knn.json").read_text())
    assert r["test_images"] == 270 and len(r["per_class_top1"]) == 10 and 0 <= r["top1"] <= 100
    assert main(["probe", "--checkpoint", str(run), "--protocol", "linear", "--epochs", "3", "--bn",
                 "--output", str(tmp_path / "lin.json")]) == 0
    assert json.loads((tmp_path / "lin.json").read_text())["bn"] is True
    assert main(["probe", "--checkpoint", str(run), "--protocol", "knn", "--blocks", "1"]) == 0
    assert main(["probe", "--checkpoint", "random:vit_pico_patch8_32", "--data", "digits", "--protocol", "linear",
                 "--epochs", "2", "--blocks", "2", "--model-arg", "embed_dim=32", "--model-arg", "num_heads=2",
                 "--output", str(tmp_path / "last2.json")]) == 0
    assert "last 2 blocks" in capsys.readouterr().out
    assert json.loads((tmp_path / "last2.json").read_text())["feature_dim"] == 2 * 32
    assert main(["probe", "--checkpoint", "random:vit_pico_patch8_32", "--data", "digits", "--protocol", "knn",
                 "--output", str(tmp_path / "rand.json")]) == 0


@pytest.mark.slow
def test_probe_random_baseline_knn(tmp_path):
    from vitlab.ssl.probe import probe

    r = probe("random:vit_pico_patch8_32", "digits", "knn", output=tmp_path / "r.json", k=5)
    assert json.loads((tmp_path / "r.json").read_text())["top1"] == r["top1"] and r["top1"] > 20  # chance: 10%


def test_random_baseline_is_the_pretraining_initialisation():
    from vitlab.ssl.probe import load_backbone
    from vitlab.ssl.tasks import PretrainTask
    from vitlab.train.trainer import seed_everything

    cfg = TrainConfig(task="simclr", model="vit_pico_patch8_32", seed=3, task_args=dict(ARGS["simclr"]))
    seed_everything(cfg.seed)
    task = type("T", (PretrainTask,), {"method": "simclr"})()
    task.build(cfg, torch.device("cpu"))
    state = torch.get_rng_state()
    random, _ = load_backbone("random:vit_pico_patch8_32", torch.device("cpu"), seed=3)
    assert torch.equal(state, torch.get_rng_state())  # the caller's stream is untouched
    for k, v in task.model.state_dict().items():
        torch.testing.assert_close(random.state_dict()[k], v, rtol=0, atol=0)


def test_cli_bad_input_one_line_exit_2(tmp_path, capsys):
    small = ["--data", "digits", "--img_size", "16", "--epochs", "1", "--quiet"]
    bad = [(["pretrain", "--method", "byol", *COMMON], "unknown method 'byol'"),
           (["pretrain", "--method", "mae", "--model", "swin_tiny_patch4_window7_224", *small, "--img_size", "64",
             "--model_kwargs.window_size", "4", "--model_kwargs.depths", "[1, 1, 1, 1]",
             "--output_dir", str(tmp_path / "x")], "plain ViT"),
           (["pretrain", "--method", "mae", *COMMON, "--task_args.mask_ratio", "1.5",
             "--output_dir", str(tmp_path / "y")], "mask_ratio must be in (0, 1)"),
           (["pretrain", "--method", "dino", *COMMON, "--task_args.local_crop_size", "4",
             "--output_dir", str(tmp_path / "z")], "does not fit"),
           (["pretrain", "--method", "mae", *COMMON, "--task_args.local_crops", "x"], "local_crops"),
           (["probe", "--checkpoint", str(tmp_path)], "holds no backbone"),
           (["probe", "--checkpoint", "random:nope", "--data", "digits"], "not a registered model"),
           (["probe", "--checkpoint", "random:vit_pico_patch8_32", "--data", "digits", "--blocks", "9"],
            "blocks must be in 1..4"),
           (["probe", "--checkpoint", "random:vit_pico_patch8_32", "--model-arg", "embed_dim"], "takes KEY=VALUE"),
           (["probe", "--checkpoint", str(tmp_path), "--model-arg", "embed_dim=96"], "only applies to a random:MODEL"),
           (["pretrain", *COMMON], "--method is required")]
    for argv, msg in bad:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    assert not any((tmp_path / d).exists() for d in "xyz")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("method", ["dino", "mae"])
@pytest.mark.usefixtures("world_of_one")
def test_strategies_resume_exactly(tmp_path, strategy, method):
    """DDP and FSDP2 (a world of one process, gloo): the teacher, centre and schedules come back on resume."""
    straight = fit(cfg_for(method, tmp_path / "a", strategy=strategy))
    assert straight["strategy"] == strategy and straight["finished"]
    fit(cfg_for(method, tmp_path / "b", strategy=strategy, stop_after=1))
    b = tmp_path / "b" / "run"
    fit(cfg_for(method, tmp_path / "b", strategy=strategy, resume=str(b), output_dir=str(b)))
    a = tmp_path / "a" / "run"
    la = [r["train_loss"] for r in read_metrics(a, "epoch")]
    lb = [r["train_loss"] for r in read_metrics(b, "epoch")]
    assert la == lb
    wa, wb = _weights(a), _weights(b)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)


def test_dino_defaults_fit_the_default_model_and_data():
    """``vitlab pretrain --method dino --model vit_pico_patch8_32 --data digits``: the local crops derive from the
    patch size (16 px: two 8-pixel patches a side), not 3/7 of 32 = 14 px."""
    from vitlab.train.task import create_task

    cfg = TrainConfig.for_task("dino", model="vit_pico_patch8_32", task_args={"out_dim": 64, "hidden_dim": 32,
                                                                              "bottleneck_dim": 16})
    task = create_task("dino")
    task.build(cfg, torch.device("cpu"))
    views = task.data.train[0][0]
    assert [v.shape[-1] for v in views] == [32, 32] + [16] * 6
