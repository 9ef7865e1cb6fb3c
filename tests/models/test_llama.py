"""The Llama decoder: equal to transformers' LlamaForCausalLM for the same (random) weights, loaded from a Hugging
Face directory and from Meta's layout; the KV cache equal to full recomputation; generation and its checks."""

from __future__ import annotations

import json
import re

import pytest
import torch

import vitlab
from vitlab.convert import CheckpointError
from vitlab.layers import RotaryEmbedding1D, apply_rotary_embs, rope_rotate, swiglu_hidden_dim
from vitlab.models.llama import Llama, LlamaConfig, sample_next_token

transformers = pytest.importorskip("transformers")

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, vocab_size=512, max_seq_len=256)


def _hf_model(tmp_path, **kw):
    """A random-init transformers LlamaForCausalLM of llama_tiny's shape (grouped-query attention, 2 kv heads),
    saved with save_pretrained into tmp_path."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                             max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
                                             eos_token_id=2), **kw})
    ref = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so a swapped norm weight would show
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ref.save_pretrained(tmp_path)
    return ref


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_llama")
    ref = _hf_model(path)
    return ref, Llama.from_pretrained(path), path


def _padded_batch():
    ids = torch.randint(3, 512, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: prompts of 9, 5 and 7 tokens
    mask[2, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_llama2_sizes_and_hidden_rule():
    assert swiglu_hidden_dim(4096, multiple_of=256) == 11008
    assert swiglu_hidden_dim(5120, multiple_of=256) == 13824
    assert swiglu_hidden_dim(8192, multiple_of=4096, ffn_dim_multiplier=1.3) == 28672
    with torch.device("meta"):
        m = vitlab.create_model("llama2_7b")
    assert sum(p.numel() for p in m.parameters()) == 6_738_415_616
    assert m.layers[0].mlp.fc2.in_features == 11008 and m.config.dim == 4096 and m.config.vocab_size == 32000
    assert not any(n.endswith("bias") for n, _ in m.named_parameters())
    assert vitlab.get_model_config("llama2_7b").task == "generate"
    with torch.device("meta"):
        assert 95e6 < sum(p.numel() for p in vitlab.create_model("llama_100m").parameters()) < 110e6


def test_logits_equal_transformers(pair):
    ref, ours, _ = pair
    ids = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)
        ids, mask = _padded_batch()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        theirs = ref(ids, attention_mask=mask, position_ids=pos).logits
        mine = ours(ids, attention_mask=mask)  # positions from the mask by default
    real = mask.bool()
    torch.testing.assert_close(mine[real], theirs[real], atol=1e-4, rtol=1e-4)


def test_create_model_loads_the_hf_directory(pair):
    ref, ours, path = pair
    loaded = vitlab.create_model("llama_tiny", checkpoint_path=str(path)).eval()
    ids = torch.randint(0, 512, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), ours(ids))


def test_greedy_generate_equals_transformers(pair):
    ref, ours, _ = pair
    ids, mask = _padded_batch()
    theirs = ref.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[:, ids.shape[1]:]
    # transformers' eos_token_id=None stops nowhere; ours: []
    mine = ours.generate(ids, max_new_tokens=12, attention_mask=mask, eos_token_id=[])
    assert torch.equal(mine, theirs)
    # the same prompts given as embeddings (how a vision-language model calls it)
    assert torch.equal(ours.generate(inputs_embeds=ours.embed_tokens(ids), max_new_tokens=12, attention_mask=mask,
                                     eos_token_id=[]), mine)
    # each prompt alone, unpadded, continues the same way
    for row in range(3):
        alone = ids[row:row + 1, ~mask[row].eq(0)]
        assert torch.equal(ours.generate(alone, max_new_tokens=12, eos_token_id=[]), mine[row:row + 1])


def test_cached_decoding_equals_full_recomputation():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY)).eval()
    ids, mask = _padded_batch()
    seq = torch.cat([ids, torch.randint(3, 512, (3, 5))], dim=1)
    full_mask = torch.cat([mask, torch.ones(3, 5, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        full = model(seq, attention_mask=full_mask)
        cache = model.new_cache(3, 14)
        parts = [model(seq[:, :9], attention_mask=full_mask[:, :9], cache=cache)]
        parts.append(model(seq[:, 9:11], attention_mask=full_mask[:, :11], cache=cache))  # two at once
        for t in range(11, 14):
            parts.append(model(seq[:, t:t + 1], attention_mask=full_mask[:, :t + 1], cache=cache))
        assert cache.length == 14
        stepped = torch.cat(parts, dim=1)
        real = full_mask.bool()
        torch.testing.assert_close(stepped[real], full[real], atol=1e-5, rtol=1e-5)
        # the prompt's last logits only (what generate asks for): the same logits, the same cache after it
        cache = model.new_cache(3, 14)
        last = model(seq[:, :9], attention_mask=full_mask[:, :9], cache=cache, logits_to_keep=1)
        torch.testing.assert_close(last[:, 0], full[:, 8], atol=1e-5, rtol=1e-5)
        step = model(seq[:, 9:10], attention_mask=full_mask[:, :10], cache=cache)
        torch.testing.assert_close(step[:, 0], full[:, 9], atol=1e-5, rtol=1e-5)
        # without padding: no mask at all; positions past the cache's length are never read (garbage there is fine)
        cache = model.new_cache(3, 14)
        for t in cache.k + cache.v:
            t.fill_(float("nan"))
        out = torch.cat([model(seq[:, :10], cache=cache)] + [model(seq[:, t:t + 1], cache=cache)
                                                               for t in range(10, 14)], dim=1)
        torch.testing.assert_close(out, model(seq), atol=1e-5, rtol=1e-5)


def test_complex_rope_of_the_blocks_equals_the_real_form_per_sequence():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY))
    x = torch.randn(3, 9, 4, 16)  # (B, N, heads, head_dim)
    pos = torch.stack([torch.arange(9), torch.arange(9).clamp(min=4) - 4, torch.arange(20, 29)])  # per sequence
    freqs = torch.view_as_complex(model.rope_freqs[pos, None])
    cos, sin = RotaryEmbedding1D(16)(256)
    want = rope_rotate(x.transpose(1, 2), cos[pos][:, None], sin[pos][:, None]).transpose(1, 2)
    torch.testing.assert_close(apply_rotary_embs(x, freqs), want, atol=1e-5, rtol=1e-5)
    # a cast to bf16 keeps both parts of the table (a complex buffer would lose its imaginary part)
    half = model.to(torch.bfloat16).rope_freqs
    assert half.dtype == torch.bfloat16 and torch.allclose(half.float(), model.rope_freqs.float(), atol=1e-2)
    assert half[1:, :, 1].abs().sum() > 0


def _meta_permute(w, n_heads):  # transformers' convert_llama_weights_to_hf.py: Meta rows -> Hugging Face rows
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


@pytest.mark.parametrize("shards", [1, 2])
def test_meta_checkpoint_equals_its_hf_conversion(tmp_path, shards):
    """Meta's consolidated.*.pth (one file or two model-parallel shards) loads to the model that the official
    conversion to Hugging Face's layout gives."""
    torch.manual_seed(1)
    cfg = LlamaConfig(**TINY)
    hd = cfg.head_dim
    meta = {"tok_embeddings.weight": torch.randn(512, 64), "norm.weight": torch.rand(64) + 0.5,
            "output.weight": torch.randn(512, 64) * 0.05, "rope.freqs": torch.randn(hd // 2)}
    for i in range(2):
        p = f"layers.{i}."
        meta.update({p + "attention.wq.weight": torch.randn(64, 64) * 0.1,
                     p + "attention.wk.weight": torch.randn(2 * hd, 64) * 0.1,
                     p + "attention.wv.weight": torch.randn(2 * hd, 64) * 0.1,
                     p + "attention.wo.weight": torch.randn(64, 64) * 0.1,
                     p + "feed_forward.w1.weight": torch.randn(192, 64) * 0.1,
                     p + "feed_forward.w2.weight": torch.randn(64, 192) * 0.1,
                     p + "feed_forward.w3.weight": torch.randn(192, 64) * 0.1,
                     p + "attention_norm.weight": torch.rand(64) + 0.5, p + "ffn_norm.weight": torch.rand(64) + 0.5})
    if shards == 1:
        torch.save(meta, tmp_path / "consolidated.00.pth")
    else:  # model parallel: embedding, wo and w2 split along dim 1, the other matrices along dim 0
        for r in range(2):
            part = {k: v if v.ndim == 1 else v.chunk(2, dim=1 if k.endswith(("tok_embeddings.weight", "wo.weight",
                                                                              "w2.weight")) else 0)[r]
                    for k, v in meta.items()}
            torch.save(part, tmp_path / f"consolidated.0{r}.pth")
    (tmp_path / "params.json").write_text(json.dumps({"dim": 64, "multiple_of": 32, "n_heads": 4, "n_kv_heads": 2,
                                                      "n_layers": 2, "norm_eps": 1e-5, "vocab_size": -1}))
    ours = Llama.from_pretrained(tmp_path, max_seq_len=256)
    hf_cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=256, rms_norm_eps=1e-5)
    ref = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf = {"model.embed_tokens.weight": meta["tok_embeddings.weight"], "model.norm.weight": meta["norm.weight"],
          "lm_head.weight": meta["output.weight"]}
    for i in range(2):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        hf.update({q + "self_attn.q_proj.weight": _meta_permute(meta[p + "attention.wq.weight"], 4),
                   q + "self_attn.k_proj.weight": _meta_permute(meta[p + "attention.wk.weight"], 2),
                   q + "self_attn.v_proj.weight": meta[p + "attention.wv.weight"],
                   q + "self_attn.o_proj.weight": meta[p + "attention.wo.weight"],
                   q + "mlp.gate_proj.weight": meta[p + "feed_forward.w1.weight"],
                   q + "mlp.down_proj.weight": meta[p + "feed_forward.w2.weight"],
                   q + "mlp.up_proj.weight": meta[p + "feed_forward.w3.weight"],
                   q + "input_layernorm.weight": meta[p + "attention_norm.weight"],
                   q + "post_attention_layernorm.weight": meta[p + "ffn_norm.weight"]})
    ref.load_state_dict(hf)
    ids = torch.randint(0, 512, (2, 10))
    registered = vitlab.create_model("llama_tiny", checkpoint_path=str(tmp_path)).eval()  # llama_tiny's shape
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(registered(ids), ours(ids))


def test_hf_directory_of_another_architecture_or_mismatch_is_one_line(tmp_path, pair):
    _, _, path = pair
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["CLIPModel"], "model_type": "clip"}))
    with pytest.raises(ValueError, match="describes CLIPModel, clip, not LlamaForCausalLM / llama$"):
        Llama.from_pretrained(tmp_path)
    # the directory's config.json names the difference before any tensor is read; the weights file alone, its shapes
    with pytest.raises(ValueError, match=r"another Llama architecture: dim 64 \(this model 32\), hidden_dim 192 "
                                         r"\(this model 96\), head_dim 16 \(this model 8\)$"):
        vitlab.create_model("llama_tiny", checkpoint_path=str(path), dim=32)
    with pytest.raises(CheckpointError, match="shape mismatch"):
        vitlab.create_model("llama_tiny", checkpoint_path=str(path / "model.safetensors"), dim=32)
    with pytest.raises(FileNotFoundError, match="neither config.json"):
        Llama.from_pretrained(tmp_path / "..")


