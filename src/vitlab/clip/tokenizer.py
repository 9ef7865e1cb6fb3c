"""Tokenizers for CLIP's text tower: ``tokenizer(texts) -> LongTensor (N, context_length)``, each row
``[start-of-text, tokens..., end-of-text, 0, ...]``; the end-of-text token has the largest id (the text tower
pools at ``argmax``).

- :class:`ClipTokenizer`: CLIP's byte-level BPE (Radford et al., 2021, Sec. 2.4: "a lower-cased byte pair
  encoding (BPE) representation of the text with a 49,152 vocab size"; Sennrich et al., 2016, BPE), read from
  the standard vocabulary file ``bpe_simple_vocab_16e6.txt.gz`` (a path, or the copy inside an installed
  ``open_clip`` package). Written here, without ``regex`` or ``ftfy``: the pre-tokenizer's ``\\p{L}`` / ``\\p{N}``
  classes are Unicode categories (``unicodedata``), and of ftfy's ``fix_text`` the fixes that change clean text
  are applied (quote uncurling, ligatures, full-width characters, line breaks, terminal escapes, control
  characters, NFC); ftfy's repair of mojibake (text decoded with the wrong codec) is not reproduced.
- :class:`WordTokenizer`: a lower-cased word-level vocabulary built from training captions (the offline demo,
  which has no BPE file to rely on); unknown words map to ``<unk>``.

Texts longer than the context: truncated with a warning (the last kept token is replaced by end-of-text, as
OpenAI's and open_clip's tokenizers do), or refused with ``truncate=False``.
"""

from __future__ import annotations

import gzip
import html
import importlib.util
import re
import unicodedata
import warnings
from functools import lru_cache
from pathlib import Path

import torch

VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"
NUM_MERGES = 49152 - 256 - 2  # vocabulary 49,408 = 2 x 256 byte symbols + 48,894 merges + 2 special tokens
SPECIAL_TOKENS = ("<start_of_text>", "<end_of_text>")
_CONTRACTIONS = ("s", "t", "re", "ve", "m", "ll", "d")


def pack(token_lists: list[list[int]], context_length: int, sot: int, eot: int, truncate: bool = True) -> torch.Tensor:
    """Rows ``[sot, *tokens, eot]`` zero-padded to ``context_length``; longer ones are truncated (end-of-text
    kept last, with one warning) or refused (``truncate=False``)."""
    out = torch.zeros(len(token_lists), context_length, dtype=torch.long)
    too_long = 0
    for i, tokens in enumerate(token_lists):
        row = [sot, *tokens, eot]
        if len(row) > context_length:
            if not truncate:
                raise ValueError(f"text {i} has {len(row)} tokens, more than the context length {context_length} "
                                 f"(truncate=True cuts it)")
            too_long += 1
            row = row[:context_length]
            row[-1] = eot
        out[i, : len(row)] = torch.tensor(row)
    if too_long:
        warnings.warn(f"{too_long} text(s) longer than the context length {context_length}: truncated",
                      stacklevel=3)
    return out


def _as_list(texts) -> list[str]:
    texts = [texts] if isinstance(texts, str) else list(texts)
    bad = [t for t in texts if not isinstance(t, str)]
    if bad:
        raise ValueError(f"texts must be strings, got {type(bad[0]).__name__}")
    return texts


@lru_cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 bytes to printable characters (BPE works on these, never on control
    or whitespace characters)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# ---- text cleaning: ftfy.fix_text's fixes for text that is not mojibake, then OpenAI's clean-up
_TERMINAL_ESCAPES = re.compile(r"\033\[((?:\d|;)*)([a-zA-Z])")
_SINGLE_QUOTES = re.compile("[\u02bc\u2018-\u201b]")
_DOUBLE_QUOTES = re.compile("[\u201c-\u201f]")
_LIGATURES = {"Ĳ": "IJ", "ĳ": "ij", "ŉ": "ʼn", "Ǳ": "DZ", "ǲ": "Dz", "ǳ": "dz", "Ǆ": "DŽ", "ǅ": "Dž", "ǆ": "dž",
              "Ǉ": "LJ", "ǈ": "Lj", "ǉ": "lj", "Ǌ": "NJ", "ǋ": "Nj", "ǌ": "nj", "ﬀ": "ff", "ﬁ": "fi", "ﬂ": "fl",
              "ﬃ": "ffi", "ﬄ": "ffl", "ﬅ": "ſt", "ﬆ": "st"}
