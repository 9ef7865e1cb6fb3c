"""``vitlab train --task clip`` on a captions folder and on digits; the runs scored and used through their run
record (``vitlab.train.evaluate`` / ``predict``, ``vitlab eval`` / ``predict``) and by ``vitlab zeroshot`` /
``vitlab retrieval``; bad input: one line, exit 2."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from PIL import Image

from tests.train.test_distributed import world_of_one  # noqa: F401  (the fixture, shared)
from vitlab.cli import main
from vitlab.clip.data import DIGIT_WORDS, HELD_OUT_TEMPLATES
from vitlab.clip.tasks import ClipArgs
from vitlab.data.captions import read_captions
from vitlab.train import TrainConfig, evaluate, fit, predict

TINY = ["--model", "clip_vit_pico_patch8", "--model_kwargs.image_depth", "1", "--model_kwargs.text_depth", "1",
        "--epochs", "1", "--batch_size", "8", "--threads", "2", "--quiet"]


def _captions(root, n=12, split=False, jsonl=False):
    """A folder of n small RGB images, two captions each (colour and shape words)."""
    rng = np.random.default_rng(0)
    colours = ["red", "green", "blue"]
    rows = []
    for i in range(n):
        c = i % 3
        img = np.zeros((16, 16, 3), np.uint8)
        img[..., c] = 200
        img += rng.integers(0, 40, img.shape, dtype=np.uint8)
        Image.fromarray(img).save(root / f"img{i}.png")
        s = ("train" if i < 8 else "val" if i < 10 else "test") if split else None
        for cap in (f"a {colours[c]} square", f"a picture that is {colours[c]}"):
            rows.append({"image": f"img{i}.png", "caption": cap, **({"split": s} if s else {})})
    if jsonl:
        (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        keys = list(rows[0])
        (root / "captions.csv").write_text(",".join(keys) + "\n" + "".join(
            ",".join(r[k] for k in keys) + "\n" for r in rows))
    return root


def test_read_captions_splits_and_holdout(tmp_path):
    splits = read_captions(_captions(tmp_path))
    assert sum(map(len, splits.values())) == 24 and set(splits) == {"train", "val"}
    held = {img for img, _ in splits["val"]}
    assert len(held) == 1 and not held & {img for img, _ in splits["train"]}  # whole images held out
    (tmp_path / "captions.csv").unlink()
    s = read_captions(_captions(tmp_path, split=True, jsonl=True))
    assert (len(s["train"]), len(s["val"]), len(s["test"])) == (16, 4, 4)


def test_train_captions_then_retrieval(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    data = _captions(tmp_path / "d", split=True)
    run = tmp_path / "run"
    assert main(["train", "--task", "clip", "--data", f"captions:{data}", "--model_kwargs.in_chans", "3",
                 "--output_dir", str(run), *TINY]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert {"test_i2t_r1", "test_t2i_r10"} <= set(summary) and summary["test_t2i_r10"] == 100.0  # 2 test images
    meta = json.loads((run / "last" / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "word" and "square" in meta["tokenizer"]["words"]
    capsys.readouterr()
    assert main(["retrieval", "--checkpoint", str(run), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["split"] == "test" and (r["num_images"], r["num_texts"]) == (2, 4)
    assert r["i2t_r1"] == summary["test_i2t_r1"] and r["t2i_r1"] == summary["test_t2i_r1"]
    # vitlab eval: the run record's task scores it the same way (image-text pairs: recall both ways)
    e = evaluate(run, output_dir=tmp_path / "eval", optimize=False)
    assert e["split"] == "test" and e["t2i_r1"] == summary["test_t2i_r1"] and e["i2t_r10"] == 100.0
    assert json.loads((tmp_path / "eval" / "eval-test.json").read_text())["num_texts"] == 4
    assert "i2t R@1" in e["summary"] and e["files"] == [str(tmp_path / "eval" / "eval-test.json")]
    # no class names in a captions run: zero-shot labels are refused in one line
    err = _error(capsys, ["predict", "--checkpoint", str(run), str(data / "img0.png"), "--no-optimize"])
    assert "zero-shot labels need class names" in err


@pytest.mark.slow  # one epoch on the 1,257 digits and a zero-shot pass: ~30 s on a quiet 2-core machine
def test_train_digits_then_zeroshot_held_out_templates(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--task", "clip", "--output_dir", str(run), *TINY[:6], "--epochs", "1",
                 "--batch_size", "128", "--threads", "2", "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["test_zeroshot_top1"] <= 100.0
    capsys.readouterr()
    assert main(["zeroshot", "--checkpoint", str(run), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["top1"] == pytest.approx(summary["test_zeroshot_top1"]) and r["num_images"] == 270
    assert r["classnames"][7] == "seven" and r["templates"][0] == "a picture of a {}"
    assert main(["zeroshot", "--checkpoint", str(run), "--classnames", "a", "b", "--json"]) == 2
    assert "2 class names for the 10 classes" in capsys.readouterr().err


def _error(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitlab: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("problem,message", [
    ("missing_image", "image not found"), ("empty_caption", "empty caption"), ("bad_json", "not JSON"),
    ("no_file", "no captions file"), ("bad_vocab", "is not a CLIP BPE vocabulary"),
    ("too_long", "more than the context length"), ("bad_arg", "unknown config key(s): 'task_args.mask_ratio'")])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, problem, message):
    data = tmp_path / "d"
    data.mkdir()
    _captions(data, n=4, jsonl=True)
    extra = []
    if problem == "missing_image":
        with open(data / "captions.jsonl", "a") as f:
            f.write(json.dumps({"image": "nope.png", "caption": "a cat"}) + "\n")
    elif problem == "empty_caption":
        with open(data / "captions.jsonl", "a") as f:
            f.write(json.dumps({"image": "img0.png", "caption": "  "}) + "\n")
    elif problem == "bad_json":
        with open(data / "captions.jsonl", "a") as f:
            f.write("{image: img0.png\n")
    elif problem == "no_file":
        (data / "captions.jsonl").unlink()
    elif problem == "bad_vocab":
        (tmp_path / "vocab.txt.gz").write_text("plain text")
        extra = ["--task_args.tokenizer", "clip", "--task_args.bpe_path", str(tmp_path / "vocab.txt.gz")]
    elif problem == "too_long":
        with open(data / "captions.jsonl", "a") as f:
            f.write(json.dumps({"image": "img0.png", "caption": "red " * 40}) + "\n")
        extra = ["--task_args.truncate", "false"]
    else:
        extra = ["--task_args.mask_ratio", "0.5"]
    err = _error(capsys, ["train", "--task", "clip", "--data", f"captions:{data}", "--model_kwargs.in_chans", "3",
                          "--output_dir", str(tmp_path / "run"), *TINY, *extra])
    assert message in err


def test_long_captions_truncate_with_a_warning(tmp_path):
    from vitlab.clip.data import CaptionPairs
    from vitlab.clip.tokenizer import WordTokenizer

    tok = WordTokenizer.from_texts(["red square"], context_length=6)
    with pytest.warns(UserWarning, match="1 text"):
        pairs = CaptionPairs([(str(tmp_path / "x.png"), "red " * 10), (str(tmp_path / "y.png"), "red")], tok, 3,
                             None)
    assert pairs.tokens[0, -1] == tok.eot_token_id
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CaptionPairs([(str(tmp_path / "x.png"), "red square")], tok, 3, None)


def test_task_args_types_and_recipe():
    """A mapping of strings is read into ClipArgs with its fields' types; the task's recipe is the digits demo's."""
    cfg = TrainConfig(task="clip", task_args={"truncate": "false", "context_length": "20"})
    assert isinstance(cfg.task_args, ClipArgs)
    assert cfg.task_args.truncate is False and cfg.task_args.context_length == 20
    with pytest.raises(ValueError, match="task_args.tokenizer"):
        TrainConfig(task="clip", task_args={"tokenizer": "sentencepiece"})
    demo = TrainConfig.for_task("clip", epochs=3)
    assert (demo.model, demo.epochs, demo.lr, demo.data.dataset) == ("clip_vit_pico_patch8", 3, 0.024, "digits")


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """One epoch of the digits demo at 16 px with one image and one text block (a few seconds on 2 cores)."""
    run = tmp_path_factory.mktemp("clip") / "run"
    fit(TrainConfig.for_task("clip", model_kwargs={"image_depth": 1, "text_depth": 1}, data={"img_size": 16},
                             epochs=1, batch_size=128, threads=2, quiet=True, output_dir=str(run)))
    return run


