"""``vitlab train --task clip``: contrastive language-image pre-training (Radford et al., 2021) on ``digits`` (the
offline demo: captions from templates, zero-shot with held-out templates) or ``captions:PATH`` (a folder of
images with a CSV / JSONL of captions).

The loss is :func:`vitlab.clip.loss.clip_loss` (symmetric InfoNCE, learned temperature, features gathered from
every rank with gradients under DDP / FSDP). Validation reports the loss (which picks the best checkpoint), the
in-batch image->text accuracy and, on digits, the zero-shot top-1 with the held-out templates; the final test is
zero-shot top-1 / top-5 (digits) or recall@1/5/10 (a captions file with a test split).

Options (``--task_args.KEY VALUE``): see :class:`ClipArgs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from vitlab.clip.data import DIGIT_WORDS, HELD_OUT_TEMPLATES, build_clip_data, digit_captions, read_captions
from vitlab.clip.loss import clip_loss
from vitlab.clip.model import clip_for_task
from vitlab.clip.tokenizer import ClipTokenizer, WordTokenizer
from vitlab.clip.zeroshot import load_clip, retrieval_evaluate, zeroshot_classifier, zeroshot_evaluate
from vitlab.registry import create_model, get_model_config
from vitlab.train.config import parse_task_args
from vitlab.train.recipe import param_groups
from vitlab.train.task import register_task


@dataclass
class ClipArgs:
    tokenizer: Literal["auto", "clip", "word"] = "auto"  # auto: CLIP's BPE for a 49,408-token text tower, else words
    bpe_path: str | None = None      # CLIP's bpe_simple_vocab_16e6.txt.gz (default: the installed open_clip's)
    context_length: int | None = None  # text context (None: the model's)
    truncate: bool = True            # captions longer than the context: truncate with a warning (False: refuse)
    embed_dim: int = 64              # joint embedding width when --model is an image model, not a clip_* model



def _training_texts(data_cfg) -> list[str]:
    if data_cfg.name == "digits":
        return digit_captions()
    return [c for _, c in read_captions(data_cfg.path)["train"]]


@register_task("clip")
class ClipTask:
    """CLIP training: ``module`` is the CLIP model; batches are (images, token ids, group)."""

    monitor = "loss"
    monitor_mode = "min"

    def build(self, cfg, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        args = self.args = parse_task_args(cfg.task_args, ClipArgs)
        mcfg = get_model_config(cfg.model)
        kwargs = {k: v for k, v in cfg.model_kwargs.items() if k not in ("img_size", "in_chans")}
        img_size = int(cfg.data.img_size or cfg.model_kwargs.get("img_size", mcfg.input_size[-1]))
        in_chans = int(cfg.model_kwargs.get("in_chans", mcfg.input_size[0]))
        is_clip = mcfg.family == "clip"
        with torch.device("meta"):  # the text tower's defaults, without allocating it
            default_text = create_model(cfg.model, **kwargs).text if is_clip else None
        kind = args.tokenizer
        if kind == "auto":
            kind = "clip" if default_text is not None and default_text.vocab_size == 49408 else "word"
        context = args.context_length or (default_text.context_length if default_text is not None else 16)
        if kind == "clip":
            self.tokenizer = ClipTokenizer(args.bpe_path, context, args.truncate)
        else:
            self.tokenizer = WordTokenizer.from_texts(_training_texts(cfg.data), context, args.truncate)
        self.data = build_clip_data(cfg.data, self.tokenizer, mcfg.mean, mcfg.std, in_chans, img_size)
        clip_desc = {"img_size": img_size, "in_chans": in_chans, "vocab_size": self.tokenizer.vocab_size,
                     "context_length": context, "embed_dim": args.embed_dim}
        model = clip_for_task(cfg.model, img_size, in_chans, self.tokenizer.vocab_size, context, args.embed_dim,
                              drop_path_rate=cfg.drop_path, **kwargs)
        self.num_params = sum(p.numel() for p in model.parameters())
        if cfg.grad_checkpointing:
            model.set_grad_checkpointing(True)
        self.model = self.module = model.to(device)
        self.digits = cfg.data.name == "digits"
        self.templates = list(HELD_OUT_TEMPLATES) if self.digits else ["a photo of a {}."]
        self._prompts = None
        if self.digits:  # the zero-shot prompts of validation: every class in every held-out template
            self._prompts = self.tokenizer([t.format(c) for c in DIGIT_WORDS for t in self.templates]).to(device)
        self._description = {
            "model": cfg.model, "model_kwargs": kwargs, "clip": clip_desc, "tokenizer": self.tokenizer.to_dict(),
            "mean": list(mcfg.mean), "std": list(mcfg.std), "img_size": img_size, "in_chans": in_chans,
            "data": self.data.config.to_dict(), "class_names": list(DIGIT_WORDS) if self.digits else None,
            "templates": self.templates, "num_classes": 0, "params": self.num_params}

    def param_groups(self, weight_decay: float) -> list[dict]:
        return param_groups(self.model, weight_decay)

    def _batch(self, batch):
        x, tokens, group = batch
        return (x.to(self.device, non_blocking=True), tokens.to(self.device, non_blocking=True),
                group.to(self.device, non_blocking=True))

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
            classes = torch.nn.functional.normalize(text[n:].view(len(DIGIT_WORDS), len(self.templates), -1)
                                                    .mean(1), dim=-1)
            sums["zs_hits"] = ((image @ classes.T).argmax(-1) == group).sum().float().cpu()
        return sums

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        n = max(sums["n"].item(), 1.0)
        out = {"loss": sums["loss"].item() / n, "i2t_acc": 100.0 * sums["i2t_hits"].item() / n}
        if "zs_hits" in sums:
            out["zeroshot_top1"] = 100.0 * sums["zs_hits"].item() / n
        return out

    def description(self) -> dict:
        return self._description

    def summary(self) -> dict:
        """The start line's fields (``train_images``: image-caption pairs) and the tokenizer's."""
        tok = self.tokenizer.to_dict()["kind"]
        return dict(model=self.cfg.model, dataset=self.data.name, params_m=self.num_params / 1e6,
                    img_size=self.data.img_size, train_images=len(self.data.train), val_images=len(self.data.val),
                    tokenizer=tok, vocab_size=self.tokenizer.vocab_size, context_length=self.tokenizer.context_length)

    @torch.no_grad()
    def test(self, run_dir, batch_size: int, checkpoint: str = "last") -> dict:
        """Digits: zero-shot top-1 / top-5 on the test split with the held-out templates. Captions with a test
        split: recall@1/5/10 both ways."""
        ckpt = Path(run_dir) / checkpoint
        if self.data.test is None or not ckpt.exists():
            return {}
        model, _, _ = load_clip(str(ckpt), device=self.device)
        if self.digits:
            classifier = zeroshot_classifier(model, self.tokenizer, DIGIT_WORDS, self.templates, self.device)
            r = zeroshot_evaluate(model, classifier, self.data.loader("test", batch_size=batch_size), self.device)
            return {"test_zeroshot_top1": r["top1"], "test_zeroshot_top5": r["top5"]}
        r = retrieval_evaluate(model, self.data.test, batch_size, self.device)
        return {f"test_{k}": v for k, v in r.items() if k.startswith(("i2t", "t2i"))}
