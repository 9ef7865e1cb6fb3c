"""wds:SOURCE: WebDataset shards written here with webdataset's own TarWriter; every sample's label is its index, so
the rank / worker split can be checked for duplicates and coverage. Bad input: one line, nothing half-written."""

from __future__ import annotations

import io
import json
import warnings
from collections import Counter

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from vitlab.cli import main
from vitlab.data import DataConfig, DataError, streaming
from vitlab.data.wds import pack, read_index, read_split

wds = pytest.importorskip("webdataset")


def png(value: int, size: int = 4) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (size, size), value % 256).save(buf, format="PNG")
    return buf.getvalue()


def write_shards(folder, n: int = 60, per_shard: int = 12, prefix: str = "train", label=lambda i: {"cls": i},
                 extra=lambda i: {}) -> list[str]:
    """``n`` samples (a grey PNG of value i, its label ``label(i)``) in shards of ``per_shard``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(0, n, per_shard):
        path = folder / f"{prefix}-{s // per_shard:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(s, min(n, s + per_shard)):
                sample = {"__key__": f"{i:08d}", "png": png(i)}
                for k, v in {**label(i), **extra(i)}.items():
                    sample[k] = v if isinstance(v, bytes) else (json.dumps(v) if k == "json" else str(v)).encode()
                sink.write(sample)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("wds")
    write_shards(root, n=60)
    write_shards(root, n=10, per_shard=5, prefix="val")
    return root


def labels_of(stream, rank: int, world: int, worker: int = 0, workers: int = 1, monkeypatch=None) -> list[int]:
    stream.set_placement(rank, world)
    monkeypatch.setattr(streaming, "worker_placement", lambda: (worker, workers))
    return [y for _, y in stream]


@pytest.mark.parametrize("world,workers", [(1, 1), (2, 1), (3, 2), (2, 4)])
def test_split_by_rank_and_worker_covers_every_sample_once(shards, monkeypatch, world, workers):
    stream = read_split("train", f"{shards}/train-{{000000..000004}}.tar", shuffle=8, classes=None)
    assert stream.classes == [str(i) for i in range(60)] and stream.total == 60
    per_rank = []
    for rank in range(world):
        got = [y for w in range(workers) for y in labels_of(stream, rank, world, w, workers, monkeypatch)]
        assert len(got) == len(stream) == 60 // world
        per_rank.append(got)
    seen = Counter(y for got in per_rank for y in got)
    assert max(seen.values()) == 1 and len(seen) == 60 // world * world  # no duplicate; all but the remainder


def test_dataloader_workers_and_batch_size_give_the_promised_batches(shards):
    stream = streaming.StreamImages(read_split("train", str(shards), shuffle=4), in_chans=3, transform=None)
    stream.batch_size = 7  # passed to the stream: each worker reads whole batches
    assert stream.dataset.batch_size == 7 and len(stream) == 60
    loader = DataLoader(stream, batch_size=7, num_workers=2, drop_last=True)
    pairs = list(loader)
    assert all(x.shape == (7, 3, 4, 4) and x.dtype == torch.uint8 for x, _ in pairs)
    batches = [y for _, y in pairs]
    assert len(batches) == len(loader) == 60 // 7
    flat = torch.cat(batches).tolist()
    assert len(set(flat)) == len(flat) == 56


def test_epochs_reshuffle_deterministically_and_epoch_length_walks_the_stream(shards, monkeypatch):
    a = read_split("train", str(shards), seed=3, shuffle=16)
    b = read_split("train", str(shards), seed=3, shuffle=16)
    e0 = labels_of(a, 0, 1, monkeypatch=monkeypatch)
    assert e0 == labels_of(b, 0, 1, monkeypatch=monkeypatch) and sorted(e0) == list(range(60))
    a.set_epoch(1)
    e1 = labels_of(a, 0, 1, monkeypatch=monkeypatch)
    assert e1 != e0 and sorted(e1) == list(range(60))
    # 25 samples an epoch on 2 ranks: 12 each; epochs 0 and 1 read different samples of the first pass
    s = read_split("train", str(shards), epoch_length=25, shuffle=0)
    got = {}
    for epoch in (0, 1):
        s.set_epoch(epoch)
        got[epoch] = [y for r in (0, 1) for y in labels_of(s, r, 2, monkeypatch=monkeypatch)]
        assert len(got[epoch]) == 24 and len(set(got[epoch])) == 24
    assert not set(got[0]) & set(got[1])


def test_resume_mid_epoch_continues_exactly(shards, monkeypatch):
    s = read_split("train", str(shards), seed=1, shuffle=10)
    s.set_epoch(2)
    full = labels_of(s, 0, 1, monkeypatch=monkeypatch)
    it = iter(s)
    head = [next(it)[1] for _ in range(23)]
    state = s.state_dict()
    assert state["epoch"] == 2 and state["consumed"] == 23
    fresh = read_split("train", str(shards), seed=1, shuffle=10)
    fresh.load_state_dict(state)
    assert head + [y for _, y in fresh] == full


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_exactly(shards, workers):
    """torchdata's StatefulDataLoader (what a resumable training loop uses) keeps each worker's position."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader():
        s = read_split("train", str(shards), shuffle=16, seed=4)
        s.set_epoch(2)
        d = streaming.StreamImages(s, 1, None)
        d.batch_size = 4
        return StatefulDataLoader(d, batch_size=4, num_workers=workers, drop_last=True)

    full = [y for _, y in loader()]
    first = loader()
    it = iter(first)
    head = [next(it)[1] for _ in range(5)]
    state = first.state_dict()
    del it
    again = loader()
    again.load_state_dict(state)
    rest = [y for _, y in again]
    assert len(full) == 15 and torch.equal(torch.cat(head + rest), torch.cat(full))


