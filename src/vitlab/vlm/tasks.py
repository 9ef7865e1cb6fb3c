"""Vision-language tasks on the engine: ``caption`` and ``vqa`` (``vitlab train --task caption | vqa``).

Both train a LLaVA-style model (Liu et al., 2023, "Visual Instruction Tuning", Sec. 4: an image tower, a
projector into the language model's embedding, a decoder that reads the image tokens where the ``<image>``
placeholder stands) by next-token cross-entropy on the *answer* tokens only -- LLaVA's training objective (its
Eq. 2 masks every token but the assistant's):

- ``caption``: ``<s> <image> caption </s>``, the loss on the caption and its end token. Scored by BLEU-4 and
  CIDEr-D (:mod:`vitlab.vlm.metrics`) of greedy captions against the references.
- ``vqa``: LLaVA's instruction format, ``<s> <image> user : question assistant : answer </s>`` (several turns for
  a conversation file), the loss on the answers and their end tokens. Scored by VQA accuracy per question kind.

Freezing follows LLaVA's two stages (Sec. 4.2): ``stage 1`` trains the projector only (feature alignment),
``stage 2`` the projector and the language model (the image tower stays frozen); ``freeze`` names further parts.
``init`` starts from a CLIP run (its image tower), another caption / vqa run (its whole model: stage 2 after
stage 1), an imported transformers checkpoint (CLIP, Llama, LLaVA, BLIP; the token rows carried over to the run's
words through its own tokenizer) or a checkpoint of the model. ``blind`` replaces every image by zeros: the same
model trained and scored without seeing, the baseline that measures what the image adds.

Data (:mod:`vitlab.vlm.data`): ``scenes`` (the embedded offline set; the default), captions from ``coco:PATH`` or
``captions:PATH`` (caption, blip), questions from ``vqa:PATH`` or ``llava:PATH`` (vqa). Text is tokenized into
words over the training texts' vocabulary; the context holds the longest sequence of every split (test
included), and an explicit ``context_length`` shorter than that is refused before training.

The run record (model, tokenizer vocabulary, sequence length, image preprocessing) rebuilds the model for
``vitlab eval`` (the metrics above on a split) and ``vitlab predict`` (a caption, or the answer to ``--prompt``).
"""

from __future__ import annotations

import json
import random
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from vitlab._console import say
from vitlab.data import DataConfig, DataError, load_image
from vitlab.data.datasets import first_undecodable
from vitlab.data.transforms import channel_stats, eval_transform
from vitlab.layers import DropPath
from vitlab.models import HF_CLIP_ARCHITECTURES, CLIPVisionTransformer
from vitlab.registry import create_model, get_model_config
from vitlab.text.subword import Tokenizer, check_vocab, load_tokenizer
from vitlab.train import checkpoint as ck
from vitlab.train.common import model_kwargs, prepare_model
from vitlab.train.config import to_plain
from vitlab.train.task import RunRecord, Task, register_task
from vitlab.vlm.data import (
    IMAGE_TOKEN,
    SCENE_SPLITS,
    TRAINING_KINDS,
    VLSample,
    make_scenes,
    objects_phrase,
    position_pairs,
    read_caption_rows,
    read_coco,
    read_llava,
    read_vqa,
    scene_question,
    scene_texts,
    scenes_vocabulary,
    take_image_placeholder,
)
from vitlab.vlm.metrics import caption_scores, vqa_accuracy

PARTS = ("vision_tower", "projector", "language_model")
STAGE_FROZEN = {1: {"vision_tower", "language_model"}, 2: {"vision_tower"}}  # LLaVA's two stages (Sec. 4.2)
PROMPT_WORDS = ("user", ":", "assistant")
IGNORE = -100
MAX_NEW_TOKENS = 24  # the answer budget of eval and predict when a run's record names none (runs made before it did)


@dataclass
class VLArgs:
    """The caption and vqa tasks' options (``--task_args.NAME``; short flags --blind, --stage, --init)."""

    blind: bool = False                # images replaced by zeros: the baseline without sight
    stage: int = 0                     # LLaVA's stages: 1 trains the projector only, 2 projector + language model
    freeze: list[str] = field(default_factory=list)  # parts kept frozen: vision_tower, projector, language_model
    init: str | None = None            # a CLIP run / directory (image tower), a caption / vqa run, a transformers
    #                                    Llama (language model) or LLaVA directory, or a checkpoint (whole model)
    context_length: int | None = None  # tokens per sequence, image placeholder included (None: the longest)
    max_new_tokens: int = MAX_NEW_TOKENS  # generation bound of eval and predict
    scenes_train: int | None = None    # scenes: training scenes (None: 4000)
    scenes_eval: int | None = None     # scenes: validation and test scenes (None: 200 and 400)
    scenes_turns: int = 5              # scenes (vqa): questions per training conversation, of different kinds
    scenes_position_weight: int = 4    # scenes (vqa): a training scene with a position question counts this many
    #                                    times an epoch (position is the kind learned last)
    language_lr_scale: float = 0.3     # the language model's learning rate relative to the image side's
    image_after_question: bool = True  # vqa: the first question before the image (user : Q <image> assistant :)
    coord_channels: bool = True        # the pixels' x and y as two more input channels (CoordConv)


# ---------------------------------------------------------------- tokens

_WORD = re.compile(r"[\w']+|[^\w\s]")


class WordTokenizer:
    """Lower-cased words and punctuation marks over a fixed vocabulary: ids 0 padding, 1 unknown, 2 ``<s>``, 3
    ``</s>``, 4 the image placeholder, 5 BLIP's [DEC] and 6 its [ENC], then the words (sorted, so the same texts
    always give the same ids)."""

    SPECIALS = ("<pad>", "<unk>", "<s>", "</s>", IMAGE_TOKEN, "[DEC]", "[ENC]")

    def __init__(self, words: list[str]):
        self.words = sorted(set(words) - set(self.SPECIALS))
        self.vocab = [*self.SPECIALS, *self.words]
        self.encoder = {w: i for i, w in enumerate(self.vocab)}
        self.pad_id, self.unk_id, self.bos_id, self.eos_id, self.image_id, self.dec_id, self.enc_id = range(7)
        self.vocab_size = len(self.vocab)

    @classmethod
    def from_texts(cls, texts) -> WordTokenizer:
        return cls([w for t in texts for w in _WORD.findall(t.lower())])

    def encode(self, text: str) -> list[int]:
        return [self.encoder.get(w, self.unk_id) for w in _WORD.findall(text.lower())]

    def warn_unknown(self, text: str) -> None:
        """A line on stderr naming the words of ``text`` (a user's question) outside the vocabulary, which the
        model reads as one unknown token each: an answer to them is a guess."""
        unknown = list(dict.fromkeys(w for w in _WORD.findall(text.lower()) if w not in self.encoder))
        if unknown:
            shown = ", ".join(repr(w) for w in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5
                                                                else "")
            print(f"warning: {shown} not in the run's vocabulary of {len(self.words):,} words: read as unknown",
                  file=sys.stderr)

    def decode(self, ids: list[int]) -> str:
        """The words of ``ids`` up to the first ``</s>``, special tokens left out."""
        words = []
        for i in ids:
            if i == self.eos_id:
                break
            if i >= len(self.SPECIALS):
                words.append(self.vocab[i])
        return " ".join(words)

    def to_dict(self) -> dict:
        return {"kind": "word", "words": self.words}


class Sequences:
    """Token ids of the instruction format: ``<s> <image> [user : Q assistant :] A </s>`` with labels on the
    answers (and their end tokens) only; ``<image>`` is one token the model replaces by the image's. With
    ``image_after_question`` the first question comes before the image, ``<s> user : Q <image> assistant : A
    </s>``: under causal attention the image's tokens then read the question (which objects it names) in every
    decoder layer, and the answer sits a fixed distance after them, so rotary positions tell it which image token
    is which cell -- LLaVA's instruction data places the image before or after the instruction alike (Liu et al.,
    2023, Sec. 3)."""

    def __init__(self, tokenizer: WordTokenizer, context_length: int, instruct: bool,
                 image_after_question: bool = False):
        self.tok, self.length, self.instruct = tokenizer, context_length, instruct
        self.image_last = instruct and image_after_question
        self.bos, self.eos, self.image_id = tokenizer.bos_id, tokenizer.eos_id, tokenizer.image_id

    def _question(self, q: str | None, first: bool) -> list[int]:
        if not self.instruct:
            return []
        if first and self.image_last:
            return [*self.tok.encode(f"user : {q}"), self.image_id, *self.tok.encode("assistant :")]
        return self.tok.encode(f"user : {q} assistant :")

    def _start(self) -> list[int]:
        return [self.bos] if self.image_last else [self.bos, self.image_id]

    def prompt(self, question: str | None = None, history: list[tuple[str, str]] = ()) -> list[int]:
        """The ids that ask ``question`` after the answered turns ``history``."""
        ids = self.encode(history)[0] if history else self._start()
        return ids + self._question(question, not history)

    def encode(self, turns: list[tuple[str | None, str]]) -> tuple[list[int], list[int]]:
        ids = self._start()
        labels = [IGNORE] * len(ids)
        for j, (q, a) in enumerate(turns):
            p = self._question(q, j == 0)
            t = self.tok.encode(a) + [self.eos]
            ids, labels = ids + p + t, labels + [IGNORE] * len(p) + t
        return ids, labels

    def padded(self, turns) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels = self.encode(turns)
        if len(ids) > self.length:  # the answer is at the end: keep the whole sequence or refuse
            raise DataError(f"a sequence of {len(ids)} tokens exceeds the context of {self.length}; raise "
                            f"--task_args.context_length")
        n = self.length - len(ids)
        return torch.tensor(ids + [self.tok.pad_id] * n), torch.tensor(labels + [IGNORE] * n)


