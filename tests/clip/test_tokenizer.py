"""vitlab's CLIP BPE tokenizer gives open_clip's token ids (dev-only oracle) on a varied text set; the word-level
tokenizer; bad vocabularies and over-long texts."""

from __future__ import annotations

import gzip

import pytest
import torch

from vitlab.clip.tokenizer import ClipTokenizer, WordTokenizer, find_vocab, pretokenize, tokenizer_from_dict

TEXTS = [
    "a photo of a cat", "A PHOTO OF A DOG.", "it's the dog's toy, isn't it? we'll see; they've gone, I'd say",
    "3.14159 and 1,234,567 apples; 2nd place", "café naïve résumé Straße Ærøskøbing", "日本語のテキストと中文",
    "emoji 🙂👍🏽 and ✨sparkles✨", "“curly quotes” and ‘single’ ones ’tis",
    "&amp; &lt;b&gt;bold&lt;/b&gt; &quot;x&quot;",
    "   many\tspaces\n\nand\r\nlines  ", "", "<start_of_text> inside <end_of_text>", "ＡＢＣ１２３ full width",
    "ﬁne ﬂour", "x² + ½ + Ⅻ", "مرحبا بالعالم", "नमस्ते दुनिया", "hyphen-ated and under_scored and slash/ed",
    "''quoted'' ''s", "a handwritten 7", "the number seven", "URL https://example.com/a?b=c#d", "Ⓐ ⓑ ©®™",
    "word " * 100,
]


@pytest.fixture(scope="module")
def ours():
    return ClipTokenizer()


def test_equal_to_open_clip_ids(ours):
    open_clip = pytest.importorskip("open_clip")
    ref = open_clip.tokenizer.SimpleTokenizer()
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
    with pytest.warns(UserWarning, match="1 text"):
        mine = ours(TEXTS)
    torch.testing.assert_close(mine, ref(TEXTS))
    assert ours.vocab_size == 49408 and ours.eot_token_id == 49407 == mine.max()
    assert ours.decode(ours.encode("a photo of a cat")).strip() == "a photo of a cat"


def test_pretokenizer_classes():
    assert pretokenize("it's x²½ ab12 ..!? <end_of_text>") == ["it", "'s", "x", "²", "½", "ab", "1", "2", "..!?",
                                                               "<end_of_text>"]


def test_truncate_or_refuse(ours):
    with pytest.warns(UserWarning, match="truncated"):
        row = ours("word " * 100)[0]
    assert row[-1] == ours.eot_token_id and row[0] == ours.sot_token_id
    strict = ClipTokenizer(truncate=False)
    with pytest.raises(ValueError, match="more than the context length 77"):
        strict("word " * 100)


def test_bad_vocabulary_files(tmp_path):
    plain = tmp_path / "vocab.txt.gz"
    plain.write_text("not gzip")
    with pytest.raises(ValueError, match="is not a CLIP BPE vocabulary"):
        ClipTokenizer(plain)
    short = tmp_path / "short.txt.gz"
    with gzip.open(short, "wt") as f:
        f.write("header\na b\nc d\n")
    with pytest.raises(ValueError, match="expected 48,894 merge lines"):
        ClipTokenizer(short)
    with pytest.raises(FileNotFoundError, match="vocabulary file not found"):
        ClipTokenizer(tmp_path / "missing.gz")
    assert find_vocab().name == "bpe_simple_vocab_16e6.txt.gz"


def test_word_tokenizer():
    tok = WordTokenizer.from_texts(["a photo of the number seven", "a handwritten 7."], context_length=8)
    ids = tok(["a photo of 7", "an unseen word"])
    assert ids.shape == (2, 8) and ids.max() == tok.eot_token_id == tok.vocab_size - 1
    assert ids[0, :6].tolist() == [tok.sot_token_id, *tok.encode("a photo of 7"), tok.eot_token_id]
    assert ids[1, 1:4].tolist() == [1, 1, 1]  # unknown words
    again = tokenizer_from_dict(tok.to_dict())
    torch.testing.assert_close(again(["a handwritten 7."]), tok(["a handwritten 7."]))
    with pytest.raises(ValueError, match="unknown tokenizer"):
        tokenizer_from_dict({"kind": "sentencepiece"})
