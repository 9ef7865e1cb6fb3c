"""vitlab.data's dataset registry: a registered function read by build (PIL or uint8 tensor images, root, options,
metadata), the wrapped splits, and the one-line errors for unknown, declared and rootless names."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset

from vitlab.data import DataConfig, DataError, build, declare_dataset, list_datasets, register_dataset
from vitlab.data.registry import DATASETS

CLASSES = ["red", "green", "blue"]
COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]


class TinyColours(Dataset):
    """Solid 12x10 images of one colour per class, as PIL images or uint8 tensors (1 or 3 channels)."""

    def __init__(self, n: int, kind: str = "pil", root: str | None = None):
        self.n, self.kind, self.root, self.classes = n, kind, root, list(CLASSES)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        label = i % 3
        img = Image.new("RGB", (12, 10), COLOURS[label])
        if self.kind == "pil":
            return img, label
        x = torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous()
        return (x[:1] if self.kind == "gray" else x), torch.tensor(label)


@pytest.fixture(autouse=True)
def _restore_registry():
    saved = dict(DATASETS)
    yield
    DATASETS.clear()
    DATASETS.update(saved)


@pytest.fixture
def mytiny() -> list:
    calls = []

    @register_dataset("mytiny")
    def tiny(split: str, root: str | None, *, n: int = 6) -> TinyColours | None:
        calls.append((split, root))
        return None if split == "test" else TinyColours(n if split == "train" else 3, "pil", root)

    return calls


def test_registered_pil_dataset_builds_a_bundle(mytiny):
    assert "mytiny" in list_datasets() and {"digits", "fake", "imagefolder", "mnist"} <= set(list_datasets())
    b = build(DataConfig("mytiny", img_size=8), mean=(0.0,), std=(1.0,), in_chans=3)
    assert mytiny == [("train", None), ("val", None), ("test", None)]
    assert (len(b.train), len(b.val), b.test) == (6, 3, None)
    assert b.num_classes == 3 and b.class_names == CLASSES and b.train.classes == CLASSES
    assert b.config.preset == "tiny" and b.config.img_size == 8 and b.name == "mytiny"
    for i in range(3):
        x, y = b.val[i]
        assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and y == i
        assert torch.allclose(x, torch.tensor(COLOURS[i], dtype=torch.float32).div(255).view(3, 1, 1).expand(3, 8, 8))
    x, y = next(iter(b.loader("train", batch_size=4)))
    assert x.shape == (4, 3, 8, 8) and y.dtype == torch.int64
    gray = build(DataConfig("mytiny", img_size=8), in_chans=1)
    assert gray.train[0][0].shape == (1, 8, 8)
    with pytest.raises(DataError, match="has no test split"):
        b.loader("test")


def test_root_and_options_reach_the_function(mytiny):
    b = build(DataConfig("mytiny:/some/root", img_size=8, options={"n": 9}))
    assert mytiny[0] == ("train", "/some/root") and b.train.root == "/some/root"  # source attributes show through
    assert len(b.train) == 9 and b.name == "mytiny:/some/root"
    with pytest.raises(DataError, match="dataset mytiny: got an unexpected keyword argument 'size'"):
        build(DataConfig("mytiny", options={"size": 3}))
    assert len(mytiny) == 3  # refused before the function ran


def test_the_wrapped_split_keeps_a_settable_transform_through_copy_and_pickle(mytiny):
    b = build(DataConfig("mytiny", img_size=8))
    plain = copy.copy(b.train)
    plain.transform = None
    x, _ = plain[1]
    assert x.dtype == torch.uint8 and x.shape == (3, 10, 12) and b.train[1][0].dtype == torch.float32
    again = pickle.loads(pickle.dumps(b.val))
    assert torch.equal(again[2][0], b.val[2][0]) and again.classes == CLASSES


@pytest.mark.parametrize("kind", ["rgb", "gray"])
def test_uint8_tensor_dataset_is_converted_to_in_chans(kind):
    given = []

    @register_dataset("tensors", takes=("in_chans", "img_size", "seed"), preset="imagenet",
                      defaults={"hflip": 0.0, "mixup": 0.0})
    def tensors(split: str, root: str | None, *, in_chans: int, img_size: int, seed: int) -> TinyColours:
        given.append((in_chans, img_size, seed))
        return TinyColours(3, kind)

    b = build(DataConfig("tensors", img_size=16, seed=3), in_chans=1, mean=(0.0,), std=(1.0,))
    assert (b.config.preset, b.config.hflip, b.config.mixup, b.config.cutmix) == ("imagenet", 0.0, 0.0, 1.0)
    x, y = b.test[1]
    luma = round(0.587 * 255) if kind == "rgb" else 0  # green: luma-weighted average; grey: its red channel
    assert x.shape == (1, 16, 16) and y == 1 and torch.allclose(x, torch.full((1, 16, 16), luma / 255))
    assert given == [(1, 16, 3)] * 3  # the working size and channels, resolved DataConfig fields
    rgb = build(DataConfig("tensors"), in_chans=3, mean=(0.0,), std=(1.0,))
    assert given[-1] == (3, 224, 0) and rgb.val[2][0].shape == (3, 224, 224)
    assert torch.equal(rgb.val[2][0][:, 0, 0], torch.tensor([0.0, 0.0, 1.0]) if kind == "rgb" else torch.zeros(3))
    with pytest.raises(DataError, match="options in_chans come from the DataConfig"):
        build(DataConfig("tensors", img_size=16, seed=3, options={"in_chans": 1}), in_chans=1)


def test_bad_items_and_splits_are_one_line():
    class Floats(TinyColours):
        def __getitem__(self, i):
            return torch.zeros(3, 4, 4), 0

    register_dataset("floats")(lambda split, root: Floats(2))
    with pytest.raises(DataError, match=r"uint8 \(C, H, W\) tensor with 1 or 3 channels, got torch.float32 tensor"):
        build(DataConfig("floats")).train[0]
    register_dataset("noval")(lambda split, root: TinyColours(2) if split == "train" else None)
    with pytest.raises(DataError, match="noval has no val split"):
        build(DataConfig("noval"))
    register_dataset("nameless")(lambda split, root: torch.utils.data.TensorDataset(torch.zeros(2)))
    with pytest.raises(DataError, match="no classes attribute"):
        build(DataConfig("nameless"))
    register_dataset("empty")(lambda split, root: TinyColours(0))
    with pytest.raises(DataError, match="empty split train"):
        build(DataConfig("empty"))
    with pytest.raises(ValueError, match="registered twice"):
        register_dataset("empty")(lambda split, root: TinyColours(1))


def test_unknown_name_has_close_matches_and_the_registered_names():
    cfg = DataConfig("fashion-mnis:/x")  # no error yet: a plugin may register the name later
    with pytest.raises(DataError, match="unknown dataset 'fashion-mnis'; close matches: fashion-mnist") as e:
        build(cfg)
    assert "\n" not in str(e.value) and "registered datasets: " in str(e.value) and "digits" in str(e.value)


def test_root_required_by_registration_metadata():
    cfg = DataConfig("later")  # registered after the config was made: build still checks
    register_dataset("later", needs_root=True)(lambda split, root: TinyColours(3, root=root))
    with pytest.raises(DataError, match="dataset later needs a path: later:PATH"):
        build(cfg)
    with pytest.raises(DataError, match="needs a path"):
        DataConfig("later")
    assert build(DataConfig("later:~/x")).train.root.endswith("/x")


def test_a_declared_name_is_sent_to_its_reader():
    declare_dataset("pairs", read_by="--task pairs", needs_root=True)
    assert "pairs" not in list_datasets()
    with pytest.raises(DataError, match="needs a path"):
        DataConfig("pairs")
    with pytest.raises(DataError, match="dataset 'pairs' is read by --task pairs, not as classification data"):
        build(DataConfig("pairs:/x"))