def build_tokenizer(texts: list[str]) -> WordTokenizer:
    """The words of ``texts`` and of the prompt."""
    return WordTokenizer.from_texts([*texts, " ".join(PROMPT_WORDS)])


def fit_context(longest: dict[str, int], explicit: int | None) -> int:
    """The context length: the longest sequence over every part of the data that is trained or scored
    (``longest``: {'train split': tokens, 'val split': ..., 'test split': ..., ...}), or ``explicit`` when every
    part fits in it. Checked when the task is built, so a sequence that cannot fit is refused before training
    rather than when the final test reaches it."""
    where, need = max(longest.items(), key=lambda kv: kv[1], default=("data", 0))
    if explicit is None:
        return need
    if need > explicit:
        raise DataError(f"--task_args.context_length {explicit} is shorter than the longest sequence of the "
                        f"{where} ({need} tokens); raise it or leave it unset (the longest of every split)")
    return explicit


# ---------------------------------------------------------------- data


@dataclass
class VLSplits:
    """Samples per split and where their images come from (file paths, or the scenes' uint8 tensors)."""

    train: list[VLSample]
    val: list[VLSample]
    test: list[VLSample] | None
    images: dict[str, torch.Tensor | None]     # split -> in-memory images (scenes), None for files
    scenes: dict[str, list] = field(default_factory=dict)   # split -> ground truth (scenes)

    def texts(self) -> list[str]:
        return [t for s in self.train for q, a in s.turns for t in (q or "", a)] + [r for s in self.train
                                                                                   for r in s.refs]


# the file sources of each kind of sample (the scenes give both)
SOURCES = {"caption": ("coco", "captions"), "vqa": ("vqa", "llava")}
READERS = {"coco": read_coco, "captions": read_caption_rows, "vqa": read_vqa, "llava": read_llava}


def sources(kind: str) -> str:
    """What a task of ``kind`` reads, for its messages: 'scenes, coco:PATH or captions:PATH'."""
    names = ["scenes", *(f"{n}:PATH" for n in SOURCES[kind])]
    return f"{', '.join(names[:-1])} or {names[-1]}"


def read_splits(data: DataConfig, kind: str, scenes_train: int | None = None,
                scenes_eval: int | None = None, task: str | None = None, scored_train: bool = False,
                read: tuple[str, ...] = ("train", "val", "test")) -> VLSplits:
    """The samples of ``data`` for ``kind`` ('caption' or 'vqa'); ``task`` (default ``kind``) is the task named in
    a refusal. ``scored_train``: the scenes' training split as fixed questions (one of each kind a scene has, the
    training templates), what ``vitlab eval --split train`` scores, rather than one sample per scene that draws a
    fresh conversation each time it is read. ``read``: the splits whose image files are decoded once to check
    them (all of a training run's; the scored ones of an evaluation)."""
    name, path = data.name, data.path
    task = task or kind
    if name == "scenes":
        sizes = {"train": scenes_train, "val": scenes_eval, "test": 2 * scenes_eval if scenes_eval else None}
        sets = {s: make_scenes(s, data.seed, sizes[s]) for s in SCENE_SPLITS}
        pick = (lambda s: s.captions) if kind == "caption" else (lambda s: s.questions)
        # training draws a fresh question about each scene every time it is read: one sample per scene
        train = (pick(sets["train"]) if kind == "caption" or scored_train
                 else [VLSample(i) for i in range(len(sets["train"].scenes))])
        return VLSplits(train, pick(sets["val"]), pick(sets["test"]),
                        {s: v.images for s, v in sets.items()}, {s: v.scenes for s, v in sets.items()})
    if name not in SOURCES[kind]:
        other = next((k for k, names in SOURCES.items() if name in names), None)
        if other:
            raise DataError(f"{data.dataset!r} holds {'captions' if other == 'caption' else 'questions'}; "
                            f"--task {task} reads {sources(kind)}")
        raise DataError(f"--task {task} reads {sources(kind)}, not {data.dataset!r}")
    s = READERS[name](path)
    # the readers check each image's header; a truncated JPEG passes that and fails only when decoded, which
    # would stop the run an epoch in (the validation images at the first evaluation): every image decoded now
    bad = first_undecodable(list(dict.fromkeys(str(x.image) for split in read for x in s.get(split) or [])))
    if bad:
        raise DataError(f"{data.dataset}: corrupt image {bad[0]}: {bad[1]}")
    return VLSplits(s["train"], s["val"], s.get("test"), {k: None for k in ("train", "val", "test")})


def eval_splits(record: RunRecord, data: str | None, split: str | None, kind: str, task: str) -> VLSplits:
    """The splits ``vitlab eval`` scores: ``data`` (default: the record's). On the scenes the training split is
    the run's own (its ``scenes_train`` scenes, drawn as training drew them) when ``split`` is 'train', and a
    single unread scene otherwise."""
    a = record.task_args
    cfg = DataConfig(**{**record.data, "dataset": data}) if data else DataConfig(**record.data)
    scenes_train = (a.get("scenes_train") if split == "train" else 1) if cfg.name == "scenes" else None
    return read_splits(cfg, kind, scenes_train, a.get("scenes_eval"), task=task, scored_train=split == "train",
                       read=("train",) if split == "train" else ("val", "test"))


def eval_split(splits: VLSplits, split: str | None, dataset: str) -> str:
    """The split ``vitlab eval`` scores: ``None`` or 'test' is the test split, or the validation split when the
    data has no test split (as every vitlab task scores; the result and its file name the split scored); a train
    or val split the data lacks is refused in one line naming the splits it has."""
    if split in (None, "test"):
        split = "test" if splits.test else "val"
    if not getattr(splits, split):
        have = [n for n in ("train", "val", "test") if getattr(splits, n)]
        raise DataError(f"{dataset} has no {split} split" + (f" (it has {', '.join(have)}); pass --split "
                                                             f"{' or '.join(have)}" if have else ""))
    return split


IMAGE_CACHE_BYTES = 512 * 2**20  # in-memory images kept transformed up to this size (4,000 scenes at 64 px: 188 MiB)


class ImageSource:
    """A split's images by sample: ``source(s.image)`` is the transformed image (C, H, W). In-memory images (the
    scenes, an index) are transformed once, as one batch, when the source is made, if the result fits in
    ``IMAGE_CACHE_BYTES`` (the transform is deterministic: per sample, torchvision's dispatch was half of the
    loader's time, some 4% of a training step on two cores); beyond that (the same scenes at 224 px would take
    2.4 GB of floats), and for files (a path), each image is transformed when asked for."""

    def __init__(self, images: torch.Tensor | None, transform):
        self.images, self.transform, self.ready = images, transform, None
        if images is not None and len(images):
            one = transform(images[:1])
            if one.numel() * one.element_size() * len(images) <= IMAGE_CACHE_BYTES:
                self.ready = transform(images)

    def __call__(self, image: str | int) -> torch.Tensor:
        if not isinstance(image, int):
            return self.transform(load_image(image, 3))
        return self.transform(self.images[image]) if self.ready is None else self.ready[image]


class VLDataset(Dataset):
    """(image (C, H, W) float, token ids (L,), labels (L,)) per sample. Training draws a caption among the
    references each time (and, on the scenes, a fresh question of a random kind about the scene)."""

    def __init__(self, samples: list[VLSample], images: torch.Tensor | None, transform, seqs: Sequences,
                 train: bool, blind: bool, scenes: list | None = None, turns: int = 1):
        self.samples, self.images, self.seqs = samples, ImageSource(images, transform), seqs
        self.train, self.blind, self.scenes, self.turns = train, blind, scenes, turns

    def __len__(self) -> int:
        return len(self.samples)

    def image(self, s: VLSample) -> torch.Tensor:
        x = self.images(s.image)
        return torch.zeros_like(x) if self.blind else x

    def __getitem__(self, i: int):
        s = self.samples[i]
        turns = s.turns
        if self.train:
            # the trainer seeds torch's stream per rank and restores it on resume
            rng = random.Random(int(torch.randint(2 ** 31, ())))
            if self.scenes is not None and self.seqs.instruct:
                # a conversation about the scene: questions of different kinds in a random order (every image
                # then teaches several answers; the first one is asked as at test time)
                kinds = rng.sample(TRAINING_KINDS, len(TRAINING_KINDS))
                turns = [qa for k in kinds if (qa := scene_question(self.scenes[s.image], k, rng)) is not None]
                turns = turns[:self.turns]
            elif not s.turns:
                turns = [(None, rng.choice(s.refs))]
        elif not s.turns:
            turns = [(None, s.refs[0])]
        ids, labels = self.seqs.padded(turns)
        return self.image(s), ids, labels