@pytest.mark.parametrize("field,value,message", [
    ("rope_theta", 5000.0, r": another Llama architecture: rope_theta 5000.0 \(this model 10000.0\)$"),
    ("rms_norm_eps", 3e-6, r": another Llama architecture: norm_eps 3e-06 \(this model 1e-05\)$"),
    ("hidden_act", "gelu", r"config.json: hidden_act 'gelu' is not supported \(Llama 2's SwiGLU gates with silu\)$"),
])
def test_hf_directory_of_another_function_is_refused_by_a_registered_model(tmp_path, field, value, message):
    """A checkpoint of llama_tiny's shapes whose config.json changes what the weights compute (the RoPE base, the
    RMSNorm eps, the activation) is refused by create_model(checkpoint_path=) in one line, not loaded into the
    registered architecture; Llama.from_pretrained builds the checkpoint's own architecture where vitlab has it."""
    ref = _hf_model(tmp_path, **{field: value})
    with pytest.raises(ValueError, match=message) as e:
        vitlab.create_model("llama_tiny", checkpoint_path=str(tmp_path))
    assert "\n" not in str(e.value)
    if field == "hidden_act":
        with pytest.raises(ValueError, match=message):
            Llama.from_pretrained(tmp_path)
        return
    ours = Llama.from_pretrained(tmp_path)
    ids = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)


