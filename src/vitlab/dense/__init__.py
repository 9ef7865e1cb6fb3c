"""Dense prediction over Vision Transformer backbones (seed 001, section 21.4): semantic segmentation and
monocular depth with SETR, Segmenter, DPT, the ViTDet simple feature pyramid and ViT-Adapter.

    import vitlab.dense as dense
    model = dense.create("dpt", backbone="vit_base_patch16_224", num_classes=150, img_size=384)
    model = dense.create("dpt_vit_base_patch16_384_depth", checkpoint_path="dpt.safetensors")  # HF weights too
    dense.list_models()                                  # the registered end-to-end configurations
    dense.metrics.mean_iou(pred, target, num_classes=150, ignore_index=255)

Modules: ``metrics`` (confusion-matrix mIoU, depth errors, SILog), ``backbone`` (features of any backbone, the
ViTDet backbone), ``heads`` (SETR, Segmenter, SFP, semantic FPN, linear depth), ``dpt``, ``adapter`` (ViT-Adapter),
``model`` (DenseModel, create, registry), ``data`` (segfolder, depthfolder, the embedded shapes), ``infer``
(sliding window, evaluate, predict) and ``tasks`` (``vitlab train --task segment|depth``).
"""

from vitlab.dense import metrics
from vitlab.dense.model import DEPTH_HEADS, HEADS, DenseModel, create, get_config, list_models, model_rows

__all__ = ["DEPTH_HEADS", "HEADS", "DenseModel", "create", "get_config", "list_models", "metrics", "model_rows"]
