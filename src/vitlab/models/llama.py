"""Llama 2 (Touvron et al., 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models", Sec. 2.2 and Table 1):
a decoder-only transformer that predicts the next token.

- Token embedding -> ``n_layers`` pre-norm blocks -> RMSNorm -> a linear head over the vocabulary (no biases
  anywhere).
- Block: ``h = x + Attention(RMSNorm(x))``, ``out = h + SwiGLU(RMSNorm(h))``; RMSNorm (Zhang & Sennrich, 2019)
  with eps 1e-5; SwiGLU (Shazeer, 2020, "GLU Variants Improve Transformer") of width ``2/3 * 4 * dim`` rounded up
  to ``multiple_of`` (11008 at dim 4096).
- Attention: causal scaled dot-product attention whose queries and keys are rotated by 1-D RoPE (Su et al.,
  2021, "RoFormer", Eq. 34: consecutive channel pairs turned by ``m * theta_i``), in Meta's complex form (each
  pair read as one complex number and multiplied by ``exp(i m theta_i)``: one multiplication instead of the real
  form's four element-wise passes), with grouped-query attention (``n_kv_heads`` key/value heads shared by groups
  of query heads, Ainslie et al., 2023; Llama 2 70B).
- Inference: a preallocated key/value cache (:class:`KVCache`), :meth:`Llama.generate` (greedy or sampling with
  temperature, top-k and nucleus top-p, Holtzman et al., 2020) over a batch of left-padded prompts, given as
  token ids or as embeddings (a vision-language model splices image features into them).

Weights load from a Hugging Face ``save_pretrained`` directory (``LlamaForCausalLM``) or Meta's original
``consolidated.*.pth`` + ``params.json``. Meta's checkpoints rotate consecutive pairs, as this model does;
Hugging Face's checkpoints permute the rows of each query and key head so that RoPE rotates the first half of the
head against the second ("rotate half"): :func:`hf_to_llama_state_dict` undoes that permutation, so both load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.convert import (
    CheckpointError,
    config_differences,
    read_hf_config,
    read_hf_state_dict,
    unreadable,
    with_generation_eos,
)
from vitlab.layers import (
    RMSNorm,
    SwiGLU,
    apply_rotary_embs,
    check_heads,
    checkpoint_seq,
    precompute_freqs_cis,
    swiglu_hidden_dim,
)
from vitlab.registry import ModelConfig, create_model, get_model_config, is_model, register_model

HF_ARCHITECTURES = ("LlamaForCausalLM", "llama")
# transformers' names of the SiLU (ACT2CLS), the only gate activation of Llama's SwiGLU
_HF_SILU = ("silu", "swish")
# keys of Meta's params.json that are no LlamaConfig field and do not change the function: the batch size of Meta's
# preallocated cache (its ModelArgs), and RoPE scaling when it is off
_META_IGNORED = ("max_batch_size", "use_scaled_rope")


@dataclass
class LlamaConfig:
    """The architecture of a Llama decoder (names as in Meta's ``params.json``)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: as many as the query heads (no grouping)
    vocab_size: int = 32000
    multiple_of: int = 256  # the SwiGLU width is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    hidden_dim: int | None = None  # the SwiGLU width; None: Llama's rule from dim, multiple_of, ffn_dim_multiplier
    head_dim: int | None = None  # None: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096  # the context: prompt plus generated tokens
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2  # one end of sequence or several (generation stops at any)
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = check_heads(self.dim, self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.hidden_dim is None:
            self.hidden_dim = swiglu_hidden_dim(self.dim, 4.0, self.multiple_of, self.ffn_dim_multiplier)


class KVCache:
    """The keys and values of every layer for a batch, preallocated: ``k[i]`` and ``v[i]`` are
    (batch, n_kv_heads, max_len, head_dim); the first ``length`` positions are filled. :meth:`Llama.forward`
    writes the new tokens' keys and values in place and advances ``length``; positions from ``length`` on are
    never read, so they are left unset (no pass over the whole cache to zero it)."""

    def __init__(self, config: LlamaConfig, batch_size: int, max_len: int, dtype=torch.float32, device=None):
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


class LlamaAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention with RoPE on the queries and keys. The query, key and
    value projections are one ``qkv`` linear layer (one matmul instead of three)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor | None,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0,
                last_only: bool = False) -> torch.Tensor:
        """``last_only``: keys and values of every position (written to ``kv``), the query and output of the last
        one only (``freqs_cis`` then per sequence, (B, N, 1, head_dim/2), as :meth:`Llama.forward` makes it)."""
        b, n, _ = x.shape
        dq, dkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if last_only:  # the cache needs every position's keys and values; the output, the last query only
            w_q, w_kv = self.qkv.weight.split([dq, 2 * dkv])
            q = apply_rotary_embs(F.linear(x[:, -1:], w_q).view(b, 1, self.n_heads, self.head_dim),
                                  freqs_cis[:, -1:]).transpose(1, 2)
            k, v = F.linear(x, w_kv).split([dkv, dkv], dim=-1)
        else:
            q, k, v = self.qkv(x).split([dq, dkv, dkv], dim=-1)
            q = apply_rotary_embs(q.view(b, n, self.n_heads, self.head_dim), freqs_cis).transpose(1, 2)
        k = apply_rotary_embs(k.view(b, n, self.n_kv_heads, self.head_dim), freqs_cis).transpose(1, 2)
        v = v.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if kv is not None:  # write this step's keys and values, attend over everything cached so far
            k_cache, v_cache = kv
            k_cache[:, :, start:start + n] = k
            v_cache[:, :, start:start + n] = v
            if start:  # with nothing cached before, the new keys and values are all there are
                k, v = k_cache[:, :, :start + n], v_cache[:, :, :start + n]
        if last_only:  # the last query sees every key; a padding mask's last row says which are real
            mask, n = None if mask is None else mask[:, :, -1:], 1
        # no mask: a prompt from position 0 is plain causal; one new token may see every cached one
        # SDPA's is_causal must be a plain bool: written as a branch, it stays one when torch.compile traces n as a
        # symbolic size (the branch becomes a guard; the comparison's value would be a symbolic bool)
        causal = mask is None and (True if n > 1 else False)
        out = self.attend(q, k, v, mask, causal)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool) -> torch.Tensor:
        """softmax(q k^T / sqrt(head_dim) + mask) v, per head (SDPA): q (B, n_heads, N, head_dim), k and v
        (B, n_kv_heads, M, head_dim), ``causal`` for a prompt from position 0 (M = N, no mask). A method of its own
        so that an optimized attention can stand in for it from outside (:mod:`vitlab.optimize.llama`)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=self.n_kv_heads != self.n_heads)


class LlamaBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(attn_norm(x))``, ``out = h + mlp(mlp_norm(h))``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.hidden_dim, bias=False)  # fc1 = [W1 (gate); W3 (up)], fc2 = W2 (down)

    def forward(self, x, freqs_cis, mask, kv=None, start: int = 0, last_only: bool = False,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """``keep``: a (B, N) boolean mask; the output is then (M, dim) for its M true positions in row-major order,
        and the MLP, which is per position, runs on those only."""
        h = (x[:, -1:] if last_only else x) + self.attn(self.attn_norm(x), freqs_cis, mask, kv, start, last_only)
        if keep is not None:
            h = h[keep]
        return h + self.mlp(self.mlp_norm(h))


def _left_padded(attention_mask: torch.Tensor) -> bool:
    """Whether each row of a (B, N) mask is zeros then ones, ending in a one (a prompt of at least one token)."""
    m = attention_mask.bool()
    return bool(m[:, -1].all()) and not bool((m[:, 1:] < m[:, :-1]).any())


def sample_next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row of ``logits`` (B, vocab): the argmax when ``temperature`` is 0, else a draw
    from ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens and then to the smallest
    set whose probability reaches ``top_p`` (nucleus sampling, Holtzman et al., 2020), in that order."""
    if not temperature:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1)  # ascending
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """``ValueError`` for generation settings :meth:`Llama.generate` refuses, before anything is computed."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not 0 <= temperature < float("inf"):  # NaN too
        raise ValueError(f"temperature must be finite and >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


class Llama(nn.Module):
    """The Llama decoder. ``forward`` returns next-token logits; :meth:`generate` continues prompts.

    Public interface (what vision-language models build on): ``embed_tokens`` (the ``nn.Embedding``),
    ``config`` (a :class:`LlamaConfig`: ``dim``, ``vocab_size``, ``max_seq_len``...), ``forward(input_ids |
    inputs_embeds, attention_mask, position_ids, cache)``, :meth:`new_cache` and :meth:`generate`.
    """

    def __init__(self, config: LlamaConfig | None = None, **kwargs):
        super().__init__()
        cfg = config if config is not None else LlamaConfig(**kwargs)
        self.config = cfg
        self.grad_checkpointing = False
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope_freqs", torch.empty(0), persistent=False)
        self.reset_rope()
        self.apply(self._init_weights)
        self.kept_cache: KVCache | None = None  # generate's last KV cache on the CPU (see generate's ``cache``)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):  # N(0, 0.02), as Hugging Face's LlamaPreTrainedModel
            nn.init.normal_(m.weight, std=0.02)

    def reset_rope(self, device=None) -> None:
        """(Re)compute the RoPE rotations of every position of the context, ``rope_freqs`` (max_seq_len,
        head_dim/2, 2): the real and imaginary parts of Meta's ``freqs_cis``, stored as real numbers so that
        ``model.to(dtype)`` casts them like every other buffer (a cast to a real dtype would drop the imaginary part
        of a complex table). They are not part of the state dict, so a model built on the ``meta`` device and then
        given weights calls this."""
        device = device if device is not None else self.embed_tokens.weight.device
        cfg = self.config
        freqs_cis = precompute_freqs_cis(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.rope_freqs = torch.view_as_real(freqs_cis).to(device)

    def shard_units(self) -> list[nn.Module]:
        return list(self.layers)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass (less memory, same gradients)."""
        self.grad_checkpointing = enable

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype=None, device=None) -> KVCache:
        """An empty :class:`KVCache` for ``batch_size`` sequences of up to ``max_len`` tokens (default: the
        context), in the model's dtype and on its device unless told."""
        w = self.embed_tokens.weight
        return KVCache(self.config, batch_size, max_len or self.config.max_seq_len, dtype or w.dtype,
                       device or w.device)

    def check_config(self, other: LlamaConfig, source: str) -> None:
        """``ValueError`` naming the differences unless ``other`` describes this decoder's function: its width,
        layers, heads, SwiGLU width, RMSNorm eps and RoPE base (the vocabulary and the context aside)."""
        keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "head_dim", "norm_eps", "rope_theta")
        bad = config_differences({k: (getattr(other, k), getattr(self.config, k)) for k in keys})
        if bad:
            raise ValueError(f"{source}: another Llama architecture: {', '.join(bad)}")

    def release_cache(self) -> None:
        """Free the KV cache :meth:`generate` keeps on the CPU (the next call allocates one)."""
        self.kept_cache = None

    def _generation_cache(self, batch_size: int, length: int) -> KVCache:
        """The cache of a :meth:`generate` call given none (see its ``cache``): taken from the model while in use,
        so a concurrent call on the same model makes its own."""
        kept, self.kept_cache = self.kept_cache, None
        if self.embed_tokens.weight.device.type != "cpu":
            return self.new_cache(batch_size, length)
        try:
            self.check_cache(kept, batch_size, length)
        except ValueError:  # none kept, or not this call's shape, dtype or device
            kept = self.new_cache(batch_size, length)
        return kept

    def check_cache(self, cache: KVCache, batch_size: int, length: int) -> None:
        """``ValueError`` unless ``cache`` is one of this model's layout, dtype and device holding ``batch_size``
        sequences of ``length`` tokens."""
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a KVCache (model.new_cache(...)), got {type(cache).__name__}")
        cfg, w = self.config, self.embed_tokens.weight
        k = cache.k[0]
        if len(cache.k) != cfg.n_layers or (k.shape[1], k.shape[3]) != (cfg.n_kv_heads, cfg.head_dim):
            raise ValueError(f"the cache is laid out for another model: {len(cache.k)} layers of {k.shape[1]} "
                             f"key/value heads of {k.shape[3]}, this one has {cfg.n_layers} of {cfg.n_kv_heads} of "
                             f"{cfg.head_dim}")
        if (k.dtype, k.device) != (w.dtype, w.device):
            raise ValueError(f"the cache is {k.dtype} on {k.device}, the model {w.dtype} on {w.device}")
        if k.shape[0] != batch_size or cache.max_len < length:
            raise ValueError(f"the cache holds {k.shape[0]} rows of {cache.max_len} positions; this call needs "
                             f"{batch_size} rows of {length}")

    def profile_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        """What :mod:`vitlab.profile` runs: ``x.shape[-1]`` tokens per sequence (the registered input size is
        (1, 1, context), one full context)."""
        return (torch.zeros(x.shape[0], x.shape[-1], dtype=torch.long, device=x.device),)

    def _mask(self, attention_mask: torch.Tensor | None, n: int, past: int) -> torch.Tensor | None:
        """The boolean SDPA mask (B, 1, n, past + n) of ``n`` new tokens after ``past`` cached ones; None where
        plain causal attention (or, for one new token, none) is exact."""
        if attention_mask is None and (past == 0 or n == 1):
            return None
        device = self.rope_freqs.device
        q_pos = torch.arange(past, past + n, device=device)[:, None]
        k_pos = torch.arange(past + n, device=device)[None, :]
        mask = k_pos <= q_pos  # (n, past + n) causal
        if attention_mask is not None:
            # padding is never a key; a padding query attends to itself only, so its row is never empty (an empty
            # softmax row gives NaN, which the next layer would carry into real tokens through 0 * NaN)
            mask = (mask & attention_mask[:, None, :].bool()) | (k_pos == q_pos)
        return mask.reshape(-1, 1, n, past + n)

    def forward(self, input_ids: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, logits_to_keep: int = 0,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits (B, N, vocab_size) for ``input_ids`` (B, N) or ``inputs_embeds`` (B, N, dim).

        - ``attention_mask``: (B, past + N), 1 for real tokens and 0 for padding (left padding), covering the
          cached tokens too; padding is never attended to.
        - ``position_ids``: (B, N) RoPE positions; default: the count of real tokens before each token (so a
          left-padded prompt starts at 0), or ``past, ..., past + N - 1`` without a mask.
        - ``cache``: a :class:`KVCache`; the new keys and values are written into it **in place** and
          ``cache.length`` advances by N, so the next call passes only the new tokens.
        - ``logits_to_keep``: only the last that many positions' logits (0: all); generation needs the last. With
          a cache and ``logits_to_keep=1`` the last block computes the keys and values of every position (the
          cache needs them) but its query, attention output and MLP for the last position only: the rest would be
          dropped.
        - ``logits_at``: a (B, N) boolean mask of the positions whose logits are wanted (a training loss on some
          tokens only, e.g. the answers); the logits come back (M, vocab_size) for its M true positions in
          row-major order, and the last block runs its MLP on those positions only (the same logits; its
          attention still reads every position).

        Cached plus new tokens (padding included) must fit the context (``config.max_seq_len``): otherwise
        ``ValueError``.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, n = x.shape[:2]
        past = cache.length if cache is not None else 0
        context = self.rope_freqs.shape[0]  # RoPE's table: one rotation per position of the context
        if past + n > context:  # shapes only (no device sync); a lookup past the table would fail on an index
            raise ValueError(f"{past} cached plus {n} new tokens take {past + n} positions, beyond the context of "
                             f"max_seq_len {context} (RoPE rotates positions 0..{context - 1} only)")
        if cache is not None and past + n > cache.max_len:
            raise ValueError(f"{past} cached plus {n} new tokens exceed the cache of {cache.max_len}")
        if logits_at is not None and (logits_to_keep or logits_at.dtype != torch.bool
                                      or tuple(logits_at.shape) != (b, n)):
            raise ValueError(f"logits_at must be a boolean (batch, new tokens) = ({b}, {n}) mask, without "
                             f"logits_to_keep; got {logits_at.dtype} {tuple(logits_at.shape)}, logits_to_keep "
                             f"{logits_to_keep}")
        if attention_mask is not None and tuple(attention_mask.shape) != (b, past + n):
            raise ValueError(f"attention_mask must be (batch, cached + new) = ({b}, {past + n}), "
                             f"got {tuple(attention_mask.shape)}")
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            else:
                position_ids = torch.arange(past, past + n, device=x.device).expand(b, n)
        freqs_cis = torch.view_as_complex(self.rope_freqs[position_ids, None].float())  # (B, N, 1, head_dim/2)
        mask = self._mask(attention_mask, n, past)
        layers = list(self.layers)
        if logits_at is not None:  # the last block's output at the kept positions only
            layers[-1] = partial(layers[-1], keep=logits_at)
        if cache is None:  # training or a full recomputation: blocks may recompute their activations
            x = checkpoint_seq(layers, x, freqs_cis, mask, enabled=self.grad_checkpointing)
        else:
            last = len(layers) - 1
            for i, (layer, k, v) in enumerate(zip(layers, cache.k, cache.v)):
                x = layer(x, freqs_cis, mask, (k, v), past, last_only=i == last and logits_to_keep == 1)
            cache.length = past + n
        x = self.norm(x if not logits_to_keep else x[:, -logits_to_keep:])
        return self.lm_head(x)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | None = None, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                 *, attention_mask: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                 pad_token_id: int | None = None, generator: torch.Generator | None = None,
                 on_token: Callable[[torch.Tensor], None] | None = None,
                 forward: Callable[..., torch.Tensor] | None = None, vocab_size: int | None = None,
                 cache: KVCache | None = None) -> torch.Tensor:
        """Continue a batch of prompts by up to ``max_new_tokens`` tokens; returns only the new tokens
        (B, n_new).

        - The prompt: ``input_ids`` (B, N) or ``inputs_embeds`` (B, N, dim); prompts of different lengths are
          left-padded with ``attention_mask`` (B, N) 0 on the padding (each row zeros then ones, at least one:
          otherwise ``ValueError``).
        - ``temperature`` 0 (default) is greedy decoding; above 0 samples, with ``top_k`` / ``top_p`` filters
          (:func:`sample_next_token`, ``generator`` for reproducible draws).
        - A row stops at ``eos_token_id`` (one id or several; default: ``config.eos_token_id``, as transformers'
          ``generate`` falls back to the model's eos; ``[]``: never stop, always ``max_new_tokens`` tokens); its
          later positions hold ``pad_token_id`` (default: the config's, else the first eos id); generation ends
          early when every row has stopped.
        - ``on_token(tokens)`` is called with each step's (B,) tokens as soon as they exist (streaming).
        - ``forward``: what computes the logits, called as the model's forward is (default: the model; a compiled
          one from :func:`vitlab.optimize.llama.compile_llama` is faster).
        - ``vocab_size``: only ids below it are generated, for a tokenizer smaller than the embedding (LLaVA-1.5
          pads its 32,001 tokens to 32,064 rows): the spare rows have no text, so they are never chosen.
        - ``cache``: a :class:`KVCache` to fill from its first position, of this batch size and at least prompt plus
          ``max_new_tokens`` long. Default: on the CPU the cache of the last call, kept on the model
          (``kept_cache``), when it has this batch size, dtype and device and is long enough, else a new one kept
          in its place (:meth:`release_cache` frees it): a new CPU cache costs more than its allocation, as the
          operating system hands its pages over zeroed at their first write (some 15,000 page faults, 6% of a
          ``llama_100m`` batch-8 prompt). On a GPU a new one per call (its caching allocator recycles the memory,
          which a kept cache would hold through training).

        Prompt plus ``max_new_tokens`` must fit the context (``config.max_seq_len``): otherwise ``ValueError``.
        """
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        if vocab_size is not None and not 0 < vocab_size <= self.config.vocab_size:
            raise ValueError(f"vocab_size must be in 1..{self.config.vocab_size} (the embedding's rows), "
                             f"got {vocab_size}")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        prompt = inputs_embeds if inputs_embeds is not None else input_ids
        if prompt.dim() != (3 if inputs_embeds is not None else 2) or 0 in prompt.shape[:2]:
            raise ValueError(f"the prompt must be (batch, tokens{', dim' if inputs_embeds is not None else ''}) "
                             f"with at least one row of one token, got {tuple(prompt.shape)}")
        b, n = prompt.shape[:2]
        # named here, once per call, rather than as an embedding lookup's IndexError (or a GPU's device assert)
        if input_ids is not None:
            lo, hi = (int(t) for t in prompt.aminmax())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"the prompt holds token ids outside the vocabulary 0..{self.config.vocab_size - 1}: "
                                 f"{lo} to {hi}")
        if n + max_new_tokens > self.config.max_seq_len:
            raise ValueError(f"the prompt ({n} tokens) plus max_new_tokens ({max_new_tokens}) exceed the context of "
                             f"{self.config.max_seq_len} tokens")
        device = prompt.device
        if attention_mask is not None and tuple(attention_mask.shape) != (b, n):
            raise ValueError(f"attention_mask must be (batch, prompt) = ({b}, {n}), got {tuple(attention_mask.shape)}")
        if attention_mask is not None and not _left_padded(attention_mask):
            raise ValueError("attention_mask must mark left padding: in each row zeros (padding) then ones (the "
                             "prompt), at least one; right padding, gaps or an all-padding row are refused")
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: plain causal attention, no mask to build
        full_mask = None
        if attention_mask is not None:  # the mask of every position generation can reach, sliced per step
            full_mask = torch.cat([attention_mask.bool(), attention_mask.new_ones(b, max_new_tokens, dtype=torch.bool)],
                                  dim=1)
        if eos_token_id is None:  # the model's own end of sequence; [] asks for none
            eos_token_id = self.config.eos_token_id
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        eos_t = torch.tensor(eos, device=device)
        pad = pad_token_id if pad_token_id is not None else (
            self.config.pad_token_id if self.config.pad_token_id is not None else (eos[0] if eos else 0))
        forward = self if forward is None else forward
        own_cache = cache is None
        if own_cache:
            cache = self._generation_cache(b, n + max_new_tokens)
        else:
            self.check_cache(cache, b, n + max_new_tokens)
        cache.length = 0
        logits = forward(input_ids if inputs_embeds is None else None, inputs_embeds=inputs_embeds,
                         attention_mask=None if full_mask is None else full_mask[:, :n], cache=cache,
                         logits_to_keep=1)[:, -1, :vocab_size]
        done = torch.zeros(b, dtype=torch.bool, device=device)
        out = []
        for i in range(max_new_tokens):
            tok = sample_next_token(logits, temperature, top_k, top_p, generator)
            if eos:
                tok = tok.masked_fill(done, pad)
                done |= torch.isin(tok, eos_t)
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            if i == max_new_tokens - 1 or (eos and bool(done.all())):
                break
            logits = forward(tok[:, None], attention_mask=None if full_mask is None else full_mask[:, :n + i + 1],
                             cache=cache)[:, -1, :vocab_size]
        if own_cache and cache.k[0].device.type == "cpu":
            self.kept_cache = cache
        return torch.stack(out, dim=1)

    # ---- weights --------------------------------------------------------------------------------------
    def checkpoint_filter_fn(self, sd: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        """Ours, Hugging Face's or Meta's key names -> ours (see :func:`hf_to_llama_state_dict`)."""
        if any(k.startswith("model.layers.") or k == "model.embed_tokens.weight" for k in sd):
            return hf_to_llama_state_dict(sd, self.config)
        if "tok_embeddings.weight" in sd:
            return meta_to_llama_state_dict(sd, self.config)
        return sd

    def read_checkpoint(self, path: str | os.PathLike) -> dict[str, torch.Tensor]:
        """The tensors of a checkpoint file or directory: a Hugging Face ``save_pretrained`` directory, Meta's
        ``consolidated.*.pth`` directory, or one weights file (keys as saved; ``checkpoint_filter_fn`` maps them).
        A directory's ``config.json`` or ``params.json`` must describe this decoder's function
        (:meth:`check_config`): the tensors' shapes cannot tell the RoPE base, the RMSNorm eps, the activation or
        RoPE scaling, and a checkpoint trained with others would load without a message and compute other logits."""
        path = Path(path)
        if path.is_dir() and ((path / "config.json").is_file() or (path / "params.json").is_file()):
            self.check_config(llama_config_from_dir(path), str(path))
        return self._read_tensors(path)

    @staticmethod
    def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
        """:meth:`read_checkpoint` without the architecture check (:meth:`from_pretrained` builds the model from
        the directory's own config)."""
        if path.is_dir() and not (path / "config.json").is_file() and sorted(path.glob("consolidated.*.pth")):
            return read_meta_state_dict(path)
        sd = read_hf_state_dict(path)
        if path.is_dir():
            sd = fill_tied_head(sd, read_hf_config(path, HF_ARCHITECTURES), "model.embed_tokens.weight",
                                "lm_head.weight")
        return sd

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None,
                        **overrides) -> Llama:
        """A Llama with the architecture and weights of a Hugging Face ``save_pretrained`` directory
        (``config.json`` of a ``LlamaForCausalLM``) or of Meta's release (``params.json`` + ``consolidated.*.pth``).
        The model is built without allocating random weights (``meta`` device) and takes the checkpoint's
        tensors, cast to ``dtype`` (default: float32). ``overrides``: config fields (e.g. ``max_seq_len``)."""
        path = Path(path)
        if not path.is_dir():
            raise NotADirectoryError(f"{path} is not a directory: expected a Hugging Face save_pretrained directory "
                                     f"or Meta's params.json + consolidated.*.pth")
        cfg = llama_config_from_dir(path, **overrides)
        with torch.device("meta"):
            model = cls(cfg)
        sd = cls._read_tensors(path)
        try:
            sd = model.checkpoint_filter_fn(sd, model)
        except CheckpointError as e:  # tensors missing for the config: say which checkpoint
            raise CheckpointError(f"{path}: {e}") from None
        sd = {k: v.to(dtype or torch.float32) for k, v in sd.items()}
        own = model.state_dict()
        missing, unexpected = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
        bad = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in sd.items()
               if k in own and v.shape != own[k].shape]
        if missing or unexpected or bad:
            raise CheckpointError(f"{path} does not match its own config: missing keys {missing[:4]}, unexpected "
                                  f"keys {unexpected[:4]}, shape mismatches {bad[:4]}")
        model.load_state_dict(sd, assign=True)  # the model takes the checkpoint's tensors: no second copy
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.reset_rope(device="cpu")
        return model.eval()


