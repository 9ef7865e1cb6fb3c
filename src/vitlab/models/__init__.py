"""Model families, one a file; importing this package imports every family module, which registers its
models (a new ``models/<family>.py`` is picked up without editing this file)."""

import importlib
import pkgutil

for _mod in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_mod.name}")

from vitlab.models.halvit import HaLViT  # noqa: E402
from vitlab.models.vision_transformer import VisionTransformer  # noqa: E402

__all__ = ["HaLViT", "VisionTransformer"]