def test_eval_split_reads_in_order_and_val_pattern_found(shards, monkeypatch):
    val = read_split("val", f"{shards}/train-*.tar", classes=[str(i) for i in range(60)])
    assert labels_of(val, 0, 1, monkeypatch=monkeypatch) == list(range(10))
    assert [labels_of(val, r, 3, monkeypatch=monkeypatch) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]


def test_labels_from_json_names_and_captions_from_txt(tmp_path, monkeypatch):
    names = ["cat", "dog", "emu"]
    write_shards(tmp_path, n=9, per_shard=4, label=lambda i: {"json": {"label": names[i % 3]}},
                 extra=lambda i: {"txt": f"a photo of a {names[i % 3]}"})
    pattern = str(tmp_path / "train-*.tar")
    s = read_split("val", pattern, val=pattern)  # an evaluation split: in order
    assert s.classes == ["cat", "dog", "emu"]
    assert labels_of(s, 0, 1, monkeypatch=monkeypatch) == [i % 3 for i in range(9)]
    c = read_split("val", pattern, val=pattern, captions=True)
    caps = [t for _, t in c]
    assert caps == [f"a photo of a {names[i % 3]}" for i in range(9)]


def image_folder(root, sizes=(("train", 6), ("val", 2))):
    for split, n in sizes:
        for c in ("ant", "bee"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (9, 7), (10 * i, 100 if c == "ant" else 200, 0)).save(root / split / c / f"{i}.jpg")
    return root


def test_pack_round_trip_through_the_cli(tmp_path, capsys):
    root = image_folder(tmp_path / "folder")
    out = tmp_path / "shards"
    assert main(["data", "pack", f"imagefolder:{root}", "--out", str(out), "--shard-size", "5"]) == 0
    assert "train 12 samples in 3 shards" in capsys.readouterr().out
    assert json.loads((out / "classes.json").read_text()) == ["ant", "bee"]
    shards, classes = read_index(str(out / "train.json"))
    assert [s.count for s in shards] == [5, 5, 2] and classes == ["ant", "bee"]
    # the JPEG bytes are the files' own, and the labels follow their folders
    files = {p.read_bytes(): ["ant", "bee"].index(p.parent.name) for p in (root / "train").rglob("*.jpg")}
    got = {s["jpg"]: int(s["cls"]) for sh in shards for s in wds.WebDataset(sh.url, shardshuffle=False)}
    assert got == files
    assert main(["data", "info", f"wds:{out}"]) == 0
    assert "train 12, val 4 samples; 2 classes" in capsys.readouterr().out


