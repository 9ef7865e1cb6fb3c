"""Dense data: segfolder / depthfolder layouts, joint transforms keeping image and mask aligned, the embedded
scenes, and every bad input as one line naming the file (exit 2 from the CLI)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.data import DataConfig, DataError
from vitlab.dense.data import (
    ShapeAssets,
    apply,
    build_dense,
    joint_transform,
    motorcycle_sample,
    shapes_scene,
)

MEAN = STD = (0.5, 0.5, 0.5)


def _blocks(seed: int, h: int = 40, w: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """An image whose red channel encodes the class of each 8x8 block (class * 60), and its mask."""
    rng = np.random.default_rng(seed)
    cls = np.kron(rng.integers(0, 4, (h // 8, w // 8)), np.ones((8, 8), np.int64))
    img = np.zeros((h, w, 3), np.uint8)
    img[..., 0] = cls * 60
    return img, cls


def _segfolder(root, n=5, classes=("bg", "a", "b", "c")):
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i in range(n):
        img, m = _blocks(i)
        Image.fromarray(img).save(root / "images" / f"im{i}.png")
        Image.fromarray(m.astype(np.uint8)).save(root / "masks" / f"im{i}.png")
    if classes:
        (root / "classes.txt").write_text("\n".join(classes))
    return root


def test_segfolder_splits_classes_and_aligned_transforms(tmp_path):
    root = _segfolder(tmp_path / "seg")
    b = build_dense(DataConfig(f"segfolder:{root}", img_size=32), "segment", MEAN, STD)
    assert (len(b.train), len(b.val), b.num_classes, b.class_names) == (4, 1, 4, ["bg", "a", "b", "c"])
    torch.manual_seed(0)
    for i in range(len(b.train)):
        x, y = b.train[i]
        assert x.shape == (3, 32, 32) and y.shape == (32, 32) and y.dtype == torch.int64
        decoded = ((x[0] * 0.5 + 0.5) * 255 / 60).round().long()  # the class the image shows at each pixel
        # aligned: bilinear (image) and nearest (mask) resampling differ on block edges only; a misaligned pair
        # (here the mask mirrored) agrees about as often as chance
        assert (decoded == y).float().mean() > 0.8
        assert (decoded == y).float().mean() > (decoded == y.flip(-1)).float().mean() + 0.2


def test_segfolder_without_classes_file_takes_largest_label(tmp_path):
    root = _segfolder(tmp_path / "seg", classes=None)
    m = np.array(Image.open(root / "masks" / "im0.png"))
    m[0, 0] = 255  # ignored pixels are fine
    Image.fromarray(m).save(root / "masks" / "im0.png")
    b = build_dense(DataConfig(f"segfolder:{root}"), "segment", MEAN, STD)
    assert b.num_classes == 4 and b.img_size == 512


@pytest.mark.parametrize("problem,match", [
    ("size", "mask .*im1.png is 20x20 but its image"),
    ("label", "im2.png has label 7 >= num_classes 4"),
    ("empty", "empty folder: no images in"),
    ("missing", "no mask file for .*im3.png"),
])
def test_bad_segfolder_is_one_line_naming_the_file(tmp_path, problem, match, capsys):
    root = _segfolder(tmp_path / "seg")
    if problem == "size":
        Image.fromarray(np.zeros((20, 20), np.uint8)).save(root / "masks" / "im1.png")
    elif problem == "label":
        m = np.array(Image.open(root / "masks" / "im2.png"))
        m[3, 3] = 7
        Image.fromarray(m).save(root / "masks" / "im2.png")
    elif problem == "empty":
        for p in (root / "images").iterdir():
            p.unlink()
    else:
        (root / "masks" / "im3.png").unlink()
    with pytest.raises(DataError, match=match):
        build_dense(DataConfig(f"segfolder:{root}"), "segment", MEAN, STD)
    assert main(["train", "--task", "segment", "--data", f"segfolder:{root}", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vitlab: error:")


def test_depthfolder_png16_npy_and_nan(tmp_path):
    root = tmp_path / "dep"
    (root / "images").mkdir(parents=True)
    (root / "depth").mkdir()
    for i in range(3):
        Image.fromarray(_blocks(i)[0]).save(root / "images" / f"d{i}.png")
    Image.fromarray(np.full((40, 48), 2500, np.uint16)).save(root / "depth" / "d0.png")
    np.save(root / "depth" / "d1.npy", np.full((40, 48), 1.5, np.float32))
    np.save(root / "depth" / "d2.npy", np.full((40, 48), np.inf, np.float32))  # inf: invalid, kept as 0
    b = build_dense(DataConfig(f"depthfolder:{root}", img_size=32), "depth", MEAN, STD, depth_scale=1000.0)
    x, d = b.train[0]
    assert x.shape == (3, 32, 32) and torch.allclose(d, torch.full((32, 32), 2.5))
    assert torch.allclose(b.train[1][1], torch.full((32, 32), 1.5))
    bad = np.full((40, 48), 1.0, np.float32)
    bad[5, 5] = np.nan
    np.save(root / "depth" / "d1.npy", bad)
    with pytest.raises(DataError, match="d1.npy contains NaN"):
        build_dense(DataConfig(f"depthfolder:{root}"), "depth", MEAN, STD)


def test_dataset_kind_must_fit_the_task(tmp_path):
    with pytest.raises(DataError, match="--task depth takes --data shapes or --data depthfolder"):
        build_dense(DataConfig(f"segfolder:{tmp_path}"), "depth", MEAN, STD)
    with pytest.raises(DataError, match="needs a path"):
        DataConfig("segfolder")
    from vitlab.data import build

    with pytest.raises(DataError, match="--task segment"):
        build(DataConfig("shapes"))


def test_shapes_scenes_are_deterministic_and_masks_exact():
    assets = ShapeAssets()
    a, ma = shapes_scene(5, 96, assets)
    b, mb = shapes_scene(5, 96, assets)
    assert torch.equal(a, b) and torch.equal(ma, mb)
    assert not torch.equal(ma, shapes_scene(6, 96, assets)[1])
    assert set(ma.unique().tolist()) <= {0, 1, 2, 3} and (ma > 0).any()
    _, depth = shapes_scene(5, 96, assets, depth=True)
    assert depth.min() >= 1.0 and depth.max() <= 8.0
    img, m = apply(joint_transform(64, True, MEAN, STD), a, ma)
    assert img.shape == (3, 64, 64) and set(m.unique().tolist()) <= {0, 1, 2, 3}


def test_motorcycle_depth_from_disparity():
    img, depth = motorcycle_sample()
    valid = depth > 0
    assert img.shape[1:] == depth.shape and valid.float().mean() > 0.85
    assert 1.5 < depth[valid].min() and depth[valid].max() < 6.0  # the scene spans about 2 to 5 m
