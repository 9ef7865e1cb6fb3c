"""hf:SOURCE[:SPLIT]: Hugging Face datasets written here with ``datasets`` itself (save_to_disk, arrow, parquet);
columns detected from the Image / ClassLabel features or named; streams split by rank and worker; bad input."""

from __future__ import annotations

import io
import json
from collections import Counter

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from vitlab.cli import main
from vitlab.data import DataConfig, DataError, build, streaming
from vitlab.data.hf import load, read_split

hfd = pytest.importorskip("datasets")


def png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (6, 5), (value % 256, 7, 9)).save(buf, format="PNG")
    return buf.getvalue()


def rows(n: int, start: int = 0) -> dict:
    return {"image": [{"bytes": png(i), "path": None} for i in range(start, start + n)],
            "label": list(range(start, start + n)), "caption": [f"picture {i}" for i in range(start, start + n)]}


def features(num_classes: int):
    return hfd.Features({"image": hfd.Image(), "label": hfd.ClassLabel(names=[f"c{i}" for i in range(num_classes)]),
                         "caption": hfd.Value("string")})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A save_to_disk DatasetDict: 24 training rows and 6 validation rows; row i has label i (24 classes)."""
    path = tmp_path_factory.mktemp("hf") / "ds"
    f = features(24)
    hfd.DatasetDict({"train": hfd.Dataset.from_dict(rows(24), features=f),
                     "validation": hfd.Dataset.from_dict(rows(6), features=f)}).save_to_disk(str(path))
    load.cache_clear()
    return path


def red(image) -> int:
    return int(image.getpixel((0, 0))[0])


def test_save_to_disk_columns_detected_and_built_like_any_dataset(saved):
    train = read_split("train", str(saved))
    assert len(train) == 24 and train.classes == [f"c{i}" for i in range(24)]
    image, label = train[5]
    assert label == 5 and red(image) == 5 and image.size == (6, 5)
    bundle = build(DataConfig(f"hf:{saved}", img_size=8, preset="tiny"), in_chans=3)
    assert (len(bundle.train), len(bundle.val), bundle.test) == (24, 6, None) and bundle.num_classes == 24
    x, y = bundle.val[2]
    assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and y == 2
    # hf:PATH:SPLIT names the training split
    assert len(read_split("train", f"{saved}:validation")) == 6


def test_named_columns_and_holdout_without_a_validation_split(tmp_path):
    d = hfd.Dataset.from_dict({"picture": [png(i) for i in range(20)], "y": [i % 4 for i in range(20)]})
    d.save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(DataError, match=r"no image column among picture, y; name it with --data.options.image_column"):
        read_split("train", str(tmp_path / "plain"))
    opts = dict(image_column="picture", label_column="y")
    train = read_split("train", str(tmp_path / "plain"), **opts)
    val = read_split("val", str(tmp_path / "plain"), **opts)
    assert (len(train), len(val)) == (18, 2) and train.classes == ["0", "1", "2", "3"]
    seen = sorted(red(train[i][0]) for i in range(18)) + sorted(red(val[i][0]) for i in range(2))
    assert sorted(seen) == list(range(20))  # a hold-out of whole rows, none in both
    assert read_split("test", str(tmp_path / "plain"), **opts) is None


def test_arrow_and_parquet_files(saved, tmp_path, monkeypatch):
    arrow = next((saved / "train").glob("*.arrow"))
    assert len(read_split("train", str(arrow))) + len(read_split("val", str(arrow))) == 24
    monkeypatch.setattr(hfd.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    hfd.load_from_disk(str(saved))["validation"].to_parquet(str(tmp_path / "v.parquet"))
    train = read_split("train", str(tmp_path / "v.parquet"))
    assert train.classes == [f"c{i}" for i in range(24)] and len(train) == 5


def test_captions_for_image_text_tasks(saved):
    pairs = read_split("val", str(saved), captions=True)
    image, caption = pairs[3]
    assert caption == "picture 3" and red(image) == 3
    assert pairs.captions() == [f"picture {i}" for i in range(6)]


@pytest.mark.parametrize("world", [1, 2])
def test_stream_split_by_rank_and_worker_without_duplicates(saved, world, monkeypatch):
    got = []
    for rank in range(world):
        s = read_split("train", str(saved), streaming=True, shuffle=4)
        s.set_placement(rank, world)
        s.batch_size = 3
        loader = DataLoader(streaming.StreamImages(s, 3, None), batch_size=3, num_workers=2, drop_last=True)
        labels = [y for _, y in loader]
        assert len(labels) == len(loader) == 24 // world // 3
        got += torch.cat(labels).tolist()
    counts = Counter(got)
    assert max(counts.values()) == 1 and len(counts) == 24


def test_stream_resume_and_epoch_length(saved, monkeypatch):
    monkeypatch.setattr(streaming, "worker_placement", lambda: (0, 1))
    s = read_split("train", str(saved), streaming=True, shuffle=8, seed=2)
    s.set_epoch(1)
    full = [y for _, y in s]
    assert sorted(full) == list(range(24))
    it = iter(s)
    head = [next(it)[1] for _ in range(10)]
    again = read_split("train", str(saved), streaming=True, shuffle=8, seed=2)
    again.load_state_dict(s.state_dict())
    assert head + [y for _, y in again] == full
    short = read_split("train", str(saved), streaming=True, epoch_length=10)
    assert len(short) == 10 and len(list(short)) == 10


def test_bad_input_one_line(saved, tmp_path, capsys, monkeypatch):
    def error(argv, *words):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("vitlab: error: "), err
        for w in words:
            assert w in err, (w, err)

    error(["data", "info", f"hf:{saved}", "--options", '{"label_column": "nope"}'], "no column 'nope'",
          "image, label, caption")
    error(["data", "info", f"hf:{saved}:nosuch"], "no split 'nosuch'", "train, validation")
    error(["data", "info", f"hf:{tmp_path}/missing"], "no dataset folder or file")
    (tmp_path / "x.txt").write_text("hello")
    error(["data", "info", f"hf:{tmp_path / 'x.txt'}"], "a file source is .parquet")
    error(["train", "--data", f"hf:{saved}", "--data.options", "{labels_column: label}", "--epochs", "1", "--quiet"],
          "unexpected keyword argument 'labels_column'")
    d = hfd.Dataset.from_dict({"image": [png(i) for i in range(4)], "label": [0, 1, 2, 3]},
                              features=hfd.Features({"image": hfd.Image(), "label": hfd.Value("int64")}))
    d.save_to_disk(str(tmp_path / "plainlabels"))
    with pytest.raises(DataError, match="needs its label column 'label' as a ClassLabel"):
        read_split("train", str(tmp_path / "plainlabels"), streaming=True, val_split="train")


def test_corrupt_image_named_or_skipped(tmp_path):
    d = hfd.Dataset.from_dict({"image": [png(0), b"garbage", png(2)], "label": [0, 1, 0]},
                              features=hfd.Features({"image": hfd.Image(), "label": hfd.ClassLabel(names=["a", "b"])}))
    hfd.DatasetDict({"train": d, "validation": d}).save_to_disk(str(tmp_path / "bad"))
    s = read_split("val", str(tmp_path / "bad"))
    with pytest.raises(DataError, match=r"unreadable image in hf:.*bad \(validation, row 1\)"):
        s[1]
    with pytest.raises(DataError) as e:  # raised in a DataLoader worker: still one line in the main process
        list(DataLoader(s, batch_size=3, num_workers=1, collate_fn=list))
    assert "\n" not in str(e.value) and str(e.value).startswith("unreadable image in hf:")
    s = read_split("val", str(tmp_path / "bad"), skip_bad_images=True)
    with pytest.warns(UserWarning, match="row 1"):
        image, label = s[1]
    assert red(image) == 2 and label == 0


def test_missing_package_names_the_extra(monkeypatch, tmp_path):
    real = streaming.importlib.import_module

    def fake(name, *a):
        if name == "datasets":
            raise ImportError(name)
        return real(name, *a)

    monkeypatch.setattr(streaming.importlib, "import_module", fake)
    load.cache_clear()
    with pytest.raises(DataError, match=r"needs the datasets package: pip install 'vitlab\[stream\]'"):
        read_split("train", str(tmp_path))


def test_train_on_hf_through_the_cli(saved, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", f"hf:{saved}", "--data.img_size", "16", "--data.preset", "tiny",
                 "--model", "vit_pico_patch8_32", "--model_kwargs.depth", "1", "--model_kwargs.embed_dim", "32",
                 "--model_kwargs.num_heads", "2", "--epochs", "1", "--batch_size", "8", "--threads", "1",
                 "--output_dir", str(run), "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    record = json.loads((run / "last" / "meta.json").read_text())
    assert summary["epochs"] == 1 and record["data"]["dataset"] == f"hf:{saved}"


def test_clip_trains_on_a_caption_column_and_scores_retrieval(saved, tmp_path):
    from vitlab.clip.data import training_texts

    run = tmp_path / "clip"
    assert main(["train", "--task", "clip", "--data", f"hf:{saved}", "--task_args.tokenizer", "clip",
                 "--data.options", "{test_split: validation}", "--model", "clip_vit_pico_patch8",
                 "--model_kwargs.image_depth", "1", "--model_kwargs.text_depth", "1", "--model_kwargs.in_chans", "3",
                 "--data.img_size", "16", "--epochs", "1", "--batch_size", "8", "--threads", "1",
                 "--output_dir", str(run), "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert {"test_i2t_r1", "test_t2i_r10"} <= set(summary) and summary["test_t2i_r10"] == 100.0  # 6 images
    assert training_texts(DataConfig(f"hf:{saved}"))[:2] == ["picture 0", "picture 1"]
