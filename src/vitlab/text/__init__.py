"""Tokenizers and prompt templates shared by the language model and the vision-language models.

- :class:`LookupTokenizer`: the word-level look-up tables of the article "Scaling ViTs across Training Compute"
  (its walkthrough: ``[5, 2, 6, 7, 4]`` and back).
- :class:`SentencePieceTokenizer` (Llama 2's ``tokenizer.model``) and :class:`HFTokenizer` (``tokenizer.json``)
  behind :class:`Tokenizer`; :func:`load_tokenizer` picks one from a path, :func:`check_vocab` refuses a tokenizer
  whose vocabulary does not match a model's embedding.
- :func:`llama2_chat` and :func:`llava_v1`: chat / instruction prompt templates.

CLIP's byte-level BPE tokenizer lives with CLIP (:mod:`vitlab.clip.tokenizer`).
"""

from vitlab.text.subword import (
    IMAGE_TOKEN,
    HFTokenizer,
    SentencePieceTokenizer,
    StreamDecoder,
    Tokenizer,
    check_vocab,
    load_tokenizer,
)
from vitlab.text.templates import LLAVA_V1_SYSTEM, llama2_chat, llava_v1
from vitlab.text.word import LookupTokenizer

__all__ = ["check_vocab", "HFTokenizer", "IMAGE_TOKEN", "llama2_chat", "LLAVA_V1_SYSTEM", "llava_v1",
           "load_tokenizer", "LookupTokenizer", "SentencePieceTokenizer", "StreamDecoder", "Tokenizer"]
