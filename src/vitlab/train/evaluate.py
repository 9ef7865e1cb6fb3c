"""``evaluate(checkpoint, data)`` (top-1, top-5, per-class accuracy, confusion matrix as JSON and PNG) and
``predict(checkpoint, images)`` (top-k labels with probabilities). A checkpoint is a run directory (its best
checkpoint), a checkpoint directory, or a ``model.safetensors`` written by ``vitlab train``: the model's
description (name, classes, input size, normalisation) travels in its metadata."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from vitlab.data import DataConfig, build, check_num_classes
from vitlab.train import checkpoint as ck
from vitlab.train.classification import create_from_description, evaluate_model
from vitlab.train.plots import confusion_png


def load_model(checkpoint: str | Path, weights: str = "auto", device: str | torch.device = "cpu"):
    """(model in eval mode, meta) from a checkpoint written by ``vitlab train``."""
    sd, meta = ck.load_weights(checkpoint, weights=weights)
    model = create_from_description(meta)
    model.load_state_dict(sd)
    return model.to(device).eval(), meta


def optimized(model, example: torch.Tensor):
    """``model`` through :func:`vitlab.optimize.optimize` (``backend="auto"``: the fastest path measured on this
    machine for ``example``'s shape, cached; outputs equal eager within 1e-5 in fp32)."""
    from vitlab.optimize import optimize

    return optimize(model, example_inputs=(example,), backend="auto")


def _data_config(data: str | DataConfig | None, meta: dict) -> DataConfig:
    trained = meta.get("data") or {}
    if data is None:
        if not trained:
            raise ValueError("the checkpoint does not say which data it was trained on; pass --data")
        cfg = DataConfig(**trained)
    elif isinstance(data, DataConfig):
        cfg = data
    else:
        same = trained.get("dataset") == data
        cfg = DataConfig(**trained) if same else DataConfig(dataset=data, crop_pct=meta.get("crop_pct"))
    return replace(cfg, img_size=meta["img_size"])


def evaluate(checkpoint: str | Path, data: str | DataConfig | None = None, split: str = "test",
             output_dir: str | Path | None = None, weights: str = "auto", batch_size: int = 256,
             device: str = "cpu", optimize: bool = True) -> dict:
    """Top-1 / top-5 / per-class accuracy (%) and the confusion matrix of a checkpoint on ``data``'s ``split``
    ('test', falling back to 'val' when the data has no test split). Writes ``eval-<split>.json`` and
    ``confusion-<split>.png`` to ``output_dir`` (default: the checkpoint's run directory). ``optimize``: run the
    model through :func:`vitlab.optimize.optimize` (False: eager, as built)."""
    model, meta = load_model(checkpoint, weights=weights, device=device)
    bundle = build(_data_config(data, meta), mean=meta["mean"], std=meta["std"], in_chans=meta["in_chans"])
    check_num_classes(bundle, meta["num_classes"])
    if split == "test" and bundle.test is None:
        split = "val"
    loader = bundle.loader(split, batch_size=batch_size)
    if optimize:
        n = min(batch_size, len(getattr(bundle, split)))
        model = optimized(model, torch.zeros(n, meta["in_chans"], meta["img_size"], meta["img_size"], device=device))
    r = evaluate_model(model, loader, torch.device(device), bundle.num_classes)
    conf = r["confusion"]
    per_class = (100.0 * conf.diag().float() / conf.sum(1).clamp(min=1).float()).tolist()
    result = {"checkpoint": str(checkpoint), "model": meta["model"], "dataset": bundle.name, "split": split,
              "num_images": int(conf.sum()), "top1": r["top1"], "top5": r["top5"], "loss": r["loss"],
              "per_class_top1": dict(zip(bundle.class_names, per_class)), "class_names": bundle.class_names,
              "confusion_matrix": conf.tolist()}
    out = Path(output_dir) if output_dir else _default_out(Path(checkpoint))
    ck.atomic_write(out / f"eval-{split}.json", json.dumps(result, indent=2).encode())
    ck.atomic_write(out / f"confusion-{split}.png",
                    confusion_png(conf, bundle.class_names, f"{meta['model']} on {bundle.name} {split}: "
                                                              f"top-1 {r['top1']:.2f}%"))
    result["json_path"] = str(out / f"eval-{split}.json")
    result["png_path"] = str(out / f"confusion-{split}.png")
    return result


def _default_out(checkpoint: Path) -> Path:
    """The run directory a checkpoint belongs to (RUN, RUN/best, RUN/checkpoints/epoch-N[/model.safetensors])."""
    p = checkpoint.resolve()
    if p.is_file():
        p = p.parent
    if p.parent.name == ck.CKPT_DIR:
        return p.parent.parent
    return p


def predict(checkpoint: str | Path, images: list[str | Path], topk: int = 5, weights: str = "auto",
            device: str = "cpu", optimize: bool = True) -> list[dict]:
    """For each image: ``{"image": path, "top": [(label, probability), ...]}`` with ``topk`` entries.
    ``optimize``: run the model through :func:`vitlab.optimize.optimize` (False: eager, as built)."""
    if not images:
        raise ValueError("no images given")
    model, meta = load_model(checkpoint, weights=weights, device=device)
    from vitlab.data import load_image
    from vitlab.data.transforms import channel_stats, eval_transform

    tf = eval_transform(meta["img_size"], crop_pct=meta.get("crop_pct") or 1.0,
                        mean=channel_stats(meta["mean"], meta["in_chans"]),
                        std=channel_stats(meta["std"], meta["in_chans"]))
    for p in images:
        if not Path(p).is_file():
            raise FileNotFoundError(f"image not found: {p}")
    x = torch.stack([tf(load_image(p, meta["in_chans"])) for p in images]).to(device)
    names = meta.get("class_names") or [str(i) for i in range(meta["num_classes"])]
    if optimize:
        model = optimized(model, x)
    with torch.no_grad():
        out = model(x)
        out = out[0] if isinstance(out, tuple) else out
        probs = out.float().softmax(-1)
    k = min(topk, probs.shape[-1])
    top = probs.topk(k, dim=-1)
    return [{"image": str(p), "top": [(names[i], float(v)) for v, i in zip(top.values[j].tolist(),
                                                                             top.indices[j].tolist())]}
            for j, p in enumerate(images)]
