"""``ClipTask`` (``vitlab train --task clip``): contrastive language-image pre-training (Radford et al., 2021,
"Learning Transferable Visual Models From Natural Language Supervision") on ``digits`` (the offline demo:
captions from templates, zero-shot with held-out templates) or ``captions:PATH`` (a folder of images with a CSV /
JSONL of captions).

The loss is :func:`vitlab.clip.loss.clip_loss` (symmetric InfoNCE, learned temperature, features gathered from
every rank with gradients under DDP / FSDP). Validation reports the loss (which picks the best checkpoint), the
in-batch image->text accuracy and, on digits, the zero-shot top-1 with the held-out templates; the final test is
zero-shot top-1 / top-5 (digits) or recall@1/5/10 both ways (a captions file with a test split).

Its run record (the model, the text tower's size, the tokenizer, the zero-shot templates and class names)
rebuilds the model for ``vitlab eval`` (zero-shot top-1 / top-5 on labelled data, recall@1/5/10 on image-text
pairs) and ``vitlab predict`` (zero-shot labels: the top-k of the run's class names, prompt-ensembled over its
templates). Options (``--task_args.KEY VALUE``): :class:`ClipArgs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn

from vitlab._io import write_json
from vitlab.clip.data import (
    DIGIT_WORDS,
    HELD_OUT_TEMPLATES,
    build_clip_data,
    digit_captions,
    training_texts,
)
from vitlab.clip.loss import clip_loss
from vitlab.clip.model import CLIP, clip_for_task
from vitlab.clip.tokenizer import ClipTokenizer, WordTokenizer
from vitlab.clip.zeroshot import (
    DEFAULT_TEMPLATES,
    clip_data,
    clip_from_record,
    load_clip,
    pick_split,
    record_templates,
    record_tokenizer,
    result_line,
    retrieval_split,
    zeroshot_classifier,
    zeroshot_split,
)
from vitlab.data import DataBundle
from vitlab.data.captions import read_captions
from vitlab.registry import create_model, get_model_config
from vitlab.train.common import model_in_chans, model_kwargs, prepare_model
from vitlab.train.config import to_plain
from vitlab.train.task import RunRecord, Task, TaskError, register_task


@dataclass
class ClipArgs:
    """The CLIP task's options (``--task_args.NAME``)."""

    tokenizer: Literal["auto", "clip", "word"] = "auto"  # auto: CLIP's BPE for a 49,408-token text tower, else words
    bpe_path: str | None = None      # CLIP's bpe_simple_vocab_16e6.txt.gz (default: the installed open_clip's)
    context_length: int | None = None  # text context (None: the model's)
    truncate: bool = True            # captions longer than the context: truncate with a warning (False: refuse)
    embed_dim: int = 64              # joint embedding width when --model is an image model, not a clip_* model


def _training_texts(data_cfg) -> list[str]:
    if data_cfg.name == "digits":
        return digit_captions()
    if data_cfg.name in ("wds", "hf"):
        return training_texts(data_cfg)
    return [c for _, c in read_captions(data_cfg.path)["train"]]


def optimized(model: CLIP, example: torch.Tensor) -> CLIP:
    """``model`` with its image tower through :func:`vitlab.optimize.optimize` (``backend="auto"``, measured for
    ``example``'s shape and cached): the tower that encodes every image; the text tower encodes only prompts."""
    from vitlab.optimize import optimize

    model.visual = optimize(model.visual, example_inputs=(example,), backend="auto")
    return model


def clip_scores(model: CLIP, tokenizer, record: RunRecord, bundle: DataBundle, split: str, batch_size: int,
                device) -> dict:
    """What a CLIP run is scored by on ``bundle``'s ``split``: zero-shot top-1 / top-5 on labelled data (the
    data's class names, the record's templates), recall@1/5/10 both ways on image-text pairs."""
    if bundle.num_classes:
        r = zeroshot_split(model, tokenizer, bundle, split, templates=record_templates(record),
                           batch_size=batch_size, device=device)
    else:
        r = retrieval_split(model, bundle, split, batch_size, device)
    return {**r, "model": record.model}