_LINE_BREAKS = re.compile("\r\n|\r|\u2028|\u2029|\u0085")
# ftfy's remove_control_chars: C0 controls but tab / newline / form feed / CR, DEL, C1, and invisible formatting
_CONTROL = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f\u206a-\u206f\ufeff\ufff9-\ufffc\U0001d173-\U0001d17a"
                      "\U000e0000-\U000e007f]")


def _fix_width(c: str) -> str:
    # full-width ASCII and the ideographic space become their ordinary forms (ftfy's fix_character_width)
    return unicodedata.normalize("NFKC", c) if "\uff01" <= c <= "\uff5e" or c == "\u3000" else c


def clean_text(text: str) -> str:
    text = _TERMINAL_ESCAPES.sub("", text)
    if "<" not in text:  # ftfy unescapes HTML only in text that is not HTML markup
        text = html.unescape(text)
    text = "".join(_LIGATURES.get(c, c) for c in text)
    text = "".join(_fix_width(c) for c in text)
    text = _SINGLE_QUOTES.sub("'", _DOUBLE_QUOTES.sub('"', text))
    text = _LINE_BREAKS.sub("\n", text)
    text = _CONTROL.sub("", text)
    text = unicodedata.normalize("NFC", text)
    text = html.unescape(html.unescape(text)).strip()  # OpenAI's basic_clean
    return " ".join(text.split()).lower()  # whitespace_clean, lower-cased


def _cat(c: str) -> str:
    return unicodedata.category(c)[0]  # 'L' letter, 'N' number, ...


