"""Image-text data for CLIP: items ``(image (C, H, W) float, token ids (context_length,), group)``.

- ``captions:PATH``: a folder with ``captions.csv`` or ``captions.jsonl`` (or PATH is that file). Columns /
  keys: ``image`` (a path relative to the file's folder) and ``caption``; optional ``split`` (train / val /
  test). Without a split column a fixed 10% of the images (at least one) is held out for validation. An image
  may have several captions (one row each); ``group`` is the image's index, so retrieval counts any of an
  image's captions as a hit. Every row is checked when the file is read: a missing image, an empty caption or a
  malformed line is named (file, line) in one error.
- ``digits`` (the offline demo): scikit-learn's handwritten digits (:mod:`vitlab.data`), each training image
  captioned on the fly from one of :data:`DIGIT_TEMPLATES` chosen at random ("a photo of the number seven",
  "a handwritten 7", ...); ``group`` is the label. Zero-shot evaluation uses :data:`HELD_OUT_TEMPLATES`, which
  share no template with training. For retrieval a split's images face the 100 distinct training captions (10
  digits x 10 templates); a caption matches every image of its digit.

- ``wds:SOURCE`` / ``hf:SOURCE[:SPLIT]`` (:mod:`vitlab.data.wds`, :mod:`vitlab.data.hf`): image-text shards (the
  ``txt`` member is the caption) or a Hugging Face dataset with a caption column (``caption_column``, else
  ``caption`` / ``text`` / ``txt``); the dataset's own options (``--data.options.NAME``) apply. A Hugging Face
  split is one caption per row (``group`` is the row), with retrieval's view below; shards are a stream, split by
  rank and worker (``group`` counts the stream's samples).

Captions and image files give retrieval the same view: ``tokens`` and ``groups`` (each distinct caption's token ids
and group) and :meth:`distinct_images` (each image once, as (image, group)); a caption matches the images of its
group.

CLIP's augmentation is a random square crop only (Radford et al., 2021, Sec. 2.5); images are normalised with
the model's mean / std.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor
from torch.utils.data import Dataset, IterableDataset

from vitlab.data import DataBundle, DataConfig, DataError, build, load_image
from vitlab.data.captions import read_captions
from vitlab.data.datasets import as_uint8
from vitlab.data.streaming import StreamImages
from vitlab.data.transforms import channel_stats, eval_transform, train_transform

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# {w}: the number word, {d}: the numeral
DIGIT_TEMPLATES = ("a photo of the number {w}", "a handwritten {d}", "a handwritten {w}", "the digit {d}",
                   "an image of a {w}", "a {w} written by hand", "a photo of the number {d}",
                   "a blurry image of the digit {w}", "a small {d}", "the number {w} in white ink")
HELD_OUT_TEMPLATES = ("a picture of a {}", "a scan of the numeral {}", "this is {}", "a sketch showing {}")
class CaptionPairs(Dataset):
    """(image, tokens, image index) per caption row; the captions are tokenized once, here."""

    def __init__(self, rows: list[tuple[str, str]], tokenizer, in_chans: int, transform):
        self.images = sorted({img for img, _ in rows})
        index = {img: i for i, img in enumerate(self.images)}
        self.groups = torch.tensor([index[img] for img, _ in rows])
        self.captions = [c for _, c in rows]
        self.tokens = tokenizer(self.captions)
        self.in_chans, self.transform = in_chans, transform

    def __len__(self) -> int:
        return len(self.captions)

    def load(self, image_index: int) -> Tensor:
        return self.transform(load_image(self.images[image_index], self.in_chans))

    def __getitem__(self, i: int):
        g = int(self.groups[i])
        return self.load(g), self.tokens[i], g

    def distinct_images(self) -> Dataset:
        """Each image once, as (image, its index): a caption's group is its image's index."""
        return ImagesOf(self)


class ImagesOf(Dataset):
    """Each distinct image of a :class:`CaptionPairs` once (retrieval encodes every image a single time)."""

    def __init__(self, pairs: CaptionPairs):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs.images)

    def __getitem__(self, i: int):
        return self.pairs.load(i), i


def digit_captions() -> list[str]:
    return [t.format(w=w, d=d) for d, w in enumerate(DIGIT_WORDS) for t in DIGIT_TEMPLATES]


class DigitCaptions(Dataset):
    """Digits with a caption from the training templates: drawn at random each time an image is read
    (``random=True``, training) or the ``i % templates``-th (validation and test: the same captions every time)."""

    def __init__(self, images: Dataset, tokenizer, random: bool = True):
        self.images, self.random = images, random
        # (10 classes, templates, context): every caption tokenized once
        self.table = torch.stack([tokenizer([t.format(w=w, d=d) for t in DIGIT_TEMPLATES])
                                  for d, w in enumerate(DIGIT_WORDS)])
        # retrieval: the distinct captions, each in the group of its digit
        self.tokens = self.table.flatten(0, 1)
        self.groups = torch.arange(len(DIGIT_WORDS)).repeat_interleave(len(DIGIT_TEMPLATES))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        x, y = self.images[i]
        # the trainer seeds torch's stream per rank and restores it on resume
        t = int(torch.randint(len(DIGIT_TEMPLATES), ())) if self.random else i % len(DIGIT_TEMPLATES)
        return x, self.table[y, t], y

    def distinct_images(self) -> Dataset:
        """The images, as (image, label): a caption's group is its digit."""
        return self.images


