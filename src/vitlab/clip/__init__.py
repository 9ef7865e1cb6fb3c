"""Vision-language: CLIP (Radford et al., 2021) built from vitlab's layers and models.

    import vitlab
    import vitlab.clip
    vitlab.list_models(task="contrastive")                   # the registered CLIP configurations
    model = vitlab.create_model("clip_vit_base_patch16")     # or checkpoint_path=an open_clip state dict
    tok = vitlab.clip.ClipTokenizer()                        # CLIP's BPE (vocabulary from open_clip or a path)
    img = model.encode_image(images, normalize=True)
    txt = model.encode_text(tok(["a photo of a cat"]), normalize=True)
    probs = (model.logit_scale.exp() * img @ txt.T).softmax(-1)

Modules: ``model`` (towers, CLIP), ``model_configs`` (the registered configurations, task ``contrastive``:
imported by the registry on demand), ``tokenizer`` (CLIP BPE, word-level), ``openclip``
(state-dict conversion), ``data`` (captions folders, the digits caption demo), ``loss`` (symmetric InfoNCE
across ranks), ``zeroshot`` (prompt-ensembled classifiers, retrieval), ``tasks`` (``vitlab train --task clip``).
"""

from vitlab.clip.model import CLIP, ImageTower, TextTransformer, build_clip, clip_from_openclip
from vitlab.clip.tokenizer import ClipTokenizer, WordTokenizer

__all__ = ["CLIP", "ClipTokenizer", "ImageTower", "TextTransformer", "WordTokenizer", "build_clip",
           "clip_from_openclip"]
