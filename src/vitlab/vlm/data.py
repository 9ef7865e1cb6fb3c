"""Vision-language data: image + conversation samples for captioning and visual question answering.

Every source is read into :class:`VLSample` lists per split (``train``, ``val``, optional ``test``): the image (a
file path, or an index into the in-memory images of the scenes set), the conversation's turns (a question and
its answer; none for a caption), the references it is scored against (all captions of the image, or the human
answers) and the question's kind. Every row is checked when the file is read, so a bad one is named before
training starts (one :class:`vitlab.data.DataError`: file, line or entry).

- ``coco:PATH`` -- COCO captions (Chen et al., 2015, "Microsoft COCO Captions"): PATH is an annotations JSON
  ``{"images": [{"id", "file_name"}], "annotations": [{"image_id", "caption"}]}`` whose images lie in the
  JSON's folder or its ``images/``; or the COCO folder (``annotations/captions_<split>*.json`` with the images
  in ``<split>*/`` or ``images/``). Every image is checked (a corrupt or missing file is named).
- ``vqa:PATH`` -- a JSONL file: ``{"image", "question", "answers": [...]}`` per line (or ``"answer"``, which
  counts as ten agreeing annotators; optional ``"kind"`` and ``"split"``), images relative to the file (Antol et
  al., 2015, "VQA: Visual Question Answering": scored against the human answers). A ``<image>`` placeholder in a
  question is taken out (the image is the row's), more than one is refused.
- ``llava:PATH`` -- LLaVA's instruction JSON (Liu et al., 2023, "Visual Instruction Tuning", Sec. 3): a list of
  ``{"image", "conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", "value": ...}]}``;
  human and model turns alternate, the first human turn holds the one image placeholder (more than one is
  refused: an entry has one image), which is taken out of the text (the task places the image itself). An
  image is looked for beside the file, then in its ``images/`` (a missing one names both paths).
- ``captions:PATH`` -- the image-caption rows ``--task clip`` reads (:func:`vitlab.data.captions.read_captions`: a
  folder with ``captions.csv`` or ``captions.jsonl``, or that file; ``image`` relative to the file, ``caption``,
  optional ``split``), one sample per image with all its captions as references, as COCO's.
- ``scenes`` (the embedded offline set, :func:`make_scenes`): one to four real objects -- scikit-image's horse
  silhouette filled with a crop of its photographs, the head of its cat photograph in an oval, a scikit-learn
  handwritten digit drawn in ink -- each in a cell of a 2 x 2 grid on a tinted crop of its brick, grass or gravel
  texture, with the exact ground truth (class, cell, box). Captions come from templates (counts of each class
  and the background), and questions of four kinds: ``count`` (0 to 4), ``presence`` (yes / no), ``position``
  (where one object is relative to another in its row or column: left, right, above, below) and ``class``
  (what is in a given corner). The test split's questions and reference captions use templates that training
  never sees. A deterministic function of (seed, split, index).

Without a validation split, a fixed 10% of the images (at least one) is held out.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vitlab.data import DataError, declare_dataset
from vitlab.data.captions import find_captions_file, held_out_images, read_captions
from vitlab.data.datasets import image_ok
from vitlab.data.registry import read_text
from vitlab.text.subword import IMAGE_TOKEN

# read by the vision-language tasks, not vitlab.data.build
READ_BY = "--task caption, --task vqa or --task blip"
declare_dataset("scenes", read_by=READ_BY)
declare_dataset("coco", read_by="--task caption or --task blip", needs_root=True)
declare_dataset("vqa", read_by="--task vqa", needs_root=True)
declare_dataset("llava", read_by="--task vqa", needs_root=True)

HUMANS = 10  # answers per question in VQA v2


@dataclass
class VLSample:
    """One image with its conversation: ``turns`` are (user text, answer) pairs (a caption has none: the caption
    is drawn from ``refs``); ``refs`` are what the output is scored against (captions or human answers)."""

    image: str | int
    turns: list[tuple[str, str]] = field(default_factory=list)
    refs: list[str] = field(default_factory=list)
    kind: str = ""


def take_image_placeholder(text: str, where: str) -> str:
    """``text`` with its image placeholder (``<image>``) taken out: a sample has one image, which the task places
    itself (LLaVA's conversations hold one placeholder where the image goes; Liu et al., 2023, Sec. 3), so one
    placeholder is dropped from the words and more than one is refused -- a second stands for no image. Read
    by every source and prompt that holds a question (VQA JSONL, LLaVA conversations, ``vitlab predict
    --prompt``), so a placeholder is never tokenized as the words '<', 'image', '>'. The placeholder is
    lower-case, as LLaVA writes it: another spelling (``<Image>``) is refused rather than read as words."""
    n = text.count(IMAGE_TOKEN)
    if n > 1:
        raise DataError(f"{where}: {n} {IMAGE_TOKEN} placeholders for one image; keep at most one")
    other = re.search(re.escape(IMAGE_TOKEN), text.replace(IMAGE_TOKEN, " "), flags=re.IGNORECASE)
    if other:
        raise DataError(f"{where}: {other.group(0)} is not the image placeholder {IMAGE_TOKEN} (lower-case)")
    return text.replace(IMAGE_TOKEN, " ").strip()


def no_image_placeholder(text: str, where: str) -> str:
    """``text`` (a caption), refused when it holds an image placeholder: a caption is the words for an image,
    never a place for one."""
    if IMAGE_TOKEN in text.lower():
        raise DataError(f"{where}: the caption holds the image placeholder {IMAGE_TOKEN}; a caption is text only")
    return text


def _hold_out(samples: list[VLSample], what: str) -> dict[str, list[VLSample]]:
    """A fixed 10% of the images (all their samples) as validation (:func:`held_out_images`)."""
    held = held_out_images({str(s.image) for s in samples}, what)
    return {"train": [s for s in samples if str(s.image) not in held],
            "val": [s for s in samples if str(s.image) in held]}


def _checked_image(path: Path, where: str) -> str:
    if not path.is_file():
        raise DataError(f"{where}: image not found: {path}")
    if not image_ok(path):
        raise DataError(f"{where}: corrupt image {path}")
    return str(path)


def _find_image(candidates: list[Path], where: str) -> str:
    """The first of ``candidates`` that is a file, checked; when none is, the error names every path tried."""
    for path in candidates:
        if path.is_file():
            return _checked_image(path, where)
    raise DataError(f"{where}: image not found: {' or '.join(map(str, dict.fromkeys(candidates)))}")


def _read_json(path: Path):
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None


# ---------------------------------------------------------------- COCO captions


def read_coco_file(file: Path, image_dirs: list[Path]) -> list[VLSample]:
    """One COCO captions JSON: a sample per image with all its captions, every image checked."""
    d = _read_json(file)
    if not isinstance(d, dict) or not isinstance(d.get("images"), list) or not isinstance(d.get("annotations"),
                                                                                           list):
        raise DataError(f"{file}: a COCO captions file is an object with 'images' and 'annotations' lists")
    names = {}
    for i, im in enumerate(d["images"]):
        if not isinstance(im, dict) or "id" not in im or not isinstance(im.get("file_name"), str):
            raise DataError(f"{file}: images[{i}] needs 'id' and 'file_name'")
        names[im["id"]] = im["file_name"]
    captions: dict[object, list[str]] = {}
    for i, a in enumerate(d["annotations"]):
        if not isinstance(a, dict) or a.get("image_id") not in names:
            raise DataError(f"{file}: annotations[{i}] names no image of the file (image_id "
                            f"{a.get('image_id') if isinstance(a, dict) else None!r})")
        c = a.get("caption")
        if c is not None and not isinstance(c, str):  # a number or a list is no caption, not an empty one
            raise DataError(f"{file}: annotations[{i}]: 'caption' must be text, got {type(c).__name__} {c!r:.40}")
        if not isinstance(c, str) or not c.strip():
            raise DataError(f"{file}: annotations[{i}] has an empty caption")
        captions.setdefault(a["image_id"], []).append(no_image_placeholder(c.strip(), f"{file}: annotations[{i}]"))
    if not captions:
        raise DataError(f"{file}: no captions")
    out = []
    for image_id, caps in captions.items():
        out.append(VLSample(_find_image([p / names[image_id] for p in image_dirs], str(file)), refs=caps))
    return out


def read_coco(path: str | Path) -> dict[str, list[VLSample]]:
    """``coco:PATH``: an annotations JSON (images beside it or in its ``images/``) or a COCO folder with
    ``annotations/captions_<split>*.json``."""
    path = Path(path).expanduser()
    if path.is_file():
        samples = read_coco_file(path, [path.parent, path.parent / "images"])
        return _hold_out(samples, str(path))
    if not path.is_dir():
        raise FileNotFoundError(f"COCO annotations file or folder not found: {path}")
    splits = {}
    for split in ("train", "val", "test"):
        files = sorted((path / "annotations").glob(f"captions_{split}*.json"))
        if files:
            stem = files[0].stem.removeprefix("captions_")  # train2017 -> images in PATH/train2017
            splits[split] = read_coco_file(files[0], [path / stem, path / "images", path])
    if "train" not in splits:
        raise DataError(f"{path}: no annotations/captions_train*.json")
    if "val" not in splits:
        splits.update(_hold_out(splits["train"], str(path)))
    return splits


# ---------------------------------------------------------------- VQA JSONL, LLaVA conversations, captions


def read_vqa(path: str | Path) -> dict[str, list[VLSample]]:
    """``vqa:PATH``: one ``{"image", "question", "answers"}`` per line, each checked."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"VQA file not found: {file}")
    splits: dict[str, list[VLSample]] = {}
    for i, line in enumerate(read_text(file).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file} line {i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("image"), str):
            raise DataError(f"{where}: expected an object with 'image', 'question' and 'answers'")
        q = row.get("question")
        if q is not None and not isinstance(q, str):  # a number or a list is no question, not an empty one
            raise DataError(f"{where}: 'question' must be text, got {type(q).__name__} {q!r:.40}")
        # the row's image is the sample's: a placeholder in the question is taken out, as predict's prompt's is
        q = take_image_placeholder(q, where) if isinstance(q, str) else q
        if not isinstance(q, str) or not q:
            raise DataError(f"{where}: empty question")
        # one given answer stands for VQA's ten agreeing humans (the accuracy rule needs 4 to give 1.0)
        answers = row.get("answers", [row["answer"]] * HUMANS if "answer" in row else None)
        if isinstance(answers, list) and answers and all(isinstance(a, dict) for a in answers):
            answers = [a.get("answer") for a in answers]  # VQA v2's [{"answer": ...}, ...]
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip()
                                                                   for a in answers):
            raise DataError(f"{where}: 'answers' must be a non-empty list of answers")
        split = row.get("split", "train")
        if split not in ("train", "val", "test"):
            raise DataError(f"{where}: split must be train, val or test, got {split!r}")
        image = _checked_image(file.parent / row["image"], where)
        best = Counter(a.strip() for a in answers).most_common(1)[0][0]  # the target: the most given answer
        splits.setdefault(split, []).append(VLSample(image, [(q, best)], [a.strip() for a in answers],
                                                     str(row.get("kind", row.get("answer_type", "")))))
    if not splits.get("train"):
        raise DataError(f"{file}: no training rows")
    if "val" not in splits:
        splits.update(_hold_out(splits["train"], str(file)))
    return splits


