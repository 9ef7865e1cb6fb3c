"""Zero-shot classification and image-text retrieval with a CLIP model (Radford et al., 2021).

- :func:`zeroshot_classifier`: prompt ensembling (Sec. 3.1.4): each class name is put into every template, the
  unit-norm text embeddings are averaged over the templates and normalised again; the class weights are these.
- :func:`zeroshot_evaluate`: top-1 / top-5 of ``argmax_c <img, w_c>`` on a labelled split.
- :func:`retrieval_metrics`: image -> text and text -> image recall@1/5/10; an image may have several captions,
  any of which counts as a hit for it (the Flickr30k / MSCOCO protocol of Sec. 3.1.5 / Table 13). Captions and
  images match by group: on ``captions:PATH`` a caption's group is its image; on the digits demo it is the
  digit, so a caption matches every image of its digit and an image every caption of its digit.
- :func:`load_clip`: a trained run (``RUN``, a checkpoint directory or ``.safetensors`` from ``vitlab train --task
  clip``) or ``openclip:FILE`` (an open_clip state dict) as (model, tokenizer, run record); :func:`clip_from_record`
  rebuilds a run's model from its :class:`~vitlab.train.task.RunRecord`.
- :func:`zeroshot` / :func:`retrieval`: the scores of a checkpoint on a dataset (``vitlab zeroshot`` / ``vitlab
  retrieval``); :func:`zeroshot_split` / :func:`retrieval_split` the same for a loaded model and data.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from vitlab.clip.data import HELD_OUT_TEMPLATES, CaptionStream, build_clip_data
from vitlab.clip.model import CLIP, clip_for_task, clip_from_openclip
from vitlab.clip.tokenizer import ClipTokenizer, tokenizer_from_dict
from vitlab.convert import load_state_dict
from vitlab.data import DataBundle, DataConfig, build
from vitlab.models import OPENAI_MEAN, OPENAI_STD
from vitlab.train import checkpoint as ck
from vitlab.train.task import RunRecord, TaskError

DEFAULT_TEMPLATES = ("a photo of a {}.",)


def check_prompts(classnames, templates) -> tuple[list[str], list[str]]:
    classnames, templates = [str(c) for c in classnames], [str(t) for t in templates]
    if not classnames or any(not c.strip() for c in classnames):
        raise ValueError("zero-shot classification needs non-empty class names")
    bad = [t for t in templates if t.count("{}") != 1]
    if not templates or bad:
        raise ValueError(f"a template holds the class name as '{{}}' exactly once, got {bad[0] if bad else 'none'!r}")
    return classnames, templates


@torch.no_grad()
def zeroshot_classifier(model: CLIP, tokenizer, classnames, templates, device="cpu") -> torch.Tensor:
    """(classes, embed_dim) unit-norm class weights, each the renormalised mean of its prompts' embeddings."""
    classnames, templates = check_prompts(classnames, templates)
    tokens = tokenizer([t.format(c) for c in classnames for t in templates]).to(device)
    emb = torch.cat([model.encode_text(chunk, normalize=True) for chunk in tokens.split(1024)])
    return F.normalize(emb.view(len(classnames), len(templates), -1).mean(dim=1), dim=-1)


@torch.no_grad()
def zeroshot_evaluate(model: CLIP, classifier: torch.Tensor, loader, device="cpu") -> dict:
    """Top-1 / top-5 (%) of the zero-shot classifier over a loader of (image, label, ...) batches."""
    hits1 = hits5 = n = 0
    k = min(5, classifier.shape[0])
    for batch in loader:
        x, y = batch[0].to(device), batch[-1].to(device)
        top = (model.encode_image(x, normalize=True) @ classifier.T).topk(k, dim=-1).indices
        hits1 += int((top[:, 0] == y).sum())
        hits5 += int((top == y[:, None]).any(dim=1).sum())
        n += len(y)
    return {"top1": 100.0 * hits1 / max(n, 1), "top5": 100.0 * hits5 / max(n, 1), "num_images": n}