# ---------------------------------------------------------------- the model


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def answer_loss(logits: torch.Tensor, labels: torch.Tensor,
                image_pos: int | torch.Tensor = 1) -> tuple[torch.Tensor, dict]:
    """Cross-entropy of next-token ``logits`` on the labelled tokens. A model that widens the placeholder into
    the image's tokens returns more positions than ``labels`` has: they are aligned by skipping the image's
    (``image_pos``: the placeholder's index, one for all rows or one per row)."""
    extra = logits.shape[1] - labels.shape[1]
    if extra:
        b, n = labels.shape
        pos = torch.as_tensor(image_pos, device=labels.device).expand(b)
        idx = torch.arange(n, device=labels.device).expand(b, n)
        idx = idx + extra * (idx > pos[:, None])  # tokens after the placeholder move past the image's
        labels = labels.new_full((b, n + extra), IGNORE).scatter(1, idx, labels)
    logits, target = logits[:, :-1], labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=IGNORE)
    mask = target != IGNORE
    hit = (logits.argmax(-1) == target) | ~mask
    return loss, {"tokens": mask.sum(), "token_hits": (hit & mask).sum(), "seq_hits": hit.all(-1).sum()}


def _stay_in_eval(module: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(module, False)


def frozen_parts(args: VLArgs) -> set[str]:
    """The parts ``args`` freeze: ``freeze`` and those of LLaVA's ``stage`` (1: all but the projector; 2: the
    image tower)."""
    return set(args.freeze) | STAGE_FROZEN.get(args.stage, set())


def _probe(part: nn.Module) -> list[torch.Tensor]:
    """A few values of each of ``part``'s parameters: enough to tell whether a load replaced its initial weights."""
    return [p.detach().flatten()[:4].clone() for p in part.parameters()]


def freeze_parts(model: nn.Module, names) -> list[str]:
    """Freeze ``model``'s parts ``names``: no gradients, and eval mode whatever mode the model is put in, so a
    frozen part computes as at inference (BatchNorm keeps its statistics, dropout stays off)."""
    for name in names:
        part = getattr(model, name)
        part.requires_grad_(False)
        part.train = types.MethodType(_stay_in_eval, part)  # model.train() reaches each child through its train()
        part.eval()
    return sorted(names)


def apply_freezing(model: nn.Module, args: VLArgs) -> list[str]:
    """Freeze the parts :func:`frozen_parts` names (:func:`freeze_parts`)."""
    return freeze_parts(model, frozen_parts(args))


# the parameters whose rows are indexed by token id: the input embeddings and the output head (Llama's
# embed_tokens / lm_head, BLIP's word_embeddings and its LM head's decoder)
VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight", "word_embeddings.weight", "lm_head.decoder.weight",
              "lm_head.decoder.bias")


def carry_rows(model: nn.Module, sd: dict, sources: list[list[int]], source: str) -> dict:
    """``sd`` with its token rows (:data:`VOCAB_ROWS`) re-indexed to ``model``'s ids: row ``i`` becomes the mean of
    ``sd``'s rows ``sources[i]`` (one row: a copy), or keeps ``model``'s fresh row where ``sources[i]`` is empty."""
    own = model.state_dict()
    need = max((i for ids in sources for i in ids), default=-1) + 1
    out = dict(sd)
    for k, v in sd.items():
        if not k.endswith(VOCAB_ROWS) or k not in own or v.shape[1:] != own[k].shape[1:]:
            continue  # another width: the load names the mismatch
        if v.shape[0] < need:
            raise DataError(f"--init {source}: {k} has {v.shape[0]} rows, its tokenizer's ids reach {need - 1}")
        fresh = own[k].clone()
        for i, ids in enumerate(sources):
            if ids:
                fresh[i] = v[ids].mean(0).to(fresh.dtype)
        out[k] = fresh
    return out


def map_vocabulary(model: nn.Module, sd: dict, old: WordTokenizer, new: WordTokenizer,
                   source: str) -> tuple[dict, int, int]:
    """``sd`` (a run trained with the word vocabulary ``old``) with its token rows (:data:`VOCAB_ROWS`) re-indexed
    to ``new``: the row of each word both vocabularies hold is copied to the word's new id; a word ``old`` never
    saw keeps ``model``'s fresh row. Returns (state dict, words mapped, words new). The rows follow the words,
    not the ids, as a vocabulary extended for a second training stage must (LLaVA's stage 2 adds its
    instruction data's words to those of stage 1's captions; Liu et al., 2023, Sec. 4.2)."""
    for k, v in sd.items():
        if k.endswith(VOCAB_ROWS) and v.shape[0] != old.vocab_size:
            raise DataError(f"--init {source}: {k} has {v.shape[0]} rows but the run's vocabulary "
                            f"{old.vocab_size} words")
    sources = [[old.encoder[w]] if w in old.encoder else [] for w in new.vocab]
    words = len(new.vocab) - len(new.SPECIALS)
    mapped = sum(bool(ids) for ids in sources[len(new.SPECIALS):])
    return carry_rows(model, sd, sources, source), mapped, words - mapped


# the source tokenizer's text of each special token of the word vocabulary, in order of preference
_SPECIAL_TEXTS = {"<pad>": ("<pad>", "[PAD]"), "<unk>": ("<unk>", "[UNK]"), "<s>": ("<s>", "[CLS]"),
                  "</s>": ("</s>", "[SEP]"), IMAGE_TOKEN: (IMAGE_TOKEN,), "[DEC]": ("[DEC]",), "[ENC]": ("[ENC]",)}


def transfer_vocabulary(model: nn.Module, sd: dict, tok: Tokenizer, new: WordTokenizer, source: str,
                        specials: dict[str, int] | None = None) -> tuple[dict, int, int, int]:
    """``sd`` (an imported checkpoint whose rows belong to the subword tokenizer ``tok``) with its token rows
    re-indexed to the word vocabulary ``new``, by fast vocabulary transfer (Gee et al., 2022, "Fast Vocabulary
    Transfer for Language Model Compression", Sec. 3): a word ``tok`` spells as one token gets that token's row,
    a word it splits into pieces the mean of the pieces' rows (an unknown piece, a character it never saw, left
    out), a word it cannot spell at all (nothing but unknown pieces and word-start marks) ``model``'s fresh row.
    Special tokens follow their texts (``<s>`` / ``[CLS]``...) where ``tok`` has them; ``specials`` (text -> id)
    adds ids the checkpoint's config names (LLaVA's ``image_token_index``). Returns (state dict, words whole,
    words from pieces, words new)."""
    named = {**tok.specials, **{t: i for t, i in (("<s>", tok.bos_id), ("</s>", tok.eos_id), ("<pad>", tok.pad_id),
                                                  ("<unk>", tok.unk_id)) if i is not None}, **(specials or {})}
    sources = [next(([named[t]] for t in _SPECIAL_TEXTS[w] if t in named), []) for w in new.SPECIALS]
    for w in new.words:
        ids = [i for i in tok.encode(w, bos=False) if i != tok.unk_id]
        sources.append(ids if tok.decode(ids).strip() else [])
    words = sources[len(new.SPECIALS):]
    whole, pieces = sum(len(ids) == 1 for ids in words), sum(len(ids) > 1 for ids in words)
    return carry_rows(model, sd, sources, source), whole, pieces, len(words) - whole - pieces