def _error(capsys, argv, *words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vitlab: error: "), err
    for w in words:
        assert w in err, (w, err)


def test_bad_input_one_line(tmp_path, shards, capsys):
    _error(capsys, ["data", "info", f"wds:{tmp_path}/none-{{0..3}}.tar"], "matches nothing")
    _error(capsys, ["data", "info", f"wds:{shards}/train-{{000000..000009}}.tar"], "5 of 10 shards missing")
    write_shards(tmp_path, n=3, prefix="only")
    _error(capsys, ["data", "info", f"wds:{tmp_path}/only-000000.tar"], "no val shards", "--data.options.val")
    _error(capsys, ["data", "info", "wds:https://example.org/s-{0..3}.tar", "--options", '{"val": "x"}'],
           "remote", "shard index")
    (tmp_path / "bad.json").write_text('{"shards": []}')
    _error(capsys, ["data", "info", f"wds:{tmp_path / 'bad.json'}"], "not a shard index")
    # pack: a folder that already holds shards is refused and left as it was; a failure leaves nothing behind
    before = sorted(p.name for p in shards.iterdir())
    _error(capsys, ["data", "pack", "digits", "--out", str(shards)], "already holds shards")
    assert sorted(p.name for p in shards.iterdir()) == before
    _error(capsys, ["data", "pack", f"imagefolder:{tmp_path}/nowhere", "--out", str(tmp_path / "o")], "missing")
    assert not (tmp_path / "o").exists()


def test_corrupt_member_refused_or_skipped_and_counted(tmp_path, monkeypatch):
    write_shards(tmp_path, n=8, per_shard=4, extra=lambda i: {"png": b"not a png"} if i == 5 else {})
    pattern, classes = str(tmp_path / "train-*.tar"), [str(i) for i in range(8)]
    s = read_split("val", pattern, val=pattern, classes=classes)
    with pytest.raises(DataError, match=r"unreadable image .*train-000001.tar sample 00000005.png"):
        labels_of(s, 0, 1, monkeypatch=monkeypatch)
    s = read_split("val", pattern, val=pattern, skip_bad_images=True, classes=classes)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = labels_of(s, 0, 1, monkeypatch=monkeypatch)
    assert got == [0, 1, 2, 3, 4, 4, 6, 7]  # the count kept: the previous sample stands in
    assert any("skipped 1 unreadable sample" in str(x.message) for x in w)


def test_truncated_shard_refused_or_read_in_part(tmp_path, monkeypatch):
    paths = write_shards(tmp_path, n=8, per_shard=4)
    data = open(paths[1], "rb").read()
    open(paths[1], "wb").write(data[: len(data) // 2 + 100])  # into the third sample's image
    with pytest.raises(DataError, match="corrupt shard .*train-000001.tar"):
        read_split("train", str(tmp_path / "train-*.tar"), classes=[str(i) for i in range(8)])
    with pytest.warns(UserWarning, match="corrupt shard"):
        s = read_split("val", str(tmp_path / "train-*.tar"), val=str(tmp_path / "train-*.tar"),
                       skip_bad_images=True, classes=[str(i) for i in range(8)])
    with pytest.warns(UserWarning, match="skipped 1 unreadable sample"):  # the cut sample, replaced
        got = labels_of(s, 0, 1, monkeypatch=monkeypatch)
    assert got[:4] == [0, 1, 2, 3] and len(got) == s.total and set(got) <= set(range(8))


def test_missing_package_names_the_extra(monkeypatch, tmp_path):
    real = streaming.importlib.import_module

    def fake(name, *a):
        if name == "webdataset":
            raise ImportError(name)
        return real(name, *a)

    monkeypatch.setattr(streaming.importlib, "import_module", fake)
    with pytest.raises(DataError, match=r"needs the webdataset package: pip install 'vitlab\[stream\]'"):
        read_split("train", str(tmp_path / "x-{0..1}.tar"))
    with pytest.raises(DataError, match="webdataset"):
        pack("digits", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_clip_trains_on_caption_shards(tmp_path):
    from vitlab.clip.data import training_texts

    for split, n in (("train", 24), ("val", 8)):
        write_shards(tmp_path / "d", n=n, per_shard=8, prefix=split, label=lambda i: {},
                     extra=lambda i: {"txt": f"a grey square of shade {i % 4}"})
    run = tmp_path / "clip"
    assert main(["train", "--task", "clip", "--data", f"wds:{tmp_path / 'd'}", "--task_args.tokenizer", "clip",
                 "--model", "clip_vit_pico_patch8", "--model_kwargs.image_depth", "1", "--model_kwargs.text_depth",
                 "1", "--model_kwargs.in_chans", "3", "--data.img_size", "16", "--epochs", "1", "--batch_size", "8",
                 "--threads", "1", "--output_dir", str(run), "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["best_val_loss"] > 0
    assert sorted(training_texts(DataConfig(f"wds:{tmp_path / 'd'}"))) == sorted(
        f"a grey square of shade {i % 4}" for i in range(24))


def _rank_labels(rank: int, world: int, port: int, sources: dict, out):
    import os

    import torch.distributed as dist

    from vitlab.data import hf
    from vitlab.data import wds as shards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    streams = {"wds": shards.read_split("train", sources["wds"], shuffle=8),
               "hf": hf.read_split("train", sources["hf"], streaming=True, shuffle=8)}
    for name, s in streams.items():
        s.set_epoch(1)
        s.batch_size = 4
        loader = DataLoader(streaming.StreamImages(s, 1, None), batch_size=4, num_workers=2, drop_last=True)
        out[(name, rank)] = (len(loader), torch.cat([y for _, y in loader]).tolist())
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes import torch and vitlab: a minute on a busy 2-core machine
def test_streams_split_between_torch_distributed_ranks(shards, tmp_path):
    """Under a real process group (gloo, 2 ranks, 2 DataLoader workers each) both streams give every rank the
    same number of batches and no sample twice: the loader needs no DistributedSampler."""
    import socket

    import datasets as hfd
    import torch.multiprocessing as mp

    f = hfd.Features({"image": hfd.Image(), "label": hfd.ClassLabel(names=[str(i) for i in range(32)])})
    rows = {"image": [{"bytes": png(i), "path": None} for i in range(32)], "label": list(range(32))}
    hfd.DatasetDict({"train": hfd.Dataset.from_dict(rows, features=f),
                     "validation": hfd.Dataset.from_dict(rows, features=f)}).save_to_disk(str(tmp_path / "hf"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_rank_labels, args=(2, port, {"wds": str(shards), "hf": str(tmp_path / "hf")}, out), nprocs=2,
             join=True)
    for name, total in (("wds", 60), ("hf", 32)):
        (n0, a), (n1, b) = out[(name, 0)], out[(name, 1)]
        assert n0 == n1 == total // 2 // 4 and len(a) == len(b) == n0 * 4
        assert not set(a) & set(b) and len(set(a)) == len(a) and len(set(b)) == len(b)


def test_pack_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    from vitlab.data import wds as shards

    calls = []

    def broken(image):  # the third image cannot be encoded: the first shard is complete by then
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return "png", png(0)

    monkeypatch.setattr(shards, "_encoded", broken)
    with pytest.raises(OSError, match="disk full"):
        pack(f"imagefolder:{image_folder(tmp_path / 'folder')}", tmp_path / "out", shard_size=2)
    assert not (tmp_path / "out").exists()


def test_pack_caption_pairs_for_clip(tmp_path, capsys):
    root = image_folder(tmp_path / "folder", (("train", 3),))
    lines = ["image,caption,split"] + [f"train/{c}/{i}.jpg,a {c} number {i},{'val' if i == 2 else 'train'}"
                                       for c in ("ant", "bee") for i in range(3)]
    (root / "captions.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "pairs"
    assert main(["data", "pack", f"captions:{root}", "--out", str(out), "--shard-size", "3"]) == 0
    assert "train 4 samples in 2 shards, val 2 samples in 1 shards; image-text pairs" in capsys.readouterr().out
    val = read_split("val", str(out), captions=True)
    assert sorted(t for _, t in val) == ["a ant number 2", "a bee number 2"]
    got = {s["txt"].decode(): s["jpg"] for sh in read_index(str(out / "train.json"))[0]
           for s in wds.WebDataset(sh.url, shardshuffle=False)}
    assert got == {f"a {c} number {i}": (root / "train" / c / f"{i}.jpg").read_bytes() for c in ("ant", "bee")
                   for i in range(2)}


def test_train_on_shards_through_the_cli(tmp_path):
    out = tmp_path / "shards"
    pack(f"imagefolder:{image_folder(tmp_path / 'folder', (('train', 12), ('val', 4)))}", out, shard_size=5)
    run = tmp_path / "run"
    assert main(["train", "--data", f"wds:{out}", "--data.img_size", "16", "--data.preset", "tiny",
                 "--model", "vit_pico_patch8_32", "--model_kwargs.depth", "1", "--model_kwargs.embed_dim", "32",
                 "--model_kwargs.num_heads", "2", "--epochs", "2", "--batch_size", "8", "--threads", "1",
                 "--data.num_workers", "2", "--output_dir", str(run), "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["dataset"] == f"wds:{out}" and summary["epochs_done"] == 2
