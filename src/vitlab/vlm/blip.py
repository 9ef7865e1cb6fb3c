"""BLIP (Li et al., 2022, "BLIP: Bootstrapping Language-Image Pre-training for Unified Vision-Language Understanding
and Generation", Sec. 3.1-3.2 and Fig. 2): a ViT image encoder and a BERT text transformer (Devlin et al., 2019)
whose layers cross-attend to the image tokens, trained with three objectives at once:

- **ITC**, image-text contrastive (Sec. 3.2): the [CLS] outputs of the image encoder and of the text encoder
  (text alone, no cross-attention) are projected to ``embed_dim``, L2-normalised and matched by a symmetric
  InfoNCE over the batch at a learned temperature (``temp``, init 0.07, clamped to [0.001, 0.5]). BLIP adds a
  momentum encoder, a feature queue and momentum distillation (from ALBEF, Li et al., 2021); this module is the
  momentum-free form: in-batch negatives, one-hot targets (or every pair of the same ``image_ids``).
- **ITM**, image-text matching: the text encoder with cross-attention, its first token replaced by [ENC],
  classifies (image, text) pairs as matched or not (``itm_head``, 2 logits). Negatives are hard: for each image one
  text and for each text one image, sampled with probability ``softmax`` of their contrastive similarity
  (matched pairs excluded).
- **LM**, language modelling (captioning): a causal text decoder with cross-attention, its first token replaced by
  [DEC], predicts the caption; cross-entropy with label smoothing 0.1 (BLIP's), padding (and an optional prompt
  such as "a picture of") left out of the loss.

Text layers are BERT's post-norm layers: ``x = LN(x + SelfAttn(x))``, ``x = LN(x + CrossAttn(x, image))``, ``x =
LN(x + MLP(x))``, with learned absolute positions and a LayerNorm on the embeddings. BLIP shares every text-encoder
weight but the self-attention between encoder and decoder during pre-training; the released checkpoints (and
transformers' ``BlipForConditionalGeneration`` / ``BlipForImageTextRetrieval``) keep them apart, as this module
does. ``heads`` chooses which parts exist: the captioner (``("lm",)``), the retrieval model (``("itc", "itm")``) or
all three.

Hugging Face checkpoints (``save_pretrained`` directories of ``BlipForConditionalGeneration`` or
``BlipForImageTextRetrieval``) load through ``create_model(name, checkpoint_path=DIR)`` or
:meth:`BLIP.from_pretrained` (architecture from ``config.json``); :func:`convert_hf_blip_state_dict` holds the
key map. For the same weights: :meth:`BLIP.forward` gives ``BlipForConditionalGeneration``'s logits and loss,
:meth:`BLIP.generate_caption` its greedy captions, :meth:`BLIP.itm_scores` / :meth:`BLIP.itc_scores`
``BlipForImageTextRetrieval``'s ``itm_score`` with and without the ITM head.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.convert import config_differences, load_state_dict, read_hf_config, read_hf_state_dict, read_state_dict
from vitlab.layers import Mlp, check_heads, checkpoint_seq, get_act_layer
from vitlab.layers import attention_mask as sdpa_mask
from vitlab.models import (
    hf_act,
    hf_act_pair,
    hf_clip_tower_differences,
    hf_layernorm,
    hf_mlp_ratio,
    sample_next_token,
    set_grad_checkpointing,
)
from vitlab.registry import create_model

HEADS = ("itc", "itm", "lm")
HF_ARCHITECTURES = {"BlipForConditionalGeneration": ("lm",), "BlipForImageTextRetrieval": ("itc", "itm")}


@dataclass
class BertConfig:
    """BLIP's text transformer (BERT-base by default, Devlin et al., 2019) and its special tokens: the
    ``bert-base-uncased`` vocabulary plus [DEC] (30522, the decoder's first token) and [ENC] (30523, the ITM
    encoder's), as BLIP's tokenizer adds them."""

    vocab_size: int = 30524
    dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    max_len: int = 512  # learned absolute positions
    act_layer: str = "gelu"
    eps: float = 1e-12
    dropout: float = 0.0  # hidden and embedding dropout (BERT pre-training: 0.1)
    attn_dropout: float = 0.0
    pad_token_id: int = 0
    cls_token_id: int = 101
    sep_token_id: int = 102  # end of caption
    bos_token_id: int = 30522  # [DEC]
    enc_token_id: int | None = 30523  # [ENC]; None: ITM keeps the text's own first token


class BertAttention(nn.Module):
    """Multi-head attention of ``x`` to ``context`` (itself for self-attention, the image tokens for cross-attention,
    of width ``context_dim``), then BERT's post-norm residual ``LN(x + out(attn))``. ``cache`` (a dict) keeps the
    keys and values of earlier tokens for decoding; for cross-attention it keeps the image's, computed once."""

    def __init__(self, dim: int, num_heads: int, context_dim: int | None = None, eps: float = 1e-12,
                 dropout: float = 0.0, attn_dropout: float = 0.0, cross: bool = False):
        super().__init__()
        self.num_heads, self.head_dim, self.cross = num_heads, check_heads(dim, num_heads), cross
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(context_dim or dim, dim)
        self.value = nn.Linear(context_dim or dim, dim)
        self.out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.drop = nn.Dropout(dropout)
        self.attn_dropout = attn_dropout

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)  # (B, heads, N, head_dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                cache: dict | None = None) -> torch.Tensor:
        q = self._heads(self.query(x))
        if self.cross and cache is not None and "k" in cache:  # the image's keys and values, from the first step
            k, v = cache["k"], cache["v"]
        else:
            src = context if self.cross else x
            k, v = self._heads(self.key(src)), self._heads(self.value(src))
            if cache is not None:
                if not self.cross and "k" in cache:
                    k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
                cache["k"], cache["v"] = k, v
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.attn_dropout if self.training else 0.0)
        return self.norm(x + self.drop(self.out(y.transpose(1, 2).flatten(2))))