def test_a_decoder_of_another_vocabulary_and_context_reads_the_directory(pair):
    """The vocabulary and the context are no part of the check (a vision-language run's --init reads a Llama
    directory into a decoder of its own tokenizer's rows and its own context, then transfers the rows)."""
    _, _, path = pair
    other = Llama(LlamaConfig(**{**TINY, "vocab_size": 300, "max_seq_len": 32}))
    assert other.read_checkpoint(path)["model.embed_tokens.weight"].shape == (512, 64)


def _meta_dir(path, **params):
    """A Meta release folder (consolidated.00.pth + params.json) of llama_tiny's shapes with random weights; its
    params.json adds ``params``."""
    sd = vitlab.create_model("llama_tiny").state_dict()
    meta = {"tok_embeddings.weight": sd["embed_tokens.weight"], "norm.weight": sd["norm.weight"] + 0.5,
            "output.weight": sd["lm_head.weight"]}
    for i in range(2):
        p = f"layers.{i}."
        wq, wk, wv = sd[p + "attn.qkv.weight"].split([64, 32, 32])
        w1, w3 = sd[p + "mlp.fc1.weight"].chunk(2)
        meta.update({p + "attention.wq.weight": wq, p + "attention.wk.weight": wk, p + "attention.wv.weight": wv,
                     p + "attention.wo.weight": sd[p + "attn.proj.weight"], p + "feed_forward.w1.weight": w1,
                     p + "feed_forward.w2.weight": sd[p + "mlp.fc2.weight"], p + "feed_forward.w3.weight": w3,
                     p + "attention_norm.weight": sd[p + "attn_norm.weight"],
                     p + "ffn_norm.weight": sd[p + "mlp_norm.weight"]})
    path.mkdir()
    torch.save({k: v.clone() for k, v in meta.items()}, path / "consolidated.00.pth")
    (path / "params.json").write_text(json.dumps({"dim": 64, "multiple_of": 32, "n_heads": 4, "n_kv_heads": 2,
                                                  "n_layers": 2, "norm_eps": 1e-5, "vocab_size": -1, **params}))
    return path


