"""What is exported: a model in eval mode and its :class:`ExportMeta` (the preprocessing a deployed file needs),
built from a registered model name or from a checkpoint written by ``vitlab train``; and the real photos the
exported files are validated on."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn as nn
from torchvision.transforms import v2

import vitlab
from vitlab.data.transforms import channel_stats, eval_transform
from vitlab.registry import IMAGENET_MEAN, IMAGENET_STD

META_KEY = "vitlab"  # the key of the JSON description in an ONNX file's metadata_props / a .pt2's extra files


@dataclass
class ExportMeta:
    """The preprocessing and labels of an exported model, embedded in the file (JSON)."""

    model: str = ""
    img_size: tuple[int, int] = (224, 224)
    in_chans: int = 3
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    crop_pct: float = 0.9
    num_classes: int = 1000
    class_names: list[str] = field(default_factory=list)  # empty: labels are the class indices
    # what the file returns: 'logits' (a classifier) or 'image_embedding' (a CLIP's image tower, unnormalised)
    output: str = "logits"
    dynamic_batch: bool = True
    dynamic_img_size: bool = False
    vitlab_version: str = vitlab.__version__

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ExportMeta:
        d = json.loads(text)
        d["img_size"] = tuple(d["img_size"])
        d["mean"], d["std"] = tuple(d["mean"]), tuple(d["std"])
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def labels(self) -> list[str]:
        return self.class_names or [str(i) for i in range(self.num_classes)]

    def transform(self):
        """vitlab's eval preprocessing for this model (uint8 image in): resize, center-crop, normalise; a
        non-square size is reached by resizing the square crop of its short side."""
        h, w = self.img_size
        tf = eval_transform(min(h, w), crop_pct=self.crop_pct or 1.0, mean=channel_stats(self.mean, self.in_chans),
                            std=channel_stats(self.std, self.in_chans))
        return tf if h == w else v2.Compose([tf, v2.Resize((h, w), antialias=True)])


def _size2(img_size) -> tuple[int, int] | None:
    if img_size is None:
        return None
    h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    if h <= 0 or w <= 0:
        raise ValueError(f"image size must be positive, got {h}x{w}")
    return int(h), int(w)


def load_source(source: str | Path, img_size: int | tuple[int, int] | None = None, dynamic_img_size: bool = False,
                **model_kwargs) -> tuple[nn.Module, ExportMeta]:
    """(model in eval mode, its ExportMeta) from a registered model name (random initial weights) or a run
    directory / checkpoint written by ``vitlab train``. ``img_size``: another fixed input size; a learned position
    embedding is resampled once, here, in eager PyTorch (by the family's checkpoint filter), so the exported graph
    holds it as a constant. ``model_kwargs`` go to :func:`vitlab.create_model` for a model name."""
    size = _size2(img_size)
    extra = {"dynamic_img_size": True} if dynamic_img_size else {}
    if is_model_name(source):
        kw = {**model_kwargs, **extra}
        if size is not None:
            kw["img_size"] = size
        try:
            model = vitlab.create_model(str(source), **kw)
        except (TypeError, ValueError) as e:  # a family without the keyword (e.g. dynamic_img_size), or refusing it
            raise _build_error(str(source), e) from None
        meta = replace(export_meta(model, size), dynamic_img_size=dynamic_img_size)
        return image_model(model)[0].eval(), meta
    path = Path(source)
    from vitlab.convert import load_state_dict
    from vitlab.train.checkpoint import load_weights
    from vitlab.train.task import RunRecord, create_task

    sd, ck = load_weights(path)
    record = RunRecord.from_meta(ck)
    trained = int(record.img_size)
    record.model_kwargs = {**record.model_kwargs, **extra}
    if size is not None:
        record.img_size = size
    try:
        model = create_task(record.task).load(record)  # the run's task rebuilds its model from the record
    except (TypeError, ValueError) as e:
        raise _build_error(ck["model"], e) from None
    load_state_dict(model, sd, source=str(path))  # resamples position embeddings to the new grid
    model, output = image_model(model)
    meta = ExportMeta(model=ck["model"], img_size=size or (trained, trained), in_chans=int(ck["in_chans"]),
                      mean=tuple(ck["mean"]), std=tuple(ck["std"]), crop_pct=ck.get("crop_pct") or 1.0,
                      num_classes=int(ck["num_classes"]), class_names=list(ck.get("class_names") or []),
                      dynamic_img_size=dynamic_img_size, output=output)
    return model.eval(), meta


def is_model_name(source: str | os.PathLike) -> bool:
    """Whether an export source is a registered model name (True) or an existing run / checkpoint path (False);
    for neither, the registry's UnknownModelError, whose message lists the close matches of a misspelt name."""
    if not vitlab.is_model(str(source)) and Path(source).exists():
        return False  # a name wins over a file or folder of the same name in the working directory
    try:
        vitlab.get_model_config(str(source))  # an unregistered name raises, listing the close matches
    except vitlab.UnknownModelError as e:
        raise vitlab.UnknownModelError(f"{e} (nor is {source} a run or checkpoint path)") from None
    return True


def export_meta(model: nn.Module, img_size: int | tuple[int, int] | None = None) -> ExportMeta:
    """The :class:`ExportMeta` of a built model: the one source of the preprocessing an export embeds, whether the
    model comes as a name (``vitlab export NAME``, :func:`load_source`) or as a module.

    The name, normalisation (mean, std) and crop fraction are those of its registry config (``model.pretrained_cfg``,
    a :class:`~vitlab.registry.ModelConfig` set by :func:`vitlab.create_model`); the input size and channels are
    the model's own (its patch embedding's or its ``img_size``: a model built at another size keeps it), else the
    config's; ``img_size`` overrides the size. A module with neither a config nor a size of its own (a bare
    ``nn.Module``) needs ``img_size``: a one-line ValueError otherwise."""
    image, output = image_model(model)
    trunk = getattr(image, "trunk", image)  # a CLIP image tower: its ViT holds the size
    cfg = getattr(model, "pretrained_cfg", None)
    size = _size2(img_size) or _model_img_size(trunk, cfg.input_size[1:] if cfg is not None else None)
    if size is None:
        raise ValueError(f"exporting a {type(model).__name__} (no registry config, no img_size of its own) needs "
                         f"img_size=(H, W) or meta=ExportMeta(...)")
    pe = getattr(trunk, "patch_embed", None)
    if cfg is None:
        meta = ExportMeta(model=type(model).__name__, num_classes=0)
    else:
        meta = ExportMeta(model=cfg.name, in_chans=cfg.input_size[0], mean=tuple(cfg.mean), std=tuple(cfg.std),
                          crop_pct=cfg.crop_pct, num_classes=cfg.num_classes)
    in_chans = getattr(pe, "in_chans", None) or getattr(trunk, "in_chans", None) or meta.in_chans
    return replace(meta, img_size=size, in_chans=int(in_chans), num_classes=_num_classes(image, meta.num_classes),
                   output=output)


def image_model(model: nn.Module) -> tuple[nn.Module, str]:
    """(the module an image goes through, what it returns). A CLIP (Radford et al., 2021) is two towers whose
    ``forward`` takes an image and a text; its deployable image part is the image tower, ``encode_image`` without
    normalisation (what open_clip's ``encode_image`` returns and timm's CLIP image models give with their
    projection head), so that is what is exported. Any other model is exported as it is (logits)."""
    from vitlab.clip.model import CLIP

    if isinstance(model, CLIP):
        return model.visual, "image_embedding"
    return model, "logits"


def _build_error(name: str, e: TypeError | ValueError) -> ValueError:
    if str(e).endswith("does not take dynamic_img_size"):  # create_model's words for a family without it
        return ValueError(f"{name} has no dynamic image size: export it at a fixed --img-size H W")
    if isinstance(e, ValueError):  # the model's own one-line reason, named
        return ValueError(f"{name}: {e}")
    return ValueError(f"{name} cannot be built with these arguments: {e}")


def num_params(name: str, **model_kwargs) -> int:
    """Parameters of a registered model, counted on the meta device (shapes only, no memory)."""
    from vitlab.profile import count_params

    with torch.device("meta"):
        return count_params(vitlab.create_model(name, **model_kwargs))[0]


def smallest_per_family(task: str | tuple[str, ...] = ("classify", "contrastive")) -> list[str]:
    """The registered model with the fewest parameters of each family, sorted, among the models of ``task``
    (default: the classifiers and CLIP, whose image tower exports)."""
    fams: dict[str, list[str]] = {}
    for name in vitlab.list_models(task=task):
        fams.setdefault(vitlab.get_model_config(name).family, []).append(name)
    return sorted(min(names, key=num_params) for names in fams.values())


def too_big_to_export(name: str, **model_kwargs) -> str | None:
    """Why exporting and validating a registered model would not fit in this machine's available memory, or None.
    The peak is about five copies of its fp32 weights (eager, the traced program, the ONNX protobuf, its serialised
    bytes, the ONNX Runtime session)."""
    need = 5 * 4 * num_params(name, **model_kwargs)
    avail = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError):  # Linux: what a new job can take without swapping others out
        meminfo = Path("/proc/meminfo").read_text().split()
        avail = int(meminfo[meminfo.index("MemAvailable:") + 1]) * 1024
    if need <= avail:
        return None
    return f"{name} needs ~{need / 2**30:.0f} GiB to export and validate; {avail / 2**30:.0f} GiB are available"


def _model_img_size(model: nn.Module, default) -> tuple[int, int] | None:
    pe = getattr(model, "patch_embed", None)
    size = getattr(pe, "img_size", None) or getattr(model, "img_size", None) or default
    return _size2(size)


def _num_classes(model: nn.Module, default: int) -> int:
    return int(getattr(model, "num_classes", default))


def real_images(meta: ExportMeta, n: int = 3) -> torch.Tensor:
    """(n, C, H, W) of scikit-image's bundled photos (astronaut, cat, coffee), through ``meta``'s preprocessing."""
    import skimage.data
    from PIL import Image

    from vitlab.data.datasets import to_chans

    photos = [skimage.data.astronaut, skimage.data.chelsea, skimage.data.coffee]
    tf = meta.transform()
    return torch.stack([tf(to_chans(Image.fromarray(photos[i % len(photos)]()), meta.in_chans)) for i in range(n)])