def import_checkpoint(model: nn.Module, path: Path, tokenizer: WordTokenizer) -> str:
    """An imported transformers directory into a run's model: a Llama (``LlamaForCausalLM``, e.g. Vicuna) into a
    LLaVA-style model's language model, a LLaVA into the whole model (LLaVA's stage-2 fine-tuning), a BLIP
    (``BlipForConditionalGeneration`` or ``...ForImageTextRetrieval``) into a BLIP, the parts it holds. The token
    rows go through the directory's own tokenizer (``tokenizer.json`` or ``tokenizer.model``, refused by
    :func:`vitlab.text.check_vocab` when its vocabulary does not fit the checkpoint's token rows) to the run's words
    (:func:`transfer_vocabulary`), a learned position table gives the run's context its first rows; every other
    tensor must fit the run's model as it is (``--model`` and its ``--model_kwargs`` name the same architecture).
    Returns what was loaded, for the run's log."""
    from vitlab.convert import CheckpointError, load_state_dict, read_hf_config
    from vitlab.vlm.blip import BLIP
    from vitlab.vlm.llava import LLaVA

    hf = read_hf_config(path)
    kind = hf.get("model_type")
    if kind == "llama" and isinstance(model, LLaVA):
        target, what = model.language_model, "the language model (transformers' Llama)"
    elif kind == "llava" and isinstance(model, LLaVA):
        target, what = model, "the whole model (transformers' LLaVA)"
    elif kind == "blip" and isinstance(model, BLIP):
        target, what = model, "transformers' BLIP"
    else:
        raise DataError(f"--init {path}: a transformers checkpoint of model_type {kind!r} cannot start a "
                        f"{type(model).__name__} (caption and vqa runs start from a CLIP, Llama or LLaVA directory, "
                        f"blip runs from a BLIP one)")
    file = next((path / f for f in ("tokenizer.json", "tokenizer.model") if (path / f).is_file()), None)
    if file is None:
        raise DataError(f"--init {path}: no tokenizer.json or tokenizer.model beside its weights; its token rows "
                        f"reach this run's words through its tokenizer")
    specials = {}
    # the reader refuses what the shapes cannot show (a layer fewer than the run's, only converted up to its count;
    # the RoPE base; the image features' selection...); a LLaVA's or BLIP's token ids it leaves to the vocabulary
    # transfer below, which carries the checkpoint's rows to the run's ids (a Llama's reader compares none)
    sd = target.read_checkpoint(path) if kind == "llama" else target.read_checkpoint(path, token_ids=False)
    if kind == "llava" and "image_token_index" in hf:  # a SentencePiece tokenizer.model lacks the added <image>
        specials[IMAGE_TOKEN] = hf["image_token_index"]
    try:
        sd = target.checkpoint_filter_fn(sd, target)
    except CheckpointError as e:  # tensors missing or left unread by the conversion: say which checkpoint
        raise CheckpointError(f"--init {path}: {e}") from None
    sub = load_tokenizer(file)
    # the tokenizer must be the checkpoint's own, as vitlab generate requires: one of another model's vocabulary
    # would carry unrelated rows to the run's words (refused before the run writes anything)
    for rows in sorted({v.shape[0] for k, v in sd.items() if k.endswith(VOCAB_ROWS)}):
        check_vocab(sub, rows, f"--init {path}")
    sd, whole, pieces, new = transfer_vocabulary(target, sd, sub, tokenizer, str(path), specials)
    own = target.state_dict()
    for k, v in sd.items():  # BERT's learned positions: the run's context needs the first rows only
        if k.endswith("position_embeddings.weight") and k in own and v.shape[1:] == own[k].shape[1:]:
            sd[k] = v[:own[k].shape[0]] if v.shape[0] >= own[k].shape[0] else v
    fresh = [k for k in own if k not in sd]
    if isinstance(model, BLIP):
        # a BLIP checkpoint holds the captioner or the retrieval heads, not both: a part it lacks entirely starts
        # fresh, but a part it holds must be whole (a layer more or less is another architecture)
        held = {k.split(".")[0] for k in sd}
        partial = [k for k in fresh if k.split(".")[0] in held]
        extra = [k for k in sd if k not in own]
        if partial or extra:
            raise DataError(f"--init {path}: another BLIP architecture than this run's: "
                            + "; ".join(f"{name} {keys[:3]}" + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")
                                        for name, keys in (("missing", partial), ("unexpected", extra)) if keys))
    load_state_dict(target, sd, strict=not isinstance(model, BLIP), source=str(path))
    return (f"{what}" + (f", {len(fresh)} tensors it lacks fresh" if fresh else "")
            + f"; vocabulary through its tokenizer: {whole} words whole, {pieces} as the mean of their pieces, "
              f"{new} new")


def init_from(model: nn.Module, source: str, tokenizer: WordTokenizer) -> str:
    """Weights from ``source``: a CLIP run or a transformers CLIP directory (``CLIPModel`` / ``CLIPVisionModel``)
    gives the image tower, a caption / vqa (or blip) run or a checkpoint of this model everything. A run's token
    rows are mapped to ``tokenizer`` by word (:func:`map_vocabulary`), an imported Llama, LLaVA or BLIP
    directory's through its own tokenizer (:func:`import_checkpoint`). Returns what was loaded, for the run's
    log."""
    from vitlab.convert import load_checkpoint, load_state_dict, read_hf_config

    p = Path(source)
    if (p.is_dir() and not (p / "config.json").is_file()) or p.suffix == ".safetensors":  # a vitlab run
        sd, meta = ck.load_weights(source, weights="raw")
        # a run directory gives its best checkpoint (as vitlab eval and predict take it): the log names it
        at = f" (checkpoint {ck.resolve_checkpoint_dir(p).name})" if p.is_dir() else ""
        if meta.get("task") == "clip":  # CLIP's image tower is the ViT under visual.trunk
            trunk = {k.removeprefix("visual.trunk."): v for k, v in sd.items() if k.startswith("visual.trunk.")}
            _check_same_function(model.vision_tower, _clip_run_tower(meta), source)
            load_state_dict(model.vision_tower, trunk, source=source)
            return f"the image tower{at}"
        old = meta.get("tokenizer")
        if not (isinstance(old, dict) and old.get("kind") == "word"):
            load_state_dict(model, sd, source=source)
            return f"the whole model{at}"
        sd, mapped, new = map_vocabulary(model, sd, WordTokenizer(old["words"]), tokenizer, source)
        load_state_dict(model, sd, source=source)
        return f"the whole model{at}; vocabulary mapped by word: {mapped} words mapped, {new} new"
    if p.is_dir() and read_hf_config(p).get("model_type") in HF_CLIP_ARCHITECTURES:
        # an imported CLIP (CLIPModel / CLIPVisionModel): its image tower, read and checked by a CLIP ViT tower
        if not isinstance(model.vision_tower, CLIPVisionTransformer):
            raise DataError(f"--init {source} is a CLIP image tower, this run's is not a CLIP ViT "
                            f"({type(model.vision_tower).__name__}); caption and vqa runs take a model with one "
                            f"(e.g. --model llava_tiny --task_args.coord_channels false)")
        load_checkpoint(model.vision_tower, source)
        return "the image tower (transformers' CLIP)"
    if p.is_dir():
        return import_checkpoint(model, p, tokenizer)
    load_checkpoint(model, source)  # a state dict file of this model
    return "the whole model"


def _clip_run_tower(meta: dict) -> nn.Module:
    """The image tower of the CLIP run that ``meta`` describes, built weightless (``meta`` device)."""
    from vitlab.train.task import create_task

    record = RunRecord.from_meta(meta)
    with torch.device("meta"):
        return create_task(record.task).load(record).visual.trunk


def _check_same_function(tower: nn.Module, source_tower: nn.Module, source: str) -> None:
    """A DataError naming what ``source_tower`` computes otherwise than ``tower`` where no weight shows it: each
    submodule's kind and settings (an activation, a norm's eps, the attention's heads). Dropout and stochastic depth
    count as the identity they are at inference, whatever their rates. Weights of the same names and shapes would
    load without a message and compute another function."""
    ours, theirs = dict(tower.named_modules()), dict(source_tower.named_modules())

    def kind(m: nn.Module) -> str:
        if isinstance(m, (nn.Identity, nn.Dropout, DropPath)):
            return "Identity()"
        return f"{type(m).__name__}({m.extra_repr()})"

    bad = [f"{name}: {kind(theirs[name])} (this run {kind(m)})" for name, m in ours.items()
           if name and name in theirs and kind(m) != kind(theirs[name])]
    if bad:
        raise DataError(f"--init {source}: its image tower computes another function than this run's: "
                        f"{'; '.join(bad[:3])}" + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
                        + "; train the CLIP run with the tower this run's model has (e.g. the same --model_kwargs)")


def check_init(source: str | None) -> None:
    """A DataError when ``--init`` names nothing: checked before the run's model is built (a 7B model takes
    minutes and most of the memory to build before its missing checkpoint would be found)."""
    if source and not Path(source).exists():
        raise DataError(f"--init {source}: no such file or folder")


def _init(model: nn.Module, source: str | None, tokenizer: WordTokenizer, cfg) -> str | None:
    """:func:`init_from` when ``source`` is given, what it loaded said in one line of the run's log."""
    if not source:
        return None
    loaded = init_from(model, source, tokenizer)
    if not cfg.quiet:
        say(f"--init {source}: {loaded}")
    return loaded


