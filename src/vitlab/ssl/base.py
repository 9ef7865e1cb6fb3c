"""The contract of a self-supervised method and its open registry.

A method is a subclass of :class:`SSLMethod` (an ``nn.Module``) registered with ``@register_method(name)`` and
built as ``cls(backbone, **options)``; ``model`` is the backbone, every other child module (heads, decoder,
teacher, centres) trains beside it. The class declares the views it trains on (:class:`ViewSpec`, a class
attribute) and the validation metric that picks its best checkpoint. ``forward(views)`` takes the list of views
of a batch and returns a dict with ``loss``; ``forward(images, monitor=True)`` returns at least ``features``,
what the collapse monitors read. The hooks of the training loop (``before_optimizer_step``, ``after_step``) and
the files a finished run writes (``artifacts``) are methods with no-op defaults.

:func:`default_local_crop_size` gives multi-crop's local views (Caron et al., 2021, "Emerging Properties in
Self-Supervised Vision Transformers", section 3.1: 96-pixel local crops of 224-pixel images) a whole number of
the backbone's patches.
"""

from __future__ import annotations

import difflib
import inspect
import sys
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch.nn as nn
from torch import Tensor


@dataclass(frozen=True)
class ViewSpec:
    """The views of an image a method trains on (the pre-training task makes them): ``global_views`` crops at the
    image size; with ``local_crops``, small local crops after them (multi-crop); with ``plain``, a crop and a
    flip only, without colour jitter or blur (MAE, He et al., 2022, appendix A.1)."""

    global_views: int = 2
    local_crops: bool = False
    plain: bool = False

    def __post_init__(self):
        if self.global_views < 1:
            raise ValueError(f"a method trains on at least one global view, got global_views={self.global_views}")


def pooled_features(backbone: nn.Module, x: Tensor) -> Tensor:
    """The backbone's image embedding (its pre-logits: class token or pooled tokens after the final norm)."""
    return backbone.forward_head(backbone.forward_features(x), pre_logits=True)


def images_of(batch: list[Tensor] | tuple | Tensor) -> Tensor:
    """The image tensor of a batch: a tensor, the first of a list of views, or the images of an (images, labels)
    pair."""
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):
        return batch[0]
    raise ValueError("expected a batch of images (B, C, H, W), a list of views or an (images, labels) pair")


