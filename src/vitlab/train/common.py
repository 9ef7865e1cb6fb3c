"""What every task shares, written once in the engine: mixed-precision contexts, metric sums, model placement,
image data normalised for a model, and the run record's image fields.

A task package (classification, dense, self-supervised, CLIP, a plugin) imports these; none imports another
task's module.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
import torch.nn as nn

import vitlab
from vitlab.data import DataBundle, build
from vitlab.train.config import to_plain
from vitlab.train.task import RunRecord

# create_model kwargs a run sets from its data, never from --model_kwargs
DATA_KWARGS = ("num_classes", "img_size", "in_chans")


def autocast(device: torch.device, amp: str):
    """The autocast context of ``amp`` ('none', 'bf16', 'fp16') on ``device``."""
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def add_sums(acc: dict | None, new: dict) -> dict:
    """Validation sums of one more batch added to ``acc`` (``None``: the first batch)."""
    return dict(new) if acc is None else {k: acc[k] + new[k] for k in acc}


def model_kwargs(cfg) -> dict:
    """``cfg.model_kwargs`` without the keys the data sets (classes, image size, channels)."""
    return {k: v for k, v in cfg.model_kwargs.items() if k not in DATA_KWARGS}


def prepare_model(model: nn.Module, cfg, device: torch.device) -> nn.Module:
    """``model`` on ``device`` as the config asks: activation checkpointing, channels-last memory format."""
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    model.to(device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    return model


def model_in_chans(cfg, model_cfg) -> int:
    return int(cfg.model_kwargs.get("in_chans", model_cfg.input_size[0]))


def build_image_data(cfg, model_cfg) -> DataBundle:
    """The image data bundle of ``cfg.data``, normalised with the model's mean / std; an unset ``img_size`` takes
    ``model_kwargs.img_size`` or the model's input size (``fake`` data: ``fake_img_size``)."""
    data_cfg = cfg.data
    if data_cfg.img_size is None and data_cfg.name != "fake":
        size = cfg.model_kwargs.get("img_size", model_cfg.input_size[-1])
        data_cfg = replace(data_cfg, img_size=int(size))
    return build(data_cfg, mean=model_cfg.mean, std=model_cfg.std, in_chans=model_in_chans(cfg, model_cfg))


def image_record(task: str, cfg, bundle: DataBundle, model_cfg, num_params: int, **extra) -> RunRecord:
    """The run record of an image model trained on ``bundle``: what rebuilds it and its input pipeline."""
    return RunRecord(task=task, model=cfg.model, model_kwargs=model_kwargs(cfg),
                     task_args=to_plain(cfg.task_args), data=bundle.config.to_dict(),
                     num_classes=bundle.num_classes, class_names=list(bundle.class_names),
                     img_size=bundle.img_size, in_chans=bundle.in_chans, mean=list(model_cfg.mean),
                     std=list(model_cfg.std), crop_pct=bundle.config.crop_pct, params=num_params, extra=extra)


def create_image_model(record: RunRecord, **overrides) -> nn.Module:
    """A registered image model as ``record`` describes it (classes, input size, channels, kwargs)."""
    kwargs = {"num_classes": record.num_classes, "img_size": record.img_size, "in_chans": record.in_chans,
              **record.model_kwargs, **overrides}
    return vitlab.create_model(record.model, **kwargs)