@pytest.mark.parametrize("params,message", [
    ({"use_scaled_rope": True}, r"params.json: use_scaled_rope true \(Llama 3.1's RoPE frequency scaling\) is not "
                                r"supported"),
    ({"vision_chunk_size": 560, "rope_scaling_factor": 8.0},
     r"params.json: keys \['rope_scaling_factor', 'vision_chunk_size'\] are not read by vitlab and may change the "
     r"function"),
])
def test_meta_params_json_keys_vitlab_does_not_implement_are_refused(tmp_path, params, message):
    """A params.json key that changes the function and that vitlab does not implement (Llama 3.1's RoPE scaling,
    an unknown key) is refused in one line, not dropped."""
    path = _meta_dir(tmp_path / "meta", **params)
    for load in (lambda: Llama.from_pretrained(path), lambda: vitlab.create_model("llama_tiny",
                                                                                  checkpoint_path=str(path))):
        with pytest.raises(ValueError, match=message) as e:
            load()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("params,message", [
    ({"rope_theta": 5000.0}, r"rope_theta 5000.0 \(this model 10000.0\)$"),
    ({"norm_eps": 3e-6}, r"norm_eps 3e-06 \(this model 1e-05\)$"),
    ({"use_scaled_rope": False, "max_batch_size": 32, "max_seq_len": 512, "ffn_dim_multiplier": None}, None),
])
def test_meta_params_json_against_a_registered_model(tmp_path, params, message):
    """Meta's folder into llama_tiny by create_model(checkpoint_path=): a RoPE base or RMSNorm eps other than the
    model's is refused in one line (from_pretrained builds it); keys of no effect on the function pass."""
    path = _meta_dir(tmp_path / "meta", **params)
    own = Llama.from_pretrained(path, max_seq_len=256)
    if message is not None:
        with pytest.raises(ValueError, match=message):
            vitlab.create_model("llama_tiny", checkpoint_path=str(path))
        return
    registered = vitlab.create_model("llama_tiny", checkpoint_path=str(path)).eval()
    ids = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(registered(ids), own(ids))


def test_generate_checks_and_eos():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**{**TINY, "max_seq_len": 16})).eval()
    ids = torch.randint(3, 512, (2, 10))
    with pytest.raises(ValueError, match=r"the prompt \(10 tokens\) plus max_new_tokens \(7\) exceed the context "
                                         r"of 16 tokens$"):
        model.generate(ids, max_new_tokens=7)
    with pytest.raises(ValueError, match="top_p must be in"):
        model.generate(ids, max_new_tokens=2, temperature=1.0, top_p=0.0)
    for t in (float("nan"), float("inf"), -0.5):
        with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
            model.generate(ids, max_new_tokens=2, temperature=t)
    for shape in ((2, 9), (3, 10)):  # never sliced or padded to fit
        want = f"attention_mask must be (batch, prompt) = (2, 10), got {shape}"
        with pytest.raises(ValueError, match=re.escape(want)):
            model.generate(ids, max_new_tokens=2, attention_mask=torch.ones(shape, dtype=torch.long))
    for bad, want in ((ids[:, :0], "at least one row of one token, got (2, 0)"), (ids[:0], "got (0, 10)"),
                      (ids[0], "got (10,)"),
                      (ids.masked_fill(ids == ids[1, 3], 512),
                       f"outside the vocabulary 0..511: {int(ids.min())} to 512"),
                      (ids.masked_fill(ids == ids[1, 3], -1), "outside the vocabulary 0..511: -1 to")):
        with pytest.raises(ValueError, match=re.escape(want)):
            model.generate(bad, max_new_tokens=2)
    for mask in ([[1] * 10, [0] * 10], [[1] * 10, [1] * 9 + [0]], [[1] * 10, [0, 1, 0] + [1] * 7]):
        with pytest.raises(ValueError, match=r"attention_mask must mark left padding: .* an all-padding row are "
                                             r"refused$"):  # all padding, right padding, a gap
            model.generate(ids, max_new_tokens=2, attention_mask=torch.tensor(mask))
    greedy = model.generate(ids, max_new_tokens=6)
    eos = int(greedy[0, 2])  # the third greedy token of row 0 as the end of sequence
    out = model.generate(ids, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out[0, :3], greedy[0, :3]) and (out[0, 3:] == 0).all()
    row1_stops = (greedy[1] == eos).nonzero()
    end = int(row1_stops[0]) + 1 if len(row1_stops) else 6
    assert torch.equal(out[1, :end], greedy[1, :end])
    streamed = []
    model.generate(ids, max_new_tokens=4, on_token=streamed.append)
    assert torch.equal(torch.stack(streamed, 1), greedy[:, :4])


