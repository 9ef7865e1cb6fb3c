"""Training and evaluation: ``fit(TrainConfig) -> summary``, ``evaluate(checkpoint, data)``,
``predict(checkpoint, images)``.

    from vitlab.train import TrainConfig, fit
    summary = fit(TrainConfig())            # the default model on digits, on the CPU
    summary["test_top1"], summary["run_dir"]

Modules: ``config`` (TrainConfig, YAML), ``recipe`` (parameter groups, AdamW, warm-up + cosine, losses, EMA),
``loop`` (fit), ``checkpoint`` (atomic saves, last/best), ``distributed`` (DDP / FSDP2 under torchrun),
``evaluate`` (evaluate, predict).
"""

from vitlab.train.config import DistillConfig, TrainConfig
from vitlab.train.evaluate import evaluate, predict
from vitlab.train.loop import fit

__all__ = ["DistillConfig", "TrainConfig", "evaluate", "fit", "predict"]