def pretokenize(text: str) -> list[str]:
    """CLIP's pre-tokenizer ``<start_of_text>|<end_of_text>|'s|'t|'re|'ve|'m|'ll|'d|[\\p{L}]+|[\\p{N}]|
    [^\\s\\p{L}\\p{N}]+`` (first alternative that matches, leftmost), written as a scanner."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        special = next((s for s in SPECIAL_TOKENS if text.startswith(s, i)), None)
        if special is None and c == "'":
            special = next(("'" + s for s in _CONTRACTIONS if text.startswith(s, i + 1)), None)
        if special is not None:
            out.append(special)
            i += len(special)
            continue
        if c.isspace():
            i += 1
            continue
        kind, j = _cat(c), i + 1
        if kind == "L":
            while j < n and _cat(text[j]) == "L":
                j += 1
        elif kind != "N":
            while j < n and not text[j].isspace() and _cat(text[j]) not in "LN":
                j += 1
        out.append(text[i:j])
        i = j
    return out


def find_vocab(path: str | Path | None = None) -> Path:
    """The BPE vocabulary file: ``path``, else the copy shipped inside an installed ``open_clip``."""
    if path is not None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"CLIP vocabulary file not found: {path}")
        return path
    spec = importlib.util.find_spec("open_clip")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / VOCAB_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no CLIP vocabulary: pass the path of {VOCAB_FILE} or install open_clip_torch")


@lru_cache(maxsize=4)
def _read_merges(path: Path) -> tuple[tuple[str, str], ...]:
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a CLIP BPE vocabulary ({VOCAB_FILE}): {e}") from None
    merges = [tuple(line.split()) for line in lines[1 : NUM_MERGES + 1]]
    if len(merges) < NUM_MERGES or any(len(m) != 2 for m in merges):
        raise ValueError(f"{path} is not a CLIP BPE vocabulary ({VOCAB_FILE}): expected {NUM_MERGES:,} merge "
                         f"lines of two symbols after the header")
    return tuple(merges)


class ClipTokenizer:
    """CLIP's BPE tokenizer; token ids equal open_clip's ``SimpleTokenizer`` (``open_clip.tokenize``)."""

    def __init__(self, bpe_path: str | Path | None = None, context_length: int = 77, truncate: bool = True):
        self.bpe_path = find_vocab(bpe_path)
        merges = _read_merges(self.bpe_path)
        byte_symbols = list(bytes_to_unicode().values())
        vocab = byte_symbols + [s + "</w>" for s in byte_symbols] + ["".join(m) for m in merges] + list(SPECIAL_TOKENS)
        self.encoder = {tok: i for i, tok in enumerate(vocab)}
        self.decoder = {i: tok for tok, i in self.encoder.items()}
        self.byte_decoder = {v: k for k, v in bytes_to_unicode().items()}
        self.bpe_ranks = {m: i for i, m in enumerate(merges)}
        self.cache = {t: t for t in SPECIAL_TOKENS}
        self.sot_token_id, self.eot_token_id = self.encoder[SPECIAL_TOKENS[0]], self.encoder[SPECIAL_TOKENS[1]]
        self.vocab_size = len(self.encoder)
        self.context_length = context_length
        self.truncate = truncate

    def bpe(self, token: str) -> str:
        """Merge the symbols of one pre-token (its last symbol marked end-of-word) by rank, lowest first."""
        if token in self.cache:
            return self.cache[token]
        word = [*token[:-1], token[-1] + "</w>"]
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            best = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if best not in self.bpe_ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        out = " ".join(word)
        self.cache[token] = out
        return out

    def encode(self, text: str) -> list[int]:
        byte_map = bytes_to_unicode()
        ids = []
        for piece in pretokenize(clean_text(text)):
            symbols = piece if piece in SPECIAL_TOKENS else "".join(byte_map[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(symbols).split(" "))
        return ids

    def decode(self, ids) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace").replace("</w>", " ")

    def __call__(self, texts: str | list[str], context_length: int | None = None) -> torch.Tensor:
        return pack([self.encode(t) for t in _as_list(texts)], context_length or self.context_length,
                    self.sot_token_id, self.eot_token_id, self.truncate)

    def to_dict(self) -> dict:
        return {"kind": "clip", "context_length": self.context_length}


_WORD = re.compile(r"\w+|[^\w\s]")


class WordTokenizer:
    """Lower-cased words and punctuation marks; ids ``0`` padding, ``1`` unknown, then the vocabulary, then
    start- and end-of-text (the largest id)."""

    PAD, UNK = "<pad>", "<unk>"

    def __init__(self, words: list[str], context_length: int = 16, truncate: bool = True):
        if len(set(words)) != len(words):
            raise ValueError("the word vocabulary has duplicates")
        self.words = list(words)
        vocab = [self.PAD, self.UNK, *self.words, *SPECIAL_TOKENS]
        self.encoder = {w: i for i, w in enumerate(vocab)}
        self.sot_token_id, self.eot_token_id = len(vocab) - 2, len(vocab) - 1
        self.vocab_size = len(vocab)
        self.context_length = context_length
        self.truncate = truncate

    @staticmethod
    def split(text: str) -> list[str]:
        return _WORD.findall(text.lower())

    @classmethod
    def from_texts(cls, texts, context_length: int = 16, truncate: bool = True) -> WordTokenizer:
        """The vocabulary of ``texts`` (sorted, so the same texts always give the same ids)."""
        return cls(sorted({w for t in _as_list(texts) for w in cls.split(t)}), context_length, truncate)

    def encode(self, text: str) -> list[int]:
        unk = self.encoder[self.UNK]
        return [self.encoder.get(w, unk) for w in self.split(text)]

    def __call__(self, texts: str | list[str], context_length: int | None = None) -> torch.Tensor:
        return pack([self.encode(t) for t in _as_list(texts)], context_length or self.context_length,
                    self.sot_token_id, self.eot_token_id, self.truncate)

    def to_dict(self) -> dict:
        return {"kind": "word", "words": self.words, "context_length": self.context_length}


def tokenizer_from_dict(d: dict, bpe_path: str | None = None):
    """The tokenizer a checkpoint describes: ``{'kind': 'word', 'words': [...]}`` or ``{'kind': 'clip'}``."""
    if d.get("kind") == "word":
        return WordTokenizer(d["words"], d.get("context_length", 16))
    if d.get("kind") == "clip":
        return ClipTokenizer(bpe_path or d.get("bpe_path"), d.get("context_length", 77))
    raise ValueError(f"unknown tokenizer description {d.get('kind')!r}; expected 'word' or 'clip'")
