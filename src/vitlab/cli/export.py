"""``vitlab export``: write a model as ONNX, an ExportedProgram (.pt2) or TorchScript, then validate the file
against eager PyTorch (exit 1 when the max abs difference exceeds 1e-4 in fp32).

    vitlab export deit_tiny_patch16_224 --format onnx --out deit.onnx               (random weights: a warning)
    vitlab export deit_tiny_patch16_224 --checkpoint deit.pth --format onnx --out deit.onnx   (timm or vitlab weights)
    vitlab export runs/RUN --format onnx --int8 --data digits --out model.onnx   (also writes model-int8.onnx)
    vitlab export pvt_tiny --format onnx --dynamic-img-size --out pvt.onnx
    vitlab export runs/RUN --format exported --img-size 64 64 --out model.pt2
    vitlab predict --onnx deit.onnx IMAGE ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SUFFIX = {"onnx": ".onnx", "exported": ".pt2", "torchscript": ".pt"}


def int8_path(out: Path) -> Path:
    return out.with_name(f"{out.stem}-int8{out.suffix}")


def cmd_export(args) -> int:
    import vitlab.export as ex

    if args.format == "onnx":
        ex.require_onnx()
    if args.int8 and args.format != "onnx":
        raise ValueError("--int8 needs --format onnx (torch.ao's dynamic int8 linears do not pass torch.export)")
    if args.data and not args.int8:
        raise ValueError("--data measures the int8 accuracy change: pass it with --int8")
    if args.dynamic_img_size and args.format == "torchscript":
        raise ValueError("--dynamic-img-size needs --format onnx or exported (a TorchScript trace fixes the size)")
    if args.opset is not None and args.format != "onnx":
        raise ValueError("--opset applies to --format onnx only")
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give a file name ending in {SUFFIX[args.format]}")
    named = ex.is_model_name(args.model)  # before any output: a misspelt name fails with its close matches
    kw = dict(img_size=args.img_size, dynamic_batch=args.dynamic_batch)
    if args.checkpoint is not None:
        if not named:
            raise ValueError(f"--checkpoint loads weights into a registered MODEL; {args.model} is a run or "
                             f"checkpoint, exported with its own weights")
        if Path(args.checkpoint).is_dir():
            raise ValueError(f"--checkpoint {args.checkpoint} is a directory: a weights file goes with a MODEL; "
                             f"export a vitlab run as MODEL (vitlab export {args.checkpoint} ...)")
        kw["checkpoint_path"] = args.checkpoint
    if not args.json:  # exporting a large model takes minutes: say what is happening
        print(f"exporting {args.model} as {args.format} to {out}, then validating against eager PyTorch ...",
              flush=True)
    if args.format == "onnx":
        report = ex.onnx(args.model, out, dynamic_img_size=args.dynamic_img_size,
                         **({"opset": args.opset} if args.opset is not None else {}), **kw)
    elif args.format == "exported":
        report = ex.exported_program(args.model, out, dynamic_img_size=args.dynamic_img_size, **kw)
    else:
        report = ex.torchscript(args.model, out, **kw)
    # warned once the export stands (bad input keeps its one error line), on stderr (--json keeps stdout JSON)
    if named and args.checkpoint is None:
        print(f"warning: no --checkpoint: random-init weights ({args.model} exported untrained, its predictions "
              f"are meaningless); pass --checkpoint PATH, or a run directory as MODEL", file=sys.stderr)
    result = {"path": report.path, "format": report.format, "exporter": report.exporter, "notes": report.notes,
              "size_bytes": report.size_bytes, "max_abs_diff": report.diffs, "ok": report.ok}
    if not args.json:
        print("\n".join(report.lines()))
    if args.int8 and report.ok:
        if not args.json:
            print(f"quantizing to int8 and measuring{' on ' + args.data if args.data else ''} ...", flush=True)
        q = ex.quantize_onnx(out, int8_path(out), data=args.data)
        result["int8"] = q
        if not args.json:
            print(f"int8: wrote {q['int8_path']} ({q['int8_bytes'] / 2**20:.1f} MiB, fp32 "
                  f"{q['fp32_bytes'] / 2**20:.1f} MiB, {q['fp32_bytes'] / q['int8_bytes']:.2f}x smaller); "
                  f"max abs logit change on real photos {q['max_abs_diff_real']:.3g}")
            if "top1_fp32" in q:
                print(f"int8 accuracy on {q['dataset']} {q['split']} ({q['num_images']} images): top-1 "
                      f"{q['top1_fp32']:.2f}% -> {q['top1_int8']:.2f}% ({q['top1_change']:+.2f} points), "
                      f"{q['prediction_agreement']:.1f}% same predictions")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0 if report.ok else 1


def register(sub) -> None:
    p = sub.add_parser("export",  # its help line is vitlab.cli.COMMANDS's
                       description="Export a registered model (random weights unless --checkpoint) or a "
                                   "vitlab-trained run, then validate the file against eager PyTorch on random and "
                                   "real images; exit 1 when the max abs difference exceeds 1e-4.")
    p.add_argument("model", metavar="MODEL|RUN", help="a registered model name or a run / checkpoint directory")
    p.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="weights (timm or vitlab format) for a registered MODEL; without it MODEL has random weights")
    p.add_argument("--format", required=True, choices=list(SUFFIX))
    p.add_argument("--out", required=True, metavar="FILE")
    p.add_argument("--img-size", type=int, nargs=2, metavar=("H", "W"), default=None,
                   help="a fixed input size other than the model's (position embeddings resampled at export time)")
    p.add_argument("--static-batch", dest="dynamic_batch", action="store_false",
                   help="batch fixed to 1 (default: a symbolic batch dimension)")
    p.add_argument("--dynamic-img-size", action="store_true",
                   help="symbolic height and width (models that compute any size exactly)")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default 20)")
    p.add_argument("--int8", action="store_true",
                   help="also write FILE-int8.onnx with ONNX Runtime dynamic int8 linears; print size and accuracy")
    p.add_argument("--data", default=None, help="with --int8: the dataset the accuracy change is measured on")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_export)
