"""Checkpoints that survive crashes, copies and tied weights.

A checkpoint is a directory ``RUN/checkpoints/<name>/`` (``epoch-NNNN``, ``step-NNNNNNNN``) holding

- ``model.safetensors``: the raw weights, with the model's description in the safetensors metadata (model name,
  kwargs, classes, input size, normalisation), so the file alone is enough for ``vitlab eval`` / ``predict``;
- ``ema.safetensors``: the EMA weights (when EMA is on);
- ``trainer.pt``: optimiser, scheduler, GradScaler, epoch, step, best metric and every RNG state (read back with
  ``torch.load(weights_only=True)``);
- ``meta.json``: the same description plus the epoch's metrics, the step, and which weights (raw or EMA) are
  preferred.

The run's own record of its checkpoints is ``RUN/checkpoints.json`` (``{"last": name, "best": name}``);
``RUN/last`` and ``RUN/best`` are relative symbolic links to the same directories, for people and tools. A save
writes everything into a temporary directory (each file fsynced), renames it into place, rewrites the record
atomically (the commit), then swaps the links with ``os.replace`` and removes the checkpoints no longer kept. A
process killed at any moment leaves the record naming a complete checkpoint: the previous one, or the new one once
the record is written. Resuming reads the record, not the links, so a run directory copied with its links turned
into directories (``shutil.copytree``, ``cp -rL``, a sync tool) resumes; without a record (a copy that lost it) the
newest complete checkpoint by step is taken. Orphaned temporary directories are removed by the next save.

Tied weights (an output head sharing the token embedding's matrix, as in BERT's and BLIP's text decoders, Li et
al., 2022, Sec. 3.1, and Llama variants with ``tie_word_embeddings``) appear in ``state_dict()`` under two names
for one tensor; safetensors stores no memory twice, so each tensor is written once under its first name and the
other names are recorded in the file's metadata (``"tied": {alias: name}``). Reading puts them back
(:func:`vitlab.convert.read_state_dict`, behind :func:`load_weights` and ``create_model(checkpoint_path=)``);
``safetensors.torch.load_model`` reads such a file too. Loading copies into the model's parameters, so a model
built with the tie keeps it.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from vitlab._io import atomic_write, fsync_dir, make_temp_dir
from vitlab.convert import CheckpointError, read_state_dict, unreadable

WEIGHTS = "model.safetensors"
EMA_WEIGHTS = "ema.safetensors"
TRAINER = "trainer.pt"
META = "meta.json"
CKPT_DIR = "checkpoints"
RECORD = "checkpoints.json"
LINKS = ("last", "best")


# ---------------------------------------------------------------- atomic files


def _write_file(path: Path, data: bytes) -> None:
    """Write and fsync (inside a temporary checkpoint directory: the directory rename is the commit)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _point(link: Path, target: str) -> None:
    """Make ``link`` a relative symbolic link to ``target`` with one ``os.replace`` (atomic on POSIX). A directory
    in its place (a run copied with its links turned into directories) is moved aside first, removed after."""
    for leftover in link.parent.glob(f".{link.name}.*.tmp"):  # of a process killed here before
        _remove(leftover)
    tmp = link.parent / f".{link.name}.{os.getpid()}.tmp"
    os.symlink(target, tmp)
    aside = None
    if link.is_dir() and not link.is_symlink():
        aside = make_temp_dir(link.parent, prefix=f".{link.name}.", suffix=".tmp")
        os.replace(link, aside / link.name)
    os.replace(tmp, link)
    fsync_dir(link.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


# ---------------------------------------------------------------- RNG states


def rng_state() -> dict:
    """Every RNG a training step draws from, in types ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- tied tensors


def untie(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the tensors to write, each memory once; {alias: the name it is written under}). Names that hold the very
    same view of one storage (tied parameters) become aliases of the first such name; a tensor that shares a
    storage with another in another view (part of it) gets its own copy."""
    first: dict[tuple, str] = {}
    storages: set[tuple] = set()
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    for k, v in state_dict.items():
        v = v.detach()
        if v.numel() == 0 or v.device.type == "meta":
            tensors[k] = v
            continue
        storage = (v.device, v.untyped_storage().data_ptr())
        view = (*storage, v.storage_offset(), v.dtype, tuple(v.shape), v.stride())
        if view in first:
            tied[k] = first[view]
            continue
        first[view] = k
        tensors[k] = v.clone() if storage in storages else v
        storages.add(storage)
    return tensors, tied



# ---------------------------------------------------------------- the record of a run's checkpoints


def _link_target(link: Path) -> str | None:
    return Path(os.readlink(link)).name if link.is_symlink() else None


def _record(run_dir: Path) -> dict[str, str]:
    """{'last': name, 'best': name} of ``RUN/checkpoints.json``; a run saved before the record existed: the names
    its links point to."""
    try:
        rec = json.loads((run_dir / RECORD).read_text())
    except (OSError, ValueError):
        rec = None
    if not isinstance(rec, dict):
        rec = {ln: _link_target(run_dir / ln) for ln in LINKS}
    return {k: v for k, v in rec.items() if k in LINKS and isinstance(v, str) and v and Path(v).name == v}


def _complete(d: Path) -> bool:
    return all((d / f).is_file() for f in (WEIGHTS, TRAINER, META))


def _position(d: Path) -> tuple[int, int, int] | None:
    """(step, epochs done, mtime) of complete checkpoint directory ``d``, from its meta.json; None otherwise."""
    if not _complete(d):
        return None
    try:
        meta = json.loads((d / META).read_text())
        return int(meta.get("step", 0)), int(meta.get("epoch", 0)), (d / META).stat().st_mtime_ns
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _checkpoints(root: Path) -> list[Path]:
    """The complete checkpoint directories under ``root``, oldest first (by step, then epoch)."""
    if not root.is_dir():
        return []
    found = [(pos, p) for p in root.iterdir() if not p.name.startswith(".") and p.is_dir()
             and (pos := _position(p)) is not None]
    return [p for _, p in sorted(found)]


def find_checkpoint(run_dir: str | Path, which: str = "last") -> Path | None:
    """Run directory ``run_dir``'s ``which`` ('last' or 'best') checkpoint directory, or None: the one its record
    names; else, for 'last', the newest complete one under ``checkpoints/``; else the ``which`` link or directory
    of the run itself (a copy holding only that)."""
    run_dir = Path(run_dir)
    name = _record(run_dir).get(which)
    if name and _complete(run_dir / CKPT_DIR / name):
        return run_dir / CKPT_DIR / name
    if which == "last":
        done = _checkpoints(run_dir / CKPT_DIR)
        if done:
            return done[-1]
    own = run_dir / which
    return own.resolve() if _complete(own) else None


def resume_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint directory a resumed run continues from; one CheckpointError line when there is none."""
    run_dir = Path(run_dir)
    d = find_checkpoint(run_dir, "last")
    if d is not None:
        return d
    root = run_dir / CKPT_DIR
    partial = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []
    if partial:
        lacks = [f for f in (WEIGHTS, TRAINER, META) if not (partial[-1] / f).is_file()]
        why = (f"{partial[-1]} lacks {', '.join(lacks)}" if lacks else f"{partial[-1] / META} is unreadable")
    else:
        why = f"{root} holds none" if root.is_dir() else f"no {CKPT_DIR}/ directory"
    raise CheckpointError(f"{run_dir} has no complete checkpoint to resume from ({why})")


# ---------------------------------------------------------------- save


def _safetensors_bytes(state_dict: dict, meta: dict) -> bytes:
    from safetensors.torch import save

    tensors, tied = untie(state_dict)
    metadata = {"vitlab": json.dumps(meta)}
    if tied:
        metadata["tied"] = json.dumps(tied)
    return save({k: v.to("cpu").contiguous() for k, v in tensors.items()}, metadata=metadata)


def _gc(root: Path, keep: set[str], keep_last: int = 1) -> None:
    """Remove the checkpoint directories the record does not name, but the ``keep_last`` newest, and temporary
    leftovers of killed saves."""
    keep = keep | {p.name for p in _checkpoints(root)[-keep_last:]}
    for p in root.iterdir():
        if p.name not in keep:
            _remove(p)


def save_checkpoint(run_dir: str | Path, name: str, model_sd: dict, trainer_state: dict, meta: dict,
                    ema_sd: dict | None = None, links: tuple[str, ...] = ("last",),
                    extra_dirs: dict[str, Path] | None = None, keep_last: int = 1) -> Path:
    """Write checkpoint ``checkpoints/<name>`` atomically, record it as each of ``links`` ('last', 'best') and
    point those links at it. ``extra_dirs`` (name -> a finished directory on the same filesystem) are moved inside
    it before the commit. Older checkpoints are removed but the ``keep_last`` newest (this one included) and those
    the record names. A directory ``name`` the record names is never replaced: the new one goes beside it."""
    run_dir = Path(run_dir)
    root = run_dir / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    record = _record(run_dir)
    tmp = make_temp_dir(root, prefix=f".{name}.", suffix=".tmp")
    try:
        _write_file(tmp / WEIGHTS, _safetensors_bytes(model_sd, meta))
        if ema_sd is not None:
            _write_file(tmp / EMA_WEIGHTS, _safetensors_bytes(ema_sd, {**meta, "weights": "ema"}))
        buf = io.BytesIO()
        torch.save(trainer_state, buf)
        _write_file(tmp / TRAINER, buf.getvalue())
        _write_file(tmp / META, json.dumps(meta, indent=2).encode())
        for sub, src in (extra_dirs or {}).items():
            os.replace(src, tmp / sub)
        fsync_dir(tmp)
        final, n = root / name, 1
        while final.exists() and final.name in record.values():
            n += 1
            final = root / f"{name}.{n}"
        if final.exists():  # a directory the record does not name: a save killed before its commit
            _remove(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    record.update({ln: final.name for ln in links})
    atomic_write(run_dir / RECORD, json.dumps(record, indent=2).encode())  # the commit
    for ln in record:
        if _link_target(run_dir / ln) != record[ln]:
            _point(run_dir / ln, f"{CKPT_DIR}/{record[ln]}")
    _gc(root, set(record.values()), keep_last)
    return final


# ---------------------------------------------------------------- load


def resolve_checkpoint_dir(path: str | Path, prefer: str = "best") -> Path:
    """A run directory (-> its ``best``, else ``last``), a checkpoint directory, or a file inside one."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.is_file():
        return path.parent
    for which in (prefer, "last" if prefer == "best" else "best"):
        d = find_checkpoint(path, which)
        if d is not None:
            return d
    if (path / WEIGHTS).is_file():
        return path
    raise CheckpointError(f"{path} holds no checkpoint (expected {WEIGHTS}, or a run directory with 'best' or "
                          f"'last')")


def _metadata(weights_path: str | Path) -> dict[str, str]:
    from safetensors import safe_open

    try:
        with safe_open(str(weights_path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:  # the safetensors reader's own error types
        raise unreadable(weights_path, e) from None


def _json(path: Path, text: str, what: str):
    try:
        return json.loads(text)
    except ValueError:
        raise CheckpointError(f"cannot read {what} of {path}: it is not valid JSON (truncated or corrupt)") from None


def read_meta(weights_path: str | Path) -> dict:
    """The model description stored in a ``model.safetensors`` written by vitlab (empty for foreign files)."""
    meta = _metadata(weights_path)
    return _json(Path(weights_path), meta["vitlab"], "the description") if "vitlab" in meta else {}


def load_weights(path: str | Path, weights: str = "auto") -> tuple[dict, dict]:
    """(state dict, meta) of a checkpoint: a run dir, a checkpoint dir or a ``.safetensors`` file. ``weights``:
    'raw', 'ema' or 'auto' (what the checkpoint's meta prefers: the EMA when it validated better)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        file = path
    elif path.is_file() and path.name not in (WEIGHTS, EMA_WEIGHTS, TRAINER, META):
        raise CheckpointError(f"{path} is not a vitlab checkpoint (expected a run directory, a checkpoint directory "
                              f"or a .safetensors file written by vitlab train)")
    else:
        d = resolve_checkpoint_dir(path)
        meta = _json(d / META, (d / META).read_text(), "the description") if (d / META).is_file() else {}
        choice = meta.get("preferred_weights", "raw") if weights == "auto" else weights
        file = d / (EMA_WEIGHTS if choice == "ema" else WEIGHTS)
        if not file.is_file():
            raise CheckpointError(f"{d} has no {file.name}" + (" (trained without EMA)" if choice == "ema" else ""))
    meta = read_meta(file)
    if not meta.get("model"):
        raise CheckpointError(f"{file} was not written by vitlab train (no model description in its metadata)")
    return read_state_dict(file), meta


def load_trainer_state(ckpt_dir: str | Path) -> dict:
    """The trainer state (optimiser, scheduler, RNGs ...) of a checkpoint directory; a one-line CheckpointError
    naming the file when it is missing, truncated or corrupt."""
    f = Path(ckpt_dir) / TRAINER
    if not f.is_file():
        raise CheckpointError(f"{ckpt_dir} has no trainer state ({TRAINER}); cannot resume from it")
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load's error types vary with where the file is cut
        raise unreadable(f, e, what="trainer state") from None
