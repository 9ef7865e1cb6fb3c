"""Zero-shot classification and image-text retrieval with a CLIP model (Radford et al., 2021).

- :func:`zeroshot_classifier`: prompt ensembling (Sec. 3.1.4): each class name is put into every template, the
  unit-norm text embeddings are averaged over the templates and normalised again; the class weights are these.
- :func:`zeroshot_evaluate`: top-1 / top-5 of ``argmax_c <img, w_c>`` on a labelled split.
- :func:`retrieval_metrics`: image -> text and text -> image recall@1/5/10; an image may have several captions,
  any of which counts as a hit for it (the Flickr30k / MSCOCO protocol of Sec. 3.1.5 / Table 13).
- :func:`load_clip`: a trained run (``RUN``, a checkpoint directory or ``.safetensors`` from ``vitlab train --task
  clip``) or ``openclip:FILE`` (an open_clip state dict) as (model, tokenizer, preprocessing info).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from vitlab.clip.data import DIGIT_WORDS, HELD_OUT_TEMPLATES, ImagesOf, build_clip_data
from vitlab.clip.model import CLIP, OPENAI_MEAN, OPENAI_STD, clip_for_task, clip_from_openclip
from vitlab.clip.tokenizer import ClipTokenizer, tokenizer_from_dict
from vitlab.convert import load_state_dict
from vitlab.data import DataConfig, build
from vitlab.train import checkpoint as ck

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


def retrieval_metrics(image_emb: torch.Tensor, text_emb: torch.Tensor, text_image: torch.Tensor,
                      ks=(1, 5, 10)) -> dict:
    """Recall@k (%) both ways; ``text_image[j]`` is the image index of caption j."""
    sim = text_emb.float() @ image_emb.float().T  # (texts, images)
    out = {}
    t2i_rank = (sim > sim.gather(1, text_image[:, None])).sum(1)  # images scoring above the right one
    own = torch.zeros_like(sim, dtype=torch.bool)
    own[torch.arange(len(text_image)), text_image] = True
    # an image's rank is the best rank of any of its captions among all captions
    order = sim.T.argsort(dim=1, descending=True)  # (images, texts)
    i2t_rank = own.T.gather(1, order).float().argmax(dim=1)
    for k in ks:
        out[f"i2t_r{k}"] = 100.0 * (i2t_rank < k).float().mean().item()
        out[f"t2i_r{k}"] = 100.0 * (t2i_rank < k).float().mean().item()
    return out


@torch.no_grad()
def retrieval_evaluate(model: CLIP, pairs, batch_size: int = 256, device="cpu") -> dict:
    """Recall@1/5/10 of a :class:`vitlab.clip.data.CaptionPairs` split (each image encoded once)."""
    images = torch.cat([model.encode_image(x.to(device), normalize=True)
                        for x, _ in DataLoader(ImagesOf(pairs), batch_size=batch_size)])
    texts = torch.cat([model.encode_text(t.to(device), normalize=True) for t in pairs.tokens.split(batch_size)])
    return {**retrieval_metrics(images.cpu(), texts.cpu(), pairs.groups), "num_images": len(images),
            "num_texts": len(texts)}


def model_from_description(meta: dict) -> CLIP:
    c = meta["clip"]
    return clip_for_task(meta["model"], c["img_size"], c["in_chans"], c.get("vocab_size"), c.get("context_length"),
                         c.get("embed_dim", 64), **meta.get("model_kwargs", {}))


def load_clip(checkpoint: str, weights: str = "auto", quick_gelu: bool = False, bpe_path: str | None = None,
              device="cpu") -> tuple[CLIP, object, dict]:
    """(model in eval mode, tokenizer, info) of ``RUN`` or ``openclip:FILE``; info holds the preprocessing
    (mean, std, img_size, in_chans) and, for a run, its data, class names and zero-shot templates."""
    if checkpoint.startswith("openclip:"):
        model = clip_from_openclip(checkpoint[len("openclip:"):], quick_gelu=quick_gelu)
        pe = model.visual.trunk.patch_embed
        info = {"mean": list(OPENAI_MEAN), "std": list(OPENAI_STD), "img_size": int(pe.img_size[0]),
                "in_chans": pe.in_chans, "data": None, "class_names": None, "templates": list(DEFAULT_TEMPLATES),
                "model": checkpoint}
        tokenizer = ClipTokenizer(bpe_path, context_length=model.context_length)
    else:
        sd, meta = ck.load_weights(Path(checkpoint), weights=weights)
        if "clip" not in meta:
            raise ValueError(f"{checkpoint} is not a CLIP run (train one with vitlab train --task clip)")
        model = model_from_description(meta)
        load_state_dict(model, sd, source=checkpoint)
        tokenizer = tokenizer_from_dict(meta["tokenizer"], bpe_path)
        info = {k: meta.get(k) for k in ("mean", "std", "img_size", "in_chans", "data", "class_names",
                                         "templates", "model")}
    return model.to(device).eval(), tokenizer, info


def _labelled_data(data: str, info: dict, tokenizer):
    cfg = DataConfig(dataset=data)
    mean, std, size, chans = info["mean"], info["std"], info["img_size"], info["in_chans"]
    if cfg.name == "digits":  # the demo's split and preprocessing
        return build_clip_data(cfg, tokenizer, mean, std, chans, size)
    return build(DataConfig(dataset=data, img_size=size), mean=mean, std=std, in_chans=chans)


def zeroshot(checkpoint: str, data: str | None = None, classnames=None, templates=None, split: str = "test",
             batch_size: int = 256, device="cpu", weights: str = "auto", quick_gelu: bool = False,
             bpe_path: str | None = None) -> dict:
    """Zero-shot top-1 / top-5 of a CLIP checkpoint on a labelled dataset (``digits``, ``imagefolder:PATH``,
    ``cifar10:PATH``...). Defaults: the run's data; class names: the number words for digits, else the
    dataset's class names; templates: the run's held-out templates, else ``'a photo of a {}.'``."""
    model, tokenizer, info = load_clip(checkpoint, weights, quick_gelu, bpe_path, device)
    if data is None:
        if not info.get("data"):
            raise ValueError("--data is needed with an openclip: checkpoint")
        data = info["data"]["dataset"]
    bundle = _labelled_data(data, info, tokenizer)
    if classnames is None:
        classnames = list(DIGIT_WORDS) if DataConfig(dataset=data).name == "digits" else bundle.class_names
    if len(classnames) != bundle.num_classes:
        raise ValueError(f"{len(classnames)} class names for the {bundle.num_classes} classes of {data}")
    templates = list(templates or info.get("templates") or DEFAULT_TEMPLATES)
    classifier = zeroshot_classifier(model, tokenizer, classnames, templates, device)
    split_data = getattr(bundle, split, None)
    if split_data is None:
        raise ValueError(f"dataset {data} has no {split} split")
    r = zeroshot_evaluate(model, classifier, DataLoader(split_data, batch_size=batch_size), device)
    return {**r, "model": info["model"], "dataset": data, "split": split, "classnames": classnames,
            "templates": templates}


def retrieval(checkpoint: str, data: str | None = None, split: str | None = None, batch_size: int = 256,
              device="cpu", weights: str = "auto", quick_gelu: bool = False, bpe_path: str | None = None) -> dict:
    """Image -> text and text -> image recall@1/5/10 of a CLIP checkpoint on ``captions:PATH`` (default: the
    run's data; split: test when the file has one, else val)."""
    model, tokenizer, info = load_clip(checkpoint, weights, quick_gelu, bpe_path, device)
    if data is None:
        if not info.get("data"):
            raise ValueError("--data captions:PATH is needed with an openclip: checkpoint")
        data = info["data"]["dataset"]
    cfg = DataConfig(dataset=data)
    if cfg.name != "captions":
        raise ValueError(f"retrieval needs image-text pairs (captions:PATH), not {data!r}")
    bundle = build_clip_data(cfg, tokenizer, info["mean"], info["std"], info["in_chans"], info["img_size"])
    split = split or ("test" if bundle.test is not None else "val")
    pairs = getattr(bundle, split, None)
    if pairs is None:
        raise ValueError(f"{data} has no {split} split")
    return {**retrieval_evaluate(model, pairs, batch_size, device), "model": info["model"], "dataset": data,
            "split": split}


__all__ = ["HELD_OUT_TEMPLATES", "load_clip", "retrieval", "retrieval_evaluate", "retrieval_metrics", "zeroshot",
           "zeroshot_classifier", "zeroshot_evaluate"]
