"""CLIP on streaming image-text data (``wds:`` shards with ``txt`` members, ``hf:`` datasets with a caption
column): the word tokenizer is built from the stream's captions without ``--task_args.tokenizer``, and ``vitlab
eval`` scores the run on its own data as image-text pairs (retrieval both ways)."""

from __future__ import annotations

import json

import pytest

from vitlab.cli import main
from vitlab.train import evaluate

TINY = ["--model", "clip_vit_pico_patch8", "--model_kwargs.image_depth", "1", "--model_kwargs.text_depth", "1",
        "--model_kwargs.in_chans", "3", "--data.img_size", "16", "--epochs", "1", "--batch_size", "8",
        "--threads", "1", "--quiet"]


def _train_then_eval(tmp_path, data: str, *extra: str) -> tuple[dict, dict]:
    run = tmp_path / "clip"
    assert main(["train", "--task", "clip", "--data", data, *extra, *TINY, "--output_dir", str(run)]) == 0
    meta = json.loads((run / "last" / "meta.json").read_text())
    e = evaluate(run, output_dir=tmp_path / "eval", optimize=False)
    assert json.loads((tmp_path / "eval" / f"eval-{e['split']}.json").read_text())["num_images"] == e["num_images"]
    return meta, e


def test_shards_word_tokenizer_and_eval(tmp_path):
    pytest.importorskip("webdataset")
    from tests.data.test_wds import write_shards

    for split, n in (("train", 16), ("val", 8)):
        write_shards(tmp_path / "d", n=n, per_shard=8, prefix=split, label=lambda i: {},
                     extra=lambda i: {"txt": f"a grey square of shade {i % 4}"})
    meta, e = _train_then_eval(tmp_path, f"wds:{tmp_path / 'd'}")
    assert meta["tokenizer"]["kind"] == "word" and "shade" in meta["tokenizer"]["words"]
    assert e["split"] == "val" and (e["num_images"], e["num_texts"]) == (8, 8) and 0 <= e["t2i_r1"] <= 100


def test_hf_caption_column_word_tokenizer_and_eval(tmp_path):
    hfd = pytest.importorskip("datasets")
    from tests.data.test_hf import features, rows
    from vitlab.data.hf import load

    path = tmp_path / "ds"
    hfd.DatasetDict({"train": hfd.Dataset.from_dict(rows(16), features=features(16)),
                     "validation": hfd.Dataset.from_dict(rows(6), features=features(16))}).save_to_disk(str(path))
    load.cache_clear()
    meta, e = _train_then_eval(tmp_path, f"hf:{path}")
    assert meta["tokenizer"]["kind"] == "word" and "picture" in meta["tokenizer"]["words"]
    assert (e["num_images"], e["num_texts"]) == (6, 6) and e["i2t_r10"] == 100.0  # 6 images: all within 10