def retrieval_metrics(image_emb: torch.Tensor, text_emb: torch.Tensor, text_group: torch.Tensor,
                      ks=(1, 5, 10), image_group: torch.Tensor | None = None) -> dict:
    """Recall@k (%) both ways. Caption j matches image i when ``text_group[j] == image_group[i]`` (default
    ``image_group``: the image's index, so ``text_group[j]`` is caption j's image). A caption is found at rank
    r when r images score above its best-scoring match; an image likewise among the captions."""
    sim = text_emb.float() @ image_emb.float().T  # (texts, images)
    image_group = torch.arange(len(image_emb)) if image_group is None else image_group
    match = text_group[:, None] == image_group[None, :]
    t2i_rank = (sim > sim.masked_fill(~match, float("-inf")).amax(1, keepdim=True)).sum(1)
    i2t_rank = (sim.T > sim.T.masked_fill(~match.T, float("-inf")).amax(1, keepdim=True)).sum(1)
    out = {}
    for k in ks:
        out[f"i2t_r{k}"] = 100.0 * (i2t_rank < k).float().mean().item()
        out[f"t2i_r{k}"] = 100.0 * (t2i_rank < k).float().mean().item()
    return out


@torch.no_grad()
def retrieval_evaluate(model: CLIP, pairs, batch_size: int = 256, device="cpu") -> dict:
    """Recall@1/5/10 of an image-text split (:class:`vitlab.clip.data.CaptionPairs`, ``DigitCaptions``, a
    Hugging Face split): each distinct image and each distinct caption encoded once. A stream of pairs
    (:class:`vitlab.clip.data.CaptionStream`: ``wds:`` shards, one caption per image) is read once, each image
    matched by its own caption."""
    if isinstance(pairs, CaptionStream):
        images, texts = [], []
        for x, tokens, _ in DataLoader(pairs, batch_size=batch_size):
            images.append(model.encode_image(x.to(device), normalize=True).cpu())
            texts.append(model.encode_text(tokens.to(device), normalize=True).cpu())
        images, texts = torch.cat(images), torch.cat(texts)
        return {**retrieval_metrics(images, texts, torch.arange(len(texts))), "num_images": len(images),
                "num_texts": len(texts)}
    images, image_group = [], []
    for x, g in DataLoader(pairs.distinct_images(), batch_size=batch_size):
        images.append(model.encode_image(x.to(device), normalize=True).cpu())
        image_group.append(g)
    texts = torch.cat([model.encode_text(t.to(device), normalize=True).cpu() for t in pairs.tokens.split(batch_size)])
    images = torch.cat(images)
    return {**retrieval_metrics(images, texts, pairs.groups, image_group=torch.cat(image_group)),
            "num_images": len(images), "num_texts": len(texts)}


# ---------------------------------------------------------------- checkpoints and data


def clip_from_record(record: RunRecord) -> CLIP:
    """The CLIP of a ``vitlab train --task clip`` run with fresh weights: its model at the record's image size and
    channels, the text tower sized for its tokenizer (``record.extra["clip"]``)."""
    c = record.extra.get("clip")
    if c is None:
        raise TaskError(f"the {record.task} run of {record.model} is not a CLIP run (train one with vitlab train "
                        f"--task clip)")
    return clip_for_task(record.model, record.img_size, record.in_chans, c.get("vocab_size"),
                         c.get("context_length"), c.get("embed_dim", 64), **record.model_kwargs)


