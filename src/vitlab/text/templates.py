"""Prompt templates of chat and instruction models, as text whose special tokens (``<s>``, ``</s>``,
``<image>``) a :class:`~vitlab.text.subword.Tokenizer` encodes as their ids.

- :func:`llama2_chat`: Llama 2-Chat (Touvron et al., 2023, Sec. 3; Meta's ``chat_completion``): each exchange
  ``<s>[INST] user [/INST] answer </s>``, the system prompt inside the first instruction between ``<<SYS>>`` and
  ``<</SYS>>``, the prompt ending with the open ``[INST] ... [/INST]``. Encoded with ``bos=False`` (the template
  writes its own ``<s>``), it gives the ids Meta's code builds turn by turn.
- :func:`llava_v1`: LLaVA v1 / v1.5 (Liu et al., 2023, "Visual Instruction Tuning"; "Improved Baselines with
  Visual Instruction Tuning", the Vicuna v1 conversation): ``SYSTEM USER: <image>\\nquestion ASSISTANT: answer</s>``,
  ending with ``ASSISTANT:`` for the model to answer.

``messages``: a list of ``{"role": "system" | "user" | "assistant", "content": str}``, alternating user and
assistant after an optional system message, ending with a user message (the one to answer).
"""

from __future__ import annotations

from vitlab.text.subword import IMAGE_TOKEN

B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
LLAVA_V1_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. The assistant gives "
                   "helpful, detailed, and polite answers to the human's questions.")


def _turns(messages: list[dict]) -> tuple[str | None, list[str]]:
    """The system prompt (or None) and the contents of the alternating user / assistant turns, checked, as
    written (each template strips what its reference code strips)."""
    if not messages:
        raise ValueError("no messages: a prompt needs at least one user message")
    system = messages[0]["content"] if messages[0].get("role") == "system" else None
    turns = messages[1:] if system is not None else messages
    for i, m in enumerate(turns):
        role = "user" if i % 2 == 0 else "assistant"
        if m.get("role") != role:
            raise ValueError(f"message {i + (system is not None)} has role {m.get('role')!r}, expected {role!r}: "
                             f"roles alternate user, assistant, ... after an optional system message")
        if not str(m.get("content", "")).strip():
            raise ValueError(f"message {i + (system is not None)} ({role}) is empty")
    if len(turns) % 2 == 0:
        raise ValueError("the last message must be the user's (the one the model answers)")
    return system, [str(m["content"]) for m in turns]


def llama2_chat(messages: list[dict], bos: str = "<s>", eos: str = "</s>") -> str:
    """The Llama 2-Chat prompt of a conversation (encode it with ``bos=False``)."""
    system, turns = _turns(messages)
    if system is not None:  # as Meta's chat_completion: the system block joins the first message, then each
        turns[0] = B_SYS + system + E_SYS + turns[0]  # message is stripped whole (the system prompt is not)
    turns = [t.strip() for t in turns]
    text = "".join(f"{bos}{B_INST} {q} {E_INST} {a} {eos}" for q, a in zip(turns[0::2], turns[1::2]))
    return text + f"{bos}{B_INST} {turns[-1]} {E_INST}"


def llava_v1(messages: list[dict], image: bool = True, eos: str = "</s>") -> str:
    """The LLaVA v1 prompt of a conversation about one image (encode it with ``bos=True``): ``<image>\\n`` opens
    the first user message unless it already holds the placeholder (``image=False``: a text-only prompt)."""
    system, turns = _turns(messages)
    turns = [t.strip() for t in turns]
    if image and IMAGE_TOKEN not in turns[0]:
        turns[0] = f"{IMAGE_TOKEN}\n{turns[0]}"
    text = (LLAVA_V1_SYSTEM if system is None else system.strip()) + " "
    text += "".join(f"USER: {q} ASSISTANT: {a}{eos}" for q, a in zip(turns[0::2], turns[1::2]))
    return text + f"USER: {turns[-1]} ASSISTANT:"