@register_task("clip")
class ClipTask(Task):
    """CLIP training: ``module`` is the CLIP model; batches are (images, token ids, group). The recipe is the
    digits demo's (``clip_vit_pico_patch8``, 10 epochs at batch 32, lr 0.024, 1 warm-up epoch, no drop-path)."""

    monitor = "loss"
    monitor_mode = "min"
    Args = ClipArgs

    @classmethod
    def defaults(cls) -> dict:
        return {"model": "clip_vit_pico_patch8", "epochs": 10, "batch_size": 32, "lr": 0.024, "warmup_epochs": 1.0,
                "drop_path": 0.0}

    def build(self, cfg, device: torch.device) -> None:
        self.cfg, self.device, self.args = cfg, device, cfg.task_args
        args: ClipArgs = self.args
        mcfg = get_model_config(cfg.model)
        kwargs = model_kwargs(cfg)
        img_size = int(cfg.data.img_size or cfg.model_kwargs.get("img_size", mcfg.input_size[-1]))
        in_chans = model_in_chans(cfg, mcfg)
        with torch.device("meta"):  # the text tower's defaults, without allocating it
            default_text = create_model(cfg.model, **kwargs).text if mcfg.family == "clip" else None
        kind = args.tokenizer
        if kind == "auto":
            kind = "clip" if default_text is not None and default_text.vocab_size == 49408 else "word"
        context = args.context_length or (default_text.context_length if default_text is not None else 16)
        if kind == "clip":
            self.tokenizer = ClipTokenizer(args.bpe_path, context, args.truncate)
        else:
            self.tokenizer = WordTokenizer.from_texts(_training_texts(cfg.data), context, args.truncate)
        self.data = build_clip_data(cfg.data, self.tokenizer, mcfg.mean, mcfg.std, in_chans, img_size)
        model = clip_for_task(cfg.model, img_size, in_chans, self.tokenizer.vocab_size, context, args.embed_dim,
                              drop_path_rate=cfg.drop_path, **kwargs)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.model = self.module = prepare_model(model, cfg, device)
        digits = self.data.name == "digits"
        templates = list(HELD_OUT_TEMPLATES if digits else DEFAULT_TEMPLATES)
        self._prompts = None
        if digits:  # the zero-shot prompts of validation: every class in every held-out template
            self._prompts = self.tokenizer([t.format(c) for c in DIGIT_WORDS for t in templates]).to(device)
        clip_desc = {"img_size": img_size, "in_chans": in_chans, "vocab_size": self.tokenizer.vocab_size,
                     "context_length": context, "embed_dim": args.embed_dim}
        self._record = RunRecord(
            task=self.name, model=cfg.model, model_kwargs=kwargs, task_args=to_plain(args),
            data=self.data.config.to_dict(), class_names=list(DIGIT_WORDS) if digits else None, img_size=img_size,
            in_chans=in_chans, mean=list(mcfg.mean), std=list(mcfg.std), crop_pct=self.data.config.crop_pct,
            params=self.num_params,
            extra={"clip": clip_desc, "tokenizer": self.tokenizer.to_dict(), "templates": templates})

    def _batch(self, batch):
        x, tokens, group = batch
        x = x.to(self.device, non_blocking=True)
        if self.cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, tokens.to(self.device, non_blocking=True), group.to(self.device, non_blocking=True)

    def training_step(self, batch, forward) -> tuple[torch.Tensor, dict]:
        x, tokens, _ = self._batch(batch)
        image, text, scale = forward(x, tokens)
        return clip_loss(image, text, scale)

    def validation_step(self, batch, forward) -> dict[str, torch.Tensor]:
        x, tokens, group = self._batch(batch)
        n = tokens.shape[0]
        if self._prompts is not None:  # one call: the batch's captions and the class prompts
            tokens = torch.cat([tokens, self._prompts])
        image, text, scale = forward(x, tokens)
        loss, logs = clip_loss(image, text[:n], scale, gather=False)  # each rank scores its own val slice
        sums = {"loss": (loss.detach() * n).double().cpu(), "i2t_hits": (logs["i2t_acc"] * n).round().cpu(),
                "n": torch.tensor(float(n))}
        if self._prompts is not None:
            classes = nn.functional.normalize(text[n:].view(len(DIGIT_WORDS), -1, text.shape[-1]).mean(1), dim=-1)
            sums["zs_hits"] = ((image @ classes.T).argmax(-1) == group).sum().float().cpu()
        return sums

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        n = max(sums["n"].item(), 1.0)
        out = {"loss": sums["loss"].item() / n, "i2t_acc": 100.0 * sums["i2t_hits"].item() / n}
        if "zs_hits" in sums:
            out["zeroshot_top1"] = 100.0 * sums["zs_hits"].item() / n
        return out

    def summary(self) -> dict:
        """The start line's fields (``train_images``: image-caption pairs) and the tokenizer's."""
        return {"model": self.cfg.model, "dataset": self.data.name, "params_m": self.num_params / 1e6,
                "img_size": self.data.img_size, "train_images": len(self.data.train),
                "val_images": len(self.data.val), "tokenizer": self.tokenizer.to_dict()["kind"],
                "vocab_size": self.tokenizer.vocab_size, "context_length": self.tokenizer.context_length}

    @torch.no_grad()
    def test(self, run_dir, batch_size: int, checkpoint: str = "last") -> dict:
        """Digits: zero-shot top-1 / top-5 on the test split with the held-out templates. Captions with a test
        split: recall@1/5/10 both ways."""
        ckpt = Path(run_dir) / checkpoint
        if self.data.test is None or not ckpt.exists():
            return {}
        model, tokenizer, record = load_clip(str(ckpt), bpe_path=self.args.bpe_path, device=self.device)
        r = clip_scores(model, tokenizer, record, self.data, "test", batch_size, self.device)
        if "top1" in r:
            return {"test_zeroshot_top1": r["top1"], "test_zeroshot_top5": r["top5"]}
        return {f"test_{k}": v for k, v in r.items() if k.startswith(("i2t_", "t2i_"))}

    def record(self) -> RunRecord:
        return self._record

    # ---- the run record ----------------------------------------------------------------------------------
    def load(self, record: RunRecord) -> nn.Module:
        return clip_from_record(record)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, record: RunRecord, data: str | None, split: str, *, out_dir: Path,
                 batch_size: int = 256, device: str = "cpu", optimize: bool = True) -> dict:
        """Zero-shot top-1 / top-5 on labelled data (digits, ``imagefolder:PATH``...: the data's class names, the
        record's templates), recall@1/5/10 both ways on image-text pairs (``captions:PATH``); ``split`` 'test'
        falls back to 'val' when the data has no test split. Writes ``eval-<split>.json`` to ``out_dir``."""
        tokenizer = record_tokenizer(record)
        bundle = clip_data(record, data, tokenizer)
        split = pick_split(bundle, split)
        if optimize:
            n = min(batch_size, len(getattr(bundle, split)))
            model = optimized(model, torch.zeros(n, record.in_chans, record.img_size, record.img_size,
                                                 device=device))
        result = {"task": self.name, **clip_scores(model, tokenizer, record, bundle, split, batch_size, device)}
        file = out_dir / f"eval-{split}.json"
        write_json(file, result)
        return {**result, "files": [str(file)], "summary": result_line(result)}

    @torch.no_grad()
    def predict(self, model: nn.Module, record: RunRecord, inputs: list[str], out_dir: Path, *, topk: int = 5,
                device: str = "cpu", optimize: bool = True, prompt: str | None = None) -> list[dict]:
        """Zero-shot labels: for each image ``{"image": path, "top": [(class name, probability), ...]}``, the
        ``topk`` of the record's class names by ``softmax(scale * cosine)`` against its prompt-ensembled
        templates."""
        from vitlab.data import load_image
        from vitlab.data.transforms import channel_stats, eval_transform

        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if not record.class_names:
            trained = (record.data or {}).get("dataset", "its data")
            raise TaskError(f"zero-shot labels need class names, and this CLIP run (trained on {trained}) has "
                            f"none; score it with vitlab zeroshot --classnames ... or vitlab retrieval")
        tokenizer = record_tokenizer(record)
        tf = eval_transform(record.img_size, crop_pct=record.crop_pct or 1.0,
                            mean=channel_stats(record.mean, record.in_chans),
                            std=channel_stats(record.std, record.in_chans))
        x = torch.stack([tf(load_image(p, record.in_chans)) for p in inputs]).to(device)
        if optimize:
            model = optimized(model, x)
        classifier = zeroshot_classifier(model, tokenizer, record.class_names, record_templates(record), device)
        probs = (model.logit_scale.exp() * model.encode_image(x, normalize=True) @ classifier.T).softmax(-1)
        top = probs.topk(min(topk, probs.shape[-1]), dim=-1)
        rows = []
        for j, p in enumerate(inputs):
            pairs = [(record.class_names[i], float(v)) for v, i in zip(top.values[j].tolist(),
                                                                       top.indices[j].tolist())]
            rows.append({"image": str(p), "top": pairs,
                         "line": f"{p}: " + "  ".join(f"{label} {prob:.3f}" for label, prob in pairs)})
        return rows
