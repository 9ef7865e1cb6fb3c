"""Trainer tasks of the self-supervised methods: ``mae``, ``simclr``, ``mocov3``, ``dino``, ``dinov2``
(``vitlab pretrain --method M`` or ``vitlab train --task M``).

The task's ``model`` is the headless backbone: ``model.safetensors`` holds exactly the weights
``vitlab train --init RUN`` fine-tunes (the description records ``ssl_method``, so an MAE backbone fine-tunes
with layer-wise lr decay 0.65 by default). Heads, decoder, teacher and centres train beside it and are
checkpointed in the trainer state (exact resume).

Views (``task_args``, :class:`ViewArgs`): MAE trains on one RandomResizedCrop(``global_scale``) + flip view; SimCLR and
MoCo v3 on two views of RandomResizedCrop(``global_scale``) + flip + brightness/contrast jitter (SimCLR section
3, MoCo v3 appendix); DINO and DINOv2 on 2 global views plus ``local_crops`` views of ``local_crop_size`` pixels at
``local_scale`` (DINO's multi-crop, section 3 and appendix).

Collapse monitors (every validation, on the val split through the eval transform): the mean per-dimension std of
the L2-normalised backbone features (``feature_std``, x sqrt(dim): about 1 for spread features, 0 when every
image maps to one point, SimSiam section 4.1), their effective rank (exp of the entropy of the normalised
singular values, Roy & Vetterli 2007), and for DINO / DINOv2 the teacher's entropy and KL(teacher || student)
on the same images. A collapse prints one warning line.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import typing
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.transforms import v2

import vitlab
from vitlab._io import write_json
from vitlab.ssl.base import (
    SSLMethod,
    create,
    create_backbone,
    default_local_crop_size,
    images_of,
    list_methods,
    method_class,
    method_options,
    pooled_features,
)
from vitlab.train import checkpoint as ck
from vitlab.train.common import build_image_data, create_image_model, image_record, model_kwargs
from vitlab.train.progress import say
from vitlab.train.recipe import param_groups
from vitlab.train.task import RunRecord, Task, register_task


@dataclass
class ViewArgs:
    """The augmentation options every method's ``task_args`` start with (the method's own options follow)."""

    global_scale: tuple[float, float] = (0.25, 1.0)  # RandomResizedCrop scale of the two global views
    local_crops: int = 6                             # DINO / DINOv2: local views per image
    local_crop_size: int | None = None               # pixels; None -> 3/7 of the image in whole patches (96 of 224)
    local_scale: tuple[float, float] = (0.05, 0.25)  # RandomResizedCrop scale of the local views
    jitter: float = 0.4                              # brightness / contrast jitter strength (0 = off)
    jitter_p: float = 0.8                            # probability of the jitter
    blur_p: float = 0.0                              # probability of a Gaussian blur (DINO: 1.0 / 0.1 / 0.5)


def method_args_class(method: str) -> type:
    """The ``Args`` dataclass of ``method``'s pre-training task: :class:`ViewArgs`, then the method's own options
    with the types and defaults of its constructor (``out_dim: int = 65536`` -> ``--task_args.out_dim``)."""
    cls = method_class(method)
    options = set(method_options(method))
    fields, seen = [], set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or not options - seen:
            continue
        hints = typing.get_type_hints(init)
        for p in list(inspect.signature(init).parameters.values())[2:]:
            if p.name in options and p.name not in seen and p.default is not inspect.Parameter.empty:
                seen.add(p.name)
                default = p.default
                spec = (dataclasses.field(default_factory=lambda d=default: copy.deepcopy(d))
                        if isinstance(default, (list, dict)) else dataclasses.field(default=default))
                fields.append((p.name, hints.get(p.name, typing.Any), spec))
    return dataclasses.make_dataclass(f"{cls.__name__}Args", fields, bases=(ViewArgs,))


# A collapsed encoder maps every image near one point (std -> 0) or onto a line (effective rank -> 1); spread
# features on the sphere have a per-dimension std near 1 / sqrt(dim) (SimSiam, figure 2).
COLLAPSE_STD, COLLAPSE_RANK = 0.05, 2.0


class MultiView:
    """An item transform giving a list of views: ``n_global`` at ``size`` then ``n_local`` at ``local_size``."""

    def __init__(self, size: int, mean, std, a: ViewArgs, hflip: float, n_global: int = 2, n_local: int = 0,
                 local_size: int | None = None):
        def pipe(sz, scale):
            ops: list = [v2.RandomResizedCrop(sz, scale=scale, antialias=True)]
            if hflip > 0:
                ops.append(v2.RandomHorizontalFlip(hflip))
            if a.jitter > 0:
                ops.append(v2.RandomApply([v2.ColorJitter(a.jitter, a.jitter)], p=a.jitter_p))
            if a.blur_p > 0:
                k = max(3, (sz // 10) | 1)
                ops.append(v2.RandomApply([v2.GaussianBlur(k, sigma=(0.1, 2.0))], p=a.blur_p))
            ops += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
            return v2.Compose(ops)

        self.global_t = pipe(size, a.global_scale)
        self.local_t = pipe(local_size, a.local_scale) if n_local else None
        self.n_global, self.n_local = n_global, n_local

    def __call__(self, img):
        return [self.global_t(img) for _ in range(self.n_global)] + [self.local_t(img) for _ in range(self.n_local)]


def effective_rank(cov: torch.Tensor) -> float:
    """exp(entropy of the normalised singular values) of the centred features whose covariance is ``cov``."""
    s = torch.linalg.eigvalsh(cov.double()).clamp_min(0).sqrt()
    p = s / s.sum().clamp_min(1e-12)
    return float(torch.exp(-(p * torch.log(p.clamp_min(1e-30))).sum()))


class PretrainTask(Task):
    """The pre-training task of a registered self-supervised method (one registered task per method, named
    after it): ``module`` is the method, ``model`` its backbone."""

    method: typing.ClassVar[str] = ""

    def build(self, cfg, device: torch.device) -> None:
        self.cfg, self.device, self.args = cfg, device, cfg.task_args
        view_names = {f.name for f in dataclasses.fields(ViewArgs)}
        self.method_args = {f.name: getattr(self.args, f.name) for f in dataclasses.fields(self.args)
                            if f.name not in view_names}
        model_cfg = vitlab.get_model_config(cfg.model)
        self.data = build_image_data(cfg, model_cfg)
        b = self.data
        backbone = create_backbone(self.method, cfg.model, img_size=b.img_size, in_chans=b.in_chans,
                                   drop_path_rate=cfg.drop_path, **model_kwargs(cfg))
        self.module: SSLMethod = create(self.method, backbone, **self.method_args).to(device)
        self.model = self.module.model
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self._set_views(b)
        kwargs = {**model_kwargs(cfg), **({"dynamic_img_size": True}
                                          if getattr(self.model, "dynamic_img_size", False) else {})}
        self._record = replace(image_record(self.name, cfg, b, model_cfg, self.num_params, ssl_method=self.method),
                               num_classes=0, class_names=[], model_kwargs=kwargs)

    def _set_views(self, b) -> None:
        a, spec = self.args, self.module.views
        mean, std = self._mean_std()
        hflip = b.config.hflip
        if spec.plain:  # one view: RandomResizedCrop + flip only (MAE, appendix A.1)
            plain = replace(a, jitter=0.0, blur_p=0.0)
            b.train.transform = MultiView(b.img_size, mean, std, plain, hflip, spec.global_views).global_t \
                if spec.global_views == 1 else MultiView(b.img_size, mean, std, plain, hflip, spec.global_views)
            return
        n_local, local = 0, None
        if spec.local_crops and a.local_crops > 0:
            patch = self.model.patch_embed.patch_size[0] if isinstance(getattr(self.model, "patch_embed", None),
                                                                      nn.Module) else 1
            local = a.local_crop_size or default_local_crop_size(b.img_size, patch)
            if local < patch or local % patch:
                raise ValueError(f"local_crop_size {local} px does not fit {self.cfg.model}: it needs a multiple of "
                                 f"its {patch}-pixel patch (at least one patch)")
            try:
                with torch.no_grad():
                    pooled_features(self.model.eval(), torch.zeros(2, b.in_chans, local, local, device=self.device))
            except (RuntimeError, ValueError) as e:
                raise ValueError(f"{self.cfg.model} cannot take {local}-pixel local crops ({str(e).splitlines()[0]}); "
                                 f"set --task_args.local_crops 0") from None
            finally:
                self.model.train()
            n_local = a.local_crops
        b.train.transform = MultiView(b.img_size, mean, std, a, hflip, spec.global_views, n_local, local)

    def param_groups(self, weight_decay: float) -> list[dict]:
        extras = [m for name, m in self.module.named_children() if name != "model"]
        return param_groups(self.model, weight_decay, extra=extras)

    def _views(self, batch):
        x = batch[0]
        if isinstance(x, (list, tuple)):
            return [v.to(self.device, non_blocking=True) for v in x]
        return [x.to(self.device, non_blocking=True)]

    def training_step(self, batch, forward):
        out = forward(self._views(batch))
        return out["loss"], {k: v.detach() for k, v in out.items() if k != "loss" and v.ndim == 0}

    def before_optimizer_step(self) -> None:
        self.module.before_optimizer_step()

    def after_step(self, step: int, total_steps: int, steps_per_epoch: int) -> None:
        self.module.after_step(step, total_steps, steps_per_epoch)

    # ---- collapse monitors -----------------------------------------------------------------------------
    def validation_step(self, batch, forward) -> dict[str, torch.Tensor]:
        x = images_of(batch).to(self.device)
        n = x.shape[0]
        out = forward([x], monitor=True)
        f = F.normalize(out["features"].double(), dim=-1)
        sums = {"n": torch.tensor(float(n), dtype=torch.float64), "sum": f.sum(0).cpu(), "outer": (f.t() @ f).cpu()}
        for k in ("loss", "teacher_entropy", "teacher_student_kl"):  # batch means -> sums
            if k in out:
                sums[k] = out[k].detach().double().cpu() * n
        return sums

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        n = sums["n"].item()
        mean = sums["sum"] / n
        cov = sums["outer"] / n - torch.outer(mean, mean)
        std = cov.diagonal().clamp_min(0).sqrt()
        d = std.numel()
        out = {"feature_std": float(std.mean()) * math.sqrt(d), "effective_rank": effective_rank(cov)}
        for k in ("loss", "teacher_entropy", "teacher_student_kl"):
            if k in sums:
                out[k] = sums[k].item() / n
        if out["feature_std"] < COLLAPSE_STD or out["effective_rank"] < COLLAPSE_RANK:
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_rank() == 0:
                say(f"warning: features collapsed: feature_std {out['feature_std']:.3f} (x sqrt(dim); < "
                    f"{COLLAPSE_STD}) or effective rank {out['effective_rank']:.2f} of {d} (< {COLLAPSE_RANK})")
        return out

    def record(self) -> RunRecord:
        return self._record

    def summary(self) -> dict:
        b = self.data
        return {"model": self.cfg.model, "method": self.method, "dataset": b.name, "params_m": self.num_params / 1e6,
                "img_size": b.img_size, "train_images": len(b.train), "val_images": len(b.val)}

    def test(self, run_dir, batch_size: int, checkpoint: str = "last") -> dict:
        """k-NN top-1 (DINO's protocol) of the checkpoint's backbone on the test split, and the method's
        artifacts (MAE: ``reconstructions.png`` of the first validation images). Rebuilt from the checkpoint, so a
        sharded run is scored the same."""
        from vitlab.ssl.probe import extract_features, knn_eval, load_backbone

        run_dir = Path(run_dir)
        if not (run_dir / checkpoint).exists():
            return {}
        model, _ = load_backbone(str(run_dir / checkpoint), self.device)
        out = {}
        if self.data.test is not None:
            train = replace(self.data, train=self._plain(self.data.train))
            ftr, ytr = extract_features(model, train.loader("train", batch_size, shuffle=False, drop_last=False),
                                        self.device)
            fte, yte = extract_features(model, self.data.loader("test", batch_size), self.device)
            out["test_knn_top1"] = knn_eval(ftr, ytr, fte, yte, self.data.num_classes)["top1"]
        state = ck.load_trainer_state((run_dir / checkpoint).resolve())
        # the method around the checkpoint's backbone, with the extras (decoder, heads) the run saved
        method = create(self.method, model, **self.method_args).to(self.device).eval()
        for name, child in method.named_children():
            if name != "model" and name in state:
                child.load_state_dict(state[name])
        x = images_of(next(iter(self.data.loader("val", 8)))).to(self.device)
        mean, std = self._mean_std()
        with torch.no_grad():
            for name, data in method.artifacts(x, mean, std).items():
                ck.atomic_write(run_dir / name, data)
        return out

    # ---- the run record ----------------------------------------------------------------------------------
    def load(self, record: RunRecord) -> nn.Module:
        """The headless backbone (what ``model.safetensors`` holds)."""
        return create_image_model(record)

    def evaluate(self, model: nn.Module, record: RunRecord, data: str | None, split: str, *, out_dir: Path,
                 batch_size: int = 256, device: str = "cpu", optimize: bool = True) -> dict:
        """k-NN top-1 / top-5 (k = 20, T = 0.07; Wu et al., 2018, as DINO) of the backbone's frozen features on
        ``data``'s ``split``, with the training split as the memory bank: ``eval-<split>.json``."""
        from vitlab.data import DataConfig, build
        from vitlab.ssl.probe import extract_features, knn_eval

        trained = dict(record.data or {})
        cfg = DataConfig(**trained) if data is None or trained.get("dataset") == data else DataConfig(dataset=data)
        bundle = build(replace(cfg, img_size=record.img_size), mean=record.mean, std=record.std,
                       in_chans=record.in_chans)
        if split == "test" and bundle.test is None:
            split = "val"
        dev = torch.device(device)
        bank = replace(bundle, train=self._plain(bundle.train, bundle.eval_transform))
        ftr, ytr = extract_features(model, bank.loader("train", batch_size, shuffle=False, drop_last=False), dev)
        fte, yte = extract_features(model, bundle.loader(split, batch_size), dev)
        r = knn_eval(ftr, ytr, fte, yte, bundle.num_classes)
        result = {"task": self.name, "model": record.model, "ssl_method": record.extra.get("ssl_method"),
                  "dataset": bundle.name, "split": split, "num_images": len(yte), "protocol": "knn",
                  "knn_top1": r["top1"], "knn_top5": r["top5"]}
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(out_dir / f"eval-{split}.json", result)
        result["files"] = [str(out_dir / f"eval-{split}.json")]
        result["summary"] = (f"{record.model} ({result['ssl_method']}) on {bundle.name} ({split}, {len(yte)} images): "
                             f"k-NN top-1 {r['top1']:.2f}%  top-5 {r['top5']:.2f}%")
        return result

    def _mean_std(self):
        norm = self.data.eval_transform.transforms[-1]
        return norm.mean, norm.std

    def _plain(self, dataset, transform=None):
        """The training images through the eval transform (for k-NN features), a shallow copy of the dataset."""
        d = copy.copy(dataset)
        d.transform = transform or self.data.eval_transform
        return d


def register_method_task(method: str) -> type[Task]:
    """Register the pre-training task of a registered method, named after it (``vitlab pretrain --method M``):
    its ``Args`` are the views' options and the method's, its monitor the method's."""
    cls = method_class(method)
    task = type(f"{cls.__name__}Task", (PretrainTask,),
                {"method": method, "monitor": cls.monitor, "monitor_mode": cls.monitor_mode,
                 "Args": method_args_class(method), "__doc__": f"Self-supervised pre-training with {cls.__name__}."})
    return register_task(method)(task)


for _method in list_methods():
    register_method_task(_method)


__all__ = ["MultiView", "PretrainTask", "ViewArgs", "effective_rank", "method_args_class", "register_method_task"]