def with_coords(x: torch.Tensor) -> torch.Tensor:
    """Images (B, C, H, W) with two more channels, each pixel's x and y in [-1, 1] (Liu et al., 2018, "An
    intriguing failing of convolutional neural networks and the CoordConv solution"). A tower trained from scratch
    with a learned position table keeps too little of where a patch lies for the decoder to tell the image's
    tokens apart (a linear probe of the scenes demo's image tokens finds their cell at chance); the coordinates
    enter every patch's embedding with its pixels."""
    b, _, h, w = x.shape
    ys, xs = (torch.linspace(-1.0, 1.0, n, device=x.device, dtype=x.dtype) for n in (h, w))
    grid = torch.stack(torch.meshgrid(ys, xs, indexing="ij"))
    return torch.cat([x, grid.expand(b, -1, -1, -1)], dim=1)


def build_vl_model(name: str, kwargs: dict, vocab_size: int, image_token_id: int, img_size: int,
                   context_length: int, max_new_tokens: int) -> nn.Module:
    """The LLaVA model of a run: its language model holds the context and ``max_new_tokens`` more, so any prompt
    the context holds gets the run's whole answer budget (as BLIP's text decoder is sized; Li et al., 2022)."""
    return create_model(name, **{"vocab_size": vocab_size, "image_token_id": image_token_id, "img_size": img_size,
                                 "max_seq_len": context_length + max_new_tokens, **kwargs})


# ---------------------------------------------------------------- the tasks


class _ScoredTask(Task):
    """A vision-language task that keeps its run record and scores a checkpoint's test split with ``score``."""

    def record(self) -> RunRecord:
        return self._record

    @torch.no_grad()
    def test(self, run_dir, batch_size: int, checkpoint: str = "last") -> dict:
        from vitlab.train.evaluate import load_model

        ckpt = Path(run_dir) / checkpoint
        if self.splits.test is None or not ckpt.exists():
            return {}
        model, record, _ = load_model(ckpt, device=self.device)
        r = self.score(model, record, self.splits, "test", batch_size, self.device)
        return {f"test_{k}": v for k, v in r.items() if isinstance(v, float)}