def load_clip(checkpoint: str, weights: str = "auto", quick_gelu: bool = False, bpe_path: str | None = None,
              device="cpu") -> tuple[CLIP, object, RunRecord]:
    """(model in eval mode, tokenizer, run record) of ``RUN`` or ``openclip:FILE``; the record holds the
    preprocessing (mean, std, img_size, in_chans) and, for a run, its data, class names and zero-shot templates
    (``extra["templates"]``)."""
    if checkpoint.startswith("openclip:"):
        model = clip_from_openclip(checkpoint[len("openclip:"):], quick_gelu=quick_gelu)
        pe = model.visual.trunk.patch_embed
        record = RunRecord(task="clip", model=checkpoint, img_size=int(pe.img_size[0]), in_chans=pe.in_chans,
                           mean=list(OPENAI_MEAN), std=list(OPENAI_STD), crop_pct=1.0,
                           extra={"templates": list(DEFAULT_TEMPLATES)})
        tokenizer = ClipTokenizer(bpe_path, context_length=model.context_length)
    else:
        sd, meta = ck.load_weights(Path(checkpoint), weights=weights)
        if "clip" not in meta:
            raise ValueError(f"{checkpoint} is not a CLIP run (train one with vitlab train --task clip)")
        record = RunRecord.from_meta(meta)
        model = clip_from_record(record)
        load_state_dict(model, sd, source=checkpoint)
        tokenizer = record_tokenizer(record, bpe_path)
    return model.to(device).eval(), tokenizer, record


def record_tokenizer(record: RunRecord, bpe_path: str | None = None):
    """The tokenizer of a CLIP run (a CLIP BPE one reads ``bpe_path``, else the run's ``--task_args.bpe_path``,
    else the installed open_clip's vocabulary)."""
    return tokenizer_from_dict(record.extra["tokenizer"], bpe_path or record.task_args.get("bpe_path"))


def clip_data(record: RunRecord, data: str | None, tokenizer) -> DataBundle:
    """The data a CLIP model of ``record`` is scored on, with the record's preprocessing: ``data`` (default: the
    run's own); ``digits``, ``captions:PATH`` and the run's own ``wds:`` / ``hf:`` data as image-text pairs, any other
    dataset as labelled images."""
    trained = record.data or {}
    if data is None:
        if not trained:
            raise ValueError("the checkpoint does not say which data it was trained on; pass --data")
        data = trained["dataset"]
    cfg = DataConfig(**trained) if trained.get("dataset") == data else DataConfig(dataset=data)
    if cfg.name in ("digits", "captions") or (cfg.name in ("wds", "hf") and trained.get("dataset") == data):
        return build_clip_data(cfg, tokenizer, record.mean, record.std, record.in_chans, record.img_size)
    return build(replace(cfg, img_size=record.img_size), mean=record.mean, std=record.std, in_chans=record.in_chans)


def record_templates(record: RunRecord) -> list[str]:
    """The zero-shot templates of a run (digits: the held-out ones), else ``'a photo of a {}.'``."""
    return list(record.extra.get("templates") or DEFAULT_TEMPLATES)


def pick_split(bundle: DataBundle, split: str | None) -> str:
    """``split``, where ``None`` or a ``test`` the data does not have means its test split, else its val split."""
    if split in (None, "test"):
        return "test" if bundle.test is not None else "val"
    return split


def _split_of(bundle: DataBundle, split: str):
    data = getattr(bundle, split, None)
    if data is None:
        raise ValueError(f"{bundle.name} has no {split} split")
    return data


# ---------------------------------------------------------------- scores


def zeroshot_split(model: CLIP, tokenizer, bundle: DataBundle, split: str, classnames=None,
                   templates=DEFAULT_TEMPLATES, batch_size: int = 256, device="cpu") -> dict:
    """Zero-shot top-1 / top-5 on ``bundle``'s ``split``; classes named by ``classnames`` (default: the data's,
    the number words on digits), prompts from ``templates``."""
    classnames = list(classnames or bundle.class_names)
    if len(classnames) != bundle.num_classes:
        raise ValueError(f"{len(classnames)} class names for the {bundle.num_classes} classes of {bundle.name}")
    data = _split_of(bundle, split)
    classifier = zeroshot_classifier(model, tokenizer, classnames, templates, device)
    r = zeroshot_evaluate(model, classifier, DataLoader(data, batch_size=batch_size), device)
    return {**r, "dataset": bundle.name, "split": split, "classnames": classnames, "templates": list(templates)}


