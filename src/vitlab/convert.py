"""Checkpoint loading: our own files and timm-format state dicts, safely.

Reads ``.safetensors`` directly and pickled ``.pth`` / ``.pt`` / ``.bin`` files with ``weights_only=True``
(an untrusted file never runs code); unwraps the usual containers ('state_dict', 'model', 'model_ema',
'module.' prefixes, torch.compile's '_orig_mod.'); lets the model's ``checkpoint_filter_fn`` adapt keys and
shapes (e.g. resample position embeddings); drops a classifier of another size with a warning; and raises one
clear error naming missing or unexpected keys unless ``strict=False``.

Hugging Face ``save_pretrained`` directories are read by :func:`read_hf_config` (``config.json``, refusing one of
another architecture) and :func:`read_hf_state_dict` (``model.safetensors``, ``pytorch_model.bin`` or a sharded
``*.index.json``); each family maps the Hugging Face key names to its own.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

_CONTAINER_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model", "module")
_STRIP_PREFIXES = ("module.", "_orig_mod.")
_HEAD_KEYS = ("head", "head_dist")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into the model, with the reason in one line."""


def unreadable(path: str | os.PathLike, e: Exception, what: str = "checkpoint") -> CheckpointError:
    """The one-line error for a file its reader (safetensors, ``torch.load``) rejected: pickled objects that
    ``weights_only`` refuses, else a truncated or corrupt file, with the reader's first sentence."""
    text = str(e).strip()
    if isinstance(e, pickle.UnpicklingError) and text.startswith("Weights only load failed"):
        return CheckpointError(f"cannot read {what} {path}: it holds pickled objects other than tensors, which are "
                               f"refused (loading them could run code); save its state dict of tensors instead")
    # torch's text runs on for several sentences and lines (how to retry without weights_only): keep the first
    first = text.splitlines()[0].split(". ")[0].rstrip(".")[:200] if text else ""
    return CheckpointError(f"cannot read {what} {path}: the file is truncated or corrupt "
                           f"({type(e).__name__}{': ' + first if first else ''})")


def retie(state_dict: dict[str, torch.Tensor], tied: dict[str, str], source: str | os.PathLike = "checkpoint"
          ) -> dict[str, torch.Tensor]:
    """``state_dict`` with each alias of a tied tensor back (``{alias: name}``, as vitlab's checkpoints record the
    names they write once in the file's ``"tied"`` metadata), holding the tensor of the name it aliases."""
    lost = sorted(name for name in tied.values() if name not in state_dict)
    if lost:
        raise CheckpointError(f"{source} records tied weights of {lost[:4]}, which it does not hold")
    return {**state_dict, **{alias: state_dict[name] for alias, name in tied.items()}}


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file (tied names put back) or of a ``weights_only`` torch file (the
    state dict inside a container such as ``{"model": ...}``, a ``module.`` / ``_orig_mod.`` prefix removed)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    tied = {}
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            from safetensors.torch import load_file

            sd = load_file(str(path))
            with safe_open(str(path), framework="pt") as f:
                tied = json.loads((f.metadata() or {}).get("tied", "{}"))
        else:
            with open(path, "rb") as f:
                head = f.read(4)
            # torch.save writes a zip archive (older torch: a pickle, protocol 2 and up); anything else (a JSON file,
            # an image) would reach the unpickler and read as a file of foreign pickled objects
            if not head.startswith((b"PK\x03\x04", b"\x80")):
                raise CheckpointError(f"{path} is not a weights file: expected a .safetensors file or a torch.save "
                                      f"file of tensors (.pth, .pt, .bin)")
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # a corrupt or foreign file: say which, not a deep traceback
        raise unreadable(path, e) from None
    for key in _CONTAINER_KEYS:
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
            break
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    for prefix in _STRIP_PREFIXES:
        if sd and all(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix):]: v for k, v in sd.items()}
    return retie(sd, tied, path) if tied else sd


def _drop_mismatched_head(sd: dict, model: nn.Module) -> dict:
    """Classifier tensors ('head.*', 'head_dist.*', e.g. 'head.fc.weight') of another size are not loaded."""
    own = model.state_dict()
    bad = [k for k in sd if k.split(".")[0] in _HEAD_KEYS and (k not in own or sd[k].shape != own[k].shape)]
    for k in bad:
        if k.endswith("weight") and sd[k].ndim >= 2:
            ours = own[k].shape[0] if k in own else 0
            warnings.warn(f"checkpoint classifier '{k}' has {sd[k].shape[0]} classes, the model {ours}: "
                          f"it is not loaded", stacklevel=4)
    return {k: v for k, v in sd.items() if k not in bad}


