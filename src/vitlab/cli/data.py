"""``vitlab data``: streaming datasets.

    vitlab data pack imagefolder:~/pets --out ~/pets-shards --shard-size 1000   WebDataset shards of a dataset
    vitlab data pack captions:~/pairs --out ~/pair-shards                      image-text shards for --task clip
    vitlab data info wds:~/pets-shards                                         samples and classes per split

``pack`` writes ``{split}-NNNNNN.tar`` shards (an image folder's files copied as they are, other datasets' images
as PNG), a shard index per split and ``classes.json`` (see :func:`vitlab.data.wds.pack`); train with
``vitlab train --data wds:DIR``.
"""

from __future__ import annotations

import json


def cmd_pack(args) -> int:
    from vitlab.data.wds import pack, pack_pairs

    if args.dataset.startswith("captions:"):  # image-text pairs, for --task clip: the caption as txt
        from vitlab.data.captions import read_captions

        r = pack_pairs(read_captions(args.dataset.partition(":")[2]), args.out, shard_size=args.shard_size,
                       seed=args.seed)
    else:
        r = pack(args.dataset, args.out, shard_size=args.shard_size, seed=args.seed,
                 skip_bad_images=args.skip_bad_images)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    parts = ", ".join(f"{s} {v['samples']} samples in {v['shards']} shards" for s, v in r["splits"].items())
    what = f"{len(r['classes'])} classes" if r["classes"] else "image-text pairs"
    print(f"{args.dataset} -> {r['out']}: {parts}; {what}")
    return 0


def cmd_info(args) -> int:
    from vitlab.data import DataConfig
    from vitlab.data.registry import SPLITS, dataset_spec

    try:
        options = json.loads(args.options) if args.options else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--options is not JSON: {e.msg}") from None
    cfg = DataConfig(dataset=args.dataset, options=options)
    spec = dataset_spec(cfg.name)
    resolved = cfg.resolved()
    given = {k: 3 if k == "in_chans" else getattr(resolved, k) for k in spec.takes}
    splits = {}
    classes: list[str] = []
    for split in SPLITS:
        d = spec.fn(split, cfg.root, **given, **cfg.options)
        if d is not None:
            splits[split] = len(d)
            classes = classes or list(d.classes)
    r = {"dataset": args.dataset, "splits": splits, "num_classes": len(classes), "classes": classes}
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    sizes = ", ".join(f"{s} {n}" for s, n in splits.items())
    shown = ", ".join(classes[:10]) + (", ..." if len(classes) > 10 else "")
    print(f"{args.dataset}: {sizes} samples; {len(classes)} classes ({shown})")
    return 0


def register(sub) -> None:
    p = sub.add_parser("data", description="Streaming datasets: write WebDataset shards, describe a dataset.")
    verbs = p.add_subparsers(dest="verb", required=True)
    pk = verbs.add_parser("pack", help="write a dataset's splits as WebDataset shards with their index",
                          description="Write DATASET's train / val / test splits as WebDataset tar shards in OUT, "
                                      "with a shard index per split and classes.json. Each shard is renamed into "
                                      "place when complete; a failure removes what this command wrote.")
    pk.add_argument("dataset", help="imagefolder:PATH, digits, mnist:PATH, ... (a registered dataset), or "
                                    "captions:PATH (image-text pairs, captions as txt)")
    pk.add_argument("--out", required=True, help="a new or empty folder for the shards")
    pk.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
    pk.add_argument("--seed", type=int, default=0, help="the one shuffle of the training samples before writing")
    pk.add_argument("--skip-bad-images", action="store_true", help="leave out unreadable images (counted)")
    pk.add_argument("--json", action="store_true")
    pk.set_defaults(func=cmd_pack)
    info = verbs.add_parser("info", help="samples per split and the classes of a dataset (wds:, hf:, ...)")
    info.add_argument("dataset", help="wds:DIR, hf:PATH, imagefolder:PATH, ...")
    info.add_argument("--options", default=None, help='the dataset\'s options as JSON, e.g. \'{"val": "v.tar"}\'')
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)
