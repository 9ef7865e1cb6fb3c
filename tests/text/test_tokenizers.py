"""Tokenizers: the article's look-up walkthrough, SentencePiece and tokenizer.json models trained here on a few
sentences, special tokens, batching with left padding, the vocabulary check, and the prompt templates."""

from __future__ import annotations

import pytest

from vitlab.text import (
    HFTokenizer,
    LookupTokenizer,
    SentencePieceTokenizer,
    check_vocab,
    llama2_chat,
    llava_v1,
    load_tokenizer,
)

SENTENCES = [
    "The ruler of a kingdom is a king.", "Eiffel Tower is in Paris.", "A red square sits left of a blue circle.",
    "How many triangles are there in the picture?", "Three small digits on a wooden texture.",
    "The assistant gives helpful, detailed, and polite answers.", "Is there a circle above the square?",
    "What is the object on the right?", "A photo of a cat and a dog playing in the grass.",
    "Language models predict the next token of a sequence.", "Rotary embeddings rotate queries and keys.",
] * 4


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("spm")
    (folder / "corpus.txt").write_text("\n".join(SENTENCES))
    # Llama's special ids: unk 0, bos 1, eos 2, no pad
    spm.SentencePieceTrainer.train(input=str(folder / "corpus.txt"), model_prefix=str(folder / "tokenizer"),
                                   vocab_size=400, model_type="bpe", byte_fallback=True, hard_vocab_limit=False,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False)
    return folder / "tokenizer.model"


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("hf_tok")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()  # spaces as '▁', as Llama's tokenizer.json
    tok.decoder = tokenizers.decoders.Metaspace()
    tok.train_from_iterator(SENTENCES, tokenizers.trainers.BpeTrainer(vocab_size=150,
                                                                     special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_article_walkthrough():
    tok = LookupTokenizer("The ruler of a kingdom is a")
    assert tok.vocab == ["a", "is", "kingdom", "of", "ruler", "the"]
    tokens = tok.encode("the kingdom had another ruler")
    assert tokens == [5, 2, 6, 7, 4]
    assert tok.decode(tokens) == "the kingdom had another ruler"
    assert len(tok) == 8
    with pytest.raises(ValueError, match="token id 99 is not in the vocabulary of 8 words"):
        tok.decode([99])


def test_sentencepiece_ids_special_tokens_and_round_trip(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    tok = SentencePieceTokenizer(sp_model, added_tokens=["<image>"])
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, None)
    assert tok.vocab_size == sp.get_piece_size() + 1 and tok.token_id("<image>") == sp.get_piece_size()
    text = "Is there a circle above the square?"
    assert tok.encode(text) == [1] + sp.encode(text)
    assert tok.encode(text, bos=False, eos=True) == sp.encode(text) + [2]
    ids = tok.encode("USER: <image>\nHow many triangles?")
    assert ids == [1] + sp.encode("USER: ") + [tok.token_id("<image>")] + sp.encode("\nHow many triangles?")
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(ids, skip_special=False) == "<s>USER: <image>\nHow many triangles?"
    with pytest.raises(ValueError, match="no '<mask>' token; its special tokens: <s>, </s>, <image>"):
        tok.token_id("<mask>")


def test_batch_is_left_padded(sp_model):
    tok = SentencePieceTokenizer(sp_model)
    ids, mask = tok(["A red square.", "How many triangles are there in the picture?"])
    short = tok.encode("A red square.")
    assert ids.shape == mask.shape and mask[0].sum() == len(short)
    assert ids[0, -len(short):].tolist() == short and (ids[0, :-len(short)] == tok.eos_id).all()
    assert mask[1].all() and not mask[0, 0]
    with pytest.raises(ValueError, match="the text is empty"):
        tok([""], bos=False)


def test_hf_tokenizer_json(hf_json):
    from tokenizers import Tokenizer as Ref

    ref = Ref.from_file(str(hf_json / "tokenizer.json"))
    tok = load_tokenizer(hf_json, added_tokens=["<image>"])
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, None)
    assert tok.vocab_size == ref.get_vocab_size() + 1
    text = "Is there a circle above the square?"
    assert tok.encode(text, eos=True) == [1] + ref.encode(text, add_special_tokens=False).ids + [2]
    ids = tok.encode("a red<image> square</s>", bos=False)
    image = tok.token_id("<image>")
    assert ids == ref.encode("a red", add_special_tokens=False).ids + [image] + \
        ref.encode(" square", add_special_tokens=False).ids + [2]
    assert tok.decode(ids) == "a red square"


def test_load_tokenizer_paths_and_errors(tmp_path, sp_model, hf_json):
    assert isinstance(load_tokenizer(sp_model), SentencePieceTokenizer)
    meta = tmp_path / "llama-2-7b"  # Meta's layout: tokenizer.model beside the checkpoint folders
    meta.mkdir()
    (tmp_path / "tokenizer.model").write_bytes(sp_model.read_bytes())
    assert isinstance(load_tokenizer(meta), SentencePieceTokenizer)
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        load_tokenizer(tmp_path / "nothing")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="bad.model is not a SentencePiece model"):
        load_tokenizer(tmp_path / "bad.model")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json is not a Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")


