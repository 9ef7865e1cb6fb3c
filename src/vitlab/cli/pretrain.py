"""``vitlab pretrain`` (self-supervised pre-training, :mod:`vitlab.ssl`) and ``vitlab probe`` (frozen-feature
evaluation: linear probe, k-NN).

    vitlab pretrain --method mae --model vit_pico_patch8_32 --data digits --epochs 100
    vitlab pretrain --method dino --model vit_pico_patch8_32 --task_args.out_dim 4096 --task_args.local_crops 4
    vitlab pretrain --resume runs/RUN                  exact resume, as vitlab train
    torchrun --nproc-per-node 2 -m vitlab pretrain --method simclr --strategy ddp ...
    vitlab train --init runs/RUN --data digits          fine-tune the pre-trained backbone
    vitlab probe --checkpoint runs/RUN --protocol knn   (or linear; --checkpoint random:MODEL for the baseline)

The run directory is ``vitlab train``'s (config.yaml, metrics.jsonl with the collapse monitors, curves.png,
checkpoints whose model.safetensors is the backbone, summary.json).
"""

from __future__ import annotations

import argparse
import json

from vitlab._console import console
from vitlab.cli._dataclass_args import device_arg, model_arg_pairs


def cmd_pretrain(args) -> int:
    from vitlab.cli.train import cmd_train, config_from_args
    from vitlab.ssl import list_methods

    if "task" not in vars(args) and "resume" not in vars(args):
        raise ValueError(f"--method is required: one of {', '.join(list_methods())}")
    task = config_from_args(args).task
    if task not in list_methods():
        raise ValueError(f"unknown method {task!r}; choose from {', '.join(list_methods())}")
    return cmd_train(args)


def cmd_probe(args) -> int:
    from vitlab.ssl.probe import probe

    r = probe(args.checkpoint, args.data, protocol=args.protocol, output=args.output, epochs=args.epochs,
              lr=args.lr, bn=args.bn, k=args.k, temperature=args.temperature, batch_size=args.batch_size,
              device=args.device, seed=args.seed, split=args.split, blocks=args.blocks,
              model_kwargs=model_arg_pairs(args.model_arg))
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    what = f"k={r['k']}, T={r['temperature']}" if r["protocol"] == "knn" else \
        f"{r['epochs']} epochs{', BN' if r['bn'] else ''}"
    if r["blocks"] > 1:
        what += f", last {r['blocks']} blocks"
    kind = "random init" if r["checkpoint"].startswith("random:") else r["ssl_method"] or "supervised"
    console.print(f"{r['model']} ({kind}) "
                  f"{r['protocol']} probe ({what}) on {r['dataset']} {r['split']}: top-1 {r['top1']:.2f}%  "
                  f"top-5 {r['top5']:.2f}%  -> {r['json_path']}", highlight=False, soft_wrap=True)
    return 0


def register(sub) -> None:
    from vitlab.cli.train import add_config_command

    t = add_config_command(
        sub, "pretrain", exclude=("task",),
        description="Self-supervised pre-training of a backbone (vitlab.ssl). Every TrainConfig field is a flag, as "
                    "in vitlab train; the method's options are --task_args.NAME VALUE (e.g. --task_args.mask_ratio "
                    "0.6).",
        usage="vitlab pretrain --method METHOD [--model M] [--data D] [--FIELD VALUE ...] "
              "[--task_args.NAME VALUE ...]")
    t.add_argument("--method", dest="task", default=argparse.SUPPRESS, metavar="METHOD",
                   help="the self-supervised method: mae, simclr, mocov3, dino, dinov2, or one a plugin registers "
                        "(vitlab.ssl.list_methods())")
    t.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("probe")  # its help line is vitlab.cli.COMMANDS's
    p.add_argument("--checkpoint", required=True,
                   help="a run directory (its last epoch), checkpoint directory or .safetensors; random:MODEL for "
                        "the baseline (the initialisation of a run with the same --seed)")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                   help="random:MODEL only: a create_model argument (e.g. embed_dim=96), repeatable")
    p.add_argument("--data", default=None, help="default: the data the checkpoint was trained on")
    p.add_argument("--protocol", default="knn", choices=["linear", "knn"])
    p.add_argument("--split", default="test", choices=["val", "test"], help="the split scored")
    p.add_argument("--epochs", type=int, default=100, help="linear: epochs over the frozen features")
    p.add_argument("--lr", type=float, default=0.1, help="linear: SGD lr at batch 256 (momentum 0.9, cosine)")
    p.add_argument("--bn", action="store_true", help="linear: MAE's BatchNorm without affine before the classifier")
    p.add_argument("--blocks", type=int, default=1,
                   help="concatenate the pre-logits of the last N blocks (DINO's n_last_blocks; 4 for ViT-S)")
    p.add_argument("--k", type=int, default=20, help="knn: neighbours")
    p.add_argument("--temperature", type=float, default=0.07, help="knn: vote weight exp(sim / T)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", default="cpu", type=device_arg)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, metavar="FILE",
                   help="the JSON file (default RUN/probe-<protocol>.json; for random:MODEL "
                        "runs/probe/probe-random-MODEL-<protocol>.json)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_probe)
