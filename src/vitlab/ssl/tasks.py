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

import math
import typing
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torchvision.transforms import v2

import vitlab
from vitlab.ssl import create, create_backbone
from vitlab.ssl.mae import MAE, images_of, reconstruction_png
from vitlab.ssl.methods import DINO, pooled_features
from vitlab.train import checkpoint as ck
from vitlab.train.classification import build_data, model_description
from vitlab.train.config import coerce
from vitlab.train.progress import say
from vitlab.train.task import register_task


@dataclass
class ViewArgs:
    """The augmentation options of ``task_args`` (the rest go to the method, see ``vitlab.ssl.create``)."""

    global_scale: tuple[float, float] = (0.25, 1.0)  # RandomResizedCrop scale of the two global views
    local_crops: int = 6                             # DINO / DINOv2: local views per image
    local_crop_size: int | None = None               # pixels; None -> 3/7 of the image size (96 of 224)
    local_scale: tuple[float, float] = (0.05, 0.25)  # RandomResizedCrop scale of the local views
    jitter: float = 0.4                              # brightness / contrast jitter strength (0 = off)
    jitter_p: float = 0.8                            # probability of the jitter
    blur_p: float = 0.0                              # probability of a Gaussian blur (DINO: 1.0 / 0.1 / 0.5)


def split_task_args(args: dict) -> tuple[ViewArgs, dict]:
    """(the view options, typed, the method's options): ``task_args`` split in two; a value that is not of its
    field's type is a one-line ValueError."""
    hints = typing.get_type_hints(ViewArgs)
    views = {}
    for k, v in args.items():
        if k in hints:
            v = coerce(str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v, hints[k], k)
            if typing.get_origin(hints[k]) is tuple:
                v = tuple(float(x) for x in v)
            views[k] = v
    return ViewArgs(**views), {k: v for k, v in args.items() if k not in hints}


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