def load_checkpoint(model: nn.Module, path: str | os.PathLike, strict: bool = True) -> nn.Module:
    """Load a checkpoint file into ``model`` (in place) and return the model. A model whose family reads its own
    formats (e.g. a checkpoint directory) has a ``read_checkpoint(path)`` that replaces :func:`read_state_dict`."""
    return load_state_dict(model, read_checkpoint(model, path), strict=strict, source=str(path))


def read_checkpoint(model: nn.Module, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint at ``path`` as ``model`` reads them: its own ``read_checkpoint(path)`` where its
    family reads formats of its own (a directory with a ``config.json`` it checks first), else
    :func:`read_state_dict`. ``model`` may be on the ``meta`` device: only its configuration is consulted."""
    return getattr(model, "read_checkpoint", read_state_dict)(path)


def load_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], strict: bool = True,
                    source: str = "state dict") -> nn.Module:
    """Load a (timm-format or our) state dict into ``model``: remap, check and report as :func:`load_checkpoint`."""
    path = source
    filter_fn = getattr(model, "checkpoint_filter_fn", None)
    if filter_fn is not None:
        try:
            sd = filter_fn(sd, model)
        except CheckpointError as e:  # a conversion that found tensors missing: say which checkpoint
            raise CheckpointError(str(e) if str(e).startswith(path) else f"{path}: {e}") from None
    sd = _drop_mismatched_head(sd, model)
    own = model.state_dict()
    head_keys = {k for k in own if k.split(".")[0] in _HEAD_KEYS}
    missing = [k for k in own if k not in sd and k not in head_keys]
    unexpected = [k for k in sd if k not in own]
    shape_bad = [f"{k} {tuple(sd[k].shape)} vs {tuple(own[k].shape)}" for k in sd
                 if k in own and sd[k].shape != own[k].shape]
    if shape_bad:
        raise CheckpointError(f"{path}: shape mismatch for {', '.join(shape_bad[:5])}"
                              + (f" (+{len(shape_bad) - 5} more)" if len(shape_bad) > 5 else ""))
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:8]}" + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:8]}"
                         + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else ""))
        raise CheckpointError(f"{path} does not match {type(model).__name__}: {'; '.join(parts)} "
                              f"(pass strict=False to load what matches)")
    model.load_state_dict(sd, strict=False)
    return model


def resolve_pretrained(model_name: str, hf_hub_id: str | None) -> str:
    """Download ``model_name``'s published weights (``hf_hub_id``, from its ModelConfig) through huggingface_hub
    (only when asked, and online)."""
    if not hf_hub_id:
        raise CheckpointError(f"no published weights are known for {model_name!r}; "
                              f"pass checkpoint_path=PATH to load a local file")
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:
        raise CheckpointError(f"pretrained=True needs huggingface_hub (pip install huggingface_hub) to fetch "
                              f"{hf_hub_id}; or download it yourself and pass checkpoint_path=PATH") from e
    try:
        return hf_hub_download(hf_hub_id, "model.safetensors")
    except Exception as e:
        raise CheckpointError(f"could not fetch {hf_hub_id} ({type(e).__name__}); offline? pass "
                              f"checkpoint_path=PATH with a local copy of the weights") from e


_HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def config_differences(pairs: dict[str, tuple[Any, ...]], prefix: str = "") -> list[str]:
    """``"{prefix}field theirs (this model mine)"`` (values as ``repr``) for each field of ``pairs`` -- field:
    ``(theirs, mine)``, a checkpoint's ``config.json`` value and the model's -- whose values differ; floats (an eps,
    a RoPE base) agree within a relative 1e-6, as a JSON round trip keeps them. A third element, where given, is
    the caller's own verdict that the two agree (two names of one activation, two indices of one block), used
    instead of comparing the values. The check of each family joins these into one ``ValueError`` line."""
    bad = []
    for field, (theirs, mine, *same) in pairs.items():
        if same:
            agree = same[0]
        elif isinstance(theirs, float) or isinstance(mine, float):
            agree = (isinstance(theirs, (int, float)) and isinstance(mine, (int, float))
                     and math.isclose(theirs, mine, rel_tol=1e-6))
        else:
            agree = theirs == mine
        if not agree:
            bad.append(f"{prefix}{field} {theirs!r} (this model {mine!r})")
    return bad


def _hf_dir(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    return path if path.is_dir() else path.parent


def with_generation_eos(config: dict, path: str | os.PathLike) -> dict:
    """``config`` (a Llama's ``config.json`` fields) with the ``eos_token_id`` of the ``save_pretrained`` directory
    ``path``'s ``generation_config.json`` (one id or several) when that file names one: transformers' ``generate``
    stops there rather than at ``config.json``'s (Llama 3's instruction-tuned checkpoints list several ends
    there)."""
    file = Path(path) / "generation_config.json"
    eos = read_hf_config(file).get("eos_token_id") if file.is_file() else None
    if eos is None:
        return config
    if not (isinstance(eos, int) or isinstance(eos, list) and all(isinstance(i, int) for i in eos)):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return {**config, "eos_token_id": eos}


def read_hf_config(path: str | os.PathLike, architectures: tuple[str, ...] = ()) -> dict:
    """The ``config.json`` of a Hugging Face ``save_pretrained`` directory (``path``: the directory or the file).

    ``architectures``: the accepted class names (``"LlamaForCausalLM"``) and model types (``"llama"``). As
    transformers picks the class by ``model_type``, a config is refused in one line (``ValueError``) when its
    ``model_type`` is not accepted, when its ``architectures`` name no accepted class, or when it has neither.
    Empty: any config."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: expected a Hugging Face save_pretrained directory")
    try:
        cfg = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{file} does not hold a JSON object")
    if architectures:
        named, model_type = list(cfg.get("architectures") or []), cfg.get("model_type")
        ok = set(architectures)
        if (model_type is None and not named) or (model_type is not None and model_type not in ok) or (
                named and not ok & set(named)):
            what = ", ".join(str(a) for a in named + [model_type] if a) or "no architecture"
            raise ValueError(f"{file} describes {what}, not {' / '.join(architectures)}")
    return cfg


