"""Checkpoints that survive crashes.

A checkpoint is a directory ``RUN/checkpoints/epoch-NNNN/`` holding

- ``model.safetensors``: the raw weights, with the model's description in the safetensors metadata (model name,
  kwargs, classes, input size, normalisation), so the file alone is enough for ``vitlab eval`` / ``predict``;
- ``ema.safetensors``: the EMA weights (when EMA is on);
- ``trainer.pt``: optimiser, scheduler, GradScaler, epoch, step, best metric and every RNG state (read back with
  ``torch.load(weights_only=True)``);
- ``meta.json``: the same description plus the epoch's metrics and which weights (raw or EMA) are preferred.

``RUN/last`` and ``RUN/best`` are relative symbolic links to such directories. A save writes everything into a
temporary directory (each file fsynced), renames it into place, then swaps the link with ``os.replace`` (atomic on
POSIX). A process killed at any moment leaves ``last`` pointing to a complete checkpoint: the previous one, or the
new one once the link has been swapped. Orphaned temporary directories are removed by the next save.
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

from vitlab._io import _fsync_dir, atomic_write, make_temp_dir  # noqa: F401  (atomic_write: re-exported)
from vitlab.convert import CheckpointError, read_state_dict, unreadable

WEIGHTS = "model.safetensors"
EMA_WEIGHTS = "ema.safetensors"
TRAINER = "trainer.pt"
META = "meta.json"
CKPT_DIR = "checkpoints"


# ---------------------------------------------------------------- atomic files


def _write_file(path: Path, data: bytes) -> None:
    """Write and fsync (inside a temporary checkpoint directory: the directory rename is the commit)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _atomic_symlink(link: Path, target: str) -> None:
    tmp = link.parent / f".{link.name}.{os.getpid()}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)
    _fsync_dir(link.parent)


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


# ---------------------------------------------------------------- save


def _safetensors_bytes(state_dict: dict, meta: dict) -> bytes:
    from safetensors.torch import save

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    return save(tensors, metadata={"vitlab": json.dumps(meta)})


def _gc(ckpt_root: Path, keep: set[str], keep_last: int = 1) -> None:
    """Remove checkpoint directories no link points to, but the ``keep_last`` newest, and temporary leftovers of
    killed saves."""
    if not ckpt_root.is_dir():
        return
    done = [p for p in ckpt_root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    keep = keep | {p.name for p in sorted(done, key=lambda p: p.stat().st_mtime_ns)[-keep_last:]}
    for p in ckpt_root.iterdir():
        if p.name not in keep:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _link_target(link: Path) -> str | None:
    return Path(os.readlink(link)).name if link.is_symlink() else None


def save_checkpoint(run_dir: str | Path, name: str, model_sd: dict, trainer_state: dict, meta: dict,
                    ema_sd: dict | None = None, links: tuple[str, ...] = ("last",),
                    extra_dirs: dict[str, Path] | None = None, keep_last: int = 1) -> Path:
    """Write checkpoint ``checkpoints/<name>`` atomically and point each of ``links`` ('last', 'best') at it.
    ``extra_dirs`` (name -> a finished directory on the same filesystem) are moved inside it before the commit.
    Older checkpoints are removed but the ``keep_last`` newest (this one included) and those a link names."""
    run_dir = Path(run_dir)
    root = run_dir / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
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
        _fsync_dir(tmp)
        if final.exists():  # a directory of that name that no link names (a save killed before its link swap)
            in_use = {_link_target(run_dir / ln) for ln in ("last", "best")}
            if name in in_use:
                old = root / f".{name}.old.{os.getpid()}"
                os.replace(final, old)
            else:
                shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for ln in links:
        _atomic_symlink(run_dir / ln, f"{CKPT_DIR}/{name}")
    _gc(root, {t for t in (_link_target(run_dir / ln) for ln in ("last", "best")) if t}, keep_last)
    return final


# ---------------------------------------------------------------- load


def resolve_checkpoint_dir(path: str | Path, prefer: str = "best") -> Path:
    """A run directory (-> its ``best``, else ``last``), a checkpoint directory, or a file inside one."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.is_file():
        return path.parent
    for ln in (prefer, "last" if prefer == "best" else "best"):
        if (path / ln).exists():
            return (path / ln).resolve()
    if (path / WEIGHTS).is_file():
        return path
    raise CheckpointError(f"{path} holds no checkpoint (expected {WEIGHTS}, or a run directory with 'best' or "
                          f"'last')")


def read_meta(weights_path: str | Path) -> dict:
    """The model description stored in a ``model.safetensors`` written by vitlab (empty for foreign files)."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights_path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # the safetensors reader's own error types
        raise unreadable(weights_path, e) from None
    return json.loads(meta["vitlab"]) if "vitlab" in meta else {}


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
        meta = json.loads((d / META).read_text()) if (d / META).is_file() else {}
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
