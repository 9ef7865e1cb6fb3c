"""mnist:PATH / fashion-mnist:PATH: readers of the standard IDX files (gzipped or not), on tiny files of our own."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from vitlab.data import DataConfig, build
from vitlab.data.datasets import DataError, read_idx


def _idx(arr: np.ndarray) -> bytes:
    head = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    return head + arr.astype(np.uint8).tobytes()


def write_idx_set(root, n_train=5020, n_test=20, gz=True):
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("t10k", n_test)):
        for kind, arr in (("images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28))),
                          ("labels-idx1-ubyte", np.arange(n) % 10)):
            data = _idx(arr)
            name = f"{split}-{kind}" + (".gz" if gz else "")
            (root / name).write_bytes(gzip.compress(data, compresslevel=1) if gz else data)
    return root


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_idx(tmp_path, gz):
    root = write_idx_set(tmp_path / "fm", gz=gz)
    b = build(DataConfig(f"fashion-mnist:{root}", img_size=32), in_chans=1)
    assert (len(b.train), len(b.val), len(b.test)) == (20, 5000, 20)
    assert b.class_names[0] == "T-shirt/top" and b.num_classes == 10
    x, y = b.test[3]
    assert x.shape == (1, 32, 32) and y == 3
    raw = read_idx(root / ("t10k-images-idx3-ubyte" + (".gz" if gz else "")))
    assert raw.shape == (20, 28, 28) and raw.dtype == np.uint8


def test_mnist_defaults_and_bad_files(tmp_path):
    root = write_idx_set(tmp_path / "m", gz=False)
    b = build(DataConfig(f"mnist:{root}"), in_chans=3)
    assert b.config.hflip == 0.0 and b.train[0][0].shape[0] == 3 and b.class_names[:2] == ["0", "1"]
    (root / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00\x0d\x01junk")
    with pytest.raises(DataError, match="not an IDX file of unsigned bytes"):
        build(DataConfig(f"mnist:{root}"), in_chans=1)
    (root / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match="missing .*t10k-labels-idx1-ubyte"):
        build(DataConfig(f"mnist:{root}"), in_chans=1)
    with pytest.raises(DataError, match="needs a path"):
        DataConfig("mnist")
    with pytest.raises(DataError, match="missing directory"):
        build(DataConfig(f"fashion-mnist:{tmp_path / 'nope'}"), in_chans=1)
