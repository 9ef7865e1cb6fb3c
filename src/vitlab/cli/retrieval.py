"""``vitlab retrieval``: image -> text and text -> image recall@1/5/10 of a CLIP checkpoint on captions.

    vitlab retrieval --checkpoint runs/RUN                          the run's captions (test split, else val)
    vitlab retrieval --checkpoint openclip:ViT-B-32.pt --data captions:~/flickr --split test
"""

from __future__ import annotations

import json

from vitlab.cli.zeroshot import add_checkpoint_args


def cmd_retrieval(args) -> int:
    from vitlab.clip.zeroshot import retrieval

    r = retrieval(args.checkpoint, args.data, args.split, args.batch_size, args.device, args.weights,
                  args.quick_gelu, args.bpe)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    recall = "  ".join(f"{d} R@{k} {r[f'{d}_r{k}']:.2f}" for d in ("i2t", "t2i") for k in (1, 5, 10))
    print(f"{r['model']} on {r['dataset']} ({r['split']}, {r['num_images']} images, {r['num_texts']} captions): "
          f"{recall}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("retrieval", help="image-text retrieval with a CLIP checkpoint: recall@1/5/10 both ways")
    add_checkpoint_args(p)
    p.add_argument("--data", default=None, help="captions:PATH (default: the run's)")
    p.add_argument("--split", default=None, choices=["train", "val", "test"],
                   help="default: test when the captions have one, else val")
    p.set_defaults(func=cmd_retrieval)