def test_check_vocab(sp_model):
    tok = SentencePieceTokenizer(sp_model, added_tokens=["<image>"])
    n = tok.vocab_size
    check_vocab(tok, n)
    for m in (8, 64, 128):  # padded embedding rows (LLaVA: 32,002 tokens, 32,064 rows)
        check_vocab(tok, (n // m + 1) * m)
    refused = [n - 1, (n // 256 + 1) * 256 + 256, 32000]  # too few; padded beyond a multiple of 128; another model
    refused += [r for r in range(n + 1, n + 130) if all(r % m or r - n >= m for m in (2, 4, 8, 16, 32, 64, 128))][:3]
    for rows in refused:
        with pytest.raises(ValueError, match=rf"tokenizer .*tokenizer.model has {n:,} tokens but the checkpoint's "
                                             rf"embedding has {rows:,} rows: they belong to different models$"):
            check_vocab(tok, rows)


def _meta_chat_completion(sp, dialog):
    """Meta's llama/generation.py chat_completion, on the SentencePiece model (bos 1, eos 2)."""
    B_INST, E_INST, B_SYS, E_SYS = "[INST]", "[/INST]", "<<SYS>>\n", "\n<</SYS>>\n\n"
    if dialog[0]["role"] == "system":
        dialog = [{"role": dialog[1]["role"], "content": B_SYS + dialog[0]["content"] + E_SYS + dialog[1]["content"]}
                  ] + dialog[2:]
    ids = sum([[1] + sp.encode(f"{B_INST} {p['content'].strip()} {E_INST} {a['content'].strip()} ") + [2]
               for p, a in zip(dialog[::2], dialog[1::2])], [])
    return ids + [1] + sp.encode(f"{B_INST} {dialog[-1]['content'].strip()} {E_INST}")


def test_llama2_chat_equals_meta_encoding(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    tok = SentencePieceTokenizer(sp_model)
    dialog = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where is the tower?"},
              {"role": "assistant", "content": "In Paris."}, {"role": "user", "content": "Who is the ruler?"}]
    assert tok.encode(llama2_chat(dialog), bos=False) == _meta_chat_completion(sp, dialog)
    assert tok.encode(llama2_chat(dialog[1:2]), bos=False) == _meta_chat_completion(sp, dialog[1:2])
    assert llama2_chat(dialog[1:2]) == "<s>[INST] Where is the tower? [/INST]"
    # whitespace as Meta's code treats it: the system block joins the first message, which is stripped whole
    spaced = [{"role": "system", "content": "  Rules:\n1. be short\n"}, {"role": "user", "content": " Hi "},
              {"role": "assistant", "content": " Hello. "}, {"role": "user", "content": "\tBye\n"}]
    assert tok.encode(llama2_chat(spaced), bos=False) == _meta_chat_completion(sp, spaced)
    assert llama2_chat(spaced).startswith("<s>[INST] <<SYS>>\n  Rules:\n1. be short\n\n<</SYS>>\n\n Hi [/INST]")
    with pytest.raises(ValueError, match="message 1 has role 'user', expected 'assistant'"):
        llama2_chat([dialog[1], dialog[1]])
    with pytest.raises(ValueError, match="message 0 .user. is empty"):
        llama2_chat([{"role": "user", "content": "  "}])


def test_llava_v1_prompt():
    q = [{"role": "user", "content": "What is left of the circle?"}]
    assert llava_v1(q) == ("A chat between a curious human and an artificial intelligence assistant. The assistant "
                           "gives helpful, detailed, and polite answers to the human's questions. USER: <image>\n"
                           "What is left of the circle? ASSISTANT:")
    two = q + [{"role": "assistant", "content": "A square."}, {"role": "user", "content": "And above?"}]
    assert llava_v1(two).endswith("ASSISTANT: A square.</s>USER: And above? ASSISTANT:")
    assert "<image>" not in llava_v1(q, image=False)


def test_streamed_pieces_add_up_to_the_decoded_text(sp_model):
    """Byte-fallback pieces of a character are held back until it is complete; what is still pending at the end
    (an incomplete character) comes out of flush, as decode gives it."""
    from vitlab.text import StreamDecoder

    tok = load_tokenizer(sp_model)
    ids = tok.encode("a cat 🙂 and a wörld", bos=False)
    assert len(ids) > len(tok.encode("a cat and a world", bos=False))  # the emoji is several byte pieces
    for seq in (ids, ids[: ids.index(tok.encode("a cat 🙂", bos=False)[-1])]):  # whole, and cut inside the emoji
        stream = StreamDecoder(tok)
        pieces = [stream.push(i) for i in seq]
        assert "".join(pieces) + stream.flush() == tok.decode(seq)
    assert "\ufffd" in tok.decode(seq) and "\ufffd" not in "".join(pieces)


@pytest.mark.parametrize("scheme", ["first", "always"])
def test_tokenizer_json_ids_around_special_tokens_are_the_librarys(tmp_path, scheme):
    """A tokenizer.json text is encoded whole by ``tokenizers``: with Metaspace's prepend_scheme "first" (what
    transformers writes for Llama with legacy=False) nothing is prepended after a special token."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme=scheme, split=False)
    tok.decoder = tokenizers.decoders.Metaspace(prepend_scheme=scheme, split=False)
    tok.train_from_iterator(SENTENCES, tokenizers.trainers.BpeTrainer(vocab_size=150,
                                                                     special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = HFTokenizer(tmp_path / "tokenizer.json", added_tokens=["<image>"])
    lib = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    lib.add_special_tokens([tokenizers.AddedToken("<image>", special=True, normalized=False)])
    for text in ["USER: <image>\nHow many triangles?", "<s>[INST] What is the object? [/INST]", "a cat</s>",
                 "<image>Is there a circle above the square?"]:
        assert ours.encode(text, bos=False) == lib.encode(text, add_special_tokens=False).ids, text