def fill_tied_head(sd: dict[str, torch.Tensor], hf_config: dict, embed: str, head: str) -> dict[str, torch.Tensor]:
    """``sd`` with the embedding ``embed`` as the output head ``head`` when the checkpoint's ``config.json`` ties
    them (``tie_word_embeddings``, top level or its ``text_config``): ``save_pretrained`` leaves a tied head out of
    the file. A checkpoint of untied weights without its head stays so (its load names the missing key). A tied
    config whose file holds a head other than its embedding is refused (:class:`CheckpointError`): the model would
    compute its logits with one of the two and drop the other."""
    tied = hf_config.get("tie_word_embeddings") or (hf_config.get("text_config") or {}).get("tie_word_embeddings")
    if tied and embed in sd:
        if head not in sd:
            return {**sd, head: sd[embed]}
        if not torch.equal(sd[head], sd[embed]):
            raise CheckpointError(f"config.json ties the output layer to the embedding (tie_word_embeddings), but the "
                                  f"weights hold a {head} other than {embed}")
    return sd


def load_llama(spec: str | os.PathLike, dtype: torch.dtype | None = None) -> Llama:
    """A Llama from a checkpoint directory (Hugging Face or Meta, :meth:`Llama.from_pretrained`) or a registered
    language model's name (random weights)."""
    if Path(spec).is_dir():
        return Llama.from_pretrained(spec, dtype=dtype)
    if is_model(str(spec)):
        if get_model_config(str(spec)).family != "llama":
            raise ValueError(f"{spec} is not a language model (family {get_model_config(str(spec)).family!r})")
        return create_model(str(spec)).to(dtype or torch.float32).eval()
    raise FileNotFoundError(f"{spec} is neither a checkpoint directory nor a registered language model "
                            f"(e.g. llama_tiny)")


