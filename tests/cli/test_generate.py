"""``vitlab generate``: a Hugging Face directory (weights + tokenizer.json) continued greedily and streamed, Meta's
layout found through the parent's tokenizer, and the one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch

import vitlab
from vitlab.cli import main
from vitlab.models.llama import Llama
from vitlab.text import load_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEXT = ["the ruler of a kingdom is a king", "the tower is in paris", "a red square left of a blue circle"] * 5


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(TEXT, trainer)
    tok.save(str(path / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                                   vocab_size=tok.get_vocab_size(), max_position_embeddings=32, bos_token_id=1,
                                   eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_generate_streams_the_greedy_continuation(lm_dir, capsys):
    assert main(["generate", "--checkpoint", str(lm_dir), "the tower is", "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    tok, model = load_tokenizer(lm_dir), Llama.from_pretrained(lm_dir)
    new = model.generate(torch.tensor([tok.encode("the tower is")]), 6, eos_token_id=tok.eos_id)[0].tolist()
    expected = tok.decode([t for t in new if t != tok.eos_id])
    assert out == expected + "\n"
    assert "prompt tokens" in err and "new tokens" in err


def test_sampling_is_seeded(lm_dir, capsys):
    args = ["generate", "--checkpoint", str(lm_dir), "a red", "--max-new-tokens", "8", "--temperature", "1.5",
            "--top-k", "20", "--top-p", "0.95"]
    outs = []
    for seed in ("1", "1"):
        assert main(args + ["--seed", seed]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "40"], r"the prompt \(\d+ tokens\) plus --max-new-tokens \(40\) exceed the context of 32 "
                                 r"tokens: shorten the prompt or ask for fewer tokens"),
    # the settings are named before anything is read (a context check would otherwise speak first)
    (["--max-new-tokens", "40", "--top-p", "1.5"], r"--top-p must be in \(0, 1\], got 1.5"),
    (["--temperature", "-1"], r"--temperature must be finite and >= 0 \(0: greedy\), got -1.0"),
    (["--top-k", "0"], r"--top-k must be at least 1, got 0"),
    (["--system", "be brief"], r"--system is a system prompt of the chat template: it needs --chat"),
    (["--tokenizer", "WRONG_TOKENIZER"], r"tokenizer .*tokenizer.model has \d+ tokens but the model .*'s embedding "
                                         r"has 512 rows: they belong to different models"),
])
def test_refusals_are_one_line(lm_dir, tmp_path, capsys, argv, message):
    import re

    checkpoint = str(lm_dir)
    if "WRONG_TOKENIZER" in argv:  # the tiny registered model (512 rows) with this tokenizer of ~80 tokens
        checkpoint = "llama_tiny"
        spm = pytest.importorskip("sentencepiece")
        (tmp_path / "c.txt").write_text("\n".join(TEXT))
        spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "tokenizer"),
                                       vocab_size=40, hard_vocab_limit=False, minloglevel=2)
        argv = ["--tokenizer", str(tmp_path / "tokenizer.model")]
    assert main(["generate", "--checkpoint", checkpoint, "the tower is", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.fullmatch(r"vitlab: error: " + message, err), err


def test_a_tokenizer_smaller_than_the_embedding_never_streams_a_spare_row(tmp_path, capsys):
    """llama_tiny has 512 rows; a 420-token tokenizer leaves 92 spare rows, which have no text: they are never
    generated (random weights pick them otherwise)."""
    spm = pytest.importorskip("sentencepiece")
    (tmp_path / "c.txt").write_text("\n".join(TEXT))
    symbols = [f"<u{i}>" for i in range(390)]  # pads the vocabulary to 420 pieces
    spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "tokenizer"),
                                   vocab_size=420, user_defined_symbols=symbols, minloglevel=2)
    tok = load_tokenizer(tmp_path / "tokenizer.model")
    assert tok.vocab_size == 420
    torch.manual_seed(0)  # the command builds the same random weights after the same seed
    model = vitlab.create_model("llama_tiny").eval()
    free = model.generate(torch.tensor([tok.encode("the tower is")]), 24, eos_token_id=[])  # never stops
    assert (free >= 420).any()  # without the limit this prompt reaches a spare row
    argv = ["generate", "--checkpoint", "llama_tiny", "--tokenizer", str(tmp_path / "tokenizer.model"),
            "the tower is", "--max-new-tokens", "24"]
    torch.manual_seed(0)
    assert main(argv) == 0
    new = model.generate(torch.tensor([tok.encode("the tower is")]), 24, eos_token_id=tok.eos_id, vocab_size=420)
    assert capsys.readouterr().out == tok.decode([t for t in new[0].tolist() if t != tok.eos_id]) + "\n"


def test_registry_name_needs_a_tokenizer_and_meta_layout_finds_the_parents(lm_dir, tmp_path, capsys):
    assert main(["generate", "--checkpoint", "llama_tiny", "hi"]) == 2
    assert capsys.readouterr().err.strip() == ("vitlab: error: llama_tiny has no tokenizer: pass --tokenizer PATH "
                                               "(tokenizer.model or tokenizer.json)")
    for extra in (["--tokenizer", str(lm_dir)], []):  # a missing checkpoint is named as such, tokenizer or not
        assert main(["generate", "--checkpoint", str(tmp_path / "absent"), *extra, "hi"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith("absent is neither a checkpoint directory nor a registered language model (e.g. "
                            "llama_tiny)") and "\n" not in err
    # Meta's layout: <root>/tokenizer.json (here) beside <root>/7B/{params.json, consolidated.00.pth}
    model = Llama.from_pretrained(lm_dir)
    (tmp_path / "tokenizer.json").write_text((lm_dir / "tokenizer.json").read_text())
    folder = tmp_path / "7B"
    folder.mkdir()
    meta = {"tok_embeddings.weight": model.embed_tokens.weight, "norm.weight": model.norm.weight,
            "output.weight": model.lm_head.weight}
    for i, layer in enumerate(model.layers):  # ours is Meta's layout with q, k, v and w1, w3 packed
        q, k, v = layer.attn.qkv.weight.chunk(3)
        w1, w3 = layer.mlp.fc1.weight.chunk(2)
        meta.update({f"layers.{i}.attention.wq.weight": q, f"layers.{i}.attention.wk.weight": k,
                     f"layers.{i}.attention.wv.weight": v, f"layers.{i}.attention.wo.weight": layer.attn.proj.weight,
                     f"layers.{i}.feed_forward.w1.weight": w1, f"layers.{i}.feed_forward.w3.weight": w3,
                     f"layers.{i}.feed_forward.w2.weight": layer.mlp.fc2.weight,
                     f"layers.{i}.attention_norm.weight": layer.attn_norm.weight,
                     f"layers.{i}.ffn_norm.weight": layer.mlp_norm.weight})
    torch.save({k: v.detach().clone() for k, v in meta.items()}, folder / "consolidated.00.pth")
    (folder / "params.json").write_text(json.dumps({"dim": 32, "n_heads": 2, "n_layers": 1, "multiple_of": 32,
                                                    "norm_eps": 1e-6, "vocab_size": -1}))
    assert main(["generate", "--checkpoint", str(lm_dir), "the tower is", "--max-new-tokens", "5"]) == 0
    hf_out = capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(folder), "the tower is", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == hf_out


def test_generation_stops_at_every_end_the_generation_config_lists(lm_dir, tmp_path, capsys):
    """A directory whose generation_config.json lists ends beside the tokenizer's (Llama 3's instruction models
    end a turn with <|eot_id|>): the command stops at any of them, as transformers' generate does."""
    import shutil

    tok, model = load_tokenizer(lm_dir), Llama.from_pretrained(lm_dir)
    greedy = model.generate(torch.tensor([tok.encode("the tower is")]), 8, eos_token_id=[])[0].tolist()
    end = next(t for t in greedy[1:] if t != tok.eos_id and t not in greedy[:1])  # a later token as a turn's end
    stop = greedy.index(end)
    shutil.copytree(lm_dir, tmp_path / "lm")
    (tmp_path / "lm" / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_id, end]}))
    assert main(["generate", "--checkpoint", str(tmp_path / "lm"), "the tower is", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out == tok.decode(greedy[:stop]) + "\n"
    assert f"{stop + 1} new tokens" in err


def test_top_k_without_sampling_is_noted(lm_dir, capsys):
    assert main(["generate", "--checkpoint", str(lm_dir), "the tower is", "--max-new-tokens", "2", "--top-k",
                 "3"]) == 0
    assert "note: --top-k and --top-p shape sampling; with --temperature 0" in capsys.readouterr().err
