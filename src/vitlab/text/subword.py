"""Subword tokenizers of language models, behind one interface (:class:`Tokenizer`).

- :class:`SentencePieceTokenizer`: a SentencePiece model file (Kudo & Richardson, 2018), such as Llama 2's
  ``tokenizer.model`` (a BPE of 32,000 pieces with byte fallback, Touvron et al., 2023, Sec. 2.1), read through
  ``sentencepiece``. Tokens added after training (LLaVA's ``<image>``) take the ids after the model's pieces.
- :class:`HFTokenizer`: a Hugging Face ``tokenizer.json`` read through ``tokenizers``, with the special tokens
  named in ``tokenizer_config.json`` when there is one.

Both encode a text as ``[bos] + pieces + [eos]`` (each optional) and treat the special tokens written in the text
(``<s>``, ``</s>``, ``<image>``...) as their ids. A SentencePiece text is split at them and each piece between is
encoded on its own, as Meta's Llama 2 chat code encodes each turn and LLaVA encodes the text around ``<image>``;
a ``tokenizer.json`` text goes to ``tokenizers`` whole, which splits at its added tokens itself (the ids of
transformers' fast tokenizer and of its processors): a special token is read as its id there when the file (or
``added_tokens``) has it as an added token, as Llama's and LLaVA's files have ``<s>``, ``</s>`` and ``<image>``.
:func:`load_tokenizer` picks the kind from a path; :func:`check_vocab` refuses a tokenizer whose ids do not fit a
model's embedding.
"""

from __future__ import annotations

import json
import os
import re
from abc import ABC, abstractmethod
from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"


