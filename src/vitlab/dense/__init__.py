"""Dense prediction over Vision Transformer backbones: semantic segmentation and monocular depth with SETR,
Segmenter, DPT, the ViTDet simple feature pyramid and ViT-Adapter.

    import vitlab, vitlab.dense as dense
    model = dense.create("dpt", backbone="vit_base_patch16_224", num_classes=150, img_size=384)
    model = vitlab.create_model("dpt_vit_base_patch16_384_depth", checkpoint_path="dpt.safetensors")  # HF weights too
    dense.list_models()                                  # the registered end-to-end configurations
    dense.list_heads("depth")                            # the registered heads that predict depth
    dense.metrics.mean_iou(pred, target, num_classes=150, ignore_index=255)

    @dense.register_head("my_head")                      # a head of your own: forward(maps) -> (B, K, h, w)
    class MyHead(torch.nn.Module):
        def __init__(self, in_channels: list[int], num_classes: int): ...

Modules: ``metrics`` (confusion-matrix mIoU, depth errors, SILog), ``backbone`` (features of any backbone, the
ViTDet backbone), ``heads`` (SETR, Segmenter, SFP, semantic FPN, linear depth; the head registry), ``dpt``,
``adapter`` (ViT-Adapter), ``model`` (DenseModel, create), ``model_configs`` (the end-to-end configurations, tasks
``segment`` / ``depth`` of the one model registry), ``data`` (segfolder, depthfolder, the embedded shapes),
``infer`` (sliding window, evaluate, predict) and ``tasks`` (``vitlab train --task segment|depth``).
"""

from vitlab.dense import metrics
from vitlab.dense.heads import Decoder, HeadContext, HeadSpec, get_head, list_heads, register_head
from vitlab.dense.model import DenseModel, create, get_config, list_models

__all__ = ["Decoder", "DenseModel", "HeadContext", "HeadSpec", "create", "get_config", "get_head", "list_heads",
           "list_models", "metrics", "register_head"]