def _digit_png(path, label: int = 7):
    """A digit of the test split (8 x 8, ink bright on dark) as a grayscale PNG."""
    from sklearn.datasets import load_digits

    d = load_digits()
    i = int(np.flatnonzero(d.target == label)[-1])
    Image.fromarray(np.round(d.images[i] * 255.0 / 16.0).astype(np.uint8)).save(path)
    return path


def test_digits_run_evaluate_and_predict_through_its_record(digits_run, tmp_path, capsys):
    summary = json.loads((digits_run / "summary.json").read_text())
    r = evaluate(digits_run, output_dir=tmp_path, optimize=False)
    assert (r["task"], r["dataset"], r["split"], r["num_images"]) == ("clip", "digits", "test", 270)
    assert r["top1"] == pytest.approx(summary["test_zeroshot_top1"]) and r["top5"] >= r["top1"]
    assert r["classnames"] == list(DIGIT_WORDS) and r["templates"] == list(HELD_OUT_TEMPLATES)
    assert r["files"] == [str(tmp_path / "eval-test.json")]
    assert json.loads((tmp_path / "eval-test.json").read_text())["top1"] == r["top1"]
    assert r["summary"].startswith("clip_vit_pico_patch8 on digits (test, 270 images, 10 classes, 4 templates): "
                                   "zero-shot top-1 ")

    img = _digit_png(tmp_path / "seven.png")
    rows = predict(digits_run, [img, img], topk=10, optimize=False)
    assert len(rows) == 2
    # the same image twice: the same top class and the same probabilities up to float rounding (the GEMM kernels
    # may treat two rows of a batch differently: on an AMD EPYC they differed in the ninth digit)
    assert rows[0]["top"][0][0] == rows[1]["top"][0][0]
    assert dict(rows[0]["top"]) == pytest.approx(dict(rows[1]["top"]), rel=1e-5, abs=1e-7)
    labels, probs = zip(*rows[0]["top"])
    assert sorted(labels) == sorted(DIGIT_WORDS) and sum(probs) == pytest.approx(1.0, abs=1e-5)
    assert list(probs) == sorted(probs, reverse=True)
    assert rows[0]["line"].startswith(f"{img}: {labels[0]} {probs[0]:.3f}  {labels[1]} ")

    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(digits_run), str(img), "--topk", "2", "--no-optimize"]) == 0
    assert capsys.readouterr().out.strip() == f"{img}: " + "  ".join(f"{n} {p:.3f}" for n, p in rows[0]["top"][:2])
    assert main(["eval", "--checkpoint", str(digits_run), "--output-dir", str(tmp_path), "--no-optimize"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [r["summary"], f"written: {tmp_path / 'eval-test.json'}"]


def test_retrieval_on_the_digits_demo(digits_run, capsys):
    """Each test digit against the 100 training captions (10 digits x 10 templates); a caption matches every
    image of its digit, so the ranks are class-level."""
    capsys.readouterr()
    assert main(["retrieval", "--checkpoint", str(digits_run), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["dataset"], r["split"], r["num_images"], r["num_texts"]) == ("digits", "test", 270, 100)
    for d in ("i2t", "t2i"):
        assert 0.0 <= r[f"{d}_r1"] <= r[f"{d}_r5"] <= r[f"{d}_r10"] <= 100.0
    assert main(["retrieval", "--checkpoint", str(digits_run), "--split", "val"]) == 0
    assert "digits (val, 270 images, 100 captions): i2t R@1 " in capsys.readouterr().out
    err = _error(capsys, ["retrieval", "--checkpoint", str(digits_run), "--data", "fake"])
    assert "retrieval needs image-text pairs (captions:PATH, digits, or wds: / hf: data with captions), not 'fake'" \
        in err


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_clip_task_under_each_strategy(tmp_path, strategy):
    """DDP wraps the CLIP model (two inputs), FSDP2 shards its declared units (image and text blocks); the loss
    gathers through the process group (a world of one here; two processes: tests/clip/test_loss_zeroshot.py)."""
    import torch.distributed as dist

    from vitlab.train import TrainConfig, fit

    (tmp_path / "d").mkdir()
    data = _captions(tmp_path / "d", n=6)
    s = fit(TrainConfig(task="clip", model="clip_vit_pico_patch8", model_kwargs={"image_depth": 1, "text_depth": 1,
                                                                                   "in_chans": 3},
                        data={"dataset": f"captions:{data}"}, epochs=1, batch_size=4, strategy=strategy, quiet=True,
                        output_dir=str(tmp_path / "run")))
    assert not dist.is_initialized() and s["strategy"] == strategy and s["finished"]
    assert (s.get("fsdp_units") == 3) == (strategy == "fsdp")  # one image block, one text block, the root