class _VLTask(_ScoredTask):
    Args = VLArgs
    instruct = False
    aliases = {"blind": "task_args.blind", "stage": "task_args.stage", "init": "task_args.init"}

    @classmethod
    def defaults(cls) -> dict:
        # 20 epochs: the scenes demo's run within 10 minutes on 2 CPU cores
        return {"model": "llava_scenes", "data.dataset": "scenes", "epochs": 20, "batch_size": 64, "lr": 8e-3,
                "warmup_epochs": 1.0, "weight_decay": 0.05, "drop_path": 0.0}

    @classmethod
    def check(cls, cfg) -> None:
        a = cfg.task_args
        bad = [p for p in a.freeze if p not in PARTS]
        if bad:
            raise ValueError(f"freeze names parts of {', '.join(PARTS)}, got {bad}")
        if a.stage not in (0, 1, 2):
            raise ValueError(f"stage must be 0 (train everything), 1 or 2, got {a.stage}")
        if set(PARTS) <= frozen_parts(a):
            raise ValueError(f"stage {a.stage} with freeze {a.freeze} leaves nothing to train")
        if a.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {a.max_new_tokens}")
        if a.language_lr_scale <= 0:
            raise ValueError(f"language_lr_scale must be > 0, got {a.language_lr_scale}")
        for k in ("scenes_train", "scenes_eval", "context_length", "scenes_turns", "scenes_position_weight"):
            v = getattr(a, k)
            if v is not None and v < 1:
                raise ValueError(f"{k} must be >= 1, got {v}")

    def build(self, cfg, device: torch.device) -> None:
        self.cfg, self.device, self.args = cfg, device, cfg.task_args
        a: VLArgs = self.args
        check_init(a.init)
        mcfg = get_model_config(cfg.model)
        if mcfg.family != "llava":
            raise ValueError(f"--task {self.name} trains a LLaVA-style model (llava_*); {cfg.model} is a "
                             f"{mcfg.family} model" + (": train it with --task blip" if mcfg.family == "blip" else ""))
        img_size = int(cfg.data.img_size or cfg.model_kwargs.get("img_size", mcfg.input_size[-1]))
        kind = "vqa" if self.instruct else "caption"
        self.splits = sp = read_splits(cfg.data, kind, a.scenes_train, a.scenes_eval, task=self.name)
        texts = sp.texts() + (scenes_vocabulary() if cfg.data.name == "scenes" else [])
        self.tokenizer = build_tokenizer(texts)
        probe = Sequences(self.tokenizer, 10 ** 6, self.instruct, a.image_after_question)

        def sequences(samples):  # a conversation is one sequence; a caption sample one per reference
            for s in samples:
                yield from [s.turns] if s.turns else ([(None, r)] for r in s.refs)

        # every split that is trained or scored: the final test (and vitlab eval) reads the test split's
        # questions and references through the same context
        longest = {f"{split} split": max((len(probe.encode(t)[0]) for t in sequences(getattr(sp, split) or [])),
                                         default=0) for split in ("train", "val", "test")}
        if cfg.data.name == "scenes":  # every template's longest question or caption, the held-out ones too
            t = scene_texts()
            if self.instruct:  # a training conversation asks at most one question of each kind
                turn = max(len(probe.encode([(q, "bottom right")])[0]) - 2 for q in t["question"])
                longest["scenes' templates"] = 2 + min(a.scenes_turns, len(TRAINING_KINDS)) * turn
            else:
                longest["scenes' templates"] = max(len(probe.encode([(None, c)])[0]) for c in t["caption"])
        context = fit_context(longest, a.context_length)
        self.seqs = Sequences(self.tokenizer, context, self.instruct, a.image_after_question)
        mean, std = channel_stats(mcfg.mean, 3), channel_stats(mcfg.std, 3)
        tf = eval_transform(img_size, crop_pct=1.0, mean=mean, std=std)
        sp = self.splits
        scenes = sp.scenes.get("train") if self.instruct else None
        train = sp.train
        if scenes is not None and a.scenes_position_weight > 1:
            train = train + [s for s in train if position_pairs(scenes[s.image])] * (a.scenes_position_weight - 1)
        self.data = _Data(VLDataset(train, sp.images["train"], tf, self.seqs, True, a.blind, scenes,
                                    a.scenes_turns),
                          VLDataset(sp.val, sp.images["val"], tf, self.seqs, False, a.blind))
        kwargs = model_kwargs(cfg)
        if a.coord_channels:
            kwargs["in_chans"] = 5  # the image's 3 and the coordinates' 2
        model = build_vl_model(cfg.model, kwargs, self.tokenizer.vocab_size, self.seqs.image_id, img_size,
                               context, a.max_new_tokens)
        initial = {name: _probe(getattr(model, name)) for name in frozen_parts(a)}
        self.loaded = _init(model, a.init, self.tokenizer, cfg)
        self.frozen = apply_freezing(model, a)
        # LLaVA's stages freeze pretrained parts (Liu et al., 2023, Sec. 4.2): one frozen at its random weights
        # learns nothing and gives the others nothing to fit, which the log says
        random = [n for n in self.frozen if initial[n]  # a part without parameters has no weights to load
                  and all(torch.equal(x, y) for x, y in zip(initial[n], _probe(getattr(model, n))))]
        if random and not cfg.quiet:
            say(f"note: {' and '.join(random)} {'stays' if len(random) == 1 else 'stay'} frozen at random initial "
                f"weights (--stage {a.stage}, --task_args.freeze {list(a.freeze)}): --init "
                f"{'loaded nothing into ' + ('it' if len(random) == 1 else 'them') if a.init else 'is not given'}")
        self.num_params = sum(p.numel() for p in model.parameters())
        self.model = self.module = prepare_model(model, cfg, device)
        data = {**cfg.data.to_dict(), "img_size": img_size}
        self._record = RunRecord(
            task=self.name, model=cfg.model, model_kwargs=kwargs, task_args=to_plain(a), data=data,
            img_size=img_size, in_chans=3, mean=list(mean), std=list(std), crop_pct=1.0, params=self.num_params,
            extra={"tokenizer": self.tokenizer.to_dict(), "context_length": context})

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW's groups, the language model's learning rate scaled by ``language_lr_scale``: trained from
        scratch at the image side's rate, the decoder settles on the answers' text-only prior within a few
        hundred steps and stops drawing on the image tokens (their gradient vanishes); slower, it keeps them."""
        groups = super().param_groups(weight_decay)
        scale = self.args.language_lr_scale
        if scale == 1.0:
            return groups
        lm = {id(p) for p in self.model.language_model.parameters()}
        out = []
        for g in groups:
            out += [{**g, "params": [p for p in g["params"] if id(p) not in lm]},
                    {**g, "params": [p for p in g["params"] if id(p) in lm], "lr_scale": scale}]
        return [g for g in out if g["params"]]

    def _batch(self, batch):
        x, ids, labels = batch
        # the sequences are right-padded to the context, so the columns after the batch's longest one hold only
        # padding, which no real token attends to under the causal mask: cut, they cost nothing (the scenes'
        # conversations fill ~60% of their context, and a training step of the demo runs ~1.2x faster)
        n = int(ids.ne(self.tokenizer.pad_id).sum(1).max())
        x, ids, labels = (t.to(self.device, non_blocking=True) for t in (x, ids[:, :n], labels[:, :n]))
        return with_coords(x) if self.args.coord_channels else x, ids, labels

    def training_step(self, batch, forward) -> tuple[torch.Tensor, dict]:
        x, ids, labels = self._batch(batch)
        # right padding under causal attention: no real token attends to a pad, so no mask is needed; the logits
        # of the scored tokens only: the answers are ~12% of a scenes conversation, and the last decoder block's
        # MLP skips the rest (the same loss; a demo training step ~1.2x faster)
        return forward(ids, x, labels=labels, scored_only=True).loss, {}

    def _image_pos(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids == self.seqs.image_id).int().argmax(1)

    def validation_step(self, batch, forward) -> dict[str, torch.Tensor]:
        x, ids, labels = self._batch(batch)
        loss, s = answer_loss(_logits(forward(ids, x)), labels, self._image_pos(ids))
        return {"loss": (loss.detach() * s["tokens"]).double().cpu(), **{k: v.double().cpu() for k, v in s.items()},
                "n": torch.tensor(float(ids.shape[0]), dtype=torch.float64)}

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        t = max(sums["tokens"].item(), 1.0)
        return {"loss": sums["loss"].item() / t, "token_acc": 100.0 * sums["token_hits"].item() / t,
                "answer_acc": 100.0 * sums["seq_hits"].item() / max(sums["n"].item(), 1.0)}

    def summary(self) -> dict:
        return {"model": self.cfg.model, "dataset": self.cfg.data.dataset, "params_m": self.num_params / 1e6,
                "img_size": self._record.img_size, "train_images": len(self.data.train),
                "val_images": len(self.data.val), "vocab_size": self.tokenizer.vocab_size,
                "context_length": self.seqs.length, "frozen": self.frozen, "blind": self.args.blind,
                **({"init": self.loaded} if self.loaded else {})}

    # ---- the run record ------------------------------------------------------------------------------
    def load(self, record: RunRecord) -> nn.Module:
        tok = WordTokenizer(record.extra["tokenizer"]["words"])
        return build_vl_model(record.model, record.model_kwargs, tok.vocab_size, tok.image_id,
                              record.img_size, record.extra["context_length"],
                              int(record.task_args.get("max_new_tokens", MAX_NEW_TOKENS)))

    def _record_seqs(self, record: RunRecord) -> Sequences:
        tok = WordTokenizer(record.extra["tokenizer"]["words"])
        return Sequences(tok, record.extra["context_length"], self.instruct,
                         record.task_args["image_after_question"])

    def _transform(self, record: RunRecord):
        return eval_transform(record.img_size, crop_pct=1.0, mean=record.mean, std=record.std)

    @torch.no_grad()
    def generate(self, model: nn.Module, record: RunRecord, images: torch.Tensor, prompts: list[list[int]],
                 batch_size: int, device) -> list[str]:
        """Greedy continuations of ``prompts`` (token ids) for ``images`` (normalised); prompts of one length are
        batched together, so no padding is needed. Every answer may run to the run's ``max_new_tokens`` (the model
        holds the context and that many more); a prompt longer than the context is refused, never an answer
        cut short."""
        seqs = self._record_seqs(record)
        blind = bool(record.task_args.get("blind"))
        max_new = int(record.task_args.get("max_new_tokens", MAX_NEW_TOKENS))
        out: list[str] = [""] * len(prompts)
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        if by_len and max(by_len) > seqs.length:  # refused before any generation, not at the longest prompt
            raise DataError(f"a prompt of {max(by_len)} tokens exceeds the run's context of {seqs.length} tokens "
                            f"(its answers get {max_new} more)")
        for _, idx in sorted(by_len.items()):
            for k in range(0, len(idx), batch_size):
                chunk = idx[k:k + batch_size]
                x = images[chunk].to(device)
                if blind:
                    x = torch.zeros_like(x)
                if record.task_args["coord_channels"]:
                    x = with_coords(x)
                ids = torch.tensor([prompts[i] for i in chunk], device=device)
                new = model.generate(ids, x, max_new_tokens=max_new, eos_token_id=seqs.eos)
                for i, row in zip(chunk, new.tolist(), strict=True):
                    out[i] = seqs.tok.decode(row)
        return out

    def score(self, model, record, splits: VLSplits, split: str, batch_size: int, device) -> dict:
        raise NotImplementedError

    def _eval_splits(self, record: RunRecord, data: str | None, split: str | None) -> VLSplits:
        return eval_splits(record, data, split, "vqa" if self.instruct else "caption", self.name)

    def _images(self, record: RunRecord, splits: VLSplits, split: str, samples: list[VLSample]) -> torch.Tensor:
        source = ImageSource(splits.images[split], self._transform(record))
        return torch.stack([source(s.image) for s in samples])

    @torch.no_grad()
    def evaluate(self, model: nn.Module, record: RunRecord, data: str | None, split: str | None, *, out_dir: Path,
                 batch_size: int = 256, device: str = "cpu", optimize: bool = True) -> dict:
        """The task's metrics on ``data`` (default: the record's) ``split`` (:func:`eval_split`: 'test' falls back
        to 'val' when the data has no test split; a train or val split it lacks is refused); writes
        ``eval-<split>.json`` (with every generated output) to ``out_dir``."""
        splits = self._eval_splits(record, data, split)
        split = eval_split(splits, split, data or record.data.get("dataset", "the run's data"))
        result = {"task": self.name, "split": split, **self.score(model, record, splits, split, batch_size, device)}
        file = Path(out_dir) / f"eval-{split}.json"
        ck.atomic_write(file, json.dumps(result, indent=2).encode())
        summary = "  ".join(f"{k} {v:.2f}" for k, v in result.items() if isinstance(v, float))
        return {**result, "files": [str(file)], "summary": f"{self.name} {split}: {summary}"}

    @torch.no_grad()
    def predict(self, model: nn.Module, record: RunRecord, inputs: list[str], out_dir: Path, *, topk: int = 5,
                device: str = "cpu", optimize: bool = True, prompt: str | None = None) -> list[dict]:
        """A caption (``caption``) or the answer to ``prompt`` (``vqa``) per image."""
        seqs = self._record_seqs(record)
        if self.instruct:
            if prompt is None or not prompt.strip():
                raise ValueError("empty question: pass --prompt \"...\"")
            text = take_image_placeholder(prompt, f"the prompt {prompt!r}")  # the image is the input file
            if not text:
                raise ValueError("empty question: the prompt holds only the image placeholder")
            p = seqs.prompt(text)
        else:
            if prompt is not None:
                raise ValueError("a caption run answers no question; drop --prompt (or use a vqa run)")
            p = seqs.prompt()
        tf = self._transform(record)  # a prompt longer than the context is refused by generate
        x = torch.stack([tf(load_image(f, 3)) for f in inputs])
        if self.instruct:  # after the images: a bad one is refused in one line, with no warning before it
            seqs.tok.warn_unknown(text)
        texts = self.generate(model, record, x, [p] * len(inputs), 64, device)
        return [{"image": str(f), "prompt": prompt, "output": t, "line": f"{f}: {t}"}
                for f, t in zip(inputs, texts, strict=True)]


@dataclass
class _Data:
    train: Dataset
    val: Dataset
    test: Dataset | None = None


@register_task("caption")
class CaptionTask(_VLTask):
    """Image captioning: the loss on the caption tokens; scored by BLEU-4 and CIDEr-D."""

    monitor = "loss"
    monitor_mode = "min"

    def score(self, model, record, splits: VLSplits, split: str, batch_size: int, device) -> dict:
        samples = getattr(splits, split)
        seqs = self._record_seqs(record)
        x = self._images(record, splits, split, samples)
        outs = self.generate(model, record, x, [seqs.prompt()] * len(samples), batch_size, device)
        hyps = {i: o for i, o in enumerate(outs)}
        refs = {i: s.refs for i, s in enumerate(samples)}
        r = caption_scores(hyps, refs)
        return {"bleu4": 100.0 * r["bleu4"], "cider": 100.0 * r["cider"], "images": len(samples),
                "captions": [{"image": str(s.image), "output": o, "refs": s.refs} for s, o in zip(samples, outs)]}


@register_task("vqa")
class VQATask(_VLTask):
    """Visual question answering in LLaVA's instruction format: the loss on the answer tokens; scored by VQA
    accuracy per question kind."""

    monitor = "answer_acc"
    instruct = True
    takes_prompt = True  # the question

    @classmethod
    def defaults(cls) -> dict:
        # 12 epochs with each position scene four times: the held-out accuracy of 20 epochs with them twice on
        # every kind, in 0.83x the samples
        return {**super().defaults(), "epochs": 12}

    def score(self, model, record, splits: VLSplits, split: str, batch_size: int, device) -> dict:
        samples = getattr(splits, split)
        seqs = self._record_seqs(record)
        x = self._images(record, splits, split, samples)
        # a conversation is scored on its last answer, its earlier turns given
        prompts = [seqs.prompt(s.turns[-1][0], s.turns[:-1]) for s in samples]
        outs = self.generate(model, record, x, prompts, batch_size, device)
        # the answers come out of the run's word tokenizer (lower case, punctuation split off), not in the
        # annotations' own form: both sides are normalised, also where the humans agree (the official script
        # compares those as written, expecting answers already in VQA's normalised form)
        r = vqa_accuracy(outs, [s.refs for s in samples], [s.kind or "all" for s in samples], always_normalize=True)
        return {"accuracy": r.pop("overall"), **r, "questions": len(samples),
                "answers": [{"image": str(s.image), "question": s.turns[-1][0], "output": o, "refs": s.refs,
                             "kind": s.kind} for s, o in zip(samples, outs)]}


# ---------------------------------------------------------------- BLIP


@dataclass
class BlipArgs:
    """The blip task's options (``--task_args.NAME``; short flags --blind, --init)."""

    blind: bool = False                # images replaced by zeros: the baseline without sight
    freeze: list[str] = field(default_factory=list)  # parts kept frozen: vision_tower, text_encoder, text_decoder
    init: str | None = None            # a CLIP run (image tower), a blip run, a transformers BLIP directory (with its
    #                                    tokenizer) or a checkpoint
    context_length: int | None = None  # caption tokens with [CLS] and [SEP] (None: the longest)
    max_new_tokens: int = MAX_NEW_TOKENS  # generation bound of eval and predict
    rerank: int = 16                   # ITM re-ranks the contrastive top-k texts of each image (BLIP's k)
    scenes_train: int | None = None    # scenes: training scenes (None: 4000)
    scenes_eval: int | None = None     # scenes: validation and test scenes (None: 200 and 400)


