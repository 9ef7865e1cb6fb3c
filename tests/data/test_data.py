"""vitlab.data: digits split, transforms, batch mixing, imagefolder (written here with PIL), fake, cifar, errors."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data import DIGITS_SPLIT, DataBundle, DataConfig, DataError, build, check_num_classes


@pytest.fixture(scope="module")
def digits() -> DataBundle:
    return build(DataConfig("digits"), in_chans=1)


# ---------------------------------------------------------------- digits


def test_digits_split_sizes_and_stratification(digits):
    sizes = {s: len(getattr(digits, s)) for s in ("train", "val", "test")}
    assert sizes == DIGITS_SPLIT == {"train": 1257, "val": 270, "test": 270}
    assert sum(sizes.values()) == 1797
    assert digits.num_classes == 10 and digits.class_names == [str(i) for i in range(10)]
    full = np.bincount(np.concatenate([getattr(digits, s).labels.numpy() for s in sizes]), minlength=10)
    for s, n in sizes.items():
        counts = np.bincount(getattr(digits, s).labels.numpy(), minlength=10)
        # Stratified: each class's share equals its share of the whole set, up to rounding (two-stage split).
        assert np.all(np.abs(counts - full * n / 1797) <= 1.5), (s, counts)


def test_digits_split_is_fixed_whatever_the_seed(digits):
    other = build(DataConfig("digits", seed=123), in_chans=1)
    for s in ("train", "val", "test"):
        a, b = getattr(digits, s), getattr(other, s)
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)


def test_digits_defaults_and_shapes(digits):
    cfg = digits.config
    assert (cfg.preset, cfg.img_size, digits.img_size) == ("tiny", 32, 32)
    assert cfg.hflip == 0.0  # a mirrored digit is another symbol
    assert digits.mixup is None
    x, y = digits.train[0]
    assert x.shape == (1, 32, 32) and x.dtype == torch.float32 and isinstance(y, int)
    x, _ = digits.test[0]
    assert x.shape == (1, 32, 32) and -1.0 <= x.min() and x.max() <= 1.0  # mean 0.5, std 0.5
    rgb = build(DataConfig("digits", img_size=16), mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    assert rgb.in_chans == 3 and rgb.train[0][0].shape == (3, 16, 16) and rgb.val[0][0].shape == (3, 16, 16)


def test_loader_defaults_and_epoch_seeded_shuffle(digits):
    tr = digits.loader("train", batch_size=100)
    assert len(tr) == 1257 // 100  # drop_last for train
    assert len(digits.loader("test", batch_size=100)) == 3  # eval keeps the last partial batch
    ys = [next(iter(digits.loader("train", batch_size=32, epoch=e)))[1] for e in (3, 3, 4)]
    assert torch.equal(ys[0], ys[1]) and not torch.equal(ys[0], ys[2])
    x, y = next(iter(digits.loader("val", batch_size=8)))
    assert x.shape == (8, 1, 32, 32) and y.dtype == torch.int64
    with pytest.raises(DataError, match="unknown split"):
        digits.loader("holdout")


def test_check_num_classes(digits):
    check_num_classes(digits, 10)
    with pytest.raises(DataError, match="10 classes but the checkpoint has 100"):
        check_num_classes(digits, 100)


# ---------------------------------------------------------------- transforms and mixing


def test_train_and_eval_transform_shapes_with_full_augmentation():
    cfg = DataConfig("fake", preset="imagenet", img_size=48, fake_img_size=64, fake_num_samples=8,
                     hflip=0.5, randaugment=True, color_jitter=0.3, reprob=1.0, crop_pct=0.875)
    b = build(cfg, in_chans=3)
    assert b.config.scale == (0.08, 1.0) and b.config.mixup == 0.8 and b.config.cutmix == 1.0
    for i in range(4):
        x, _ = b.train[i]
        assert x.shape == (3, 48, 48) and x.dtype == torch.float32
    x, _ = b.val[0]
    assert x.shape == (3, 48, 48)


def test_mixup_soft_targets_sum_to_one():
    b = build(DataConfig("digits", mixup=0.8, cutmix=1.0), in_chans=1)
    x, y = next(iter(b.loader("train", batch_size=16)))
    for _ in range(4):  # MixUp or CutMix, chosen per batch
        xm, t = b.mixup(x, y)
        assert xm.shape == x.shape and t.shape == (16, 10)
        assert torch.allclose(t.sum(1), torch.ones(16)) and (t >= 0).all()
    only_cutmix = build(DataConfig("digits", mixup=0.0, cutmix=1.0), in_chans=1)
    assert only_cutmix.mixup(x, y)[1].shape == (16, 10)


# ---------------------------------------------------------------- imagefolder


def _write(path: Path, mode: str, size=(12, 10), color=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    color = color if color is not None else {"L": 128, "RGB": (200, 10, 10), "RGBA": (0, 0, 255, 0)}[mode]
    Image.new(mode, size, color).save(path)


@pytest.fixture
def folder(tmp_path) -> Path:
    root = tmp_path / "ds"
    for split, n in (("train", 3), ("val", 1), ("test", 1)):
        for c, mode in (("cat", "RGB"), ("dog", "L"), ("emu", "RGBA")):
            for i in range(n):
                _write(root / split / c / f"{i}.png", mode)
    return root


def test_imagefolder_rgb_grayscale_rgba(folder):
    b = build(DataConfig(f"imagefolder:{folder}", img_size=16), in_chans=3)
    assert b.config.preset == "imagenet"
    assert (len(b.train), len(b.val), len(b.test)) == (9, 3, 3)
    assert b.class_names == ["cat", "dog", "emu"] and b.num_classes == 3
    for i in range(len(b.train)):
        x, y = b.train[i]
        assert x.shape == (3, 16, 16) and y == i // 3
    gray = build(DataConfig(f"imagefolder:{folder}", img_size=16), in_chans=1)
    assert all(gray.val[i][0].shape == (1, 16, 16) for i in range(3))
    # A fully transparent RGBA image is composited over white; identity normalisation shows raw [0, 1] values.
    raw = build(DataConfig(f"imagefolder:{folder}", img_size=16), mean=(0.0,), std=(1.0,), in_chans=3)
    assert torch.allclose(raw.val[2][0], torch.ones(3, 16, 16))
    assert torch.allclose(raw.preprocess(folder / "val" / "cat" / "0.png")[0], torch.full((16, 16), 200 / 255))
    x, _ = next(iter(b.loader("train", batch_size=4)))
    assert x.shape == (4, 3, 16, 16)


def test_imagefolder_without_test_split(folder):
    import shutil

    shutil.rmtree(folder / "test")
    assert build(DataConfig(f"imagefolder:{folder}", img_size=8)).test is None


def test_imagefolder_corrupt_image_fails_then_is_skipped(folder):
    bad = folder / "train" / "dog" / "broken.png"
    bad.write_bytes(b"this is not a png")
    with pytest.raises(DataError, match="unreadable image .*broken.png"):
        build(DataConfig(f"imagefolder:{folder}", img_size=8))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        b = build(DataConfig(f"imagefolder:{folder}", img_size=8, skip_bad_images=True))
    assert len(b.train) == 9
    msgs = [str(m.message) for m in w if "unreadable" in str(m.message)]
    assert len(msgs) == 1 and "skipped 1 unreadable" in msgs[0] and "broken.png" in msgs[0]


def test_imagefolder_truncated_image_found_at_load_time(folder):
    # Half a JPEG passes the scan (header and verify() are fine) and fails only when decoded.
    p = folder / "train" / "cat" / "trunc.jpg"
    noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(p, quality=95)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    b = build(DataConfig(f"imagefolder:{folder}", img_size=8))
    i = [s for s, _ in b.train.samples].index(str(p))
    with pytest.raises(DataError, match="unreadable image .*trunc.jpg"):
        b.train[i]
    b = build(DataConfig(f"imagefolder:{folder}", img_size=8, skip_bad_images=True))
    with pytest.warns(UserWarning, match="skipped unreadable image .*trunc.jpg"):
        x, y = b.train[i]  # the next image stands in
    assert x.shape == (3, 8, 8) and len(b.train) == 10


def test_first_undecodable_decodes_what_verify_passes(tmp_path, monkeypatch, capsys):
    """Half a JPEG (which PIL's verify() passes) is the first file that does not decode, named in the files'
    order whatever thread decoded it; a check of many images says so before and after."""
    from vitlab.data import datasets

    noise = np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    paths = []
    for i in range(6):
        paths.append(str(tmp_path / f"{i}.jpg"))
        Image.fromarray(noise).save(paths[-1], quality=90)
    assert datasets.image_ok(Path(paths[3])) and datasets.first_undecodable(paths) is None
    for i in (3, 5):
        Path(paths[i]).write_bytes(Path(paths[i]).read_bytes()[:1000])
    assert datasets.image_ok(Path(paths[3]))
    bad, why = datasets.first_undecodable(paths)
    assert bad == paths[3] and "truncated" in why
    monkeypatch.setattr(datasets, "DECODE_SAYS_FROM", 2)
    capsys.readouterr()
    assert datasets.first_undecodable(paths[:3]) is None
    said = capsys.readouterr().out.strip().splitlines()
    assert said[0] == "decoding 3 images once to check them" and said[1].startswith("all 3 images decode (")


def test_imagefolder_missing_directories(tmp_path, folder):
    with pytest.raises(DataError, match="missing directory .*nowhere"):
        build(DataConfig(f"imagefolder:{tmp_path / 'nowhere'}"))
    import shutil

    shutil.rmtree(folder / "val")
    with pytest.raises(DataError, match=r"missing directory .*val"):
        build(DataConfig(f"imagefolder:{folder}"))


def test_imagefolder_empty_class_dir_and_empty_split(folder, tmp_path):
    (folder / "train" / "fox").mkdir()
    with pytest.raises(DataError, match="class directory without images: .*fox"):
        build(DataConfig(f"imagefolder:{folder}"))
    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    with pytest.raises(DataError, match="no class directories in .*train"):
        build(DataConfig(f"imagefolder:{empty}"))


def test_imagefolder_val_class_unknown_to_train(folder):
    _write(folder / "val" / "yak" / "0.png", "RGB")
    with pytest.raises(DataError, match="yak.*not among the train classes"):
        build(DataConfig(f"imagefolder:{folder}"))


# ---------------------------------------------------------------- fake, cifar, config errors


def test_fake_any_size_and_class_count_deterministic():
    cfg = DataConfig("fake", fake_num_samples=20, fake_num_classes=7, fake_img_size=24, randaugment=False,
                     reprob=0.0)
    a, b = build(cfg, in_chans=3), build(cfg, in_chans=3)
    assert a.num_classes == 7 and len(a.train) == 20 and len(a.val) == 7 and a.test is None
    assert a.config.preset == "tiny" and a.img_size == 24
    assert [a.val[i][1] for i in range(7)] == list(range(7))
    assert torch.equal(a.val[3][0], b.val[3][0]) and a.val[3][0].shape == (3, 24, 24)
    assert a.train[5][0].shape == (3, 24, 24)
    assert build(DataConfig("fake", fake_img_size=224, fake_num_samples=4)).config.preset == "imagenet"


@pytest.mark.parametrize("kind", ["cifar10", "cifar100"])
def test_cifar_missing_without_download(tmp_path, kind):
    with pytest.raises(DataError, match="missing directory .*--download"):
        build(DataConfig(f"{kind}:{tmp_path / 'none'}"))
    with pytest.raises(DataError, match=f"{kind} not found or corrupt under .*--download"):
        build(DataConfig(f"{kind}:{tmp_path}"))


def test_config_errors():
    with pytest.raises(DataError, match="unknown dataset"):
        build(DataConfig("svhn"))  # a plugin may register a name after the config is made
    with pytest.raises(DataError, match="needs a path"):
        DataConfig("imagefolder")
    with pytest.raises(DataError, match="unknown preset"):
        DataConfig(preset="huge")
    with pytest.raises(DataError, match="in_chans"):
        build(DataConfig(), in_chans=4)
    import yaml

    cfg = DataConfig(scale=(0.5, 1)).resolved()
    assert DataConfig(**yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg  # YAML round trip
    assert isinstance(DataError("x"), ValueError)


def test_cifar_split_from_torchvision_format(tmp_path, monkeypatch):
    # torchvision's CIFAR checks md5 sums of the real archives, so its class is stood in for here.
    import torchvision.datasets

    class FakeCifar:
        def __init__(self, root, train=True, download=False):
            n = 6000 if train else 1000
            rng = np.random.default_rng(int(train))
            self.data = rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8)
            self.targets = [i % 10 for i in range(n)]
            self.classes = [f"c{i}" for i in range(10)]

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCifar)
    b = build(DataConfig(f"cifar10:{tmp_path}"), in_chans=1)
    assert (len(b.train), len(b.val), len(b.test)) == (1000, 5000, 1000)
    assert np.bincount(b.val.labels.numpy()).tolist() == [500] * 10
    assert b.config.preset == "tiny" and b.config.hflip == 0.5 and b.mixup is not None
    assert b.train[0][0].shape == (1, 32, 32) and b.test[0][0].shape == (1, 32, 32)


def test_digits_never_flipped_even_under_imagenet_preset():
    cfg = DataConfig("digits", preset="imagenet").resolved()
    assert (cfg.img_size, cfg.hflip, cfg.crop_pct) == (224, 0.0, 0.875)
    assert DataConfig("digits", preset="imagenet", hflip=0.5).resolved().hflip == 0.5  # explicit wins