class Tokenizer(ABC):
    """What the language models need of a tokenizer: ``encode`` / ``decode``, the special ids (``bos_id``,
    ``eos_id``, ``pad_id``, ``unk_id``; None where the tokenizer has none), ``vocab_size`` (every id, added tokens
    included), ``specials`` (special token text -> id) and a batch call that left-pads for generation."""

    def __init__(self, specials: dict[str, int], bos_id: int | None, eos_id: int | None, pad_id: int | None,
                 vocab_size: int, unk_id: int | None = None):
        self.specials, self.bos_id, self.eos_id, self.pad_id = specials, bos_id, eos_id, pad_id
        self.unk_id = unk_id  # what a text the vocabulary cannot spell becomes (None: byte fallback or none)
        self.vocab_size = vocab_size
        names = sorted(specials, key=len, reverse=True)  # the longest first, so '<image>' wins over a prefix
        self._split_re = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    @abstractmethod
    def _encode_plain(self, text: str) -> list[int]:
        """The ids of a text without special tokens."""

    @abstractmethod
    def _decode_plain(self, ids: list[int]) -> str:
        """The text of ids without special tokens."""

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of ``text``, with the beginning-of-sequence id first (``bos``) and the end one last (``eos``)."""
        ids = [self.bos_id] if bos and self.bos_id is not None else []
        ids.extend(self._encode_text(text))
        if eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _encode_text(self, text: str) -> list[int]:
        """The ids of a text that may hold special tokens: split at them, each piece between encoded on its own."""
        ids: list[int] = []
        for part in self._split_re.split(text) if self._split_re is not None else [text]:
            if part in self.specials:
                ids.append(self.specials[part])
            elif part:
                ids.extend(self._encode_plain(part))
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        """The text of ``ids``; special tokens are left out (``skip_special``) or written as their text."""
        names = {i: s for s, i in self.specials.items()}
        if skip_special:  # one run: the pieces around a dropped token join as the tokenizer joins them
            return self._decode_plain([i for i in (int(t) for t in ids) if i not in names])
        out, run = [], []
        for i in (int(t) for t in ids):
            if i in names:
                if run:
                    out.append(self._decode_plain(run))
                    run = []
                out.append(names[i])
            else:
                run.append(i)
        if run:
            out.append(self._decode_plain(run))
        return "".join(out)

    def token_id(self, token: str) -> int:
        """The id of a special token (``'<image>'``), or ``ValueError`` naming the ones there are."""
        if token not in self.specials:
            raise ValueError(f"the tokenizer has no {token!r} token; its special tokens: {', '.join(self.specials)}")
        return self.specials[token]

    def __call__(self, texts: str | list[str], bos: bool = True, eos: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch: ``(ids, attention_mask)``, each (B, longest), left-padded (generation appends on the right)
        with ``pad_id`` (else ``eos_id``, else 0) and mask 0 on the padding."""
        rows = [self.encode(t, bos, eos) for t in ([texts] if isinstance(texts, str) else texts)]
        if not rows or not any(rows):
            raise ValueError("nothing to tokenize: the text is empty")
        n = max(len(r) for r in rows)
        pad = next((p for p in (self.pad_id, self.eos_id) if p is not None), 0)
        ids = torch.tensor([[pad] * (n - len(r)) + r for r in rows], dtype=torch.long)
        mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
        return ids, mask

    def __len__(self) -> int:
        return self.vocab_size


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file (Llama 2's ``tokenizer.model``). ``added_tokens`` (e.g. ``['<image>']``)
    are special tokens appended after the model's pieces, as Hugging Face adds them."""

    def __init__(self, path: str | os.PathLike, added_tokens: tuple[str, ...] | list[str] = ()):
        import sentencepiece as spm

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer model not found: {path}")
        self.path = path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{path} is not a SentencePiece model ({str(e).splitlines()[0][:120]})") from None
        n = self.sp.get_piece_size()

        def special(i: int) -> int | None:
            return i if 0 <= i < n else None

        bos, eos, pad = special(self.sp.bos_id()), special(self.sp.eos_id()), special(self.sp.pad_id())
        specials = {self.sp.id_to_piece(i): i for i in (bos, eos, pad) if i is not None}
        new = [t for t in added_tokens if self.sp.piece_to_id(t) == self.sp.unk_id() and t not in specials]
        specials.update({t: n + k for k, t in enumerate(new)})
        super().__init__(specials, bos, eos, pad, n + len(new), unk_id=special(self.sp.unk_id()))

    def _encode_plain(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def _decode_plain(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json``. The special tokens are the tokenizer's added special tokens; bos / eos /
    pad are those ``tokenizer_config.json`` beside it names, else the usual texts (``<s>``, ``</s>``, ``<pad>``...)
    when the vocabulary has them. ``added_tokens`` missing from the file are added as special tokens."""

    _BOS = ("<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")
    _EOS = ("</s>", "<|end_of_text|>", "<|endoftext|>", "[SEP]")
    _PAD = ("<pad>", "[PAD]", "<|pad|>")
    _UNK = ("<unk>", "[UNK]")

    def __init__(self, path: str | os.PathLike, added_tokens: tuple[str, ...] | list[str] = ()):
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {file}")
        self.path = file
        try:
            self.tok = _Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust parser's message: keep its first line
            raise ValueError(f"{file} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0][:120]})") from None
        vocab = self.tok.get_vocab(with_added_tokens=True)
        missing = [t for t in added_tokens if t not in vocab]
        if missing:
            self.tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
            vocab = self.tok.get_vocab(with_added_tokens=True)
        specials = {t.content: i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        specials.update({t: vocab[t] for t in added_tokens})
        config = {}
        if (file.parent / "tokenizer_config.json").is_file():
            try:
                config = json.loads((file.parent / "tokenizer_config.json").read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{file.parent / 'tokenizer_config.json'} is not valid JSON ({e})") from None

        def find(key: str, names: tuple[str, ...]) -> int | None:
            text = _token_text(config.get(key))
            for name in ([text] if text else []) + list(names):
                if name in vocab:
                    specials.setdefault(name, vocab[name])
                    return vocab[name]
            return None

        bos, eos, pad = find("bos_token", self._BOS), find("eos_token", self._EOS), find("pad_token", self._PAD)
        super().__init__(specials, bos, eos, pad, self.tok.get_vocab_size(with_added_tokens=True),
                         unk_id=find("unk_token", self._UNK))

    def _encode_plain(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _encode_text(self, text: str) -> list[int]:
        # the library splits at its added tokens itself, and its pre-tokenizer decides what follows one (a
        # Metaspace with prepend_scheme "first" adds no "▁" there): the ids of transformers' fast tokenizer
        return self._encode_plain(text)

    def _decode_plain(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(path: str | os.PathLike, added_tokens: tuple[str, ...] | list[str] = ()) -> Tokenizer:
    """The tokenizer at ``path``: a ``tokenizer.json`` (Hugging Face), a SentencePiece ``.model`` file, or a
    directory holding one of them (``tokenizer.json`` first); for Meta's checkpoint folders, whose
    ``tokenizer.model`` sits one level up, the parent directory is searched too."""
    path = Path(path)
    if path.is_file():
        return HFTokenizer(path, added_tokens) if path.suffix == ".json" else SentencePieceTokenizer(path, added_tokens)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer not found: {path}")
    for folder in (path, path.parent):
        if (folder / "tokenizer.json").is_file():
            return HFTokenizer(folder / "tokenizer.json", added_tokens)
        if (folder / "tokenizer.model").is_file():
            return SentencePieceTokenizer(folder / "tokenizer.model", added_tokens)
    raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {path} (or its parent); pass --tokenizer PATH")


class StreamDecoder:
    """Text of a growing token sequence, piece by piece, for printing tokens as they are generated:
    :meth:`push` returns the text the new token adds (empty while a character's UTF-8 bytes are incomplete).
    Decoding the whole sequence each time keeps the spaces SentencePiece attaches to the next piece right."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a byte-fallback character not complete yet
            return ""
        new, self.text = text[len(self.text):], text
        return new

    def flush(self) -> str:
        """The text held back at the end (a character whose bytes never completed decodes as U+FFFD, as
        :meth:`Tokenizer.decode` gives it), so the streamed pieces add up to the decoded sequence."""
        text = self.tokenizer.decode(self.ids)
        new, self.text = text[len(self.text):], text
        return new


# an embedding may have spare rows: its row count rounded up to a multiple of a power of two, at most this one
# (LLaVA-1.5 pads its 32,002 tokens to 32,064 rows, transformers' resize_token_embeddings(pad_to_multiple_of=64))
MAX_PAD_MULTIPLE = 128


def check_vocab(tokenizer: Tokenizer, num_embeddings: int, what: str = "the checkpoint") -> None:
    """Refuse (``ValueError``, one line) a tokenizer of another model: its ``vocab_size`` tokens must fill
    ``num_embeddings`` rows, or the rows must be that count rounded up to a multiple of a power of two of at most
    :data:`MAX_PAD_MULTIPLE` (padded embeddings)."""
    n = tokenizer.vocab_size
    step = min(num_embeddings & -num_embeddings, MAX_PAD_MULTIPLE)  # the largest such power of two dividing it
    if not (num_embeddings == n or n < num_embeddings < n + step):
        source = getattr(tokenizer, "path", type(tokenizer).__name__)
        raise ValueError(f"tokenizer {source} has {n:,} tokens but {what}'s embedding has {num_embeddings:,} rows: "
                         f"they belong to different models")