# ---- checkpoint formats ---------------------------------------------------------------------------------------

def _unpermute_rope(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Hugging Face's "rotate half" row order of a query / key projection -> Meta's consecutive pairs: Hugging Face
    stores row ``(h, half, j)`` where Meta has ``(h, j, half)`` (its conversion script's ``permute``)."""
    return w.reshape(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def _check_keys(sd: dict[str, torch.Tensor], needed: list[str]) -> None:
    """:class:`CheckpointError` naming the tensors of ``needed`` a checkpoint lacks (an index that leaves a shard
    out, a file cut to fewer layers), before any is converted."""
    missing = [k for k in needed if k not in sd]
    if missing:
        raise CheckpointError(f"the checkpoint lacks {len(missing)} of the {len(needed)} tensors a Llama of its "
                              f"config needs, e.g. {', '.join(map(repr, missing[:3]))}")


# buffers some checkpoints carry that are no weights: RoPE tables (older transformers' per-layer ``inv_freq``,
# Meta's ``rope.freqs``), recomputed here
_RECOMPUTED = ("rotary_emb.inv_freq", "rope.freqs")


def _check_unread(sd: dict[str, torch.Tensor], read: set[str], cfg: LlamaConfig) -> None:
    """:class:`CheckpointError` naming the tensors of ``sd`` the conversion does not read (biases, layers beyond
    the config's ``n_layers``): refused, never dropped, since the checkpoint then computes another function."""
    unread = sorted(k for k in sd if k not in read and not k.endswith(_RECOMPUTED))
    if unread:
        raise CheckpointError(f"the checkpoint holds {len(unread)} tensor(s) a Llama of its config (n_layers "
                              f"{cfg.n_layers}, no biases) has no place for, e.g. {', '.join(map(repr, unread[:3]))}: "
                              f"another architecture, refused rather than dropped")


def hf_to_llama_state_dict(sd: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """A Hugging Face ``LlamaForCausalLM`` state dict -> ours: q/k/v packed into ``qkv`` (q and k rows back in
    RoPE's pair order), gate/up packed into ``mlp.fc1``, down -> ``mlp.fc2``."""
    needed = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{name}.weight" for i in range(cfg.n_layers)
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                     "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")]
    _check_keys(sd, needed)
    _check_unread(sd, {*needed, "lm_head.weight"}, cfg)
    out = {"embed_tokens.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    if "lm_head.weight" in sd:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        q = _unpermute_rope(sd[p + "self_attn.q_proj.weight"], cfg.n_heads, cfg.head_dim)
        k = _unpermute_rope(sd[p + "self_attn.k_proj.weight"], cfg.n_kv_heads, cfg.head_dim)
        out.update({
            f"layers.{i}.attn.qkv.weight": torch.cat([q, k, sd[p + "self_attn.v_proj.weight"]]),
            f"layers.{i}.attn.proj.weight": sd[p + "self_attn.o_proj.weight"],
            f"layers.{i}.mlp.fc1.weight": torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]),
            f"layers.{i}.mlp.fc2.weight": sd[p + "mlp.down_proj.weight"],
            f"layers.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"layers.{i}.mlp_norm.weight": sd[p + "post_attention_layernorm.weight"],
        })
    return out


def meta_to_llama_state_dict(sd: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Meta's ``consolidated.*.pth`` names -> ours (no permutation: Meta already rotates consecutive pairs)."""
    needed = ["tok_embeddings.weight", "norm.weight", "output.weight"] + [
        f"layers.{i}.{name}.weight" for i in range(cfg.n_layers)
        for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                     "feed_forward.w2", "feed_forward.w3", "attention_norm", "ffn_norm")]
    _check_keys(sd, needed)
    _check_unread(sd, set(needed), cfg)
    out = {"embed_tokens.weight": sd["tok_embeddings.weight"], "norm.weight": sd["norm.weight"],
           "lm_head.weight": sd["output.weight"]}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out.update({
            f"layers.{i}.attn.qkv.weight": torch.cat([sd[p + f"attention.{w}.weight"] for w in ("wq", "wk", "wv")]),
            f"layers.{i}.attn.proj.weight": sd[p + "attention.wo.weight"],
            f"layers.{i}.mlp.fc1.weight": torch.cat([sd[p + f"feed_forward.{w}.weight"] for w in ("w1", "w3")]),
            f"layers.{i}.mlp.fc2.weight": sd[p + "feed_forward.w2.weight"],
            f"layers.{i}.attn_norm.weight": sd[p + "attention_norm.weight"],
            f"layers.{i}.mlp_norm.weight": sd[p + "ffn_norm.weight"],
        })
    return out


# Meta's model-parallel shards split each matrix: the embedding and the row-parallel output projections (wo, w2)
# along their input dimension, every other matrix along its output dimension; norms are replicated
_META_SPLIT_DIM1 = ("tok_embeddings.weight", "attention.wo.weight", "feed_forward.w2.weight")


def _check_meta_ranks(folder: Path, files: list[Path], shards: list[dict[str, torch.Tensor]]) -> None:
    """:class:`CheckpointError` naming the missing files when ``files`` are not every model-parallel rank: their
    numbers must run 00, 01, ... and, with ``params.json`` beside them, the embedding's shards (each holds
    ``dim / ranks`` of its columns) must add up to its ``dim``."""
    ranks = [f.name.split(".")[1] for f in files]
    if not all(r.isdigit() for r in ranks):
        raise CheckpointError(f"{folder}: Meta's weights are consolidated.NN.pth, one per model-parallel rank; got "
                              f"{', '.join(f.name for f in files)}")
    width = shards[0].get("tok_embeddings.weight")
    expected = len(files)
    if width is not None and width.ndim == 2 and (folder / "params.json").is_file():
        try:
            dim = json.loads((folder / "params.json").read_text()).get("dim")
        except (UnicodeDecodeError, json.JSONDecodeError):
            dim = None  # named by the config check
        if isinstance(dim, int) and width.shape[1] and dim % width.shape[1] == 0:
            expected = dim // width.shape[1]
    missing = sorted({f"consolidated.{i:02d}.pth" for i in range(expected)} - {f.name for f in files})
    if missing or len(files) != expected:
        raise CheckpointError(f"{folder}: the weights are split over {expected} model-parallel rank(s), "
                              f"consolidated.00.pth to consolidated.{expected - 1:02d}.pth; "
                              + (f"missing {', '.join(missing)}" if missing else f"{len(files)} files are there"))


def read_meta_state_dict(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Meta's released weights: ``consolidated.00.pth``, ``consolidated.01.pth``... (one per model-parallel rank,
    read with ``weights_only=True``), merged into one state dict with Meta's key names."""
    files = sorted(Path(folder).glob("consolidated.*.pth"))
    if not files:
        raise FileNotFoundError(f"no consolidated.*.pth in {folder}")
    shards = []
    for f in files:
        try:
            shards.append(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        except Exception as e:  # a truncated file: name it in one line
            raise unreadable(f, e, "weights file") from None
    _check_meta_ranks(Path(folder), files, shards)
    if len(shards) == 1:
        return {k: v for k, v in shards[0].items() if k != "rope.freqs"}
    out = {}
    for k, v in shards[0].items():
        if k == "rope.freqs":  # Meta's RoPE table, recomputed here
            continue
        if v.ndim == 1:
            out[k] = v
        else:
            out[k] = torch.cat([s[k] for s in shards], dim=1 if k.endswith(_META_SPLIT_DIM1) else 0)
    return out


def llama_config_from_hf(hf: dict, **overrides) -> LlamaConfig:
    """A :class:`LlamaConfig` from a Hugging Face ``LlamaConfig`` dict (``config.json``). What vitlab does not
    implement and the weights cannot show is refused in one line: RoPE scaling, biases, a gate activation other
    than SiLU (Llama 2's SwiGLU, Shazeer, 2020)."""
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        raise ValueError(f"RoPE scaling {scaling.get('rope_type') or scaling.get('type')!r} is not supported "
                         f"(Llama 2 uses none)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention or MLP biases are not part of Llama 2")
    act = hf.get("hidden_act", "silu")  # transformers' LlamaConfig default
    if act not in _HF_SILU:  # the weights cannot tell the gate's activation
        raise ValueError(f"hidden_act {act!r} is not supported (Llama 2's SwiGLU gates with silu)")
    kw = dict(dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
              n_kv_heads=hf.get("num_key_value_heads"), vocab_size=hf["vocab_size"],
              hidden_dim=hf["intermediate_size"], head_dim=hf.get("head_dim"), norm_eps=hf.get("rms_norm_eps", 1e-6),
              rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
              max_seq_len=hf.get("max_position_embeddings", 2048),  # transformers' default
              tie_word_embeddings=hf.get("tie_word_embeddings", False), bos_token_id=hf.get("bos_token_id"),
              eos_token_id=hf.get("eos_token_id"), pad_token_id=hf.get("pad_token_id"))
    return LlamaConfig(**{**kw, **overrides})


def llama_config_from_meta(params: dict, vocab_size: int, **overrides) -> LlamaConfig:
    """A :class:`LlamaConfig` from Meta's ``params.json`` (its ``vocab_size`` is -1 in the Llama 2 release: the
    embedding's rows give it). Every key must be one vitlab reads: a :class:`LlamaConfig` field (``dim``,
    ``n_layers``, ``n_heads``, ``n_kv_heads``, ``multiple_of``, ``ffn_dim_multiplier``, ``norm_eps``,
    ``rope_theta``, ``max_seq_len``...), ``max_batch_size`` (the size of Meta's preallocated cache, no part of the
    function) or ``use_scaled_rope`` false. Any other key is refused in one line rather than dropped: Llama 3.1's
    ``use_scaled_rope: true`` (its RoPE frequency scaling, Meta's ``apply_scaling``) or the vision keys of Llama 3.2
    change the function, and a dropped key would load with wrong outputs."""
    if params.get("use_scaled_rope"):
        raise ValueError("use_scaled_rope true (Llama 3.1's RoPE frequency scaling) is not supported (Llama 2 "
                         "uses none)")
    names = {f.name for f in fields(LlamaConfig)}
    unknown = sorted(k for k in params if k not in names and k not in _META_IGNORED)
    if unknown:
        raise ValueError(f"keys {unknown} are not read by vitlab and may change the function (it reads "
                         f"LlamaConfig's fields, max_batch_size and use_scaled_rope false)")
    kw = {k: v for k, v in params.items() if k in names}
    kw["vocab_size"] = vocab_size
    return LlamaConfig(**{**kw, **overrides})


def llama_config_from_dir(path: str | os.PathLike, **overrides) -> LlamaConfig:
    """The architecture of a checkpoint directory: Hugging Face's ``config.json`` or Meta's ``params.json``."""
    path = Path(path)
    if (path / "config.json").is_file():
        hf = with_generation_eos(read_hf_config(path, HF_ARCHITECTURES), path)  # where generate stops
        try:
            return llama_config_from_hf(hf, **overrides)
        except KeyError as e:
            raise ValueError(f"{path / 'config.json'} has no {e}") from None
        except ValueError as e:  # what vitlab does not implement, named with the file
            raise ValueError(f"{path / 'config.json'}: {e}") from None
    if (path / "params.json").is_file():
        try:
            params = json.loads((path / "params.json").read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path / 'params.json'} is not valid JSON ({e})") from None
        vocab = params.get("vocab_size", -1)
        if vocab is None or vocab < 0:
            files = sorted(path.glob("consolidated.*.pth"))
            if not files:
                raise FileNotFoundError(f"no consolidated.*.pth in {path}")
            try:
                vocab = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)[
                    "tok_embeddings.weight"].shape[0]
            except Exception as e:
                raise unreadable(files[0], e, "weights file") from None
        try:
            return llama_config_from_meta(params, vocab, **overrides)
        except ValueError as e:
            raise ValueError(f"{path / 'params.json'}: {e}") from None
    raise FileNotFoundError(f"{path} holds neither config.json (Hugging Face) nor params.json (Meta)")


def llama_to_hf_config(cfg: LlamaConfig) -> dict:
    """The Hugging Face ``config.json`` fields of a :class:`LlamaConfig` (for exporting or comparing)."""
    c = asdict(cfg)
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=c["dim"],
                num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
                num_key_value_heads=c["n_kv_heads"], vocab_size=c["vocab_size"], intermediate_size=c["hidden_dim"],
                head_dim=c["head_dim"], rms_norm_eps=c["norm_eps"], rope_theta=c["rope_theta"],
                max_position_embeddings=c["max_seq_len"], tie_word_embeddings=c["tie_word_embeddings"],
                bos_token_id=c["bos_token_id"], eos_token_id=c["eos_token_id"], pad_token_id=c["pad_token_id"],
                hidden_act="silu", attention_bias=False, mlp_bias=False)