def _read_hf_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated shard: name the file in one line
        raise unreadable(file, e, "weights file") from None


def read_hf_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face checkpoint, by its Hugging Face key name.

    ``path``: a ``save_pretrained`` directory (``model.safetensors``, ``pytorch_model.bin``, or a sharded
    ``model.safetensors.index.json`` / ``pytorch_model.bin.index.json`` whose ``weight_map`` names the shards),
    or one of those files. A shard the index names that is missing (``FileNotFoundError``), a truncated or corrupt
    file, or a shard without the tensors the index puts there (:class:`CheckpointError`) is named in one line."""
    path = Path(path)
    folder = _hf_dir(path)
    if path.is_file() and not path.name.endswith(".index.json"):
        return _read_hf_file(path)
    if path.is_file():
        index = path
    else:
        index = next((folder / f"{w}.index.json" for w in _HF_WEIGHTS if (folder / f"{w}.index.json").is_file()), None)
        single = next((folder / w for w in _HF_WEIGHTS if (folder / w).is_file()), None)
        if index is None:
            if single is None:
                raise FileNotFoundError(f"no model.safetensors, pytorch_model.bin or sharded index in {folder}")
            return _read_hf_file(single)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a weights index (a JSON object with a 'weight_map'): "
                              f"{type(e).__name__}") from None
    shards: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        shards.setdefault(shard, []).append(key)
    for shard in shards:  # every shard present before reading any (they can be many GB)
        if not (folder / shard).is_file():
            raise FileNotFoundError(f"shard {folder / shard} named in {index.name} is missing")
    # and every shard of the set named: save_pretrained's "model-00003-of-00005.safetensors" says how many
    # there are, so an index that leaves one out is found here, not as a missing tensor later
    weights = index.name[:-len(".index.json")]
    stem, ext = os.path.splitext(weights)
    for shard in shards:
        m = re.fullmatch(rf"{re.escape(stem)}-(\d+)-of-(\d+){re.escape(ext)}", shard)
        if m:
            width, total = len(m.group(1)), int(m.group(2))
            unnamed = [f"{stem}-{i:0{width}d}-of-{m.group(2)}{ext}" for i in range(1, total + 1)]
            unnamed = [f for f in unnamed if f not in shards]
            if unnamed:
                raise CheckpointError(f"{index} is incomplete: its shard names count {total} shards, but it puts "
                                      f"no tensor in {unnamed[0]}"
                                      + (f" nor in {len(unnamed) - 1} more" if len(unnamed) > 1 else ""))
            break
    sd: dict[str, torch.Tensor] = {}
    for shard, keys in shards.items():
        part = _read_hf_file(folder / shard)
        absent = [k for k in keys if k not in part]
        if absent:
            raise CheckpointError(f"shard {folder / shard} lacks {len(absent)} tensor(s) {index.name} puts there, "
                                  f"e.g. {absent[0]!r}")
        sd.update(part)
    return sd
