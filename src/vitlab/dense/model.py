"""``DenseModel`` (a backbone read at chosen blocks + a decoder), :func:`create` (a registered head over any
registered backbone, or a registered end-to-end configuration by name) and views of the one model registry.

The end-to-end configurations (``dpt_vit_base_patch16_384`` ...) are models of :mod:`vitlab.registry` with task
``segment`` or ``depth``, registered in :mod:`vitlab.dense.model_configs`: ``vitlab.create_model`` builds them and
``vitlab models`` lists them. :func:`list_models` and :func:`get_config` are that registry filtered on those tasks.
The heads come from the head registry of :mod:`vitlab.dense.heads` (``@register_head``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import vitlab
from vitlab.convert import load_state_dict, read_state_dict
from vitlab.dense.backbone import feature_specs, is_plain, num_levels
from vitlab.dense.dpt import convert_hf_state_dict
from vitlab.dense.heads import TASKS, HeadContext, get_head, list_heads
from vitlab.registry import ModelConfig, UnknownModelError


def _four(n: int) -> list[int]:
    """Four evenly spaced blocks ending with the last (12 blocks: 2, 5, 8, 11; 24: 5, 11, 17, 23)."""
    return [n // 4 * (i + 1) - 1 for i in range(4)]


def _has_prefix(backbone: nn.Module) -> bool:
    """A plain ViT with prefix ([CLS], distillation, register) tokens."""
    return is_plain(backbone) and getattr(backbone, "num_prefix_tokens", 0) > 0


class DenseModel(nn.Module):
    """``forward(x) -> (B, K, H, W)`` class logits (segment) or (B, 1, H, W) depth (depth) at the input's size.

    ``backbone``: a vitlab model read through ``forward_intermediates`` at ``indices`` (``norm``: its final norm
    applied to each map), or wrapped by ``adapter`` (ViT-Adapter); ``head``: a decoder of :mod:`vitlab.dense.heads`,
    called ``head(maps)``, or ``head(maps, prefix)`` when ``prefix_tokens`` (prefix: the backbone's prefix tokens at
    each block, or None for a backbone without them)."""

    def __init__(self, backbone: nn.Module, head: nn.Module, indices: list[int], norm: bool, task: str,
                 num_classes: int, adapter: nn.Module | None = None, prefix_tokens: bool = False):
        super().__init__()
        # the decoder is not called ``head``: vitlab.convert treats 'head.*' keys as a replaceable classifier
        self.backbone, self.decoder, self.adapter = backbone, head, adapter
        self.indices, self.norm, self.task, self.num_classes = list(indices), norm, task, num_classes
        self.prefix_tokens = prefix_tokens
        self.prefix = prefix_tokens and _has_prefix(backbone)  # read them only for a head that takes them
        # parts of the classifier the dense forward never runs: dropped, so no parameter lacks a gradient (DDP)
        if hasattr(backbone, "fc_norm"):
            backbone.fc_norm = nn.Identity()
        if (adapter is not None or not norm) and hasattr(backbone, "norm"):
            backbone.norm = nn.Identity()
        self.grad_checkpointing = False

    def features(self, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(NCHW maps, the prefix tokens of each or None): what the head reads."""
        if self.adapter is not None:
            return self.adapter(x), None
        kw = dict(indices=self.indices, norm=self.norm, intermediates_only=True)
        if self.prefix:
            out = self.backbone.forward_intermediates(x, return_prefix_tokens=True, **kw)
            return [m for m, _ in out], [p for _, p in out]
        return list(self.backbone.forward_intermediates(x, **kw)), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        maps, prefix = self.features(x)
        y = self.decoder(maps, prefix) if self.prefix_tokens else self.decoder(maps)
        if tuple(y.shape[-2:]) != tuple(x.shape[-2:]):
            y = F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return y

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable
        self.backbone.set_grad_checkpointing(enable)

    def shard_units(self) -> list[nn.Module]:
        """FSDP units: the backbone's blocks (or stages), then the decoder."""
        from vitlab.train.strategy import shard_units

        return [*shard_units(self.backbone), self.decoder]

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        fn = getattr(self.backbone, "no_weight_decay", None)
        return {f"backbone.{n}" for n in fn()} if callable(fn) else set()

    def checkpoint_filter_fn(self, sd: dict, model: nn.Module) -> dict:
        """Hugging Face DPT state dicts -> our keys; the backbone's own filter (position-embedding resampling)."""
        sd = convert_hf_state_dict(sd)
        if not any(k.startswith("dpt.") for k in sd) and hasattr(self.backbone, "checkpoint_filter_fn"):
            bb = {k[len("backbone."):]: v for k, v in sd.items() if k.startswith("backbone.")}
            bb = self.backbone.checkpoint_filter_fn(bb, self.backbone)
            sd = {**{k: v for k, v in sd.items() if not k.startswith("backbone.")},
                  **{f"backbone.{k}": v for k, v in bb.items()}}
        own = self.state_dict()
        unused = ("backbone.norm.", "backbone.fc_norm.", "backbone.head.")
        return {k: v for k, v in sd.items() if k in own or not k.startswith(unused)}