# ---- registered configurations ---------------------------------------------------------------------------------

_PAPER = "Touvron et al., Llama 2: Open Foundation and Fine-Tuned Chat Models, 2023 (Table 1)"
_SMOKE = {"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 256, "max_seq_len": 64}


def _cfg(context: int, params_m: float | None = None, hub: str | None = None) -> ModelConfig:
    # input size (1, 1, context): one sequence of a full context, what `vitlab models` / `info` profile
    return ModelConfig(family="llama", task="generate", paper=_PAPER, input_size=(1, 1, context), mean=(0.0,),
                       std=(1.0,), crop_pct=1.0, num_classes=0, published_params_m=params_m, hf_hub_id=hub,
                       smoke_kwargs=_SMOKE)


def _llama(defaults: dict, kwargs: dict) -> Llama:
    return Llama(LlamaConfig(**{**defaults, **kwargs}))


@register_model(config=_cfg(4096, 7000.0))
def llama2_7b(**kwargs) -> Llama:
    """Llama 2 7B: dim 4096, 32 layers of 32 heads, SwiGLU 11008, vocabulary 32000, context 4096."""
    return _llama(dict(dim=4096, n_layers=32, n_heads=32), kwargs)


@register_model(config=_cfg(4096, 13000.0))
def llama2_13b(**kwargs) -> Llama:
    """Llama 2 13B: dim 5120, 40 layers of 40 heads, SwiGLU 13824."""
    return _llama(dict(dim=5120, n_layers=40, n_heads=40), kwargs)


@register_model(config=_cfg(4096, 70000.0))
def llama2_70b(**kwargs) -> Llama:
    """Llama 2 70B: dim 8192, 80 layers of 64 query heads sharing 8 key/value heads (grouped-query attention),
    SwiGLU 28672 (``ffn_dim_multiplier`` 1.3, multiple of 4096)."""
    return _llama(dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
                  kwargs)


@register_model(config=_cfg(2048))
def llama_100m(**kwargs) -> Llama:
    """A ~100M-parameter Llama (dim 640, 12 layers of 10 heads of 64, SwiGLU 1792, vocabulary 32000, context
    2048): the generation-speed benchmark's model."""
    return _llama(dict(dim=640, n_layers=12, n_heads=10, max_seq_len=2048), kwargs)


@register_model(config=_cfg(256))
def llama_tiny(**kwargs) -> Llama:
    """A tiny Llama for tests and demos: dim 64, 2 layers of 4 heads (2 key/value heads), SwiGLU 192 (multiple of
    32), vocabulary 512, context 256."""
    return _llama(dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, vocab_size=512, max_seq_len=256),
                  kwargs)