def test_generate_stops_at_the_config_eos_by_default_as_transformers(pair):
    """Without eos_token_id both stop at the model's own eos (transformers falls back to its generation config);
    eos_token_id=[] never stops."""
    ref, ours, _ = pair
    ids = torch.randint(3, 512, (3, 5), generator=torch.Generator().manual_seed(1))
    free = ours.generate(ids, max_new_tokens=10, eos_token_id=[])
    eos = int(free[0, 2])  # the third greedy token of row 0 made the end of sequence
    saved = ours.config.eos_token_id, ref.generation_config.eos_token_id
    ours.config.eos_token_id = ref.generation_config.eos_token_id = eos
    try:
        mine = ours.generate(ids, max_new_tokens=10, pad_token_id=0)
        theirs = ref.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
        assert torch.equal(mine, theirs[:, :mine.shape[1]])
        assert mine[0, :3].tolist() == free[0, :3].tolist() and (mine[0, 3:] == 0).all()
        assert torch.equal(ours.generate(ids, max_new_tokens=10, eos_token_id=[]), free)  # no stop: all 10
    finally:
        ours.config.eos_token_id, ref.generation_config.eos_token_id = saved


def test_several_ends_of_sequence_from_the_generation_config_as_transformers(tmp_path):
    """A checkpoint's generation_config.json listing several end-of-sequence ids (Llama 3's instruction models
    do): the loaded model stops at any of them, as transformers' generate does, rather than at the first only."""
    ref = _hf_model(tmp_path)
    ids = torch.randint(3, 512, (3, 5), generator=torch.Generator().manual_seed(1))
    free = Llama.from_pretrained(tmp_path).generate(ids, max_new_tokens=10, eos_token_id=[])
    ends = [2, int(free[0, 2])]  # the third greedy token of row 0 made a second end
    ref.generation_config.eos_token_id = ends
    ref.generation_config.save_pretrained(tmp_path)
    ours = Llama.from_pretrained(tmp_path)
    assert ours.config.eos_token_id == ends
    mine = ours.generate(ids, max_new_tokens=10, pad_token_id=0)
    theirs = ref.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
    assert torch.equal(mine, theirs[:, :mine.shape[1]]) and (mine[0, 3:] == 0).all()
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be a token id or a list"):
        Llama.from_pretrained(tmp_path)