class BlipCaptions(Dataset):
    """(image, token ids ``[CLS] caption [SEP]`` padded (L,), attention mask (L,), group) per image; training
    draws a caption among the references each time. ``group``: images whose captions are interchangeable (the
    scenes' content; each file image its own), positives for ITC and never ITM negatives."""

    def __init__(self, samples: list[VLSample], images, transform, tok: WordTokenizer, length: int, train: bool,
                 blind: bool, groups: list[int]):
        self.samples, self.images, self.tok = samples, ImageSource(images, transform), tok
        self.length, self.train, self.blind, self.groups = length, train, blind, groups

    def __len__(self) -> int:
        return len(self.samples)

    def encode(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [self.tok.bos_id, *self.tok.encode(text), self.tok.eos_id]
        if len(ids) > self.length:
            raise DataError(f"a caption of {len(ids)} tokens exceeds the context of {self.length}; raise "
                            f"--task_args.context_length")
        n = self.length - len(ids)
        return torch.tensor(ids + [self.tok.pad_id] * n), torch.tensor([1] * len(ids) + [0] * n)

    def __getitem__(self, i: int):
        s = self.samples[i]
        x = self.images(s.image)
        caption = s.refs[int(torch.randint(len(s.refs), ()))] if self.train else s.refs[0]
        ids, mask = self.encode(caption)
        return torch.zeros_like(x) if self.blind else x, ids, mask, self.groups[i]


class BlipObjectives(nn.Module):
    """What the strategy wraps: ``forward`` is BLIP's three objectives on a batch (:meth:`BLIP.losses`); a batch
    of one image (a validation split's last, or a split of one image) scores ITM as 0, having no negative (the
    validation mean leaves such batches out of ``val_itm``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, ids, mask, groups) -> dict[str, torch.Tensor]:
        return self.model.losses(x, ids, mask, image_ids=groups, lone_image_itm=True)


def _groups(splits: VLSplits, split: str, samples: list[VLSample]) -> list[int]:
    scenes = splits.scenes.get(split)
    if scenes is None:
        return list(range(len(samples)))
    keys = [objects_phrase(scenes[s.image]) + " on " + scenes[s.image].texture for s in samples]
    index = {k: i for i, k in enumerate(sorted(set(keys)))}
    return [index[k] for k in keys]


def _recall(sim: torch.Tensor, hit: torch.Tensor, ks=(1, 5)) -> dict[int, float]:
    """Percent of rows whose top-k columns of ``sim`` hold a ``hit``."""
    top = sim.topk(min(max(ks), sim.shape[1]), dim=1).indices
    found = hit.gather(1, top)
    return {k: 100.0 * found[:, :k].any(1).float().mean().item() for k in ks}


@register_task("blip")
class BlipTask(_ScoredTask):
    """BLIP pre-training (Li et al., 2022, Sec. 3.2): image-text contrastive (ITC), image-text matching with hard
    negatives mined from the contrastive similarities (ITM) and captioning (LM), summed with equal weights, on
    captions (the scenes or ``coco:PATH``). Scored by retrieval (ITC recall@1/5 both ways and BLIP's ITM
    re-ranking of the contrastive top-k) and, with a captioning head, BLEU-4 / CIDEr-D of greedy captions."""

    takes_prompt = True  # the start of the caption (BLIP's "a picture of")

    Args = BlipArgs
    monitor = "loss"
    monitor_mode = "min"
    aliases = {"blind": "task_args.blind", "init": "task_args.init"}

    @classmethod
    def defaults(cls) -> dict:
        return {"model": "blip_tiny", "data.dataset": "scenes", "data.img_size": 64, "epochs": 20, "batch_size": 64,
                "lr": 1.6e-2, "warmup_epochs": 1.0, "weight_decay": 0.05, "drop_path": 0.0}

    @classmethod
    def check(cls, cfg) -> None:
        a = cfg.task_args
        bad = [p for p in a.freeze if p not in ("vision_tower", "text_encoder", "text_decoder")]
        if bad:
            raise ValueError(f"freeze names parts of vision_tower, text_encoder, text_decoder, got {bad}")
        for k in ("scenes_train", "scenes_eval", "context_length", "max_new_tokens", "rerank"):
            v = getattr(a, k)
            if v is not None and v < 1:
                raise ValueError(f"{k} must be >= 1, got {v}")

    def build(self, cfg, device: torch.device) -> None:
        self.cfg, self.device, self.args = cfg, device, cfg.task_args
        a: BlipArgs = self.args
        check_init(a.init)
        mcfg = get_model_config(cfg.model)
        if mcfg.family != "blip":
            raise ValueError(f"--task blip trains a BLIP model (blip_*); {cfg.model} is a {mcfg.family} model"
                             + (": train it with --task caption or --task vqa" if mcfg.family == "llava" else ""))
        img_size = int(cfg.data.img_size or cfg.model_kwargs.get("img_size", mcfg.input_size[-1]))
        self.splits = sp = read_splits(cfg.data, "caption", a.scenes_train, a.scenes_eval, task=self.name)
        texts = sp.texts() + (scenes_vocabulary() if cfg.data.name == "scenes" else [])
        self.tokenizer = tok = WordTokenizer.from_texts(texts)
        # [CLS] caption [SEP] of every split: retrieval on the test split encodes all its captions
        longest = {f"{split} split": max((len(tok.encode(r)) + 2 for s in getattr(sp, split) or [] for r in s.refs),
                                         default=0) for split in ("train", "val", "test")}
        if cfg.data.name == "scenes":
            longest["scenes' templates"] = max(len(tok.encode(c)) + 2 for c in scene_texts()["caption"])
        context = fit_context(longest, a.context_length)
        mean, std = channel_stats(mcfg.mean, 3), channel_stats(mcfg.std, 3)
        tf = eval_transform(img_size, crop_pct=1.0, mean=mean, std=std)
        self.data = _Data(
            BlipCaptions(sp.train, sp.images["train"], tf, tok, context, True, a.blind, _groups(sp, "train", sp.train)),
            BlipCaptions(sp.val, sp.images["val"], tf, tok, context, False, a.blind, _groups(sp, "val", sp.val)))
        if len(set(self.data.val.groups)) < 2 and not cfg.quiet:
            say(f"note: the validation split has {len(sp.val)} image(s) of one content: no ITM negative to draw, "
                f"no val_itm (val_loss is ITC + LM)")
        kwargs = model_kwargs(cfg)
        model = self._model(cfg.model, kwargs, tok, img_size, context + a.max_new_tokens)
        self.loaded = _init(model, a.init, tok, cfg)
        freeze_parts(model, a.freeze)  # as LLaVA's stages: no gradients, and dropout off in the frozen parts
        self.num_params = sum(p.numel() for p in model.parameters())
        self.model = prepare_model(model, cfg, device)
        self.module = BlipObjectives(self.model)
        self._record = RunRecord(
            task=self.name, model=cfg.model, model_kwargs=kwargs, task_args=to_plain(a),
            data={**cfg.data.to_dict(), "img_size": img_size}, img_size=img_size, in_chans=3, mean=list(mean),
            std=list(std), crop_pct=1.0, params=self.num_params,
            extra={"tokenizer": tok.to_dict(), "context_length": context})

    @staticmethod
    def _model(name: str, kwargs: dict, tok: WordTokenizer, img_size: int, max_len: int) -> nn.Module:
        text = {"text_vocab_size": tok.vocab_size, "text_max_len": max_len, "text_pad_token_id": tok.pad_id,
                "text_cls_token_id": tok.bos_id, "text_sep_token_id": tok.eos_id, "text_bos_token_id": tok.dec_id,
                "text_enc_token_id": tok.enc_id}
        return create_model(name, **{"img_size": img_size, **text, **kwargs})

    def _batch(self, batch):
        return tuple(t.to(self.device, non_blocking=True) for t in batch)

    def training_step(self, batch, forward) -> tuple[torch.Tensor, dict]:
        out = forward(*self._batch(batch))
        return out["loss"], {k: v.detach() for k, v in out.items() if k != "loss"}

    def validation_step(self, batch, forward) -> dict[str, torch.Tensor]:
        b = self._batch(batch)
        out = forward(*b)
        n = float(b[0].shape[0])
        # a batch of one image (or content group) has no ITM negative: its ITM (0) stays out of the mean
        n_itm = n if len(torch.unique(b[3])) > 1 else 0.0
        sums = {k: (v.detach() * (n_itm if k == "itm" else n)).double().cpu() for k, v in out.items() if k != "loss"}
        return {**sums, "n": torch.tensor(n, dtype=torch.float64), "n_itm": torch.tensor(n_itm, dtype=torch.float64)}

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Each objective's mean over the batches that have it, and their sum (``loss``)."""
        n, n_itm = max(sums["n"].item(), 1.0), sums["n_itm"].item()
        out = {k: v.item() / (n_itm if k == "itm" else n) for k, v in sums.items()
               if k not in ("n", "n_itm") and (k != "itm" or n_itm)}
        return {**out, "loss": sum(out.values())}

    def summary(self) -> dict:
        return {"model": self.cfg.model, "dataset": self.cfg.data.dataset, "params_m": self.num_params / 1e6,
                "img_size": self._record.img_size, "train_images": len(self.data.train),
                "val_images": len(self.data.val), "vocab_size": self.tokenizer.vocab_size,
                "context_length": self._record.extra["context_length"], "blind": self.args.blind,
                **({"init": self.loaded} if self.loaded else {})}

    # ---- the run record ------------------------------------------------------------------------------
    def load(self, record: RunRecord) -> nn.Module:
        tok = WordTokenizer(record.extra["tokenizer"]["words"])
        return self._model(record.model, record.model_kwargs, tok, record.img_size,
                           record.extra["context_length"] + int(record.task_args.get("max_new_tokens", MAX_NEW_TOKENS)))

    def score(self, model, record: RunRecord, splits: VLSplits, split: str, batch_size: int, device) -> dict:
        """Retrieval over the split's images and distinct captions (a caption matches the images of its group);
        greedy captions scored by BLEU-4 and CIDEr-D when the model has a captioning head."""
        a = record.task_args
        tok = WordTokenizer(record.extra["tokenizer"]["words"])
        samples = getattr(splits, split)
        groups = _groups(splits, split, samples)
        tf = eval_transform(record.img_size, crop_pct=1.0, mean=record.mean, std=record.std)
        ds = BlipCaptions(samples, splits.images[split], tf, tok, record.extra["context_length"], False,
                          bool(a.get("blind")), groups)
        images = torch.stack([ds[i][0] for i in range(len(ds))]).to(device)
        texts = {}
        for s, g in zip(samples, groups, strict=True):
            for r in s.refs:
                texts.setdefault(r, g)
        enc = [ds.encode(t) for t in texts]
        ids, mask = torch.stack([e[0] for e in enc]).to(device), torch.stack([e[1] for e in enc]).to(device)
        text_groups = torch.tensor(list(texts.values()), device=device)
        img_groups = torch.tensor(groups, device=device)
        hit = img_groups[:, None] == text_groups[None, :]
        out: dict = {"images": len(samples), "texts": len(texts)}
        embeds = torch.cat([model.encode_image(images[i:i + batch_size]) for i in range(0, len(images), batch_size)])
        if "itc" in model.heads:
            feats = [model.contrastive_features(embeds[:1], ids[i:i + batch_size], mask[i:i + batch_size])[1]
                     for i in range(0, len(ids), batch_size)]
            img = F.normalize(model.vision_proj(embeds[:, 0]), dim=-1)
            sim = img @ torch.cat(feats).T
            i2t, t2i = _recall(sim, hit), _recall(sim.T, hit.T)
            out.update({"i2t_r1": i2t[1], "i2t_r5": i2t[5], "t2i_r1": t2i[1], "t2i_r5": t2i[5]})
            if "itm" in model.heads:  # BLIP's re-ranking: the contrastive top-k of each image by ITM
                k = min(int(a.get("rerank", 16)), len(texts))
                top = sim.topk(k, dim=1).indices
                enc_ids = ids.clone()
                enc_ids[:, 0] = tok.enc_id  # ITM reads the text with [ENC] first
                itm = torch.stack([model.itm_logits(embeds[i:i + 1].expand(k, -1, -1), enc_ids[top[i]],
                                                    mask[top[i]]).softmax(-1)[:, 1] for i in range(len(samples))])
                best = top.gather(1, itm.argmax(1, keepdim=True))
                out["i2t_itm_r1"] = 100.0 * hit.gather(1, best).float().mean().item()
        if "lm" in model.heads:
            caps, budget = [], int(a.get("max_new_tokens", MAX_NEW_TOKENS))
            for i in range(0, len(images), batch_size):
                new = model.generate_caption(images[i:i + batch_size], max_new_tokens=budget)
                caps += [tok.decode(row[1:]) for row in new.tolist()]
            r = caption_scores(dict(enumerate(caps)), {i: s.refs for i, s in enumerate(samples)})
            out.update({"bleu4": 100.0 * r["bleu4"], "cider": 100.0 * r["cider"]})
            out["captions"] = [{"image": str(s.image), "output": c, "refs": s.refs} for s, c in zip(samples, caps)]
        return out

    @torch.no_grad()
    def evaluate(self, model: nn.Module, record: RunRecord, data: str | None, split: str | None, *, out_dir: Path,
                 batch_size: int = 256, device: str = "cpu", optimize: bool = True) -> dict:
        """Retrieval (and captioning) scores on ``data`` (default: the record's) ``split`` (:func:`eval_split`: 'test'
        falls back to 'val' when the data has no test split; a train or val split it lacks is refused); writes
        ``eval-<split>.json`` to ``out_dir``."""
        splits = eval_splits(record, data, split, "caption", self.name)
        split = eval_split(splits, split, data or record.data.get("dataset", "the run's data"))
        result = {"task": self.name, "split": split, **self.score(model, record, splits, split, batch_size, device)}
        file = Path(out_dir) / f"eval-{split}.json"
        ck.atomic_write(file, json.dumps(result, indent=2).encode())
        summary = "  ".join(f"{k} {v:.2f}" for k, v in result.items() if isinstance(v, float))
        return {**result, "files": [str(file)], "summary": f"{self.name} {split}: {summary}"}

    @torch.no_grad()
    def predict(self, model: nn.Module, record: RunRecord, inputs: list[str], out_dir: Path, *, topk: int = 5,
                device: str = "cpu", optimize: bool = True, prompt: str | None = None) -> list[dict]:
        """A greedy caption per image; ``prompt`` starts it (BLIP's "a picture of"; an ``<image>`` placeholder in it
        is taken out, more than one refused)."""
        if "lm" not in model.heads:
            raise ValueError(f"{record.model} has no captioning head; score it with vitlab eval (retrieval)")
        tok = WordTokenizer(record.extra["tokenizer"]["words"])
        tf = eval_transform(record.img_size, crop_pct=1.0, mean=record.mean, std=record.std)
        x = torch.stack([tf(load_image(f, 3)) for f in inputs]).to(device)
        if record.task_args.get("blind"):
            x = torch.zeros_like(x)
        # the image is the input file: a placeholder in the prompt is taken out, more than one refused (as vqa's)
        text = take_image_placeholder(prompt, f"the prompt {prompt!r}") if prompt else ""
        tok.warn_unknown(text)  # after the images (above): a bad one is refused with no warning before it
        start = [tok.dec_id, *tok.encode(text)]
        ids = torch.tensor([start] * len(inputs), device=device)
        new = model.generate_caption(x, ids, max_new_tokens=int(record.task_args.get("max_new_tokens", MAX_NEW_TOKENS)))
        texts = [tok.decode(row[1:]) for row in new.tolist()]
        return [{"image": str(f), "prompt": prompt, "output": t, "line": f"{f}: {t}"}
                for f, t in zip(inputs, texts, strict=True)]
