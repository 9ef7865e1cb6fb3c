"""The image-caption files of ``captions:PATH``: a folder with ``captions.csv`` or ``captions.jsonl`` (or PATH is
that file). Columns / keys: ``image`` (a path relative to the file's folder) and ``caption``; optional ``split``
(train / val / test). Without a split column a fixed 10% of the images (at least one) is held out for validation
(all of an image's captions together). Every row is checked when the file is read: a missing image, an empty
caption or a malformed line is named (file, line) in one error. CLIP's task (:mod:`vitlab.clip.data`) and the
captioning tasks (:mod:`vitlab.vlm.data`) read them through :func:`read_captions`.
"""

from __future__ import annotations

import csv
import io
import json
import random
from pathlib import Path

from vitlab.data.registry import DataError, declare_dataset, read_text

# read by CLIP's task and the caption and blip tasks, not vitlab.data.build: a classifier given this name is sent
# to them
declare_dataset("captions", read_by="--task clip, --task caption or --task blip", needs_root=True)

CAPTION_FILES = ("captions.csv", "captions.jsonl")
VAL_FRACTION = 0.1


def _rows_csv(path: Path) -> list[tuple[int, dict]]:
    reader = csv.DictReader(io.StringIO(read_text(path), newline=""))
    if not reader.fieldnames or not {"image", "caption"} <= set(reader.fieldnames):
        raise DataError(f"{path}: the CSV header must name the columns 'image' and 'caption' "
                        f"(found {reader.fieldnames})")
    return [(i + 2, row) for i, row in enumerate(reader)]


def _rows_jsonl(path: Path) -> list[tuple[int, dict]]:
    rows = []
    for i, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {i}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path} line {i}: expected an object with 'image' and 'caption'")
        rows.append((i, row))
    return rows


def held_out_images(images, what: str) -> set[str]:
    """The images held out for validation when a file names no validation split: a fixed 10% of them (at least
    one; the same choice on every read). ``what`` names the file in the refusal of a single image."""
    images = sorted(images)
    held = set(random.Random(0).sample(images, max(1, round(VAL_FRACTION * len(images)))))
    if len(held) == len(images):
        raise DataError(f"{what}: one image cannot give both a training and a validation split; add a 'split' "
                        f"column or more images")
    return held


def find_captions_file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if path.is_dir():
        found = [path / n for n in CAPTION_FILES if (path / n).is_file()]
        if not found:
            raise FileNotFoundError(f"no captions file in {path} (expected {' or '.join(CAPTION_FILES)})")
        return found[0]
    if not path.is_file():
        raise FileNotFoundError(f"captions file or folder not found: {path}")
    if path.suffix not in (".csv", ".jsonl"):
        raise DataError(f"{path}: a captions file is .csv or .jsonl")
    return path


def read_captions(path: str | Path) -> dict[str, list[tuple[str, str]]]:
    """``{split: [(image path, caption), ...]}`` of a captions folder or file, every row checked."""
    file = find_captions_file(path)
    rows = _rows_csv(file) if file.suffix == ".csv" else _rows_jsonl(file)
    root = file.parent
    splits: dict[str, list[tuple[str, str]]] = {}
    has_split = any("split" in row for _, row in rows)
    for line, row in rows:
        image, caption = row.get("image"), row.get("caption")
        if not isinstance(image, str) or not image.strip():
            raise DataError(f"{file} line {line}: no image path")
        if not isinstance(caption, str) or not caption.strip():
            raise DataError(f"{file} line {line}: empty caption for {image}")
        img = root / image
        if not img.is_file():
            raise DataError(f"{file} line {line}: image not found: {img}")
        split = row.get("split", "train") if has_split else "train"
        if split not in ("train", "val", "test"):
            raise DataError(f"{file} line {line}: split must be train, val or test, got {split!r}")
        splits.setdefault(split, []).append((str(img), caption.strip()))
    if not splits.get("train"):
        raise DataError(f"{file}: no training rows")
    if "val" not in splits:  # hold out whole images (all their captions)
        held = held_out_images({img for img, _ in splits["train"]}, str(file))
        splits["val"] = [r for r in splits["train"] if r[0] in held]
        splits["train"] = [r for r in splits["train"] if r[0] not in held]
    return splits