def retrieval_split(model: CLIP, bundle: DataBundle, split: str, batch_size: int = 256, device="cpu") -> dict:
    """Recall@1/5/10 both ways on ``bundle``'s ``split`` of image-text pairs (``captions:PATH``, ``digits``, or
    ``wds:`` / ``hf:`` data with captions)."""
    if not (hasattr(bundle.val, "distinct_images") or isinstance(bundle.val, CaptionStream)):
        raise ValueError(f"retrieval needs image-text pairs (captions:PATH, digits, or wds: / hf: data with "
                         f"captions), not {bundle.name!r}")
    return {**retrieval_evaluate(model, _split_of(bundle, split), batch_size, device), "dataset": bundle.name,
            "split": split}


def result_line(r: dict) -> str:
    """One console line of a :func:`zeroshot_split` or :func:`retrieval_split` result (with its ``model``)."""
    if "top1" in r:
        return (f"{r['model']} on {r['dataset']} ({r['split']}, {r['num_images']} images, {len(r['classnames'])} "
                f"classes, {len(r['templates'])} templates): zero-shot top-1 {r['top1']:.2f}%  top-5 "
                f"{r['top5']:.2f}%")
    recall = "  ".join(f"{d} R@{k} {r[f'{d}_r{k}']:.2f}" for d in ("i2t", "t2i") for k in (1, 5, 10))
    return (f"{r['model']} on {r['dataset']} ({r['split']}, {r['num_images']} images, {r['num_texts']} captions): "
            f"{recall}")


def zeroshot(checkpoint: str, data: str | None = None, classnames=None, templates=None, split: str = "test",
             batch_size: int = 256, device="cpu", weights: str = "auto", quick_gelu: bool = False,
             bpe_path: str | None = None) -> dict:
    """Zero-shot top-1 / top-5 of a CLIP checkpoint on a labelled dataset (``digits``, ``imagefolder:PATH``,
    ``cifar10:PATH``...). Defaults: the run's data; class names: the number words for digits, else the
    dataset's class names; templates: the run's held-out templates, else ``'a photo of a {}.'``."""
    model, tokenizer, record = load_clip(checkpoint, weights, quick_gelu, bpe_path, device)
    bundle = clip_data(record, data, tokenizer)
    r = zeroshot_split(model, tokenizer, bundle, split, classnames, templates or record_templates(record),
                       batch_size, device)
    return {**r, "model": record.model}


def retrieval(checkpoint: str, data: str | None = None, split: str | None = None, batch_size: int = 256,
              device="cpu", weights: str = "auto", quick_gelu: bool = False, bpe_path: str | None = None) -> dict:
    """Image -> text and text -> image recall@1/5/10 of a CLIP checkpoint on ``captions:PATH`` or ``digits`` (each
    image against the digits' training captions). Defaults: the run's data; split: test when the data has one,
    else val (:func:`pick_split`)."""
    model, tokenizer, record = load_clip(checkpoint, weights, quick_gelu, bpe_path, device)
    bundle = clip_data(record, data, tokenizer)
    r = retrieval_split(model, bundle, pick_split(bundle, split), batch_size, device)
    return {**r, "model": record.model}


__all__ = ["DEFAULT_TEMPLATES", "HELD_OUT_TEMPLATES", "clip_data", "clip_from_record", "load_clip", "pick_split",
           "record_templates", "record_tokenizer", "result_line", "retrieval", "retrieval_evaluate",
           "retrieval_metrics", "retrieval_split", "zeroshot", "zeroshot_classifier", "zeroshot_evaluate",
           "zeroshot_split"]
