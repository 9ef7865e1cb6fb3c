"""The built-in experiment trackers of ``--log`` (:class:`~vitlab.train.callbacks.Tracker` callbacks, rank 0):

- ``tensorboard``: ``torch.utils.tensorboard`` event files in ``RUN/tensorboard`` (scalars, images, the config as
  text and as hyper-parameters); a resumed run purges the steps after its checkpoint.
- ``mlflow``: an MLflow run through ``MlflowClient``, in ``RUN/mlruns`` unless ``--mlflow_uri`` or
  ``MLFLOW_TRACKING_URI`` names a tracking server (checked reachable before the run starts); the config as
  parameters, scalars with their step, pictures and the run's files as artifacts.
- ``wandb``: a Weights & Biases run in ``RUN/wandb``, offline when no ``WANDB_API_KEY`` is set (``wandb sync``
  uploads it later; ``WANDB_MODE`` overrides), project ``$WANDB_PROJECT`` or ``vitlab``; scalars against the
  optimiser step (``trainer/step``), pictures, the run's files as an artifact.

Scalar names: ``train/<name>`` per optimiser step (the keys of the step lines of ``metrics.jsonl``),
``epoch/<name>`` per epoch (the keys of its epoch lines; see :mod:`vitlab.train.metrics_file`) and
``best/val_<monitor>``, each at the optimiser step it was logged after: the values of ``metrics.jsonl``, step for
step. A resumed run continues the same MLflow / W&B run (their ids are kept in ``RUN/trackers.json``).
"""

from __future__ import annotations

import difflib
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

from vitlab.train.callbacks import TRACKERS, Tracker, hyperparameters, register_tracker, run_files


def _numbers(values: dict) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("epoch", "step")}


def _image_array(image):
    """An (H, W, 3) uint8 array of a PNG path or a matplotlib Figure."""
    import numpy as np
    from PIL import Image

    if hasattr(image, "canvas"):  # a Figure
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        canvas = FigureCanvasAgg(image)
        canvas.draw()
        return np.asarray(canvas.buffer_rgba())[..., :3].copy()
    with Image.open(image) as im:
        return np.asarray(im.convert("RGB"))


@register_tracker("tensorboard")
class TensorBoard(Tracker):
    """``torch.utils.tensorboard.SummaryWriter`` into ``RUN/tensorboard``."""

    extra = "tensorboard"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.require("tensorboard")
        self.writer = None

    def on_fit_start(self, trainer) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run drops what the killed one logged after its checkpoint (TensorBoard's purge_step)
        self.writer = SummaryWriter(str(trainer.run_dir / "tensorboard"),
                                    purge_step=trainer.step + 1 if trainer.step else None)
        if not trainer.step:
            self.writer.add_text("config", "```\n" + trainer.cfg.to_yaml() + "```", 0)

    def on_step_end(self, trainer, step, scalars) -> None:
        for k, v in _numbers(scalars).items():
            self.writer.add_scalar(f"train/{k}", v, step)

    def on_eval_end(self, trainer, epoch, metrics, best) -> None:
        for k, v in _numbers(metrics).items():
            self.writer.add_scalar(f"epoch/{k}", v, trainer.step)
        if best.get("monitor") is not None:
            self.writer.add_scalar(f"best/val_{trainer.task.monitor}", best["monitor"], trainer.step)
        self.writer.flush()

    def on_image(self, trainer, name, image, step) -> None:
        self.writer.add_image(name, _image_array(image), step, dataformats="HWC")

    def on_fit_end(self, trainer, summary) -> None:
        from torch.utils.tensorboard.summary import hparams

        if summary is not None:
            metrics = {f"best/val_{trainer.task.monitor}": summary.get(f"best_val_{trainer.task.monitor}")}
            metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            if metrics:
                writer = self.writer._get_file_writer()
                for part in hparams(hyperparameters(trainer.cfg), metrics):
                    writer.add_summary(part)
        self.writer.close()


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """ValueError (one line) when an http(s) tracking URI's server does not accept a connection."""
    url = urlparse(uri)
    if url.scheme not in ("http", "https"):
        return
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            pass
    except OSError as e:
        raise ValueError(f"MLflow tracking URI {uri} is unreachable ({e.strerror or e}); start the server or "
                         f"pass another --mlflow_uri") from None


@register_tracker("mlflow")
class MLflow(Tracker):
    """An MLflow run (experiment ``vitlab``) through ``mlflow.tracking.MlflowClient``."""

    extra = "mlflow"
    experiment = "vitlab"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.require("mlflow")
        self.uri = cfg.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if self.uri:
            check_reachable(self.uri)
        self.client = self.run_id = None

    def on_fit_start(self, trainer) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.uri
        if uri is None:
            # the local default: MLflow's file store in the run directory (`mlflow ui --backend-store-uri
            # RUN/mlruns`); MLflow 3 keeps it in maintenance and asks for this opt-in, a database needs SQLAlchemy
            uri = (Path(trainer.run_dir).resolve() / "mlruns").as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = self.remembered(trainer).get(self.name, {}).get("run_id")
        if self.run_id is None or trainer.step == 0:
            exp = self.client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.experiment)
            run = self.client.create_run(exp_id, run_name=Path(trainer.run_dir).name,
                                         tags={"vitlab.task": trainer.cfg.task, "vitlab.model": trainer.cfg.model})
            self.run_id = run.info.run_id
            self.remember(trainer, run_id=self.run_id, tracking_uri=uri)
            params = [Param(k, str(v)[:6000]) for k, v in hyperparameters(trainer.cfg).items()]
            for i in range(0, len(params), 100):  # the tracking API's limit per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        else:
            self.client.update_run(self.run_id, status="RUNNING")

    def _log(self, values: dict[str, float], step: int, prefix: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"{prefix}{k}", v, now, step) for k, v in values.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def on_step_end(self, trainer, step, scalars) -> None:
        self._log(_numbers(scalars), step, "train/")

    def on_eval_end(self, trainer, epoch, metrics, best) -> None:
        values = _numbers(metrics)
        self._log(values, trainer.step, "epoch/")
        if best.get("monitor") is not None:
            self._log({f"val_{trainer.task.monitor}": best["monitor"]}, trainer.step, "best/")

    def on_image(self, trainer, name, image, step) -> None:
        if isinstance(image, (str, Path)):
            self.client.log_artifact(self.run_id, str(image), "images")
        else:
            self.client.log_figure(self.run_id, image, f"images/{name}-{step:08d}.png")

    def on_fit_end(self, trainer, summary) -> None:
        if summary is not None:
            for f in run_files(Path(trainer.run_dir)):
                self.client.log_artifact(self.run_id, str(f),
                                         "checkpoint" if f.parent.parent.name == "checkpoints" else None)
        self.client.set_terminated(self.run_id, "FINISHED" if summary is not None else "KILLED")


