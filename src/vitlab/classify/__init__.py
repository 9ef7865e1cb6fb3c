"""Supervised image classification (``--task classify``, the default task): the DeiT recipe, DeiT and feature
distillation, token merging / pruning as model transforms, and the classification metrics.

    from vitlab.train import TrainConfig, fit
    fit(TrainConfig.for_task("classify", model="deit_tiny_patch16_224", epochs=30,
                             task_args={"distill": {"kind": "hard", "teacher": "runs/TEACHER"}}))
"""

from vitlab.classify.tasks import (
    ClassificationTask,
    ClassifyArgs,
    DistillConfig,
    classification_metrics,
    classification_sums,
    evaluate_model,
)

__all__ = ["ClassificationTask", "ClassifyArgs", "DistillConfig", "classification_metrics", "classification_sums",
           "evaluate_model"]
