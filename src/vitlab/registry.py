"""The one model registry: ``register_model``, ``create_model``, ``list_models`` with timm's names and behaviour.

Each registered entrypoint carries a :class:`ModelConfig` record (family, task, paper, default input,
normalisation, published figures, hub id) so tools can reason about a model without building it. The task says
what the model predicts: ``classify`` (image classifiers, the default), ``segment`` and ``depth`` (dense maps),
``contrastive`` (CLIP's image and text embeddings); ``list_models(task=...)`` filters on it.

The core families (:mod:`vitlab.models`) and the capability packages register on the first listing or on a
lookup of a name not yet registered: the registry then imports :mod:`vitlab.models` and every capability's
``model_configs`` module (``vitlab/<capability>/model_configs.py``). ``import vitlab`` imports neither.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import importlib.util
import pkgutil
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from vitlab.convert import load_state_dict, read_checkpoint, resolve_pretrained

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INCEPTION_MEAN = (0.5, 0.5, 0.5)
INCEPTION_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class ModelConfig:
    """What is known about a registered model before it is built."""

    name: str = ""
    family: str = ""
    task: str = "classify"  # what it predicts: classify, segment, depth, contrastive (see the module docstring)
    paper: str = ""
    input_size: tuple[int, int, int] = (3, 224, 224)
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    crop_pct: float = 0.9
    num_classes: int = 1000
    published_params_m: float | None = None
    published_gmacs: float | None = None
    published_top1: float | None = None
    hf_hub_id: str | None = None  # e.g. 'timm/vit_base_patch16_224.augreg2_in21k_ft_in1k'
    # kwargs of create_model that build a small instance of the same architecture (a smaller image, fewer
    # blocks) for the registry-wide smoke tests; they must keep every kind of layer the full model has
    smoke_kwargs: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


class UnknownModelError(ValueError):
    """Raised for a model name that is not registered; the message lists close matches."""


_ENTRYPOINTS: dict[str, Callable[..., nn.Module]] = {}
_CONFIGS: dict[str, ModelConfig] = {}
CONFIGS_MODULE = "model_configs"  # vitlab.<capability>.model_configs registers the capability's models
_discovered = False


def _discover() -> None:
    """Import the core families (``vitlab.models``) and every ``vitlab.<package>.model_configs`` module (once), so
    their models register. Only the packages that have one are imported; the registry names no capability."""
    global _discovered
    if _discovered:
        return
    importlib.import_module(f"{__package__}.models")  # by name, as the capabilities: the families import this module
    for pkg in pkgutil.iter_modules(sys.modules[__package__].__path__):
        spec = importlib.util.find_spec(f"{__package__}.{pkg.name}") if pkg.ispkg else None
        if spec is not None and any(m.name == CONFIGS_MODULE
                                    for m in pkgutil.iter_modules(spec.submodule_search_locations)):
            importlib.import_module(f"{__package__}.{pkg.name}.{CONFIGS_MODULE}")
    _discovered = True


def register_model(fn: Callable[..., nn.Module] | None = None, *, config: ModelConfig | None = None):
    """Register a model entrypoint under its function name (usable bare or with ``config=``)."""

    def _register(f: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        name = f.__name__
        if name in _ENTRYPOINTS:
            raise ValueError(f"model {name!r} is registered twice")
        _ENTRYPOINTS[name] = f
        _CONFIGS[name] = replace(config or ModelConfig(), name=name)
        return f

    return _register(fn) if fn is not None else _register


def model_tasks() -> list[str]:
    """The tasks of the registered models, sorted."""
    _discover()
    return sorted({c.task for c in _CONFIGS.values()})


def list_models(pattern: str | list[str] = "*", exclude: str | list[str] = "",
                task: str | Iterable[str] | None = None) -> list[str]:
    """Registered model names matching an fnmatch ``pattern`` (or any of a list) and, if given, of ``task`` (or
    any of several), sorted. An unknown task raises ``ValueError`` naming the known ones."""
    _discover()
    pats = [pattern] if isinstance(pattern, str) else list(pattern)
    excl = [exclude] if isinstance(exclude, str) and exclude else list(exclude or [])
    names = {n for n in _ENTRYPOINTS for p in pats if fnmatch.fnmatch(n, p)}
    names = {n for n in names if not any(fnmatch.fnmatch(n, e) for e in excl)}
    if task is not None:
        tasks = {task} if isinstance(task, str) else set(task)
        unknown = sorted(tasks - set(model_tasks()))
        if unknown:
            raise ValueError(f"unknown model task {', '.join(map(repr, unknown))}; "
                             f"known tasks: {', '.join(model_tasks())}")
        names = {n for n in names if _CONFIGS[n].task in tasks}
    return sorted(names)


def is_model(name: str) -> bool:
    if name not in _ENTRYPOINTS:
        _discover()
    return name in _ENTRYPOINTS


def _check_name(name: str) -> None:
    if not is_model(name):
        close = difflib.get_close_matches(name, list(_ENTRYPOINTS), n=5, cutoff=0.6)
        hint = f"; close matches: {', '.join(close)}" if close else "; see vitlab.list_models()"
        raise UnknownModelError(f"unknown model {name!r}{hint}")


def get_model_config(name: str) -> ModelConfig:
    _check_name(name)
    return _CONFIGS[name]


def model_entrypoint(name: str) -> Callable[..., nn.Module]:
    _check_name(name)
    return _ENTRYPOINTS[name]


def create_model(
    model_name: str,
    pretrained: bool = False,
    checkpoint_path: str | None = None,
    num_classes: int | None = None,
    img_size: int | tuple[int, int] | None = None,
    in_chans: int | None = None,
    drop_rate: float = 0.0,
    drop_path_rate: float = 0.0,
    global_pool: str | None = None,
    dynamic_img_size: bool = False,
    strict: bool = True,
    **kwargs,
) -> nn.Module:
    """Build a registered model, optionally loading weights (a local checkpoint or, when asked, the hub).

    Arguments left as ``None`` keep the model's defaults. ``checkpoint_path`` accepts our checkpoints and
    timm-format state dicts (``.pth``/``.bin``/``.safetensors``); see :mod:`vitlab.convert`.
    """
    entry = model_entrypoint(model_name)
    for key, value in (("num_classes", num_classes), ("img_size", img_size), ("in_chans", in_chans),
                       ("global_pool", global_pool)):
        if value is not None:
            kwargs[key] = value
    if drop_rate:
        kwargs["drop_rate"] = drop_rate
    if drop_path_rate:
        kwargs["drop_path_rate"] = drop_path_rate
    if dynamic_img_size:
        kwargs["dynamic_img_size"] = True
    sd = path = None
    if checkpoint_path is not None or pretrained:
        path = checkpoint_path if checkpoint_path is not None else resolve_pretrained(
            model_name, get_model_config(model_name).hf_hub_id)
        # read (and check) the checkpoint against a weightless copy first: one of another architecture is refused
        # in a second, before the weights are allocated (27 GB for a 7B model in float32)
        with torch.device("meta"):
            probe = _build(model_name, entry, kwargs)
        sd = read_checkpoint(probe, path)
    model = _build(model_name, entry, kwargs)
    model.pretrained_cfg = get_model_config(model_name)
    if sd is not None:
        load_state_dict(model, sd, strict=strict, source=str(path))
    return model


def _build(model_name: str, entry: Callable[..., nn.Module], kwargs: dict) -> nn.Module:
    """``entry(**kwargs)``, with an argument the model does not take named in one line (``ValueError``)."""
    try:
        return entry(**kwargs)
    except TypeError as e:
        unexpected = re.search(r"unexpected keyword argument '(\w+)'|multiple values for argument '(\w+)'", str(e))
        if unexpected is None:
            raise
        name, fixed = unexpected.group(1) or unexpected.group(2), unexpected.group(2) is not None
        raise ValueError(f"{model_name} does not take {name}" + (" (the model sets it itself)" if fixed else "")) \
            from None