@register_tracker("wandb")
class WandB(Tracker):
    """A Weights & Biases run in ``RUN/wandb`` (offline without ``WANDB_API_KEY``)."""

    extra = "wandb"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.require("wandb")
        self.run = None

    def on_fit_start(self, trainer) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        run_id = self.remembered(trainer).get(self.name, {}).get("id") if trainer.step else None
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "vitlab"), name=Path(trainer.run_dir).name,
                              dir=str(trainer.run_dir), mode=mode, config=hyperparameters(trainer.cfg), id=run_id,
                              resume="allow" if run_id else None,
                              settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
        self.run.define_metric("trainer/step")
        self.run.define_metric("*", step_metric="trainer/step")
        self.remember(trainer, id=self.run.id, mode=mode)

    def on_step_end(self, trainer, step, scalars) -> None:
        self.run.log({**{f"train/{k}": v for k, v in _numbers(scalars).items()}, "trainer/step": step})

    def on_eval_end(self, trainer, epoch, metrics, best) -> None:
        values = {f"epoch/{k}": v for k, v in _numbers(metrics).items()}
        if best.get("monitor") is not None:
            values[f"best/val_{trainer.task.monitor}"] = best["monitor"]
        self.run.log({**values, "trainer/step": trainer.step})

    def on_image(self, trainer, name, image, step) -> None:
        import wandb

        self.run.log({f"images/{name}": wandb.Image(str(image) if isinstance(image, Path) else image),
                      "trainer/step": step})

    def on_fit_end(self, trainer, summary) -> None:
        import wandb

        if summary is not None:
            self.run.summary.update(_numbers(summary))
            art = wandb.Artifact(f"run-{self.run.id}", type="run")
            for f in run_files(Path(trainer.run_dir)):
                art.add_file(str(f), name=f.name)
            self.run.log_artifact(art)
        self.run.finish(exit_code=0 if summary is not None else 1)


def list_trackers() -> list[str]:
    """The registered trackers' names: the built-in ones and the installed plugins'."""
    from vitlab.plugins import load_plugins

    load_plugins()
    return sorted(TRACKERS)


def create_trackers(names: list[str], cfg) -> list[Tracker]:
    """The trackers ``names`` of a run of ``cfg``, checked (a missing package, an unreachable server, an unknown
    name: one-line ValueError)."""
    out = []
    for name in dict.fromkeys(names):  # in order, each once
        if name not in TRACKERS:
            known = list_trackers()
            if name not in TRACKERS:
                close = difflib.get_close_matches(name, known, n=2)
                hint = f"; did you mean {' or '.join(close)}?" if close else ""
                raise ValueError(f"unknown tracker {name!r} in --log{hint} (known: {', '.join(known)})")
        out.append(TRACKERS[name](cfg))
    return out
