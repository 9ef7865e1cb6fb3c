"""``vitlab generate``: continue a prompt with a Llama language model, printing tokens as they are produced.

    vitlab generate --checkpoint ~/llama-2-7b-hf "The ruler of a kingdom is a"
    vitlab generate --checkpoint ~/llama-2-7b-chat --chat "Where is the Eiffel Tower?"    Meta's release
    vitlab generate --checkpoint llama_tiny --tokenizer tokenizer.model "Hello"          random weights
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from vitlab.cli._dataclass_args import device_arg

_DTYPES = ("float32", "bfloat16", "float16")


def cmd_generate(args) -> int:
    import torch

    from vitlab.models.llama import check_sampling, llama_config_from_dir, load_llama
    from vitlab.registry import is_model
    from vitlab.text import StreamDecoder, check_vocab, llama2_chat, load_tokenizer

    try:  # the sampling settings first: a bad one is named before any file is read
        check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    except ValueError as e:  # in the flags' own names
        raise ValueError(f"--{str(e).replace('_', '-')}") from None
    if not args.prompt.strip():
        raise ValueError("the prompt is empty")
    if args.system is not None and not args.chat:
        raise ValueError("--system is a system prompt of the chat template: it needs --chat")
    if not args.temperature and (args.top_k is not None or args.top_p is not None):
        print("note: --top-k and --top-p shape sampling; with --temperature 0 (the default) decoding is greedy and "
              "they do nothing", file=sys.stderr)
    is_dir = Path(args.checkpoint).is_dir()
    if not is_dir and not is_model(args.checkpoint):
        raise FileNotFoundError(f"{args.checkpoint} is neither a checkpoint directory nor a registered language "
                                f"model (e.g. llama_tiny)")
    if args.tokenizer is None and not is_dir:
        raise ValueError(f"{args.checkpoint} has no tokenizer: pass --tokenizer PATH (tokenizer.model or "
                         f"tokenizer.json)")
    tokenizer = load_tokenizer(args.tokenizer or args.checkpoint)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        ids = tokenizer.encode(llama2_chat(messages), bos=False)
    else:
        ids = tokenizer.encode(args.prompt)
    if is_dir:  # the architecture first: refuse a bad request before loading gigabytes
        cfg = llama_config_from_dir(args.checkpoint)
    else:
        with torch.device("meta"):
            cfg = load_llama(args.checkpoint).config
    check_vocab(tokenizer, cfg.vocab_size, f"the model {args.checkpoint}")
    # generation stops at the tokenizer's end of sequence and at every end the checkpoint's generation_config.json
    # lists (Llama 3's instruction-tuned models end a turn with <|eot_id|>, not the tokenizer's eos), as
    # transformers' generate does; a registered model's random weights have no ends of their own
    ends = cfg.eos_token_id if is_dir else None
    eos = sorted({tokenizer.eos_id, *([ends] if isinstance(ends, int) else ends or [])} - {None})
    if len(ids) + args.max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"the prompt ({len(ids)} tokens) plus --max-new-tokens ({args.max_new_tokens}) exceed the "
                         f"context of {cfg.max_seq_len} tokens: shorten the prompt or ask for fewer tokens")
    model = load_llama(args.checkpoint, dtype=getattr(torch, args.dtype)).to(args.device)
    forward = None
    if args.optimize:
        from vitlab.optimize.llama import compile_llama

        forward = compile_llama(model, prefill=False)  # one prompt: its compile would not pay back
    generator = torch.Generator(args.device).manual_seed(args.seed)
    stream = StreamDecoder(tokenizer)
    times = []

    def on_token(t: torch.Tensor) -> None:
        times.append(time.perf_counter())
        if int(t[0]) not in eos:
            sys.stdout.write(stream.push(int(t[0])))
            sys.stdout.flush()

    start = time.perf_counter()
    out = model.generate(torch.tensor([ids], device=args.device), args.max_new_tokens, args.temperature, args.top_k,
                         args.top_p, eos, generator=generator, on_token=on_token, forward=forward,
                         vocab_size=tokenizer.vocab_size)  # spare embedding rows have no text
    sys.stdout.write(stream.flush() + "\n")
    n = out.shape[1]
    decode = f", decode {(n - 1) / (times[-1] - times[0]):.1f} tokens/s" if n > 1 else ""
    print(f"{len(ids)} prompt tokens in {times[0] - start:.2f} s, {n} new tokens{decode}", file=sys.stderr)
    return 0


def register(sub) -> None:
    p = sub.add_parser(  # its help line is vitlab.cli.COMMANDS's
        "generate",
        description="Continue a prompt with a Llama language model, streaming the new text. The prompt plus "
                    "--max-new-tokens must fit the model's context (4096 tokens for Llama 2): a longer request "
                    "is refused, never truncated.")
    p.add_argument("prompt", help="the text to continue (with --chat: the user's message)")
    p.add_argument("--checkpoint", required=True, metavar="LM",
                   help="a Hugging Face save_pretrained directory, Meta's directory (params.json + "
                        "consolidated.*.pth), or a registered model name (random weights; needs --tokenizer)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.model (SentencePiece) or tokenizer.json, or a directory with one "
                        "(default: the checkpoint directory or its parent)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above 0: sampling")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set of probability p")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in Llama 2-Chat's [INST] ... [/INST]")
    p.add_argument("--system", default=None, help="with --chat: a system prompt")
    p.add_argument("--dtype", default="float32", choices=_DTYPES)
    p.add_argument("--device", default="cpu", type=device_arg)
    p.add_argument("--optimize", action="store_true",
                   help="compile the decoding step (vitlab.optimize.llama; the first tokens wait for the compile)")
    p.set_defaults(func=cmd_generate)