class CaptionRows(Dataset):
    """A Hugging Face split of (image, caption) rows as (image, tokens, row); each row is its own group."""

    def __init__(self, rows, tokenizer, in_chans: int, transform):
        self.rows, self.in_chans, self.transform = rows, in_chans, transform
        self.tokens = tokenizer(rows.captions())
        self.groups = torch.arange(len(rows))
        self.images = range(len(rows))  # retrieval's distinct images: every row

    def __len__(self) -> int:
        return len(self.rows)

    def load(self, i: int) -> Tensor:
        return self.transform(as_uint8(self.rows[i][0], self.in_chans))

    def __getitem__(self, i: int):
        return self.load(i), self.tokens[i], i

    def distinct_images(self) -> Dataset:
        """Each row's image once, as (image, row)."""
        return ImagesOf(self)


class CaptionStream(StreamImages):
    """An image-text stream as (image, tokens, index in this worker's stream); tokenized as it is read."""

    def __init__(self, stream, tokenizer, in_chans: int, transform):
        super().__init__(stream, in_chans, transform)
        self.tokenizer = tokenizer

    def __iter__(self):
        for k, (x, caption) in enumerate(super().__iter__()):
            yield x, self.tokenizer([caption])[0], k


def read_pairs(data_cfg: DataConfig, split: str):
    """One split of ``wds:`` / ``hf:`` image-text data: (PIL image, caption) items, or None (no test split)."""
    from vitlab.data import hf, wds

    reader = wds.read_split if data_cfg.name == "wds" else hf.read_split
    return reader(split, data_cfg.root, seed=data_cfg.seed, skip_bad_images=data_cfg.skip_bad_images,
                  captions=True, **data_cfg.options)


def training_texts(data_cfg: DataConfig) -> list[str]:
    """The training captions of ``wds:`` / ``hf:`` data (for a word tokenizer), read without decoding images."""
    from vitlab.data.hf import HFImages
    from vitlab.data.wds import ShardStream, shard_samples

    pairs = read_pairs(data_cfg, "train")
    if isinstance(pairs, HFImages):  # a Hugging Face split: the caption column alone
        return pairs.captions()
    if isinstance(pairs, ShardStream):  # shards: their txt members
        return [s["txt"].decode("utf-8", "replace").strip() for shard in pairs.shards
                for s in shard_samples(shard.url) if "txt" in s]
    column = pairs.cols.target  # a Hugging Face stream: one pass over its caption column
    return [str(row[column]).strip() for row in pairs.data.select_columns([column])]


def build_clip_data(data_cfg: DataConfig, tokenizer, mean, std, in_chans: int, img_size: int) -> DataBundle:
    """The CLIP data bundle of ``data_cfg`` (``digits`` or ``captions:PATH``): train / val / test datasets of
    (image, tokens, group), the loaders of :class:`vitlab.data.DataBundle`."""
    scale = data_cfg.scale or (0.9, 1.0)
    if data_cfg.name == "digits":
        cfg = replace(data_cfg, img_size=img_size, scale=scale, hflip=0.0, randaugment=False, reprob=0.0,
                      mixup=0.0, cutmix=0.0)
        base = build(cfg, mean=mean, std=std, in_chans=in_chans)
        return replace(base, train=DigitCaptions(base.train, tokenizer),
                       val=DigitCaptions(base.val, tokenizer, random=False),
                       test=DigitCaptions(base.test, tokenizer, random=False),
                       class_names=list(DIGIT_WORDS), mixup=None)
    if data_cfg.name not in ("captions", "wds", "hf"):
        raise DataError(f"the clip task reads digits, captions:PATH, wds:SOURCE or hf:SOURCE, not "
                        f"{data_cfg.dataset!r}")
    try:
        mean, std = channel_stats(mean, in_chans), channel_stats(std, in_chans)
    except ValueError as e:
        raise DataError(str(e)) from None
    t_train = train_transform(img_size, scale=scale, hflip=0.0, randaugment=False, rand_num_ops=0,
                              rand_magnitude=0, color_jitter=0.0, reprob=0.0, mean=mean, std=std)
    t_eval = eval_transform(img_size, crop_pct=data_cfg.crop_pct or 1.0, mean=mean, std=std)
    if data_cfg.name == "captions":
        splits = read_captions(data_cfg.path)
        train = CaptionPairs(splits["train"], tokenizer, in_chans, t_train)
        val = CaptionPairs(splits["val"], tokenizer, in_chans, t_eval)
        test = CaptionPairs(splits["test"], tokenizer, in_chans, t_eval) if splits.get("test") else None
    else:
        def pairs(split, transform):
            d = read_pairs(data_cfg, split)
            if d is None:
                return None
            if isinstance(d, IterableDataset):
                return CaptionStream(d, tokenizer, in_chans, transform)
            return CaptionRows(d, tokenizer, in_chans, transform)

        train, val, test = pairs("train", t_train), pairs("val", t_eval), pairs("test", t_eval)
    resolved = replace(data_cfg, img_size=img_size, scale=scale, hflip=0.0, randaugment=False, reprob=0.0,
                       mixup=0.0, cutmix=0.0, color_jitter=0.0, crop_pct=data_cfg.crop_pct or 1.0,
                       preset=data_cfg.preset or "tiny")
    return DataBundle(train=train, val=val, test=test, num_classes=0, class_names=[], in_chans=in_chans,
                      img_size=img_size, mixup=None, config=resolved, name=data_cfg.dataset,
                      train_transform=t_train, eval_transform=t_eval)
