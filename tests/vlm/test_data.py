"""Vision-language data: COCO captions, CLIP's captions files, VQA JSONL and LLaVA conversation files read and
checked; the embedded scenes' ground truth agrees with their captions and answers, and the test split's templates
are held out."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
from PIL import Image

from vitlab.data import DataError
from vitlab.vlm.data import (
    CAPTION_TEMPLATES,
    CELLS,
    HELD_OUT_CAPTIONS,
    HELD_OUT_QUESTIONS,
    QUESTION_TEMPLATES,
    SCENE_CLASSES,
    draw_scene,
    make_scenes,
    read_caption_rows,
    read_coco,
    read_llava,
    read_vqa,
    scene_question,
    scenes_vocabulary,
)


def _images(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for n in names:
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(folder / n)


def _coco(tmp_path, n=4):
    _images(tmp_path / "images", [f"{i}.png" for i in range(n)])
    d = {"images": [{"id": 10 + i, "file_name": f"{i}.png"} for i in range(n)],
         "annotations": [{"image_id": 10 + i, "caption": f"a picture number {i} {k}"} for i in range(n)
                         for k in range(2)]}
    file = tmp_path / "captions.json"
    file.write_text(json.dumps(d))
    return file, d


def test_coco_file_groups_captions_and_holds_out_images(tmp_path):
    file, _ = _coco(tmp_path)
    s = read_coco(file)
    assert len(s["train"]) + len(s["val"]) == 4 and len(s["val"]) == 1
    sample = s["train"][0]
    assert sample.image.endswith(".png") and len(sample.refs) == 2


def test_coco_folder_layout(tmp_path):
    _images(tmp_path / "train2017", ["a.jpg", "b.jpg"])
    _images(tmp_path / "val2017", ["c.jpg"])
    (tmp_path / "annotations").mkdir()
    for split, names in (("train2017", ["a.jpg", "b.jpg"]), ("val2017", ["c.jpg"])):
        d = {"images": [{"id": n, "file_name": n} for n in names],
             "annotations": [{"image_id": n, "caption": "a thing"} for n in names]}
        (tmp_path / "annotations" / f"captions_{split}.json").write_text(json.dumps(d))
    s = read_coco(tmp_path)
    assert [len(s["train"]), len(s["val"])] == [2, 1]
    assert s["val"][0].image.endswith("val2017/c.jpg")


def test_coco_names_a_corrupt_image_and_bad_entries(tmp_path):
    file, d = _coco(tmp_path)
    (tmp_path / "images" / "2.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"corrupt image .*2\.png"):
        read_coco(file)
    (tmp_path / "images" / "2.png").unlink()
    with pytest.raises(DataError, match=r"image not found: .*2\.png"):
        read_coco(file)
    _images(tmp_path / "images", ["2.png"])
    d["annotations"][1]["caption"] = "<Image> a picture"  # a caption is text, never a place for the image
    file.write_text(json.dumps(d))
    with pytest.raises(DataError, match=r"annotations\[1\]: the caption holds the image placeholder <image>"):
        read_coco(file)
    d["annotations"][1]["caption"] = 5  # not text: named as such, not as an empty caption
    file.write_text(json.dumps(d))
    with pytest.raises(DataError, match=r"annotations\[1\]: 'caption' must be text, got int 5$"):
        read_coco(file)
    d["annotations"][1]["caption"] = "a picture"
    d["annotations"].append({"image_id": 99, "caption": "x"})
    file.write_text(json.dumps(d))
    with pytest.raises(DataError, match="names no image"):
        read_coco(file)
    file.write_text("{")
    with pytest.raises(DataError, match="not JSON"):
        read_coco(file)


def test_vqa_jsonl(tmp_path):
    _images(tmp_path, ["a.png", "b.png", "c.png"])
    rows = [{"image": "a.png", "question": "what colour?", "answers": ["red"] * 7 + ["blue"] * 3, "kind": "color"},
            {"image": "b.png", "question": "how many?", "answer": "two", "split": "val"},
            {"image": "c.png", "question": "is it?", "answers": [{"answer": "yes"}] * 10}]
    file = tmp_path / "q.jsonl"
    file.write_text("\n".join(json.dumps(r) for r in rows))
    s = read_vqa(file)
    assert len(s["train"]) == 2 and len(s["val"]) == 1
    a = s["train"][0]
    assert a.turns == [("what colour?", "red")] and len(a.refs) == 10 and a.kind == "color"
    assert s["train"][1].refs == ["yes"] * 10 and s["val"][0].refs == ["two"] * 10
    # the row's image is the sample's: one placeholder is taken out of the question, a second one refused
    rows[0]["question"] = "<image>\nwhat colour?"
    file.write_text("\n".join(json.dumps(r) for r in rows))
    assert read_vqa(file)["train"][0].turns == [("what colour?", "red")]
    rows[0]["question"] = "<image> what <image> colour?"
    file.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=r"q\.jsonl line 1: 2 <image> placeholders for one image; keep at most one"):
        read_vqa(file)
    rows[0]["question"] = "<IMAGE> what colour?"  # not the placeholder, and not to be read as words either
    file.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=r"line 1: <IMAGE> is not the image placeholder <image> \(lower-case\)"):
        read_vqa(file)
    rows[0]["question"] = " <image> "
    file.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match="line 1: empty question"):
        read_vqa(file)
    rows[0]["question"] = "  "
    file.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match="line 1: empty question"):
        read_vqa(file)
    rows[0]["question"] = 7  # not text: named as such, not as an empty question
    file.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=r"line 1: 'question' must be text, got int 7$"):
        read_vqa(file)


def test_llava_conversations(tmp_path):
    _images(tmp_path / "images", ["a.png", "b.png"])
    conv = [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A cat."},
            {"from": "human", "value": "And its colour?"}, {"from": "gpt", "value": "Orange."}]
    d = [{"id": "1", "image": "a.png", "conversations": conv},
         {"id": "2", "image": "b.png", "conversations": conv[:2]}]
    file = tmp_path / "llava.json"
    file.write_text(json.dumps(d))
    s = read_llava(file)
    sample = next(x for x in s["train"] + s["val"] if x.image.endswith("a.png"))
    assert sample.turns == [("What is this?", "A cat."), ("And its colour?", "Orange.")]
    d[1]["conversations"] = [{"from": "human", "value": "no placeholder"}, {"from": "gpt", "value": "x"}]
    file.write_text(json.dumps(d))
    with pytest.raises(DataError, match="entry 1: the first human turn has no <image>"):
        read_llava(file)
    d[1]["conversations"] = conv[:1]
    file.write_text(json.dumps(d))
    with pytest.raises(DataError, match="alternate"):
        read_llava(file)
    # one image per entry: a second placeholder is refused, not stripped
    d[1]["conversations"] = [{"from": "human", "value": "<image>\nwhat <image> color is it"},
                             {"from": "gpt", "value": "red"}]
    file.write_text(json.dumps(d))
    with pytest.raises(DataError, match="entry 1 turn 0: 2 <image> placeholders for one image"):
        read_llava(file)


def test_captions_source_names_every_task_that_reads_it():
    from vitlab.data.registry import dataset_spec

    with pytest.raises(DataError) as e:
        dataset_spec("captions")
    assert "--task clip, --task caption or --task blip" in str(e.value)


def test_llava_missing_image_names_both_paths_tried(tmp_path):
    _images(tmp_path / "images", ["a.png"])
    conv = [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A cat."}]
    file = tmp_path / "llava.json"
    file.write_text(json.dumps([{"image": "a.png", "conversations": conv}, {"image": "b.png", "conversations": conv}]))
    with pytest.raises(DataError) as e:
        read_llava(file)
    assert str(e.value) == (f"{file} entry 1: image not found: {tmp_path / 'b.png'} or "
                            f"{tmp_path / 'images' / 'b.png'}")


def test_caption_rows_group_an_images_captions(tmp_path):
    """CLIP's captions CSV and JSONL as caption samples: one per image with all its captions, 10% of the images
    held out without a split column, the split column followed otherwise."""
    _images(tmp_path, [f"{i}.png" for i in range(10)])
    rows = [("image", "caption")] + [(f"{i}.png", f"picture {i}") for i in range(10)] + [("3.png", 'a "quoted", one')]
    (tmp_path / "captions.csv").write_text("".join(f'{a},"{b.replace(chr(34), 2 * chr(34))}"\n' for a, b in rows))
    s = read_caption_rows(tmp_path)
    assert [len(s["train"]), len(s["val"])] == [9, 1] and "test" not in s
    three = next(x for x in s["train"] + s["val"] if x.image == str(tmp_path / "3.png"))
    assert three.refs == ["picture 3", 'a "quoted", one'] and three.turns == []
    lines = [{"image": f"{i}.png", "caption": f"cap {i} ☃", "split": "train"} for i in range(8)]
    lines += [{"image": "8.png", "caption": "held", "split": "val"},
              {"image": "9.png", "caption": "t", "split": "test"}]
    file = tmp_path / "captions.jsonl"
    file.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in lines))
    s = read_caption_rows(file)
    assert [len(s[k]) for k in ("train", "val", "test")] == [8, 1, 1] and s["train"][0].refs == ["cap 0 ☃"]
    (tmp_path / "4.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"corrupt image .*4\.png"):
        read_caption_rows(file)
    lines[4]["caption"] = "<image> four"
    file.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in lines))
    with pytest.raises(DataError, match=r"captions\.jsonl: image .*4\.png: the caption holds the image placeholder"):
        read_caption_rows(file)


# ---------------------------------------------------------------- the scenes


def test_scene_ground_truth():
    for seed in range(30):
        image, scene = draw_scene(seed)
        assert image.shape == (3, 64, 64) and image.dtype.is_floating_point is False
        assert 1 <= len(scene.objects) <= 4
        cells = [o.cell for o in scene.objects]
        assert len(set(cells)) == len(cells)
        for o in scene.objects:  # every box lies inside its cell
            y0, x0, y1, x1 = o.box
            r, c = divmod(o.cell, 2)
            assert 32 * r <= y0 < y1 <= 32 * (r + 1) and 32 * c <= x0 < x1 <= 32 * (c + 1)
    a, _ = draw_scene(7)
    b, _ = draw_scene(7)
    assert (a == b).all()


def test_scene_answers_follow_the_ground_truth():
    rng = random.Random(0)
    seen = set()
    for seed in range(60):
        _, s = draw_scene(seed)
        for _ in range(8):
            q, ans = scene_question(s, "count", rng)
            target = next((c for c in SCENE_CLASSES if f" {c}s " in f" {q} "), "object")
            assert int(ans) == (len(s.objects) if target == "object" else sum(o.cls == target for o in s.objects))
            q, ans = scene_question(s, "presence", rng)
            c = next(c for c in SCENE_CLASSES if re.search(rf"\b{c}\b", q))
            assert ans == ("yes" if any(o.cls == c for o in s.objects) else "no")
            q, ans = scene_question(s, "class", rng)
            cell = next(i for i, name in enumerate(CELLS) if q.endswith(name))
            assert ans == next(o.cls for o in s.objects if o.cell == cell)
            qa = scene_question(s, "locate", rng)
            unique = [o for o in s.objects if sum(p.cls == o.cls for p in s.objects) == 1]
            assert (qa is None) == (not unique)
            if qa is not None:
                o = next(o for o in unique if re.search(rf"\b{o.cls}\b", qa[0]))
                assert qa[1] == CELLS[o.cell]
            qa = scene_question(s, "position", rng)
            if qa is None:
                continue
            q, ans = qa
            a_cls, b_cls = re.findall(r"the (\w+)", q)
            oa = next(o for o in s.objects if o.cls == a_cls)
            ob = next(o for o in s.objects if o.cls == b_cls)
            (ya, xa), (yb, xb) = (oa.box[:2]), (ob.box[:2])
            want = {"left": xa < xb, "right": xa > xb, "above": ya < yb, "below": ya > yb}
            assert want[ans] and abs(oa.cell - ob.cell) in (1, 2)
            seen.add(ans)
        seen.update(o.cls for o in s.objects)
    assert {"left", "right", "above", "below", *SCENE_CLASSES} <= seen


def test_scenes_splits_hold_out_templates():
    test = make_scenes("test", n=40)
    val = make_scenes("val", n=40)
    assert test.images.shape == (40, 3, 64, 64)
    assert {q.kind for q in test.questions} == {"count", "presence", "position", "class"}

    def template_of(q: str, templates) -> bool:
        return any(re.fullmatch(re.sub(r"\\{\w+\\}", r"[\\w ]+", re.escape(t)), q) for t in templates)

    for q in test.questions:
        assert template_of(q.turns[0][0], HELD_OUT_QUESTIONS[q.kind])
        assert not template_of(q.turns[0][0], QUESTION_TEMPLATES[q.kind])
    for q in val.questions:
        assert template_of(q.turns[0][0], QUESTION_TEMPLATES[q.kind])
    objs = r"[\w ]+"
    for c in test.captions:
        assert len(c.refs) == len(HELD_OUT_CAPTIONS)
        assert not any(re.fullmatch(t.format(objs=objs, bg=r"\w+"), r) for r in c.refs for t in CAPTION_TEMPLATES
                       if not t.startswith("{"))
    # deterministic by seed, different across seeds and splits
    assert (make_scenes("test", n=5).images == test.images[:5]).all()
    assert not (make_scenes("test", seed=1, n=5).images == test.images[:5]).all()
    words = set(scenes_vocabulary())
    assert all(w in words for q in test.questions for w in q.turns[0][0].split())


@pytest.mark.parametrize("read, name", [(read_coco, "c.json"), (read_vqa, "q.jsonl"), (read_llava, "l.json"),
                                        (read_caption_rows, "captions.csv"), (read_caption_rows, "captions.jsonl")])
def test_a_file_that_is_not_utf8_is_named(read, name, tmp_path):
    (tmp_path / name).write_bytes(b'\xff\xfe{"images": []}')
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path / name))}: not UTF-8 text \(byte 0xff at "
                                        rf"offset 0\)$"):
        read(tmp_path / name)
