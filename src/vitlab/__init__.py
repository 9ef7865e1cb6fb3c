"""vitlab: build, train, benchmark, analyse and scale Vision Transformers in PyTorch.

Quick start::

    import vitlab
    vitlab.list_models("deit_*")
    vitlab.list_models(task="segment")              # classify, segment, depth, contrastive
    model = vitlab.create_model("vit_base_patch16_224", num_classes=10)
    vitlab.profile_model("vit_giant_patch14_224")   # params, GMACs, memory, without allocating weights

``import vitlab`` imports nothing else, torch included: each name below is imported on first use (so ``vitlab
--help`` starts in a fraction of a second). The models register when the registry first lists or looks up a name
it does not hold yet: the core families (:mod:`vitlab.models`), then the capabilities' (``vitlab.dense``,
``vitlab.clip``, ...).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ModelConfig", "ModelProfile", "UnknownModelError", "create_model", "get_model_config",
    "is_model", "list_models", "load_checkpoint", "model_tasks", "profile_model", "register_model", "__version__",
]

_SUBMODULES = ("attention", "layers", "models", "optimize", "profile")
_CONVERT = ("CheckpointError", "load_checkpoint")
_PROFILE = ("ModelProfile", "profile_model")
_REGISTRY = ("ModelConfig", "UnknownModelError", "create_model", "get_model_config", "is_model", "list_models",
             "model_tasks", "register_model")


def __getattr__(name: str):
    """The public names, imported on first use (PEP 562); Python then finds a submodule on the package itself."""
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _CONVERT:
        from vitlab import convert as module
    elif name in _PROFILE:
        from vitlab import profile as module
    elif name in _REGISTRY:
        from vitlab import registry as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})