def test_forward_beyond_the_context_is_one_value_error():
    """RoPE has rotations for max_seq_len positions: more is refused by the shapes, not by an index error."""
    model = Llama(LlamaConfig(**{**TINY, "max_seq_len": 64})).eval()
    with pytest.raises(ValueError, match=re.escape("0 cached plus 70 new tokens take 70 positions, beyond the "
                                                   "context of max_seq_len 64")):
        model(torch.zeros(1, 70, dtype=torch.long))
    cache = model.new_cache(1, 80)  # a cache longer than the context does not make room for more positions
    with torch.no_grad():
        model(torch.zeros(1, 60, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match=r"60 cached plus 5 new tokens take 65 positions, beyond the context "
                                             r"of max_seq_len 64 \(RoPE rotates positions 0\.\.63 only\)$"):
            model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
        assert model(torch.zeros(1, 4, dtype=torch.long), cache=cache).shape == (1, 4, 512)  # fits exactly


def test_generate_refills_a_given_cache():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY)).eval()
    ids, mask = _padded_batch()
    cache = model.new_cache(3, 24)
    for prompt, m in ((ids, mask), (torch.randint(3, 512, (3, 4)), None), (ids, mask)):  # refilled each time
        want = model.generate(prompt, max_new_tokens=6, attention_mask=m)
        assert torch.equal(model.generate(prompt, max_new_tokens=6, attention_mask=m, cache=cache), want)
        assert cache.length == prompt.shape[1] + 5  # the last token is returned, never fed back
    with pytest.raises(ValueError, match=r"the cache holds 3 rows of 24 positions; this call needs 2 rows of 11"):
        model.generate(ids[:2], max_new_tokens=2, cache=cache)
    with pytest.raises(ValueError, match=r"this call needs 3 rows of 25"):
        model.generate(ids, max_new_tokens=16, cache=cache)
    other = Llama(LlamaConfig(**{**TINY, "n_layers": 1})).eval()
    with pytest.raises(ValueError, match=r"laid out for another model: 1 layers of 2 key/value heads of 16, this one "
                                         r"has 2 of 2 of 16"):
        model.generate(ids, max_new_tokens=2, cache=other.new_cache(3, 24))
    with pytest.raises(ValueError, match=r"the cache is torch.bfloat16 on cpu, the model torch.float32 on cpu"):
        model.generate(ids, max_new_tokens=2, cache=model.new_cache(3, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"cache must be a KVCache"):
        model.generate(ids, max_new_tokens=2, cache=(cache.k, cache.v))
    with pytest.raises(ValueError, match=r"pass exactly one of input_ids and inputs_embeds"):
        model.generate(ids, max_new_tokens=2, inputs_embeds=model.embed_tokens(ids))


def test_generate_keeps_its_cpu_cache_between_calls():
    """On the CPU, generate refills the cache of its last call when it fits (batch size, dtype, length) and makes a
    new one (kept in its place) when not; what it generates equals a call with a new cache, whatever the kept one
    held before. A caller's cache is never kept; release_cache frees the kept one."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY)).eval()
    ids, mask = _padded_batch()
    calls = [(ids, mask, 6), (torch.randint(3, 512, (3, 4)), None, 3), (ids, mask, 2), (ids[:2], mask[:2], 4)]
    want = []
    for prompt, m, n in calls:
        model.release_cache()
        want.append(model.generate(prompt, n, attention_mask=m))
    model.release_cache()
    assert model.kept_cache is None
    kept = []
    for (prompt, m, n), w in zip(calls, want):
        assert torch.equal(model.generate(prompt, n, attention_mask=m), w)
        kept.append(model.kept_cache)
    assert kept[0] is kept[1] is kept[2] and kept[3] is not kept[0]  # 3 rows of 15, refilled; then 2 rows
    assert kept[3].k[0].shape[0] == 2
    model.generate(ids, 2, cache=model.new_cache(3, 11))
    assert model.kept_cache is kept[3]
    model.to(torch.bfloat16)  # another dtype: a new cache
    model.generate(ids[:2], 2, attention_mask=mask[:2])
    assert model.kept_cache is not kept[3] and model.kept_cache.k[0].dtype == torch.bfloat16


def test_generate_never_picks_the_spare_rows_past_vocab_size():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY)).eval()
    with torch.no_grad():  # the spare rows 500..511 (no text in a 500-token tokenizer) made the likeliest
        model.lm_head.weight[500:] = model.lm_head.weight[:12] * 40
    ids = torch.randint(3, 500, (2, 6))
    assert (model.generate(ids, max_new_tokens=8) >= 500).any()
    for temperature in (0.0, 1.0):
        out = model.generate(ids, max_new_tokens=8, temperature=temperature, vocab_size=500,
                             generator=torch.Generator().manual_seed(0))
        assert (out < 500).all()
    with pytest.raises(ValueError, match=r"vocab_size must be in 1\.\.512"):
        model.generate(ids, max_new_tokens=2, vocab_size=513)


def test_sampling_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next_token(logits), torch.tensor([3, 0]))
    assert torch.equal(sample_next_token(logits, 1.0, top_k=1, generator=g), torch.tensor([3, 0]))
    # top_p 0.5: softmax([0,1,2,3]) = .03 .09 .24 .64 -> only the top token is needed to reach 0.5
    assert torch.equal(sample_next_token(logits, 1.0, top_p=0.5, generator=g), torch.tensor([3, 0]))
    draws = torch.stack([sample_next_token(logits, 1.0, top_k=2, generator=g) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {2, 3} and set(draws[:, 1].tolist()) == {0, 1}
    a = sample_next_token(logits.repeat(50, 1), 2.0, generator=torch.Generator().manual_seed(3))
    b = sample_next_token(logits.repeat(50, 1), 2.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and len(set(a.tolist())) > 2


def test_profile_and_serving_estimate_without_weights():
    prof = vitlab.profile_model("llama2_7b", activations=False)
    assert round(prof.params_m * 1e6) == 6_738_415_616
    assert prof.input_size == (1, 1, 4096)


def test_grad_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY))
    ids, mask = _padded_batch()
    grads = []
    for enable in (False, True):
        model.zero_grad()
        model.set_grad_checkpointing(enable)
        model(ids, attention_mask=mask)[mask.bool()].logsumexp(-1).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_logits_at_kept_positions_equal_the_full_forward_with_their_gradients(checkpointing):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY))
    model.set_grad_checkpointing(checkpointing)
    ids, mask = _padded_batch()
    keep = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.3
    keep[0, -1] = True
    seen = []
    hook = model.layers[-1].mlp.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    out = []
    for at in (None, keep):
        model.zero_grad()
        logits = model(ids, attention_mask=mask, logits_at=at)
        logits = logits[keep] if at is None else logits
        logits.logsumexp(-1).mean().backward()
        out.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    hook.remove()
    assert out[1][0].shape == (int(keep.sum()), TINY["vocab_size"])
    assert seen[-1] == int(keep.sum())  # the last block's MLP ran on the kept positions alone
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(out[0][1], out[1][1], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("at", [torch.ones(2, 3, dtype=torch.bool), torch.ones(2, 5, dtype=torch.long)])
def test_logits_at_of_another_shape_or_dtype_is_one_value_error(at):
    model = Llama(LlamaConfig(**TINY))
    with pytest.raises(ValueError, match="logits_at must be a boolean"):
        model(torch.zeros(2, 5, dtype=torch.long), logits_at=at)


def test_tied_embeddings_and_a_truncated_meta_file(tmp_path):
    ref = _hf_model(tmp_path / "tied", tie_word_embeddings=True)
    from vitlab.convert import read_hf_state_dict

    assert "lm_head.weight" not in read_hf_state_dict(tmp_path / "tied")  # save_pretrained drops a tied head
    ours = Llama.from_pretrained(tmp_path / "tied")
    assert ours.lm_head.weight is ours.embed_tokens.weight
    ids = torch.randint(0, 512, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)
        # the registered model of the same shape, tied or not, takes the tied checkpoint by checkpoint_path=
        for tie in (True, False):
            reg = vitlab.create_model("llama_tiny", checkpoint_path=str(tmp_path / "tied"),
                                      tie_word_embeddings=tie).eval()
            assert (reg.lm_head.weight is reg.embed_tokens.weight) == tie
            torch.testing.assert_close(reg(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)
    # an untied checkpoint that lost its head is not given the embedding: the missing key is named
    cfg = json.loads((tmp_path / "tied" / "config.json").read_text())
    (tmp_path / "tied" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    with pytest.raises(CheckpointError, match=r"missing keys \['lm_head.weight'\]"):
        vitlab.create_model("llama_tiny", checkpoint_path=str(tmp_path / "tied"))
    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "params.json").write_text(json.dumps({"dim": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 512}))
    torch.save({"tok_embeddings.weight": torch.zeros(512, 64)}, meta / "consolidated.00.pth")
    data = (meta / "consolidated.00.pth").read_bytes()
    (meta / "consolidated.00.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"consolidated.00.pth: the file is truncated or corrupt") as e:
        Llama.from_pretrained(meta)
    assert "\n" not in str(e.value)


def test_a_tied_config_with_another_head_is_refused(tmp_path):
    """config.json ties the head to the embedding but the file holds a different lm_head.weight: refused (the
    model would compute with one of the two and drop the other), as transformers' save_pretrained never writes."""
    from safetensors.torch import save_file

    from vitlab.convert import read_hf_state_dict

    _hf_model(tmp_path, tie_word_embeddings=True)
    sd = read_hf_state_dict(tmp_path)
    for head, ok in ((sd["model.embed_tokens.weight"].clone(), True), (torch.randn(512, 64), False)):
        save_file({**sd, "lm_head.weight": head}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        if ok:  # the same tensor written twice is the tie itself
            assert Llama.from_pretrained(tmp_path).lm_head.weight is not None
            continue
        for load in (lambda: Llama.from_pretrained(tmp_path),
                     lambda: vitlab.create_model("llama_tiny", checkpoint_path=str(tmp_path))):
            with pytest.raises(CheckpointError, match=r"ties the output layer to the embedding \(tie_word_embeddings\)"
                                                      r", but the weights hold a lm_head.weight other than "
                                                      r"model.embed_tokens.weight$"):
                load()


@pytest.mark.parametrize("files, missing", [
    (["00", "01", "03"], "missing consolidated.02.pth"), (["00", "01", "02"], "missing consolidated.03.pth"),
    (["00", "01", "02", "03", "04"], "5 files are there")])
def test_a_missing_meta_rank_is_named(tmp_path, files, missing):
    """Meta's model-parallel files: the embedding's shards (dim / ranks columns each) tell how many ranks there
    are, so a rank left out, in the middle or at the end, is named rather than reported as shape mismatches."""
    (tmp_path / "params.json").write_text(json.dumps({"dim": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 512}))
    for r in files:
        torch.save({"tok_embeddings.weight": torch.zeros(512, 16)}, tmp_path / f"consolidated.{r}.pth")
    with pytest.raises(CheckpointError, match=r"the weights are split over 4 model-parallel rank\(s\), "
                                              rf"consolidated.00.pth to consolidated.03.pth; {missing}$"):
        Llama.from_pretrained(tmp_path)


def test_a_checkpoint_of_another_architecture_is_refused_before_the_weights_are_allocated(tmp_path):
    """create_model("llama2_7b", checkpoint_path=a tiny directory) reads the directory's config against a weightless
    copy: refused in one line without building the 27 GB of float32 weights (which would exhaust the memory)."""
    import resource

    _hf_model(tmp_path)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    with pytest.raises(ValueError, match=r"another Llama architecture: dim 64 \(this model 4096\)"):
        vitlab.create_model("llama2_7b", checkpoint_path=str(tmp_path))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2 ** 20  # under 1 GiB more at its peak


def test_a_config_without_max_position_embeddings_has_transformers_default_context():
    from vitlab.models.llama import llama_config_from_hf

    cfg = llama_config_from_hf(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
                                    intermediate_size=192))
    assert cfg.max_seq_len == transformers.LlamaConfig().max_position_embeddings == 2048


@pytest.mark.parametrize("load", ["from_pretrained", "create_model"])
def test_checkpoint_lacking_a_tensor_is_named(tmp_path, load):
    """A file holding fewer tensors than its config needs (a layer's MLP left out): one CheckpointError naming
    the checkpoint and the tensor, not a KeyError from the conversion."""
    from safetensors.torch import save_file

    from vitlab.convert import CheckpointError, read_hf_state_dict

    _hf_model(tmp_path / "full")
    sd = read_hf_state_dict(tmp_path / "full")
    del sd["model.layers.1.mlp.down_proj.weight"]
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "cut" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"cut: the checkpoint lacks 1 of the 20 tensors a Llama of its config "
                                              r"needs, e.g. 'model.layers.1.mlp.down_proj.weight'$"):
        if load == "from_pretrained":
            Llama.from_pretrained(tmp_path / "cut")
        else:
            vitlab.create_model("llama_tiny", checkpoint_path=tmp_path / "cut")


