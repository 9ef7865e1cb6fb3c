"""Frozen-feature evaluation of a backbone:

- ``linear``: a linear classifier on the frozen pre-logit features, SGD (lr 0.1, momentum 0.9, no weight decay)
  with a cosine schedule; ``bn=True`` puts MAE's BatchNorm without affine parameters in front
  of it (He et al., 2022, appendix A.2). Features are computed once (eval transform, no augmentation).
- ``knn``: DINO's weighted k-NN (Caron et al., 2021, section 4.1 and appendix; ``eval_knn.py``): L2-normalised
  features, the k = 20 nearest training images by cosine similarity vote with weight ``exp(sim / 0.07)``.

The features are the backbone's pre-logits; ``blocks=n`` concatenates them over the last n blocks (DINO's
``n_last_blocks``, Caron et al., 2021, appendix, ``eval_linear.py``: 4 for ViT-S): each block's output goes through
the final norm and the model's own pooling (class token or average of the patch tokens, then ``fc_norm``), so
``blocks=1`` is the plain pre-logits.

``probe(checkpoint, data, protocol)`` writes JSON (top-1, top-5, per-class top-1) and returns it; a checkpoint
``random:MODEL`` probes MODEL as a pre-training run with the same ``seed`` initialises it, the baseline a
pre-trained backbone must beat.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import vitlab
from vitlab._io import write_json
from vitlab.convert import CheckpointError, load_state_dict
from vitlab.data import DataConfig, build
from vitlab.ssl.methods import pooled_features

PROTOCOLS = ("linear", "knn")
RANDOM_PROBE_DIR = Path("runs") / "probe"  # where a random:MODEL baseline's JSON goes without an explicit output


def check_blocks(model: nn.Module, blocks: int) -> None:
    """A one-line ValueError unless ``model``'s pre-logits can be taken over its last ``blocks`` blocks."""
    if blocks == 1:
        return
    if not (hasattr(model, "forward_intermediates") and getattr(model, "num_prefix_tokens", None) is not None):
        raise ValueError(f"blocks={blocks} needs a plain ViT backbone (ViT, DeiT, HaLViT): "
                         f"{type(model).__name__} has no single stack of blocks")
    depth = len(model.blocks)
    if not 1 <= blocks <= depth:
        raise ValueError(f"blocks must be in 1..{depth} (the backbone's depth), got {blocks}")


