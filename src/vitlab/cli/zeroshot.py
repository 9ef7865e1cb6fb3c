"""``vitlab zeroshot``: zero-shot classification with a CLIP checkpoint (Radford et al., 2021, Sec. 3.1.4: class
weights from the text tower, prompt-ensembled over templates; images classified by cosine similarity).

    vitlab zeroshot --checkpoint runs/RUN                         the run's data and held-out templates
    vitlab zeroshot --checkpoint openclip:ViT-B-16.pt --data imagefolder:~/pets --classnames cat dog \\
        --templates "a photo of a {}." "a blurry photo of a {}."
"""

from __future__ import annotations

import json
from pathlib import Path

from vitlab.cli._dataclass_args import device_arg


def read_list(values: list[str] | None) -> list[str] | None:
    """The values themselves, or the lines of the one file named (one class name / template per line)."""
    if values and len(values) == 1 and Path(values[0]).expanduser().is_file():
        return [line.strip() for line in Path(values[0]).expanduser().read_text().splitlines() if line.strip()]
    return values


def add_checkpoint_args(p) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="a CLIP run (directory, checkpoint directory or .safetensors) or openclip:FILE")
    p.add_argument("--weights", default="auto", choices=["auto", "raw", "ema"])
    p.add_argument("--quick-gelu", action="store_true", help="openclip: the model uses QuickGELU (OpenAI weights)")
    p.add_argument("--bpe", default=None, metavar="PATH", help="CLIP's bpe_simple_vocab_16e6.txt.gz "
                                                               "(default: the installed open_clip's)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", default="cpu", type=device_arg)
    p.add_argument("--json", action="store_true")


def cmd_zeroshot(args) -> int:
    from vitlab.clip.zeroshot import result_line, zeroshot

    r = zeroshot(args.checkpoint, args.data, read_list(args.classnames), read_list(args.templates), args.split,
                 args.batch_size, args.device, args.weights, args.quick_gelu, args.bpe)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(result_line(r))
    return 0


def register(sub) -> None:
    p = sub.add_parser("zeroshot",  # its help line is vitlab.cli.COMMANDS's
                       description="Zero-shot classification: class weights from the text tower (prompt "
                                   "ensembling over the templates), images classified by cosine similarity.")
    add_checkpoint_args(p)
    p.add_argument("--data", default=None, help="digits | imagefolder:PATH | cifar10:PATH ... (default: the run's)")
    p.add_argument("--split", default="test", choices=["train", "val", "test"])
    p.add_argument("--classnames", nargs="+", default=None, metavar="NAME",
                   help="one per class, in the dataset's class order, or a file with one per line")
    p.add_argument("--templates", nargs="+", default=None, metavar="TEMPLATE",
                   help="prompts with {} for the class name, or a file with one per line (default: the run's)")
    p.set_defaults(func=cmd_zeroshot)
