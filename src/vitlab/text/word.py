"""The word-level look-up tokenizer of the article "Scaling ViTs across Training Compute" (its walkthrough before
Llama 2's SentencePiece): lower-case, split on whitespace, a sorted vocabulary of the words of a text, and every
unseen word appended with the next id. Tokenizing "the kingdom had another ruler" with the vocabulary of
"The ruler of a kingdom is a" gives ``[5, 2, 6, 7, 4]``, and decoding gives the sentence back.

It shows what a tokenizer is (two look-up tables), not what a language model uses: Llama 2 uses a SentencePiece
BPE model (Touvron et al., 2023, Sec. 2.1; :mod:`vitlab.text.subword`)."""

from __future__ import annotations


class LookupTokenizer:
    """``words_to_ids`` / ``ids_to_words`` built from ``text``; :meth:`encode` grows them with unseen words."""

    def __init__(self, text: str = ""):
        self.vocab = sorted(set(self.split(text)))
        self.words_to_ids = {w: i for i, w in enumerate(self.vocab)}
        self.ids_to_words = {i: w for w, i in self.words_to_ids.items()}

    @staticmethod
    def split(text: str) -> list[str]:
        """Case-insensitive words separated by whitespace."""
        return text.lower().split()

    def lookup(self, word: str) -> int:
        """The id of ``word``; an unseen word gets the next id (the vocabulary grows)."""
        if word not in self.words_to_ids:
            self.vocab.append(word)
            self.words_to_ids[word] = len(self.vocab) - 1
            self.ids_to_words[len(self.vocab) - 1] = word
        return self.words_to_ids[word]

    def encode(self, text: str) -> list[int]:
        return [self.lookup(w) for w in self.split(text)]

    def decode(self, ids) -> str:
        try:
            return " ".join(self.ids_to_words[int(i)] for i in ids)
        except KeyError as e:
            raise ValueError(f"token id {e.args[0]} is not in the vocabulary of {len(self.vocab)} words") from None

    def __len__(self) -> int:
        return len(self.vocab)
