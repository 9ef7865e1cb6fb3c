"""vitlab.ssl.probe: the features the probes read (DINO's last-n-blocks concatenation)."""

import pytest
import torch

import vitlab
from vitlab.ssl.methods import pooled_features
from vitlab.ssl.probe import check_blocks, last_blocks_features


def _restated(model, x, n):
    """DINO's eval_linear: run the blocks by hand, keep the last n outputs, each through the final norm and the
    model's pooling (here: class token for a token-pooled ViT, mean of the patch tokens + fc_norm for a GAP ViT)."""
    t = model.embed(x)[0]
    outs = []
    for blk in model.blocks:
        t = blk(t)
        outs.append(model.norm(t))
    p = model.num_prefix_tokens
    pooled = [o[:, 0] if model.global_pool == "token" else model.fc_norm(o[:, p:].mean(1)) for o in outs[-n:]]
    return torch.cat(pooled, 1)


@pytest.mark.parametrize("pool", ["avg", "token"])
def test_last_blocks_features_equal_a_restatement(pool):
    torch.manual_seed(0)
    model = vitlab.create_model("vit_pico_patch8_32", num_classes=0, global_pool=pool).eval()
    x = torch.randn(3, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(last_blocks_features(model, x, 1), pooled_features(model, x))
        torch.testing.assert_close(last_blocks_features(model, x, 1), _restated(model, x, 1), rtol=1e-5, atol=1e-5)
        f4 = last_blocks_features(model, x, 4)
        assert f4.shape == (3, 4 * 64)
        torch.testing.assert_close(f4, _restated(model, x, 4), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f4[:, -64:], pooled_features(model, x))  # the last block's slice is the pre-logits


def test_blocks_out_of_range_or_hierarchical_is_one_line():
    vit = vitlab.create_model("vit_pico_patch8_32", num_classes=0)
    with pytest.raises(ValueError, match=r"blocks must be in 1\.\.4"):
        check_blocks(vit, 5)
    swin = vitlab.create_model("swin_tiny_patch4_window7_224", num_classes=0, depths=(1, 1, 1, 1))
    check_blocks(swin, 1)
    with pytest.raises(ValueError, match="needs a plain ViT backbone"):
        check_blocks(swin, 2)


def test_random_baseline_takes_model_kwargs(tmp_path):
    from vitlab.ssl.probe import load_backbone

    model, meta = load_backbone("random:vit_pico_patch8_32", torch.device("cpu"), model_kwargs={"embed_dim": 96})
    assert model.num_features == 96 and meta["model_kwargs"] == {"embed_dim": 96}
    with pytest.raises(ValueError, match="only applies to a random:MODEL"):
        load_backbone(str(tmp_path), torch.device("cpu"), model_kwargs={"embed_dim": 96})


def test_random_baseline_json_goes_under_runs(tmp_path, monkeypatch, capsys):
    from vitlab.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["probe", "--checkpoint", "random:vit_pico_patch8_32", "--model-arg", "depth=1", "--data",
                 "digits", "--k", "5"]) == 0
    want = tmp_path / "runs" / "probe" / "probe-random-vit_pico_patch8_32-knn.json"
    assert str(want.relative_to(tmp_path)) in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]  # nothing written into the working directory itself
    assert want.is_file()
    out = tmp_path / "elsewhere" / "baseline.json"
    assert main(["probe", "--checkpoint", "random:vit_pico_patch8_32", "--model-arg", "depth=1", "--data",
                 "digits", "--k", "5", "--output", str(out)]) == 0
    assert out.is_file()