def create(head: str, backbone: str = "vit_base_patch16_224", num_classes: int | None = None, task: str | None = None,
           img_size: int | None = None, in_chans: int = 3, indices: list[int] | None = None,
           backbone_kwargs: dict | None = None, head_kwargs: dict | None = None, checkpoint_path: str | None = None,
           backbone_checkpoint: str | None = None, drop_path_rate: float = 0.0, strict: bool = True) -> DenseModel:
    """Build a dense model: a registered ``head`` (:func:`vitlab.dense.heads.list_heads`) over any registered
    ``backbone`` (plain or hierarchical), or a registered configuration by name
    (``create('dpt_vit_base_patch16_384')``, the same as ``vitlab.create_model``; ``backbone`` is then the
    configuration's and the other arguments override its own).

    ``task``: ``segment`` or ``depth`` (default: the head's first). ``indices``: the blocks / stages the head reads
    (default: the head's: the last block; four evenly spaced for SETR-MLA and DPT; all four stages of a
    hierarchical backbone). ``backbone_checkpoint``: classifier weights for the backbone (timm / vitlab file);
    ``checkpoint_path``: weights of the whole dense model (ours, or a Hugging Face DPT state dict). ``head_kwargs``:
    the decoder's options (e.g. ``readout='add'``, ``window_size=14``, ``global_blocks=[2, 5, 8, 11]`` for ViTDet,
    ``interactions`` for ViT-Adapter)."""
    if head not in list_heads():
        if head not in list_models():
            raise ValueError(f"unknown dense head or model {head!r}; heads: {', '.join(list_heads())}; "
                             f"models: {', '.join(list_models())}")
        given = dict(num_classes=num_classes, task=task, img_size=img_size, indices=indices,
                     backbone_kwargs=backbone_kwargs, head_kwargs=head_kwargs, backbone_checkpoint=backbone_checkpoint)
        return vitlab.create_model(head, checkpoint_path=checkpoint_path, strict=strict, in_chans=in_chans,
                                   drop_path_rate=drop_path_rate, **{k: v for k, v in given.items() if v is not None})
    spec = get_head(head)
    task = task or spec.tasks[0]
    num_classes = 150 if num_classes is None else num_classes
    if task not in TASKS:
        raise ValueError(f"unknown dense task {task!r}; choose from {', '.join(TASKS)}")
    if task not in spec.tasks:
        raise ValueError(f"head {head!r} does not predict {task}; {task} heads: {', '.join(list_heads(task))}")
    if task == "segment" and num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    bk = {**spec.backbone_kwargs, **(backbone_kwargs or {})}
    if img_size is not None:
        bk["img_size"] = img_size
    bb = vitlab.create_model(backbone, num_classes=0, in_chans=in_chans, drop_path_rate=drop_path_rate,
                             checkpoint_path=backbone_checkpoint, strict=False if backbone_checkpoint else True, **bk)
    plain = is_plain(bb)
    n = num_levels(bb)
    if indices is None:
        indices = (_four(n) if plain else list(range(n))) if spec.multi_level else [n - 1]
    indices = [i % n for i in indices]
    ch_st = feature_specs(bb, indices)
    K = num_classes if task == "segment" else 1
    ctx = HeadContext(backbone=bb, in_channels=[c for c, _ in ch_st], strides=[s for _, s in ch_st], num_classes=K,
                      task=task, in_chans=in_chans, has_prefix=_has_prefix(bb))
    dec = spec.make(ctx, dict(head_kwargs or {}))
    model = DenseModel(bb, dec.head, indices, spec.norm, task, K, dec.adapter, spec.prefix_tokens)
    model.pretrained_cfg = ModelConfig(name=f"{head}_{backbone}", family="dense", task=task, input_size=(
        in_chans, *(bb.patch_embed.img_size if hasattr(bb, "patch_embed") else (224, 224))),
        mean=bb.pretrained_cfg.mean, std=bb.pretrained_cfg.std, num_classes=K)
    if checkpoint_path is not None:
        load_state_dict(model, read_state_dict(checkpoint_path), strict=strict, source=str(checkpoint_path))
    return model


def list_models(pattern: str | list[str] = "*") -> list[str]:
    """The registered dense configurations (tasks ``segment`` and ``depth``) matching an fnmatch ``pattern`` (or
    any of a list), sorted."""
    return vitlab.list_models(pattern, task=TASKS)


def get_config(name: str) -> ModelConfig:
    """The :class:`~vitlab.registry.ModelConfig` of a registered dense configuration."""
    cfg = vitlab.get_model_config(name)
    if cfg.task not in TASKS:
        raise UnknownModelError(f"{name!r} is a {cfg.task} model, not a dense configuration; "
                                f"see vitlab.dense.list_models()")
    return cfg
