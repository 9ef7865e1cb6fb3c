"""Callbacks: what runs around the training loop without being part of it -- experiment trackers, a user's own
logging or alerts. One small protocol, :class:`Callback`, with a no-op default for every event (the pattern of
Keras' and Lightning's callbacks)::

    from vitlab.train import Callback, Trainer, TrainConfig

    class PrintLoss(Callback):
        def on_step_end(self, trainer, step, scalars):
            if step % 100 == 0:
                print(step, scalars["loss"])

    Trainer(TrainConfig.for_task("classify", epochs=3), callbacks=[PrintLoss()]).fit()

A callback passed to the Trainer runs on every process (``trainer.strategy.is_main`` tells rank 0). A named
tracker -- a :class:`Tracker` registered with :func:`register_tracker` -- is what ``--log NAME`` (``TrainConfig.log``)
turns on: built only on rank 0; its packages are checked before the run starts (one line naming the extra to
install); a failure while the run goes on is reported once and the tracker is dropped, training continues.
:mod:`vitlab.train.trackers` registers ``tensorboard``, ``mlflow`` and ``wandb`` and builds the trackers of a run;
a plugin registers its own the same way (entry-point group ``vitlab.plugins`` or ``--import MODULE``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vitlab._console import say

if TYPE_CHECKING:
    from vitlab.train.trainer import Trainer


class Callback:
    """Events of a run, each a no-op by default. ``scalars`` and ``metrics`` map names to floats."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """The run directory exists (``trainer.run_dir``), its ``config.yaml`` is written; ``trainer.step`` is the
        step the run starts from (0, or the resumed checkpoint's)."""

    def on_step_end(self, trainer: Trainer, step: int, scalars: dict[str, float]) -> None:
        """After optimiser step ``step`` (1-based): loss, lr, grad_norm, img_per_s, tokens_per_s, step_time_s,
        data_wait (share of the step spent waiting for data), mfu, peak memory (the step's line of
        ``metrics.jsonl``)."""

    def on_eval_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float], best: dict) -> None:
        """After epoch ``epoch`` (1-based): its line of ``metrics.jsonl`` (the validation metrics as ``val_*`` when
        it was evaluated) and ``best`` (``monitor``: the best value so far, ``epoch``, ``weights``: raw or ema)."""

    def on_image(self, trainer: Trainer, name: str, image: Any, step: int) -> None:
        """A picture the run drew (``image``: a PNG's path or a matplotlib ``Figure``): the curves after each
        evaluation, the task's pictures at the end (confusion matrix, reconstructions...)."""

    def on_fit_end(self, trainer: Trainer, summary: dict | None) -> None:
        """The run is over: ``summary`` as in ``summary.json``, or None when it failed or was interrupted."""


class Tracker(Callback):
    """A named callback that records a run in an experiment tracker (rank 0 only). ``__init__(cfg)`` checks what
    the tracker needs (its package, a reachable server) and raises ``ValueError`` in one line if it cannot work;
    it opens nothing: the run is started in :meth:`Callback.on_fit_start`. ``extra`` names the package extra
    that installs what it needs."""

    name: str = ""
    extra: str = ""

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def require(self, module: str) -> None:
        """ValueError naming the extra to install when ``module`` cannot be imported."""
        import importlib.util

        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError(f"--log {self.name} needs the {module} package: pip install 'vitlab[{self.extra}]'")

    # ---- what trackers share
    @staticmethod
    def remembered(trainer: Trainer) -> dict:
        """What trackers stored in ``RUN/trackers.json`` (their run ids, so a resumed run continues the same
        tracker run)."""
        f = trainer.run_dir / "trackers.json"
        return json.loads(f.read_text()) if f.is_file() else {}

    def remember(self, trainer: Trainer, **values) -> None:
        from vitlab._io import atomic_write

        saved = self.remembered(trainer)
        saved[self.name] = values
        atomic_write(trainer.run_dir / "trackers.json", json.dumps(saved, indent=2).encode())


def hyperparameters(cfg) -> dict[str, float | int | str | bool]:
    """The resolved config as flat ``{dotted.key: scalar}`` (lists and None as text): what trackers take as
    hyper-parameters."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, (bool, int, float, str)):
            flat[prefix] = value
        else:
            flat[prefix] = json.dumps(value)

    walk("", cfg.to_dict())
    return flat


def run_files(run_dir: Path) -> list[Path]:
    """The run's files a tracker keeps as artifacts: config, metrics, summary, pictures, and the ``last``
    checkpoint's weights and description."""
    files = [run_dir / n for n in ("config.yaml", "metrics.jsonl", "summary.json")]
    files += sorted(run_dir.glob("*.png"))
    last = run_dir / "last"
    if last.exists():
        files += [last.resolve() / n for n in ("model.safetensors", "ema.safetensors", "meta.json")]
    return [f for f in files if f.is_file()]


# ---------------------------------------------------------------- the registry

TRACKERS: dict[str, type[Tracker]] = {}


def register_tracker(name: str):
    """Class decorator: make a :class:`Tracker` subclass available as ``--log name``."""

    def deco(cls: type[Tracker]) -> type[Tracker]:
        if not (isinstance(cls, type) and issubclass(cls, Tracker)):
            raise TypeError(f"register_tracker({name!r}) needs a subclass of vitlab.train.Tracker, got {cls!r}")
        if name in TRACKERS and TRACKERS[name] is not cls:
            raise ValueError(f"tracker {name!r} is registered twice")
        TRACKERS[name] = cls
        cls.name = name
        return cls

    return deco


class Callbacks:
    """The run's callbacks, called in order. A :class:`Tracker` that raises is reported once and dropped (a
    tracker never stops training); another callback's error propagates."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = list(callbacks)

    def __call__(self, event: str, *args) -> None:
        for cb in list(self.callbacks):
            if not isinstance(cb, Tracker):
                getattr(cb, event)(*args)
                continue
            try:
                getattr(cb, event)(*args)
            except Exception as e:  # any failure of a tracker's package or server
                self.callbacks.remove(cb)
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                say(f"warning: {cb.name or type(cb).__name__} logging failed in {event} ({type(e).__name__}: "
                    f"{first[:200]}); training continues without it")


__all__ = ["TRACKERS", "Callback", "Callbacks", "Tracker", "hyperparameters", "register_tracker", "run_files"]
