"""Fine-tuning throughput of a LLaVA-style model (Liu et al., 2023): image tower -> projector -> Llama decoder, one
``<image>`` placeholder per prompt widened into the image's tokens, next-token cross-entropy on the text.

Random images and prompts of ``--text-len`` tokens (random weights: the figure is speed, not learning); AdamW steps
(forward, backward, optimizer) after ``--warmup`` untimed ones; ``--stage 1`` trains the projector only and
``--stage 2`` the projector and the language model (LLaVA's two stages), ``0`` everything. Prints (and writes with
``--json``) samples/s and the tokens/s the language model sees (text plus image tokens), median over ``--runs``
timed windows of ``--steps`` steps.

    python benchmarks/vlm_train_throughput.py --model llava_tiny --batch-size 8 --steps 3 --runs 2
    python benchmarks/vlm_train_throughput.py --model llava_scenes --batch-size 64 --json docs/bench/vlm_train_cpu.json
    python benchmarks/vlm_train_throughput.py --model llava_scenes --device cuda --amp bf16 --batch-size 256 \\
        --json docs/bench/vlm_train_cuda_bf16.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llava_scenes")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--text-len", type=int, default=24)
    ap.add_argument("--stage", type=int, default=0, choices=[0, 1, 2])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--amp", default="none", choices=["none", "bf16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    import vitlab
    from vitlab._io import write_json

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = vitlab.create_model(args.model).to(dev).train()
    frozen = {1: ("vision_tower", "language_model"), 2: ("vision_tower",)}.get(args.stage, ())
    for part in frozen:
        for p in getattr(model, part).parameters():
            p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    c, h, w = vitlab.get_model_config(args.model).input_size
    vocab, image = model.language_model.config.vocab_size, model.image_token_id
    images = torch.randn(args.batch_size, c, h, w, device=dev)
    ids = torch.randint(0, vocab, (args.batch_size, args.text_len), device=dev)
    ids = torch.where(ids == image, (ids + 1) % vocab, ids)  # no stray placeholder
    ids[:, 1] = image
    labels = ids.masked_fill(ids == image, -100)
    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if args.amp == "bf16"
                else contextlib.nullcontext())
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step():
        with autocast:
            loss = model(ids, images, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    sync()
    times = []
    for _ in range(args.runs):
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        times.append((time.perf_counter() - t) / args.steps)
    sec = statistics.median(times)
    seq = args.text_len - 1 + model.num_image_tokens
    row = {"model": args.model, "device": str(dev), "amp": args.amp, "stage": args.stage,
           "batch_size": args.batch_size, "text_len": args.text_len, "image_tokens": model.num_image_tokens,
           "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
           "trainable_m": round(sum(p.numel() for p in params) / 1e6, 3), "step_s": round(sec, 5),
           "step_s_min": round(min(times), 5), "step_s_max": round(max(times), 5),
           "samples_per_s": round(args.batch_size / sec, 2), "lm_tokens_per_s": round(args.batch_size * seq / sec, 1),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
           "cpu": platform.processor() or platform.machine(),
           "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None}
    print(json.dumps(row, indent=2))
    if args.json:
        write_json(args.json, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