class BertLayer(nn.Module):
    """Self-attention, cross-attention to the image (skipped when no image is given: BLIP's unimodal text encoder
    for ITC), MLP; each post-norm."""

    def __init__(self, cfg: BertConfig, context_dim: int):
        super().__init__()
        kw = dict(eps=cfg.eps, dropout=cfg.dropout, attn_dropout=cfg.attn_dropout)
        self.attention = BertAttention(cfg.dim, cfg.num_heads, **kw)
        self.crossattention = BertAttention(cfg.dim, cfg.num_heads, context_dim, cross=True, **kw)
        self.mlp = Mlp(cfg.dim, cfg.mlp_dim, act_layer=cfg.act_layer, drop=0.0)
        self.drop = nn.Dropout(cfg.dropout)
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.eps)

    def forward(self, x, mask, image=None, image_mask=None, cache: dict | None = None) -> torch.Tensor:
        x = self.attention(x, mask=mask, cache=None if cache is None else cache.setdefault("self", {}))
        if image is not None:
            x = self.crossattention(x, image, image_mask, None if cache is None else cache.setdefault("cross", {}))
        return self.norm(x + self.drop(self.mlp(x)))


class BertText(nn.Module):
    """BERT over token ids (B, N) -> hidden states (B, N, dim), bidirectional (the encoder) or causal (the
    decoder), cross-attending to ``image`` tokens when given."""

    def __init__(self, cfg: BertConfig, context_dim: int):
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_len, cfg.dim)
        self.embed_norm = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.embed_drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(BertLayer(cfg, context_dim) for _ in range(cfg.depth))
        self.grad_checkpointing = False
        self.apply(_init_bert)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                image: torch.Tensor | None = None, causal: bool = False, cache: list | None = None,
                start: int = 0) -> torch.Tensor:
        """``attention_mask`` (B, start + N): 1 for real tokens, 0 for padding (cached tokens included);
        ``cache``: a list (one dict per layer, filled on the first call) for decoding token by token from
        position ``start``."""
        n = input_ids.shape[1]
        if start + n > self.cfg.max_len:
            raise ValueError(f"text of {start + n} tokens is longer than the {self.cfg.max_len} positions")
        pos = torch.arange(start, start + n, device=input_ids.device)
        x = self.embed_drop(self.embed_norm(self.word_embeddings(input_ids) + self.position_embeddings(pos)))
        mask = sdpa_mask(start + n, key_padding=attention_mask.bool()) if attention_mask is not None else None
        if causal and n > 1:  # query i (position start + i) sees keys up to start + i
            allowed = torch.ones(n, start + n, dtype=torch.bool, device=x.device).tril(start)
            mask = allowed if mask is None else mask & allowed
        if cache is None:
            return checkpoint_seq(self.layers, x, mask, image, enabled=self.grad_checkpointing)
        if not cache:
            cache.extend({} for _ in self.layers)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x = layer(x, mask, image, None, layer_cache)
        return x