def views_of(batch: list[Tensor] | tuple) -> list[Tensor]:
    """The list of views of a batch: ``[v1, v2, ...]`` or ``([v1, v2, ...], labels)`` from a multi-view loader;
    a one-line ValueError with fewer than two."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], (tuple, list)):
        batch = batch[0]
    if not isinstance(batch, (tuple, list)) or len(batch) < 2 or not all(isinstance(v, Tensor) for v in batch):
        raise ValueError("this method takes a list of at least two views of the batch: [view1, view2, ...]")
    return list(batch)


class SSLMethod(nn.Module):
    """Base of the self-supervised methods: ``model`` is the backbone (the run's output weights).

    A subclass implements ``objective(views)`` (or overrides ``forward``) and declares ``views``; ``monitor`` /
    ``monitor_mode`` name the validation metric of the pre-training task that picks the best checkpoint
    (``effective_rank``, ``feature_std``, ``loss``, ``teacher_entropy`` or ``teacher_student_kl``)."""

    views: ClassVar[ViewSpec] = ViewSpec()
    monitor: ClassVar[str] = "effective_rank"
    monitor_mode: ClassVar[Literal["max", "min"]] = "max"

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.model = backbone

    def forward(self, views: list[Tensor], monitor: bool = False) -> dict[str, Tensor]:
        """The method's loss (and logs) on a list of views of a batch; ``monitor=True``: what the collapse monitors
        read from a batch of plain images (``features``, and ``loss``, ``teacher_entropy``, ``teacher_student_kl``
        where the method has them), through ``forward`` so that a sharded module gathers its weights."""
        return self.monitor_outputs(images_of(views)) if monitor else self.objective(views)

    def objective(self, views: list[Tensor]) -> dict[str, Tensor]:
        raise NotImplementedError(f"{type(self).__name__} defines neither objective() nor forward()")

    def features(self, images: Tensor) -> Tensor:
        return pooled_features(self.model, images)

    def monitor_outputs(self, images: Tensor) -> dict[str, Tensor]:
        return {"features": self.features(images)}

    def before_optimizer_step(self) -> None:
        """Called after backward (and gradient clipping), before the optimiser step; nothing by default."""

    def after_step(self, step: int, total_steps: int, steps_per_epoch: int) -> None:
        """Called after optimiser step ``step`` (0-based) of ``total_steps``: EMA teachers, schedules; nothing by
        default."""

    def shard_units(self) -> list[nn.Module]:
        """The submodules FSDP wraps one by one: the backbone's."""
        from vitlab.train.strategy import shard_units

        return shard_units(self.model)

    def artifacts(self, images: Tensor, mean, std) -> dict[str, bytes]:
        """Files a finished run writes to its directory (name -> bytes), from a batch of normalised validation
        images and the normalisation's ``mean`` / ``std``, on a module in eval mode; none by default."""
        return {}


_METHODS: dict[str, type[SSLMethod]] = {}


def register_method(name: str):
    """Class decorator: register an :class:`SSLMethod` subclass as ``name`` (built as ``cls(backbone, **options)``
    by :func:`create`)."""

    def register(cls: type[SSLMethod]) -> type[SSLMethod]:
        if not (isinstance(cls, type) and issubclass(cls, SSLMethod)):
            raise TypeError(f"@register_method({name!r}) takes a subclass of vitlab.ssl.SSLMethod, got {cls!r}")
        if not isinstance(cls.views, ViewSpec):
            raise TypeError(f"{cls.__name__}.views must be a vitlab.ssl.ViewSpec, got {cls.views!r}")
        if name in _METHODS:
            raise ValueError(f"self-supervised method {name!r} is registered twice")
        _METHODS[name] = cls
        tasks = sys.modules.get("vitlab.ssl.tasks")
        if tasks is not None:  # the pre-training tasks are loaded already: the new method gets its task now
            tasks.register_method_task(name)
        return cls

    return register


def list_methods() -> list[str]:
    """The registered method names, in registration order (the built-in ones first), plugins included."""
    from vitlab.plugins import load_plugins

    load_plugins()
    return list(_METHODS)


def method_class(name: str) -> type[SSLMethod]:
    """The class registered as ``name``; an unknown name is a one-line ValueError with close matches."""
    if name not in _METHODS:
        names = list_methods()
        if name not in _METHODS:
            close = difflib.get_close_matches(str(name), names, n=3)
            hint = f"; close matches: {', '.join(close)}" if close else ""
            raise ValueError(f"unknown self-supervised method {name!r}{hint} (choose from {', '.join(names)})")
    return _METHODS[name]


def method_parameters(name: str) -> list[inspect.Parameter]:
    """The options :func:`create` takes for ``name``, as ``inspect.Parameter`` (name, default, annotation resolved
    to a type): the keyword parameters of its class's ``__init__`` after the backbone, then those of its base
    classes' while an ``__init__`` passes ``**kwargs`` on (a name once, the subclass's own first)."""
    params: dict[str, inspect.Parameter] = {}
    for klass in method_class(name).__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            hints = typing.get_type_hints(init)
        except NameError:  # an annotation naming what its module cannot see: kept as written
            hints = {}
        own = list(inspect.signature(init).parameters.values())[2:]  # self, backbone
        for p in own:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in params:
                params[p.name] = p.replace(annotation=hints.get(p.name, p.annotation))
        if not any(p.kind is p.VAR_KEYWORD for p in own):
            break
    return list(params.values())


def method_options(name: str) -> list[str]:
    """The names of the options :func:`create` takes for ``name``, sorted (see :func:`method_parameters`)."""
    return sorted(p.name for p in method_parameters(name))


def create_backbone(method: str, name: str, **kwargs) -> nn.Module:
    """A registered model without classifier (``num_classes=0``) for ``method``; a method with local crops gets a
    model that takes their size too (``dynamic_img_size=True``) when its family has that option."""
    import vitlab

    kwargs = {"num_classes": 0, **kwargs}
    if method_class(method).views.local_crops and "dynamic_img_size" not in kwargs:
        try:
            return vitlab.create_model(name, dynamic_img_size=True, **kwargs)
        except (TypeError, ValueError):  # PVT and LITv2 take any size already; Swin takes one size
            pass
    return vitlab.create_model(name, **kwargs)


def create(method: str, backbone: str | nn.Module, backbone_kwargs: dict | None = None, **kwargs) -> SSLMethod:
    """The registered self-supervised ``method`` around ``backbone`` (a registered model name, built headless with
    ``backbone_kwargs``, or a module). ``kwargs`` are the method's options (e.g. ``mask_ratio=0.75`` for MAE,
    ``out_dim`` for DINO); an unknown one is a one-line ValueError naming those it takes."""
    cls = method_class(method)
    allowed = method_options(method)
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) for {method}: {', '.join(unknown)}; it takes {', '.join(allowed)}")
    if isinstance(backbone, str):
        backbone = create_backbone(method, backbone, **(backbone_kwargs or {}))
    return cls(backbone, **kwargs)


def default_local_crop_size(img_size: int, patch: int) -> int:
    """Multi-crop's local-crop size in pixels for ``img_size``-pixel images and a backbone of ``patch``-pixel
    patches: 3/7 of the image (DINO's 96 of 224) rounded to a whole number of patches, at least one (16 of 32 for
    8-pixel patches; DINOv2's 98 of 224 for 14-pixel patches)."""
    if img_size < 1 or patch < 1:
        raise ValueError(f"image size and patch size must be positive, got {img_size} and {patch}")
    return patch * max(1, round(img_size * 3 / (7 * patch)))


__all__ = ["SSLMethod", "ViewSpec", "create", "create_backbone", "default_local_crop_size", "images_of",
           "list_methods", "method_class", "method_options", "method_parameters", "pooled_features", "register_method",
           "views_of"]