def read_llava(path: str | Path) -> dict[str, list[VLSample]]:
    """``llava:PATH``: LLaVA's conversation JSON (a list of entries; images relative to the file, or to its
    ``images/``); entries without an image are refused (these tasks need one)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"LLaVA conversation file not found: {file}")
    d = _read_json(file)
    if not isinstance(d, list):
        raise DataError(f"{file}: LLaVA's conversation file is a JSON list of entries")
    samples = []
    for i, e in enumerate(d):
        where = f"{file} entry {i}"
        if not isinstance(e, dict) or not isinstance(e.get("image"), str) or not isinstance(e.get("conversations"),
                                                                                             list):
            raise DataError(f"{where}: needs 'image' and a 'conversations' list")
        conv = e["conversations"]
        if not conv or len(conv) % 2:
            raise DataError(f"{where}: conversations must alternate human and gpt turns (got {len(conv)} turns)")
        turns = []
        for j in range(0, len(conv), 2):
            h, g = conv[j], conv[j + 1]
            if not (isinstance(h, dict) and isinstance(g, dict) and h.get("from") == "human"
                    and g.get("from") == "gpt" and isinstance(h.get("value"), str) and isinstance(g.get("value"),
                                                                                                   str)):
                raise DataError(f"{where}: turn {j} must be from 'human' and turn {j + 1} from 'gpt', each with a "
                                f"'value'")
            if j and IMAGE_TOKEN in h["value"]:
                raise DataError(f"{where}: {IMAGE_TOKEN} in turn {j}; the image goes in the first turn only")
            q = take_image_placeholder(h["value"], f"{where} turn {j}")
            if not q or not g["value"].strip():
                raise DataError(f"{where}: empty text in turn {j} or {j + 1}")
            turns.append((q, g["value"].strip()))
        if IMAGE_TOKEN not in conv[0]["value"]:
            raise DataError(f"{where}: the first human turn has no {IMAGE_TOKEN} placeholder")
        image = _find_image([file.parent / e["image"], file.parent / "images" / e["image"]], where)
        samples.append(VLSample(image, turns, [turns[-1][1]] * HUMANS, "conversation"))
    if not samples:
        raise DataError(f"{file}: no conversations")
    return _hold_out(samples, str(file))


def read_caption_rows(path: str | Path) -> dict[str, list[VLSample]]:
    """``captions:PATH``: the image-caption rows CLIP trains on, read by :func:`vitlab.data.captions.read_captions`
    (a CSV or JSONL of ``image``, ``caption`` and an optional ``split``; without a validation split a fixed 10% of
    the images held out, as :func:`read_coco` does), one sample per image of a split with all its captions as
    references (COCO's grouping, Chen et al., 2015); every image checked (a corrupt file is named)."""
    where = str(find_captions_file(path))
    out = {}
    for split, rows in read_captions(path).items():
        refs: dict[str, list[str]] = {}
        for image, caption in rows:
            refs.setdefault(image, []).append(no_image_placeholder(caption, f"{where}: image {image}"))
        out[split] = [VLSample(_checked_image(Path(image), where), refs=caps) for image, caps in refs.items()]
    return out


# ---------------------------------------------------------------- the embedded scenes

SCENE_CLASSES = ("horse", "cat", "digit")
PLURALS = {"horse": "horses", "cat": "cats", "digit": "digits", "object": "objects"}
TEXTURES = ("brick", "grass", "gravel")  # the order of the assets' textures
CELLS = ("top left", "top right", "bottom left", "bottom right")  # cell i: row i // 2, column i % 2
COUNT_WORDS = ("no", "a", "two", "three", "four")
SCENE_SIZE = 64
SCENE_SPLITS = {"train": 4000, "val": 200, "test": 400}
QUESTION_KINDS = ("count", "presence", "position", "class")
# asked in training conversations only: which corner holds an object (of a class the scene has once) -- the
# binding of a class to its place that the position and class questions compose, taught directly as LLaVA-1.5's
# instruction mix teaches grounding with region-level questions (Liu et al., 2024, Sec. 3.2 and Table 7)
TRAINING_KINDS = (*QUESTION_KINDS, "locate")

# {obj}: a class, {plural}: a plural ("horses", "objects"), {a}/{b}: classes, {cell}: a corner. Several phrasings
# of each kind, of different lengths, so a model learns what a question asks rather than where its words stand
QUESTION_TEMPLATES = {
    "count": ("how many {plural} are there", "how many {plural} can you see", "how many {plural} are in the picture",
              "how many {plural} does the picture show", "what is the number of {plural}", "count the {plural}"),
    "presence": ("is there a {obj}", "is there a {obj} in the picture", "can you see a {obj}",
                 "does the picture show a {obj}", "is a {obj} present", "is any {obj} visible"),
    "position": ("where is the {a} relative to the {b}", "where is the {a} compared to the {b}",
                 "where is the {a} in relation to the {b}", "where does the {a} lie relative to the {b}",
                 "where is the {a} placed relative to the {b}", "where is the {a} as seen from the {b}"),
    "class": ("what is in the {cell}", "what object is in the {cell}", "which object is in the {cell}",
              "what is shown in the {cell}", "what lies in the {cell}", "name the object in the {cell}"),
}
LOCATE_TEMPLATES = ("which corner is the {obj} in", "in which corner is the {obj}", "which corner holds the {obj}")
HELD_OUT_QUESTIONS = {
    "count": ("how many {plural} do you see",),
    "presence": ("do you see a {obj}",),
    "position": ("where is the {a} with respect to the {b}",),
    "class": ("what can you see in the {cell}",),
}
# {objs}: "two horses and a cat", {bg}: the texture
CAPTION_TEMPLATES = ("{objs} on {bg}", "a picture of {objs} on {bg}", "there are {objs} on {bg}",
                     "{objs} lying on {bg}")
HELD_OUT_CAPTIONS = ("a photo of {objs} on {bg}", "an image showing {objs} on {bg}", "a scene with {objs} on {bg}")


@dataclass
class SceneObject:
    """One pasted object: its class, grid cell and box (y0, x0, y1, x1) in pixels."""

    cls: str
    cell: int
    box: tuple[int, int, int, int]


@dataclass
class Scene:
    """A scene's ground truth: its objects and background texture."""

    objects: list[SceneObject]
    texture: str

    def count(self, cls: str) -> int:
        return sum(o.cls == cls for o in self.objects) if cls != "object" else len(self.objects)


@functools.lru_cache(maxsize=1)
def scene_assets() -> dict:
    """The real pictures the scenes are cut from, loaded once a process: scikit-image's textures, colour
    photographs, horse silhouette and cat photograph, and scikit-learn's digits (grey levels 0..1)."""
    import skimage.data as sk
    from sklearn.datasets import load_digits

    return {"textures": [sk.brick(), sk.grass(), sk.gravel()], "photos": [sk.astronaut(), sk.coffee(), sk.rocket()],
            "horse": ~sk.horse(),  # the silhouette is False on True
            "digits": load_digits().images / 16.0, "cat": sk.chelsea()[30:290, 50:410]}  # the cat's head


def _crop(rng, a: np.ndarray, h: int, w: int) -> np.ndarray:
    y, x = rng.integers(0, a.shape[0] - h + 1), rng.integers(0, a.shape[1] - w + 1)
    return a[y:y + h, x:x + w]


def _object(rng, cls: str, assets: dict, extent: int) -> tuple[np.ndarray, np.ndarray]:
    """(opacity (h, w) in 0..1, colour pixels (h, w, 3)) of one object of ``cls`` about ``extent`` pixels."""
    if cls == "horse":  # the silhouette, filled with a crop of a colour photograph
        shape = assets["horse"]
        ys, xs = np.nonzero(shape)
        shape = shape[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
        h, w = max(6, int(extent * shape.shape[0] / shape.shape[1])), extent
        m = _resize(shape, h, w) > 0.5
        photo = assets["photos"][int(rng.integers(len(assets["photos"])))]
        return m.astype(np.float32), _crop(rng, photo, h, w).astype(np.float32)
    if cls == "cat":  # the cat's head in an oval
        head = assets["cat"]
        s = rng.uniform(0.8, 1.0)
        crop = _crop(rng, head, int(head.shape[0] * s), int(head.shape[1] * s))
        h, w = extent, max(6, int(extent * 1.2))
        yy, xx = np.mgrid[:h, :w]
        m = ((yy - (h - 1) / 2) / (h / 2)) ** 2 + ((xx - (w - 1) / 2) / (w / 2)) ** 2 <= 1.0
        return m.astype(np.float32), np.stack([_resize(crop[..., c], h, w) for c in range(3)], -1)
    # a handwritten digit in bright ink, its grey level the ink's opacity
    look = assets["digits"][int(rng.integers(len(assets["digits"])))]
    h, w = extent, max(6, int(extent * 0.8))
    return np.clip(1.6 * _resize(look, h, w), 0, 1), np.broadcast_to(rng.uniform(170, 255, size=3), (h, w, 3))


def draw_scene(seed: int, size: int = SCENE_SIZE) -> tuple[Tensor, Scene]:
    """One scene: a uint8 image (3, size, size) and its ground truth."""
    assets = scene_assets()
    rng = np.random.default_rng(seed)
    t = int(rng.integers(len(TEXTURES)))
    # a dimmed, tinted texture, so the objects stand out as they would in a photograph of them on it
    img = _crop(rng, assets["textures"][t], size, size).astype(np.float32)[..., None] * rng.uniform(0.45, 0.8, 3)
    half = size // 2
    objects = []
    for cell in sorted(rng.choice(4, size=int(rng.integers(1, 5)), replace=False).tolist()):
        cls = SCENE_CLASSES[int(rng.integers(len(SCENE_CLASSES)))]
        extent = int(half * rng.uniform(0.55, 0.75))
        oy, ox = (cell // 2) * half + 1, (cell % 2) * half + 1
        alpha, pix = _object(rng, cls, assets, extent)
        if rng.random() < 0.5:
            alpha, pix = alpha[:, ::-1], pix[:, ::-1]
        h, w = alpha.shape
        oy += int(rng.integers(0, half - 1 - h))
        ox += int(rng.integers(0, half - 1 - w))
        region = img[oy:oy + h, ox:ox + w]
        region[:] = (1 - alpha[..., None]) * region + alpha[..., None] * np.clip(pix, 0, 255)
        objects.append(SceneObject(cls, cell, (oy, ox, oy + h, ox + w)))
    image = torch.from_numpy(np.ascontiguousarray(img.astype(np.uint8))).permute(2, 0, 1).contiguous()
    return image, Scene(objects, TEXTURES[t])


def _resize(a: np.ndarray, h: int, w: int) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(a.astype(np.float32)).resize((w, h), Image.BILINEAR))


def objects_phrase(scene: Scene) -> str:
    """"two horses and a coin": the count of each class present, in a fixed class order."""
    parts = []
    for c in SCENE_CLASSES:
        k = scene.count(c)
        if k:
            parts.append(f"{COUNT_WORDS[k]} {c if k == 1 else PLURALS[c]}")
    return " and ".join(parts)


def scene_captions(scene: Scene, templates=CAPTION_TEMPLATES) -> list[str]:
    return [t.format(objs=objects_phrase(scene), bg=scene.texture) for t in templates]


def position_pairs(scene: Scene) -> list[tuple[SceneObject, SceneObject]]:
    """The (a, b) a position question may ask about: two objects of classes the scene has once, in one row or
    one column."""
    unique = [o for o in scene.objects if scene.count(o.cls) == 1]
    return [(a, b) for a in unique for b in unique
            if a is not b and (a.cell // 2 == b.cell // 2 or a.cell % 2 == b.cell % 2)]


def scene_question(scene: Scene, kind: str, rng: random.Random, templates=None) -> tuple[str, str] | None:
    """(question, answer) of ``kind`` about ``scene`` from ``templates`` (default: the training ones), None when
    the scene has none of that kind (``position`` needs two objects of unique classes in a row or column,
    ``locate`` -- training only -- an object of a unique class)."""
    if kind == "locate":
        unique = [o for o in scene.objects if scene.count(o.cls) == 1]
        if not unique:
            return None
        o = rng.choice(unique)
        return rng.choice(LOCATE_TEMPLATES).format(obj=o.cls), CELLS[o.cell]
    template = rng.choice((templates or QUESTION_TEMPLATES)[kind])
    if kind == "count":
        target = rng.choice((*SCENE_CLASSES, "object"))
        return template.format(plural=PLURALS[target]), str(scene.count(target))
    if kind == "presence":
        c = rng.choice(SCENE_CLASSES)
        return template.format(obj=c), "yes" if scene.count(c) else "no"
    if kind == "class":
        o = rng.choice(scene.objects)
        return template.format(cell=CELLS[o.cell]), o.cls
    pairs = position_pairs(scene)
    if not pairs:
        return None
    a, b = rng.choice(pairs)
    if a.cell // 2 == b.cell // 2:
        answer = "left" if a.cell % 2 < b.cell % 2 else "right"
    else:
        answer = "above" if a.cell // 2 < b.cell // 2 else "below"
    return template.format(a=a.cls, b=b.cls), answer


@dataclass
class ScenesSplit:
    """One split of the scenes: uint8 images (N, 3, S, S), their ground truth, and the samples of the split's
    fixed questions (val: training templates; test: held-out ones) and captions (test: held-out templates)."""

    images: Tensor
    scenes: list[Scene]
    questions: list[VLSample]
    captions: list[VLSample]


def make_scenes(split: str, seed: int = 0, n: int | None = None, size: int = SCENE_SIZE) -> ScenesSplit:
    """The ``split`` of the scenes set drawn with ``seed`` (``n`` scenes; default :data:`SCENE_SPLITS`)."""
    if split not in SCENE_SPLITS:
        raise DataError(f"unknown split {split!r}; expected train, val or test")
    n = SCENE_SPLITS[split] if n is None else n
    base = {"train": 0, "val": 10_000_000, "test": 20_000_000}[split] + seed * 100_000_007
    drawn = [draw_scene(base + i, size) for i in range(n)]
    images = torch.stack([d[0] for d in drawn]) if drawn else torch.zeros(0, 3, size, size, dtype=torch.uint8)
    scenes = [d[1] for d in drawn]
    held = split == "test"
    rng = random.Random(base)
    questions, captions = [], []
    for i, s in enumerate(scenes):
        for kind in QUESTION_KINDS:  # one question of each kind the scene has
            qa = scene_question(s, kind, rng, HELD_OUT_QUESTIONS if held else None)
            if qa is not None:
                questions.append(VLSample(i, [qa], [qa[1]] * HUMANS, kind))
        captions.append(VLSample(i, refs=scene_captions(s, HELD_OUT_CAPTIONS if held else CAPTION_TEMPLATES)))
    return ScenesSplit(images, scenes, questions, captions)


def scene_texts() -> dict[str, list[str]]:
    """Every question and caption template of the scenes (held-out ones included) filled with its longest words:
    ``{"question": [...], "caption": [...]}``, what sizes the context and the vocabulary."""
    fill = {"objs": "two horses and a cat and a digit", "plural": "objects", "obj": "horse", "a": "horse", "b": "digit",
            "cell": "bottom right", "bg": "gravel"}
    questions = [t.format(**fill) for d in (QUESTION_TEMPLATES, HELD_OUT_QUESTIONS) for ts in d.values() for t in ts]
    questions += [t.format(**fill) for t in LOCATE_TEMPLATES]
    captions = [t.format(**fill) for t in (*CAPTION_TEMPLATES, *HELD_OUT_CAPTIONS)]
    return {"question": questions, "caption": captions}


def scenes_vocabulary() -> list[str]:
    """Every word of the scenes' templates, classes, textures, cells and answers (held-out templates included,
    so a held-out question has no unknown word; the model never trains on their phrasing)."""
    words = {*SCENE_CLASSES, *PLURALS.values(), *TEXTURES, *COUNT_WORDS, "yes", "no", "left", "right", "above",
             "below", *map(str, range(5)), *" ".join(CELLS).split()}
    for texts in scene_texts().values():
        words.update(w for t in texts for w in t.split())
    return sorted(words)