class PretrainTask:
    """The shared task; each registered subclass names its ``method``."""

    method = ""
    monitor = "effective_rank"

    def build(self, cfg, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        views, method_args = split_task_args(dict(cfg.task_args))
        self.views = views
        model_cfg = vitlab.get_model_config(cfg.model)
        self.data = build_data(cfg, model_cfg)
        b = self.data
        kwargs = {k: v for k, v in cfg.model_kwargs.items() if k not in ("num_classes", "img_size", "in_chans")}
        backbone = create_backbone(self.method, cfg.model, img_size=b.img_size, in_chans=b.in_chans,
                                   drop_path_rate=cfg.drop_path, **kwargs)
        self.module = create(self.method, backbone, **method_args).to(device)
        self.model = self.module.model
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self._set_views(b, model_cfg)
        desc = model_description(cfg, b, model_cfg, self.num_params)
        self._description = {**desc, "num_classes": 0, "class_names": [], "ssl_method": self.method,
                             "model_kwargs": {**desc["model_kwargs"],
                                              **({"dynamic_img_size": True}
                                                 if getattr(self.model, "dynamic_img_size", False) else {})}}

    def _set_views(self, b, model_cfg) -> None:
        a = self.views
        mean, std = self._mean_std()
        hflip = b.config.hflip
        train = b.train
        if not hasattr(train, "transform"):
            raise ValueError(f"dataset {b.name} does not expose a transform to make views from")
        if isinstance(self.module, MAE):  # one view: RandomResizedCrop + flip only (MAE, appendix A.1)
            train.transform = MultiView(b.img_size, mean, std, replace(a, jitter=0.0, blur_p=0.0), hflip, 1).global_t
            return
        n_local, local = 0, None
        if isinstance(self.module, DINO) and a.local_crops > 0:
            local = a.local_crop_size or max(1, round(b.img_size * 3 / 7))
            patch = getattr(getattr(self.model, "patch_embed", None), "patch_size", (1, 1))[0]
            if local < patch or local % patch:
                raise ValueError(f"local_crop_size {local} px is too few pixels for {self.cfg.model}: it needs a "
                                 f"multiple of its {patch}-pixel patch (at least one patch)")
            try:
                with torch.no_grad():
                    pooled_features(self.model.eval(), torch.zeros(2, b.in_chans, local, local, device=self.device))
            except (RuntimeError, ValueError) as e:
                raise ValueError(f"{self.cfg.model} cannot take {local}-pixel local crops ({str(e).splitlines()[0]}); "
                                 f"set --task_args.local_crops 0") from None
            finally:
                self.model.train()
            n_local = a.local_crops
        train.transform = MultiView(b.img_size, mean, std, a, hflip, 2, n_local, local)

    def param_groups(self, weight_decay: float) -> list[dict]:
        from vitlab.train.recipe import param_groups

        extras = [m for name, m in self.module.named_children() if name != "model"]
        return param_groups(self.model, weight_decay, extra=extras)

    def _views(self, batch):
        x = batch[0]
        if isinstance(x, (list, tuple)):
            return [v.to(self.device, non_blocking=True) for v in x]
        return x.to(self.device, non_blocking=True)

    def training_step(self, batch, forward):
        out = forward(self._views(batch))
        return out["loss"], {k: v.detach() for k, v in out.items() if k != "loss" and v.ndim == 0}

    def before_optimizer_step(self) -> None:
        if hasattr(self.module, "before_optimizer_step"):  # DINO / DINOv2: freeze_last_layer
            self.module.before_optimizer_step()

    def after_step(self, step: int, total_steps: int, steps_per_epoch: int) -> None:
        if hasattr(self.module, "after_step"):  # MAE has no schedule of its own
            self.module.after_step(step, total_steps, steps_per_epoch)

    # ---- collapse monitors -----------------------------------------------------------------------------
    def validation_step(self, batch, forward) -> dict[str, torch.Tensor]:
        x = images_of(batch).to(self.device)
        n = x.shape[0]
        if isinstance(self.module, MAE):
            g = torch.Generator(device=x.device).manual_seed(0)  # the same masks every validation
            noise = torch.rand(n, self.module.grid[0] * self.module.grid[1], device=x.device, generator=g)
            out = forward(x, noise=noise, monitor=True)
        else:
            out = forward(x, monitor=True)
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

    def description(self) -> dict:
        return self._description

    def summary(self) -> dict:
        b = self.data
        return {"model": self.cfg.model, "method": self.method, "dataset": b.name, "params_m": self.num_params / 1e6,
                "img_size": b.img_size, "train_images": len(b.train), "val_images": len(b.val)}

    def test(self, run_dir, batch_size: int, checkpoint: str = "last") -> dict:
        """k-NN top-1 (DINO's protocol) of the checkpoint's backbone on the test split, and for MAE a
        reconstruction grid (``reconstructions.png``) of the first validation images. Rebuilt from the checkpoint,
        so a sharded run is scored the same."""
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
        if isinstance(self.module, MAE) and "decoder" in state:  # the decoder trains beside the backbone
            mae = MAE(model, self.module.mask_ratio, norm_pix_loss=self.module.norm_pix_loss,
                      **self.module.decoder.config).to(self.device).eval()
            mae.decoder.load_state_dict(state["decoder"])
            x = images_of(next(iter(self.data.loader("val", 8)))).to(self.device)
            rec, mask = mae.reconstruct(x)
            mean, std = self._mean_std()
            ck.atomic_write(run_dir / "reconstructions.png", reconstruction_png(x, rec, mask, mean, std))
        return out

    def _mean_std(self):
        norm = self.data.eval_transform.transforms[-1]
        return norm.mean, norm.std

    def _plain(self, dataset):
        """The training images through the eval transform (for k-NN features), a shallow copy of the dataset."""
        import copy

        d = copy.copy(dataset)
        d.transform = self.data.eval_transform
        return d


@register_task("mae")
class MAETask(PretrainTask):
    method = "mae"
    monitor = "loss"
    monitor_mode = "min"  # the masked-patch reconstruction loss on validation images (fixed masks)


for _method in ("simclr", "mocov3", "dino", "dinov2"):  # the joint-embedding methods: one task each
    register_task(_method)(type(f"{_method.upper()}Task", (PretrainTask,), {"method": _method}))


__all__ = ["MultiView", "PretrainTask", "ViewArgs", "effective_rank"]
