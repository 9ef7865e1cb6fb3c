"""vitlab: build, train, benchmark, analyse and scale Vision Transformers in PyTorch.

Quick start::

    import vitlab
    vitlab.list_models("deit_*")
    vitlab.list_models(task="segment")              # classify, segment, depth, contrastive
    model = vitlab.create_model("vit_base_patch16_224", num_classes=10)
    vitlab.profile_model("vit_giant_patch14_224")   # params, GMACs, memory, without allocating weights

Importing vitlab imports no capability (``vitlab.dense``, ``vitlab.clip``, ...): their models register when the
registry first lists or looks up a name it does not hold yet.
"""

from vitlab import attention, layers, models, optimize, profile  # noqa: F401  (registers models, mechanisms)
from vitlab.convert import CheckpointError, load_checkpoint
from vitlab.profile import ModelProfile, profile_model
from vitlab.registry import (
    ModelConfig,
    UnknownModelError,
    create_model,
    get_model_config,
    is_model,
    list_models,
    model_tasks,
    register_model,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ModelConfig", "ModelProfile", "UnknownModelError", "create_model", "get_model_config",
    "is_model", "list_models", "load_checkpoint", "model_tasks", "profile_model", "register_model", "__version__",
]