def last_blocks_features(model: nn.Module, x: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    """(B, blocks * D): ``model``'s pre-logits computed from each of its last ``blocks`` blocks, concatenated
    (earliest first); ``blocks=1`` is :func:`vitlab.ssl.methods.pooled_features`."""
    check_blocks(model, blocks)
    if blocks == 1:
        return pooled_features(model, x)
    inter = model.forward_intermediates(x, indices=blocks, norm=True, output_fmt="NLC", intermediates_only=True,
                                        return_prefix_tokens=True)
    return torch.cat([model.forward_head(torch.cat([prefix, patches], 1), pre_logits=True)
                      for patches, prefix in inter], 1)


@torch.no_grad()
def extract_features(model: nn.Module, loader, device: torch.device,
                     blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(features (N, D) float32 on CPU, labels (N,)) of ``model``'s pre-logits (over its last ``blocks`` blocks)
    over ``loader``."""
    was = model.training
    model.eval()
    feats, labels = [], []
    for x, y in loader:
        feats.append(last_blocks_features(model, x.to(device), blocks).float().cpu())
        labels.append(y)
    model.train(was)
    return torch.cat(feats), torch.cat(labels)


def _scores(scores: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict:
    k = min(5, num_classes)
    top = scores.topk(k, dim=1).indices
    hit1 = top[:, 0] == y
    per_class = {}
    for c in range(num_classes):
        sel = y == c
        per_class[c] = 100.0 * hit1[sel].float().mean().item() if sel.any() else None
    top5 = (top == y[:, None]).any(1).float().mean().item()
    return {"top1": 100.0 * hit1.float().mean().item(), "top5": 100.0 * top5, "per_class_top1": per_class}


@torch.no_grad()
def knn_eval(train_f: torch.Tensor, train_y: torch.Tensor, test_f: torch.Tensor, test_y: torch.Tensor,
             num_classes: int, k: int = 20, temperature: float = 0.07, chunk: int = 1024) -> dict:
    """DINO's weighted k-NN classifier: top-1 / top-5 / per-class top-1 (%) of the test features."""
    tr = F.normalize(train_f, dim=1)
    te = F.normalize(test_f, dim=1)
    k = min(k, tr.shape[0])
    scores = []
    for i in range(0, te.shape[0], chunk):
        sim, idx = (te[i: i + chunk] @ tr.t()).topk(k, dim=1)
        w = (sim / temperature).exp()
        votes = torch.zeros(sim.shape[0], num_classes).scatter_add_(1, train_y[idx], w)
        scores.append(votes)
    return _scores(torch.cat(scores), test_y, num_classes)


def linear_probe(train_f: torch.Tensor, train_y: torch.Tensor, test_f: torch.Tensor, test_y: torch.Tensor,
                 num_classes: int, epochs: int = 100, lr: float = 0.1, batch_size: int = 256, bn: bool = False,
                 seed: int = 0) -> dict:
    """A linear classifier (optionally after BatchNorm without affine) on frozen features: SGD lr ``lr`` at
    ``batch_size`` 256, momentum 0.9, cosine over ``epochs``; top-1 / top-5 / per-class top-1 (%) on the test."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    d = train_f.shape[1]
    clf = nn.Sequential(nn.BatchNorm1d(d, affine=False, eps=1e-6) if bn else nn.Identity(), nn.Linear(d, num_classes))
    nn.init.trunc_normal_(clf[1].weight, std=0.01)  # MAE's linear-probe head initialisation
    nn.init.zeros_(clf[1].bias)
    opt = torch.optim.SGD(clf.parameters(), lr=lr * batch_size / 256, momentum=0.9, weight_decay=0.0)
    steps = epochs * math.ceil(train_f.shape[0] / batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    clf.train()
    for _ in range(epochs):
        perm = torch.randperm(train_f.shape[0], generator=g)
        for i in range(0, len(perm), batch_size):
            b = perm[i: i + batch_size]
            if len(b) < 2 and bn:
                continue  # BatchNorm needs two samples
            loss = F.cross_entropy(clf(train_f[b]), train_y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    clf.eval()
    with torch.no_grad():
        return _scores(clf(test_f), test_y, num_classes)


def load_backbone(checkpoint: str, device: torch.device, seed: int = 0,
                  model_kwargs: dict | None = None) -> tuple[nn.Module, dict]:
    """(backbone without classifier, description) of a run / checkpoint, or of ``random:MODEL`` built with
    ``model_kwargs``: the weights a pre-training run with ``--seed seed`` (and those ``--model_kwargs``) starts from
    (drawn under a forked RNG: the caller's stream is kept)."""
    if model_kwargs and not checkpoint.startswith("random:"):
        raise ValueError("model_kwargs only applies to a random:MODEL baseline (a checkpoint records its own)")
    if checkpoint.startswith("random:"):
        name = checkpoint[len("random:"):]
        try:
            cfg = vitlab.get_model_config(name)
        except vitlab.UnknownModelError as e:  # its message lists the close matches of a misspelt name
            raise vitlab.UnknownModelError(f"{checkpoint}: not a registered model ({e})") from None
        meta = {"model": name, "model_kwargs": dict(model_kwargs or {}), "in_chans": cfg.input_size[0],
                "img_size": cfg.input_size[-1],
                "mean": list(cfg.mean), "std": list(cfg.std), "data": None, "random_init": True}
    else:
        from vitlab.train import checkpoint as ck

        try:  # a run directory: its last epoch (a pre-training run's "best" is only its monitor's pick)
            path = Path(checkpoint)
            sd, meta = ck.load_weights(ck.resolve_checkpoint_dir(path, prefer="last") if path.is_dir() else path,
                                       weights="raw")
        except CheckpointError as e:
            raise CheckpointError(f"{checkpoint} holds no backbone to probe: {e}") from None
    kwargs = {k: v for k, v in meta.get("model_kwargs", {}).items() if k not in ("num_classes", "img_size", "in_chans")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = vitlab.create_model(meta["model"], num_classes=0, img_size=meta["img_size"],
                                    in_chans=meta["in_chans"], **kwargs)
    if not meta.get("random_init"):
        load_state_dict(model, sd, source=str(checkpoint))
    return model.to(device).eval(), meta


def probe(checkpoint: str, data: str | None = None, protocol: str = "knn", output: str | Path | None = None,
          epochs: int = 100, lr: float = 0.1, bn: bool = False, k: int = 20, temperature: float = 0.07,
          batch_size: int = 256, device: str = "cpu", seed: int = 0, split: str = "test", blocks: int = 1,
          model_kwargs: dict | None = None) -> dict:
    """Probe ``checkpoint``'s frozen backbone on ``data`` (default: the data it was trained on) with ``protocol``
    ('linear' or 'knn') on its pre-logits over the last ``blocks`` blocks: train on the train split, score
    ``split``; writes the JSON to ``output`` (default RUN/probe-<protocol>.json, or
    runs/probe/probe-random-MODEL-<protocol>.json for a random backbone, never the working directory itself)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")
    for flag, value, ok, rule in (("--k", k, k >= 1, ">= 1"), ("--epochs", epochs, epochs >= 1, ">= 1"),
                                  ("--blocks", blocks, blocks >= 1, ">= 1"),
                                  ("--batch-size", batch_size, batch_size >= 1, ">= 1"),
                                  ("--temperature", temperature, temperature > 0, "> 0"), ("--lr", lr, lr > 0, "> 0")):
        if not ok:  # also refuses nan, which fails every comparison
            raise ValueError(f"{flag} must be {rule}, got {value}")
    if output is not None and Path(output).is_dir():
        raise ValueError(f"--output {output} is a directory; give the JSON file's name (e.g. {output}/probe.json)")
    t0 = time.perf_counter()
    dev = torch.device(device)
    model, meta = load_backbone(checkpoint, dev, seed, model_kwargs)
    check_blocks(model, blocks)
    dataset = data or (meta.get("data") or {}).get("dataset")
    if not dataset:
        raise ValueError("--data is needed: the checkpoint does not record its dataset")
    bundle = build(DataConfig(dataset=dataset, img_size=meta["img_size"]), mean=meta["mean"], std=meta["std"],
                   in_chans=meta["in_chans"])
    if getattr(bundle, split) is None:
        raise ValueError(f"dataset {dataset} has no {split} split")
    train_loader = bundle.loader("train", batch_size, shuffle=False, drop_last=False)
    train_loader.dataset.transform = bundle.eval_transform  # frozen features: no augmentation
    ftr, ytr = extract_features(model, train_loader, dev, blocks)
    fte, yte = extract_features(model, bundle.loader(split, batch_size), dev, blocks)
    if protocol == "knn":
        r = knn_eval(ftr, ytr, fte, yte, bundle.num_classes, k=k, temperature=temperature)
        settings = {"k": k, "temperature": temperature}
    else:
        r = linear_probe(ftr, ytr, fte, yte, bundle.num_classes, epochs=epochs, lr=lr, bn=bn, seed=seed)
        settings = {"epochs": epochs, "lr": lr, "momentum": 0.9, "schedule": "cosine", "bn": bn}
    names = bundle.class_names
    result = {"checkpoint": str(checkpoint), "model": meta["model"], "ssl_method": meta.get("ssl_method"),
              "dataset": bundle.name, "split": split, "protocol": protocol, "blocks": blocks, **settings,
              "top1": r["top1"], "top5": r["top5"],
              "per_class_top1": {names[c]: v for c, v in r["per_class_top1"].items()},
              "train_images": int(ftr.shape[0]), "test_images": int(fte.shape[0]), "feature_dim": int(ftr.shape[1]),
              "wall_time_s": time.perf_counter() - t0}
    if output is None:
        tag = protocol if blocks == 1 else f"{protocol}-last{blocks}"
        if checkpoint.startswith("random:"):
            output = RANDOM_PROBE_DIR / f"probe-random-{meta['model']}-{tag}.json"
        else:
            run = Path(checkpoint)
            output = (run if run.is_dir() else run.parent) / f"probe-{tag}.json"
    result["json_path"] = str(output)
    write_json(output, result)
    return result


__all__ = ["PROTOCOLS", "check_blocks", "extract_features", "knn_eval", "last_blocks_features", "linear_probe",
           "load_backbone", "probe"]