@pytest.mark.parametrize("load", ["from_pretrained", "create_model"])
@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.q_proj.bias", "model.layers.2.mlp.down_proj.weight"])
def test_checkpoint_holding_a_tensor_its_config_has_no_place_for_is_refused(tmp_path, load, extra):
    """A bias its config.json does not declare, or a layer beyond its num_hidden_layers: the checkpoint computes
    another function, so the tensor is named in one CheckpointError, never dropped without a word. (Older
    transformers' per-layer rotary inv_freq buffers are no weights: they still load.)"""
    from safetensors.torch import save_file

    from vitlab.convert import read_hf_state_dict

    _hf_model(tmp_path / "full")
    sd = read_hf_state_dict(tmp_path / "full")
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
    save_file({**{k: v.contiguous() for k, v in sd.items()}, extra: torch.zeros(64),
               "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)},
              str(tmp_path / "more" / "model.safetensors"))
    message = (r"more: the checkpoint holds 1 tensor\(s\) a Llama of its config \(n_layers 2, no biases\) has no "
               rf"place for, e.g. '{re.escape(extra)}'")
    with pytest.raises(CheckpointError, match=message):
        if load == "from_pretrained":
            Llama.from_pretrained(tmp_path / "more")
        else:
            vitlab.create_model("llama_tiny", checkpoint_path=tmp_path / "more")
    del sd["lm_head.weight"]  # the inv_freq buffer alone passes (and a tied head is filled in as before)
    save_file({**{k: v.contiguous() for k, v in sd.items()}, "model.layers.0.self_attn.rotary_emb.inv_freq":
               torch.zeros(8)}, str(tmp_path / "more" / "model.safetensors"))
    cfg = json.loads((tmp_path / "more" / "config.json").read_text())
    (tmp_path / "more" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    assert Llama.from_pretrained(tmp_path / "more").lm_head.weight.shape == (512, 64)
