"""``vitlab retrieval``: image -> text and text -> image recall@1/5/10 of a CLIP checkpoint (Radford et al., 2021,
Sec. 3.1.5) on image-text pairs: ``captions:PATH``, or ``digits`` (each image against the demo's 100 training
captions; a caption matches every image of its digit).

    vitlab retrieval --checkpoint runs/RUN                          the run's data (test split, else val)
    vitlab retrieval --checkpoint openclip:ViT-B-32.pt --data captions:~/flickr --split test
"""

from __future__ import annotations

import json

from vitlab.cli.zeroshot import add_checkpoint_args


def cmd_retrieval(args) -> int:
    from vitlab.clip.zeroshot import result_line, retrieval

    r = retrieval(args.checkpoint, args.data, args.split, args.batch_size, args.device, args.weights,
                  args.quick_gelu, args.bpe)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(result_line(r))
    return 0


def register(sub) -> None:
    p = sub.add_parser("retrieval")  # its help line is vitlab.cli.COMMANDS's
    add_checkpoint_args(p)
    p.add_argument("--data", default=None, help="captions:PATH or digits (default: the run's)")
    p.add_argument("--split", default=None, choices=["train", "val", "test"],
                   help="default: test when the data has one, else val")
    p.set_defaults(func=cmd_retrieval)
