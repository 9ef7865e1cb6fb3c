"""MAE pre-training throughput (images/s) and model FLOPs utilisation of ``vitlab.ssl.MAE`` on ViT-B/16
(decoder 8 x 512, 16 heads, mask ratio 0.75; He et al., 2022), bf16 autocast, AdamW, on one GPU.

    python benchmarks/mae_throughput.py --out docs/bench/mae_vit_b16_cuda_bf16.json
    python benchmarks/mae_throughput.py --device cpu --model vit_pico_patch8_32 --batch 32 --steps 3   (smoke)

FLOPs of one training step (forward + backward, SDPA included) are counted once with
``torch.utils.flop_counter.FlopCounterMode`` (2 FLOPs per multiply-add); MFU = FLOPs per step / median step time
/ the GPU's dense bf16 peak (``--peak_tflops``, default from the device name: H100 SXM 989, H100 PCIe 756, H200 989).
Every timed step is synchronised; the median and quartiles over ``--steps`` steps after ``--warmup`` are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import vitlab
from vitlab.ssl import MAE

PEAKS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, v in PEAKS.items():  # the most specific names first
        if key in name:
            return v
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--amp", default="bf16", choices=["bf16", "none"])
    ap.add_argument("--peak_tflops", type=float, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = vitlab.get_model_config(args.model)
    backbone = vitlab.create_model(args.model, num_classes=0)
    small = backbone.embed_dim < 256  # a smoke run on a tiny model gets a tiny decoder
    mae = MAE(backbone, decoder_dim=64 if small else 512, decoder_depth=2 if small else 8,
              decoder_heads=4 if small else 16).to(dev)
    opt = torch.optim.AdamW([p for p in mae.parameters() if p.requires_grad], lr=1.5e-4, betas=(0.9, 0.95),
                            fused=dev.type == "cuda")
    x = torch.randn(args.batch, *cfg.input_size, device=dev)
    ctx = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if args.amp == "bf16" else None

    def step():
        if ctx is None:
            loss = mae(x)["loss"]
        else:
            with ctx():
                loss = mae(x)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    flops = counter.get_total_flops()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [med, med, med]
    peak = args.peak_tflops or peak_tflops(dev)
    r = {"model": args.model, "decoder": [mae.decoder.embed.out_features, len(mae.decoder.blocks)],
         "mask_ratio": mae.mask_ratio, "batch": args.batch, "amp": args.amp, "device": str(dev),
         "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
         "torch": torch.__version__, "step_s_median": med, "step_s_q1": q[0], "step_s_q3": q[2],
         "img_per_s": args.batch / med, "train_flops_per_img": flops / args.batch,
         "achieved_tflops": flops / med / 1e12, "peak_tflops": peak,
         "mfu": flops / med / 1e12 / peak if peak else None,
         "max_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None}
    print(json.dumps(r, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