def _init_bert(m: nn.Module) -> None:
    """BERT's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorms."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.Embedding) and m.padding_idx is not None:
            nn.init.zeros_(m.weight[m.padding_idx])


class LMHead(nn.Module):
    """BERT's prediction head: dense -> activation -> LayerNorm -> a linear map to the vocabulary whose weight is
    the word embedding (tied, as BERT and BLIP do), with its own bias."""

    def __init__(self, cfg: BertConfig, embedding: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(cfg.dim, cfg.dim)
        self.act = get_act_layer(cfg.act_layer)()
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.decoder = nn.Linear(cfg.dim, cfg.vocab_size)
        self.decoder.weight = embedding.weight
        nn.init.zeros_(self.decoder.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(x))))


class BLIP(nn.Module):
    """BLIP: ``vision_tower`` (a registered ViT, ``num_classes=0``), ``text_encoder`` (ITC / ITM) and
    ``text_decoder`` + ``lm_head`` (captioning), each present when its head is in ``heads``.

    Public interface: :meth:`encode_image`, :meth:`forward` (captioning logits, or a retrieval model's ITM
    logits, and the loss), :meth:`losses` (the objectives of its heads), :meth:`itc_scores`, :meth:`itm_scores`,
    :meth:`generate_caption`."""

    def __init__(self, vision_model: str = "vit_base_patch16_224", vision_kwargs: dict | None = None,
                 text: BertConfig | dict | None = None, embed_dim: int = 256, heads: tuple[str, ...] = HEADS,
                 label_smoothing: float = 0.1, init_temp: float = 0.07):
        super().__init__()
        heads = tuple(heads)
        bad = sorted(set(heads) - set(HEADS))
        if bad or not heads:
            raise ValueError(f"unknown BLIP heads {bad}; choose from {list(HEADS)}" if bad else "BLIP needs a head")
        cfg = text if isinstance(text, BertConfig) else BertConfig(**(text or {}))
        self.text_config, self.heads, self.label_smoothing = cfg, heads, label_smoothing
        self.vision_tower = create_model(vision_model, num_classes=0, **(vision_kwargs or {}))
        if not getattr(self.vision_tower, "num_prefix_tokens", 0):
            raise ValueError(f"BLIP's image encoder needs a [CLS] token; {vision_model} has none")
        width = self.vision_tower.num_features
        if "itc" in heads or "itm" in heads:
            self.text_encoder = BertText(cfg, width)
        if "itc" in heads:
            self.vision_proj = nn.Linear(width, embed_dim)
            self.text_proj = nn.Linear(cfg.dim, embed_dim)
            self.temp = nn.Parameter(torch.full((1,), init_temp))  # (1,): FSDP2 shards no scalar
        if "itm" in heads:
            self.itm_head = nn.Linear(cfg.dim, 2)
        if "lm" in heads:
            self.text_decoder = BertText(cfg, width)
            self.lm_head = LMHead(cfg, self.text_decoder.word_embeddings)

    # ---- parts ----------------------------------------------------------------------------------------
    def _need(self, head: str) -> None:
        if head not in self.heads:
            raise ValueError(f"this BLIP has no {head.upper()} head (heads: {', '.join(self.heads)})")

    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> the image tokens (B, 1 + N, width) after the final norm, [CLS] first."""
        return self.vision_tower.forward_features(pixel_values)

    def _image(self, pixel_values: torch.Tensor | None, image_embeds: torch.Tensor | None) -> torch.Tensor:
        if (pixel_values is None) == (image_embeds is None):
            raise ValueError("pass exactly one of pixel_values and image_embeds")
        return self.encode_image(pixel_values) if image_embeds is None else image_embeds

    def contrastive_features(self, image_embeds: torch.Tensor, input_ids: torch.Tensor,
                             attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit-norm ITC features of the images' [CLS] (B_img, embed_dim) and of the texts' first token, the text
        encoded alone (B_txt, embed_dim)."""
        self._need("itc")
        text = self.text_encoder(input_ids, attention_mask)
        return (F.normalize(self.vision_proj(image_embeds[:, 0]), dim=-1),
                F.normalize(self.text_proj(text[:, 0]), dim=-1))

    def itc_scores(self, pixel_values: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None, *,
                   image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Cosine similarity of every image and text (B_img, B_txt), without the temperature (transformers'
        ``BlipForImageTextRetrieval(use_itm_head=False)``)."""
        img, txt = self.contrastive_features(self._image(pixel_values, image_embeds), input_ids, attention_mask)
        return img @ txt.T

    def itm_logits(self, image_embeds: torch.Tensor, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Matched / not-matched logits (B, 2) of row-aligned image tokens and texts (ids used as given)."""
        self._need("itm")
        return self.itm_head(self.text_encoder(input_ids, attention_mask, image=image_embeds)[:, 0])

    def itm_scores(self, pixel_values: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None, *,
                   image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """ITM logits (B, 2) of image i with text i (transformers' ``BlipForImageTextRetrieval`` ``itm_score``;
        ``softmax(-1)[:, 1]`` is the match probability). BLIP's own checkpoints expect [ENC] as the first token:
        :meth:`losses` puts it there, this method takes the ids as given."""
        return self.itm_logits(self._image(pixel_values, image_embeds), input_ids, attention_mask)

    def forward(self, pixel_values: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                image_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's main output and, with ``labels``, its loss, as transformers' class for these heads:

        - with an LM head (captioner, full model): next-token logits (B, N, vocab) of the decoder over
          ``input_ids`` (used as given: the first token should be [DEC], ``bos_token_id``); ``labels`` (B, N; -100
          where not scored) give the mean cross-entropy of position i's logits against label i + 1 with
          ``label_smoothing`` (``BlipForConditionalGeneration``'s logits and loss);
        - a retrieval model: the ITM logits (B, 2) (``BlipForImageTextRetrieval``'s ``itm_score``); ``labels``
          (B,) 1 for matched pairs give their cross-entropy.

        The three pre-training objectives together: :meth:`losses`."""
        if input_ids is None:
            raise ValueError("BLIP needs input_ids (a caption, or its first token)")
        image = self._image(pixel_values, image_embeds)
        if "lm" not in self.heads:
            logits = self.itm_logits(image, input_ids, attention_mask)
            return logits, None if labels is None else F.cross_entropy(logits, labels)
        logits = self.lm_head(self.text_decoder(input_ids, attention_mask, image=image, causal=True))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                   label_smoothing=self.label_smoothing)
        return logits, loss

    # ---- training ------------------------------------------------------------------------------------
    def caption_labels(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       prompt_length: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """BLIP's decoder input (the first token replaced by [DEC]) and labels (padding and the first
        ``prompt_length`` tokens, e.g. "a picture of", set to -100)."""
        ids = input_ids.clone()
        ids[:, 0] = self.text_config.bos_token_id
        labels = ids.masked_fill(ids == self.text_config.pad_token_id, -100)
        if attention_mask is not None:
            labels = labels.masked_fill(attention_mask == 0, -100)
        labels[:, :prompt_length] = -100
        return ids, labels

    def losses(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               *, image_ids: torch.Tensor | None = None, prompt_length: int = 0,
               generator: torch.Generator | None = None, lone_image_itm: bool = False) -> dict[str, torch.Tensor]:
        """The objectives of this model's heads on a batch of matched (image, caption) pairs: ``{"itc", "itm",
        "lm", "loss"}`` (``loss``: their sum, BLIP's equal weighting).

        ``input_ids`` (B, N) start with [CLS] (BERT's tokenizer); ITM and LM swap in [ENC] and [DEC].
        ``image_ids`` (B,): captions of the same image are all positives for ITC and never ITM negatives (COCO
        has five per image). ``prompt_length``: leading caption tokens not scored by LM. ``generator``: the draws
        of the hard negatives. ``lone_image_itm``: a batch of one image (or group) has no negative to draw, and
        its ITM loss is then 0 instead of a ``ValueError`` (a validation split of one image)."""
        image = self.encode_image(pixel_values)
        out: dict[str, torch.Tensor] = {}
        b = image.shape[0]
        same = (torch.eye(b, dtype=torch.bool, device=image.device) if image_ids is None
                else image_ids[:, None] == image_ids[None, :])
        sim_i2t = None
        if "itc" in self.heads or "itm" in self.heads:
            if "itc" in self.heads:
                with torch.no_grad():
                    self.temp.clamp_(0.001, 0.5)
                img, txt = self.contrastive_features(image, input_ids, attention_mask)
                sim_i2t = img @ txt.T / self.temp
                targets = same.float() / same.sum(1, keepdim=True)
                out["itc"] = (torch.sum(-F.log_softmax(sim_i2t, 1) * targets, 1).mean()
                              + torch.sum(-F.log_softmax(sim_i2t.T, 1) * targets, 1).mean()) / 2
            if "itm" in self.heads:
                if lone_image_itm and (b < 2 or bool(same.all())):
                    out["itm"] = image.sum() * 0.0  # nothing to tell apart; zero keeps the graph whole
                else:
                    out["itm"] = self._itm_loss(image, input_ids, attention_mask, sim_i2t, same, generator)
        if "lm" in self.heads:
            ids, labels = self.caption_labels(input_ids, attention_mask, prompt_length)
            out["lm"] = self(input_ids=ids, attention_mask=attention_mask, labels=labels, image_embeds=image)[1]
        out["loss"] = sum(out.values())
        return out

    def _itm_loss(self, image, input_ids, attention_mask, sim_i2t, same, generator) -> torch.Tensor:
        """ITM on the matched pairs, one hard negative text per image and one hard negative image per text."""
        b = image.shape[0]
        if b < 2 or bool(same.all()):
            raise ValueError("ITM needs at least two different images in a batch to draw negatives from")
        ids = input_ids.clone()
        if self.text_config.enc_token_id is not None:
            ids[:, 0] = self.text_config.enc_token_id
        mask = attention_mask if attention_mask is not None else torch.ones_like(ids)
        with torch.no_grad():
            if sim_i2t is None:  # without an ITC head: negatives drawn uniformly among the unmatched
                sim_i2t = torch.zeros(b, b, device=image.device)
            w_i2t = (F.softmax(sim_i2t.float(), 1) + 1e-4).masked_fill(same, 0)
            w_t2i = (F.softmax(sim_i2t.T.float(), 1) + 1e-4).masked_fill(same, 0)
            neg_text = torch.multinomial(w_i2t, 1, generator=generator).squeeze(1)  # for each image
            neg_image = torch.multinomial(w_t2i, 1, generator=generator).squeeze(1)  # for each text
        images = torch.cat([image, image[neg_image], image])
        texts = torch.cat([ids, ids, ids[neg_text]])
        masks = torch.cat([mask, mask, mask[neg_text]])
        labels = torch.cat([torch.ones(b), torch.zeros(2 * b)]).long().to(image.device)
        return F.cross_entropy(self.itm_logits(images, texts, masks), labels)

    # ---- generation ----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_caption(self, pixel_values: torch.Tensor, input_ids: torch.Tensor | None = None,
                         max_new_tokens: int = 30, temperature: float = 0.0, top_k: int | None = None,
                         top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Caption each image: (B, prompt + new) token ids, the prompt first ([DEC], or ``input_ids`` (B, P) such
        as [DEC] "a picture of", whose first token is set to [DEC]), then up to ``max_new_tokens`` tokens; a row
        stops at [SEP] (``sep_token_id``) and is padded after it. Greedy by default, or sampled
        (``temperature`` > 0 with ``top_k`` / ``top_p``, BLIP's nucleus sampling for CapFilt). Greedy captions
        equal transformers' ``BlipForConditionalGeneration.generate``."""
        self._need("lm")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        cfg = self.text_config
        image = self.encode_image(pixel_values)
        b = image.shape[0]
        ids = (torch.full((b, 1), cfg.bos_token_id, device=image.device) if input_ids is None
               else input_ids.clone().to(image.device))
        if ids.shape[0] != b:
            raise ValueError(f"{ids.shape[0]} prompts for {b} images")
        ids[:, 0] = cfg.bos_token_id
        if ids.shape[1] + max_new_tokens > cfg.max_len:
            raise ValueError(f"the prompt ({ids.shape[1]} tokens) plus max_new_tokens ({max_new_tokens}) exceed the "
                             f"decoder's {cfg.max_len} positions")
        cache: list = []
        step_ids, start = ids, 0
        done = torch.zeros(b, dtype=torch.bool, device=image.device)
        for _ in range(max_new_tokens):
            hidden = self.text_decoder(step_ids, image=image, causal=True, cache=cache, start=start)
            tok = sample_next_token(self.lm_head(hidden[:, -1]), temperature, top_k, top_p, generator)
            tok = tok.masked_fill(done, cfg.pad_token_id)
            done |= tok == cfg.sep_token_id
            ids = torch.cat([ids, tok[:, None]], 1)
            if bool(done.all()):
                break
            start += step_ids.shape[1]
            step_ids = tok[:, None]
        return ids

    def profile_inputs(self, image: torch.Tensor) -> tuple:
        """What :mod:`vitlab.profile` runs: :meth:`forward` on one image and a 32-token caption, shorter where the
        text has fewer positions (the image encoder and the decoder; a retrieval model's encoder with
        cross-attention)."""
        ids = torch.zeros(image.shape[0], min(32, self.text_config.max_len), dtype=torch.long, device=image.device)
        return (image, ids)

    def shard_units(self) -> list[nn.Module]:
        """FSDP units: the image encoder's blocks, then every text layer."""
        units = list(self.vision_tower.shard_units())
        for name in ("text_encoder", "text_decoder"):
            if hasattr(self, name):
                units += list(getattr(self, name).layers)
        return units

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute the activations of the image encoder's blocks and the text layers in the backward pass."""
        set_grad_checkpointing(self, enable)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {f"vision_tower.{n}" for n in self.vision_tower.no_weight_decay()} | (
            {"temp"} if "itc" in self.heads else set())

    # ---- weights -------------------------------------------------------------------------------------
    def check_hf_config(self, cfg: dict, source: str, token_ids: bool = True) -> None:
        """``ValueError`` (one line: the field, the checkpoint's value, this model's) unless a transformers
        ``BlipConfig`` dict describes this model's function beyond its tensors' shapes: each tower's activation,
        LayerNorm eps and heads and, with ``token_ids``, the text's [DEC] (``bos_token_id``), [SEP] and padding ids
        that captioning starts, stops and pads with. ``token_ids=False`` is for a checkpoint whose token ids are
        mapped onto the model's (``--init``'s vocabulary transfer)."""
        v, t = {**_HF_VISION, **cfg.get("vision_config", {})}, {**_HF_TEXT, **cfg.get("text_config", {})}
        text = self.text_config
        # the image tower is CLIP's pre-norm ViT; the text layers (BERT's, post-norm) hold their settings in
        # text_config, compared by the same rules (activations named as transformers names them)
        bad = hf_clip_tower_differences(self.vision_tower, v, "vision_config.")
        # field: (the checkpoint's value, this model's)
        pairs = {"hidden_act": hf_act_pair(t["hidden_act"], get_act_layer(text.act_layer)()),
                 "layer_norm_eps": (t["layer_norm_eps"], text.eps),
                 "num_attention_heads": (t["num_attention_heads"], text.num_heads)}
        if token_ids:
            pairs.update({k: (t[k], getattr(text, k)) for k in ("bos_token_id", "sep_token_id", "pad_token_id")})
        bad += config_differences(pairs, "text_config.")
        if bad:
            raise ValueError(f"{source}: another BLIP architecture: {', '.join(bad)}")

    def read_checkpoint(self, path: str | os.PathLike, token_ids: bool = True) -> dict[str, torch.Tensor]:
        """The tensors of a Hugging Face ``save_pretrained`` directory of a BLIP model, else of a file. A
        directory's ``config.json`` must describe this model (:meth:`check_hf_config`: what the weights cannot
        tell, the special tokens' ids too unless ``token_ids`` is False)."""
        p = Path(path)
        if not p.is_dir():
            return read_state_dict(p)
        self.check_hf_config(read_hf_config(p, architectures=(*HF_ARCHITECTURES, "blip")), str(p), token_ids)
        return read_hf_state_dict(p)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> BLIP:
        """A BLIP with the architecture (``config.json``) and weights of a transformers
        ``BlipForConditionalGeneration`` (the captioner) or ``BlipForImageTextRetrieval`` directory, in eval mode."""
        model = cls(**blip_kwargs_from_hf(read_hf_config(path, architectures=(*HF_ARCHITECTURES, "blip"))))
        return load_state_dict(model, model.read_checkpoint(path), source=str(path)).eval()

    @staticmethod
    def checkpoint_filter_fn(sd: dict[str, torch.Tensor], model: BLIP) -> dict[str, torch.Tensor]:
        """transformers' key names -> ours (:func:`convert_hf_blip_state_dict`); ours pass as they are. The
        temperature, which transformers does not keep, stays the model's."""
        if not is_hf_blip_state_dict(sd):
            return sd
        out = convert_hf_blip_state_dict(sd)
        if "itc" in model.heads and "temp" not in out:
            out["temp"] = model.temp.detach().clone()
        return out


# ---- transformers' layout -------------------------------------------------------------------------------
_VISION_LAYER = [("layer_norm1.", "norm1."), ("layer_norm2.", "norm2."), ("self_attn.qkv.", "attn.qkv."),
                 ("self_attn.projection.", "attn.proj."), ("mlp.", "mlp.")]
_TEXT_LAYER = [("attention.self.", "attention."), ("attention.output.dense.", "attention.out."),
               ("attention.output.LayerNorm.", "attention.norm."), ("crossattention.self.", "crossattention."),
               ("crossattention.output.dense.", "crossattention.out."),
               ("crossattention.output.LayerNorm.", "crossattention.norm."), ("intermediate.dense.", "mlp.fc1."),
               ("output.dense.", "mlp.fc2."), ("output.LayerNorm.", "norm.")]
_TEXT_ROOT = {"embeddings.word_embeddings.weight": "word_embeddings.weight",
              "embeddings.position_embeddings.weight": "position_embeddings.weight",
              "embeddings.LayerNorm.weight": "embed_norm.weight", "embeddings.LayerNorm.bias": "embed_norm.bias"}
_LM_HEAD = {"cls.predictions.transform.dense.weight": "lm_head.dense.weight",
            "cls.predictions.transform.dense.bias": "lm_head.dense.bias",
            "cls.predictions.transform.LayerNorm.weight": "lm_head.norm.weight",
            "cls.predictions.transform.LayerNorm.bias": "lm_head.norm.bias",
            "cls.predictions.bias": "lm_head.decoder.bias", "cls.predictions.decoder.bias": "lm_head.decoder.bias",
            "cls.predictions.decoder.weight": "lm_head.decoder.weight"}


def is_hf_blip_state_dict(sd: dict) -> bool:
    return "vision_model.embeddings.class_embedding" in sd


def _rename(rest: str, table: list[tuple[str, str]]) -> str:
    for old, new in table:
        if rest.startswith(old):
            return new + rest[len(old):]
    return rest


def convert_hf_blip_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers ``BlipForConditionalGeneration`` / ``BlipForImageTextRetrieval`` state dict in BLIP's names
    here: ``vision_model.`` -> ``vision_tower.`` (timm's ViT names), ``text_encoder.`` -> ``text_encoder.``,
    ``text_decoder.bert.`` -> ``text_decoder.``, ``text_decoder.cls.predictions.`` -> ``lm_head.`` (the decoder
    weight, tied to the word embedding and often not saved, filled from it); the projections and ITM head keep
    their names."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.startswith("vision_model."):
            rest = k[len("vision_model."):]
            m = re.match(r"encoder\.layers\.(\d+)\.(.*)", rest)
            if m:
                out[f"vision_tower.blocks.{m.group(1)}.{_rename(m.group(2), _VISION_LAYER)}"] = v
            else:
                out["vision_tower." + {"embeddings.class_embedding": "cls_token",
                                       "embeddings.position_embedding": "pos_embed",
                                       "embeddings.patch_embedding.weight": "patch_embed.proj.weight",
                                       "embeddings.patch_embedding.bias": "patch_embed.proj.bias",
                                       "post_layernorm.weight": "norm.weight",
                                       "post_layernorm.bias": "norm.bias"}.get(rest, rest)] = v
            continue
        m = re.match(r"(text_encoder|text_decoder\.bert)\.(.*)", k)
        if m:
            tower = m.group(1).split(".")[0]
            rest = m.group(2)
            layer = re.match(r"encoder\.layer\.(\d+)\.(.*)", rest)
            if layer:
                out[f"{tower}.layers.{layer.group(1)}.{_rename(layer.group(2), _TEXT_LAYER)}"] = v
            elif rest != "embeddings.position_ids":
                out[f"{tower}.{_TEXT_ROOT.get(rest, rest)}"] = v
            continue
        if k.startswith("text_decoder.cls."):
            out[_LM_HEAD.get(k[len("text_decoder."):], k)] = v
            continue
        out[k] = v
    if "text_decoder.word_embeddings.weight" in out and "lm_head.decoder.weight" not in out:
        out["lm_head.decoder.weight"] = out["text_decoder.word_embeddings.weight"]
    return out


# transformers' BlipVisionConfig / BlipTextConfig / BlipConfig defaults, for keys a config.json leaves out
_HF_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  image_size=384, patch_size=16, hidden_act="gelu", layer_norm_eps=1e-5)
_HF_TEXT = dict(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                num_attention_heads=8, max_position_embeddings=512, hidden_act="gelu", layer_norm_eps=1e-12,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, bos_token_id=30522, pad_token_id=0,
                sep_token_id=102)


def blip_kwargs_from_hf(cfg: dict) -> dict:
    """The :class:`BLIP` arguments of a transformers ``BlipConfig`` (a dict of ``config.json``); the heads from
    its architecture. [ENC] is not part of transformers' config: ITM keeps the text's first token."""
    arch = next((a for a in cfg.get("architectures") or [] if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"not a BLIP captioning or retrieval config (architectures {cfg.get('architectures')}); "
                         f"supported: {', '.join(HF_ARCHITECTURES)}")
    v, t = {**_HF_VISION, **cfg.get("vision_config", {})}, {**_HF_TEXT, **cfg.get("text_config", {})}
    vision = dict(img_size=v["image_size"], patch_size=v["patch_size"], embed_dim=v["hidden_size"],
                  depth=v["num_hidden_layers"], num_heads=v["num_attention_heads"], mlp_ratio=hf_mlp_ratio(v),
                  act_layer=hf_act(v["hidden_act"]), norm_layer=hf_layernorm(v["layer_norm_eps"]))
    text = BertConfig(vocab_size=t["vocab_size"], dim=t["hidden_size"], depth=t["num_hidden_layers"],
                      num_heads=t["num_attention_heads"], mlp_dim=t["intermediate_size"],
                      max_len=t["max_position_embeddings"], act_layer=hf_act(t["hidden_act"]), eps=t["layer_norm_eps"],
                      dropout=t["hidden_dropout_prob"], attn_dropout=t["attention_probs_dropout_prob"],
                      pad_token_id=t["pad_token_id"], bos_token_id=t["bos_token_id"], sep_token_id=t["sep_token_id"],
                      enc_token_id=None)
    return dict(vision_model="vit_base_patch16_224", vision_kwargs=vision, text=text,
                embed_dim=cfg.get("image_text_hidden_size", 256), heads=HF_ARCHITECTURES[arch],
                label_smoothing=t.get("label_smoothing", cfg.get("label_smoothing", 0.0)))


def build_blip(vision_model: str, vision: dict, text: dict, **kwargs) -> BLIP:
    """A BLIP of a registered ViT (``vision``: its arguments) and a :class:`BertConfig` (``text``); ``kwargs``:
    ``vision_*`` go to the ViT (``vision_depth=2``), ``text_*`` to the text config (``text_depth=2``),
    ``img_size`` / ``in_chans`` / ``drop_path_rate`` (``create_model``'s) to the ViT, the rest to :class:`BLIP`."""
    vision, text = dict(vision), dict(text)
    for key in list(kwargs):
        if key.startswith("vision_") and key not in ("vision_model", "vision_kwargs"):
            vision[key[7:]] = kwargs.pop(key)
        elif key.startswith("text_") and key != "text":
            text[key[5:]] = kwargs.pop(key)
        elif key in ("img_size", "in_chans", "drop_path_rate", "dynamic_img_size"):
            vision[key] = kwargs.pop(key)
    kwargs.pop("num_classes", None)  # create_model's; BLIP has no classifier
    names = {f.name for f in fields(BertConfig)}
    unknown = sorted(set(text) - names)
    if unknown:
        raise ValueError(f"unknown BLIP text option(s) {unknown}; known: {sorted(names)}")
    return BLIP(vision_model, vision, BertConfig(**text), **kwargs)


__all__ = ["BLIP", "BertConfig", "BertText", "build_blip", "convert_hf_blip_state_dict"]
