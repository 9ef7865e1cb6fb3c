"""The caption and vqa tasks through the command line: a seconds-long train, eval and predict on the scenes; the
loss only on answer tokens (equal to the model's own labelled loss); LLaVA's freezing stages; bad input in one
line with exit code 2."""

from __future__ import annotations

import copy
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

import vitlab
from vitlab.cli import main
from vitlab.train import TrainConfig, read_metrics
from vitlab.train import checkpoint as vitlab_checkpoint
from vitlab.vlm.data import draw_scene
from vitlab.vlm.tasks import IGNORE, Sequences, VLArgs, WordTokenizer, answer_loss, apply_freezing, with_coords

# a one-block tower and a one-layer decoder: seconds on a CPU
TINY = ["--model_kwargs.vision_depth", "1", "--model_kwargs.text_n_layers", "1", "--model_kwargs.vision_patch_size",
        "16", "--task_args.scenes_train", "16", "--task_args.scenes_eval", "6", "--epochs", "1", "--batch_size", "8",
        "--task_args.max_new_tokens", "4"]


@pytest.fixture(scope="module")
def scene_png(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "scene.png"
    Image.fromarray(draw_scene(3)[0].permute(1, 2, 0).numpy()).save(path)
    return path


@pytest.fixture(scope="module")
def vqa_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("vqa") / "run"
    assert main(["train", "--task", "vqa", "--output_dir", str(run), *TINY]) == 0
    return run


@pytest.fixture(scope="module")
def caption_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("caption") / "run"
    assert main(["train", "--task", "caption", "--output_dir", str(run), *TINY]) == 0
    return run


def _one_line_error(capsys, argv, *words):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vitlab: error:"), err
    for w in words:
        assert w in err[0], err[0]
    return err[0]


def test_vqa_train_eval_predict(vqa_run, scene_png, tmp_path, capsys):
    summary = json.loads((vqa_run / "summary.json").read_text())
    for kind in ("count", "presence", "position", "class"):
        assert 0.0 <= summary[f"test_acc_{kind}"] <= 100.0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(vqa_run), "--output-dir", str(tmp_path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["task"] == "vqa" and r["split"] == "test" and {"accuracy", "acc_count", "acc_class"} <= set(r)
    rows = json.loads((tmp_path / "eval-test.json").read_text())["answers"]
    assert rows and all({"question", "output", "refs", "kind"} <= set(a) for a in rows)
    assert main(["predict", "--checkpoint", str(vqa_run), str(scene_png), "--prompt", "how many cats are there",
                 "--json"]) == 0
    row, = json.loads(capsys.readouterr().out)
    assert row["prompt"] == "how many cats are there" and isinstance(row["output"], str)


def test_vqa_bad_questions(vqa_run, scene_png, capsys):
    _one_line_error(capsys, ["predict", "--checkpoint", str(vqa_run), str(scene_png), "--prompt", "  "],
                    "empty question")
    _one_line_error(capsys, ["predict", "--checkpoint", str(vqa_run), str(scene_png)], "empty question")
    long = " ".join(["cat"] * 100)
    _one_line_error(capsys, ["predict", "--checkpoint", str(vqa_run), str(scene_png), "--prompt", long],
                    "tokens exceeds the run's context of")
    # one image: a second placeholder is refused, not stripped; one is taken out of the question
    _one_line_error(capsys, ["predict", "--checkpoint", str(vqa_run), str(scene_png), "--prompt",
                             "<image> is there a horse <image>"], "2 <image> placeholders", "is there a horse")
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(vqa_run), str(scene_png), "--prompt", "<image> is there a horse"]) == 0
    assert capsys.readouterr().err == ""
    _one_line_error(capsys, ["predict", "--checkpoint", str(vqa_run), str(scene_png), "--prompt",
                             "<Image> is there a horse"], "<Image> is not the image placeholder <image>")
    # words the run never saw: answered, with a warning naming them
    assert main(["predict", "--checkpoint", str(vqa_run), str(scene_png), "--prompt", "is there a zyzzyva"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("warning: 'zyzzyva' not in the run's vocabulary of"), err
    # a corrupt image with such a word: the image's one line, no warning before it
    (scene_png.parent / "corrupt.png").write_bytes(scene_png.read_bytes()[:100])
    _one_line_error(capsys, ["predict", "--checkpoint", str(vqa_run), str(scene_png.parent / "corrupt.png"),
                             "--prompt", "is there a zyzzyva"], "corrupt.png")


@pytest.mark.parametrize("task,model,words", [
    ("caption", "blip_tiny_caption", ("blip model", "--task blip")),
    ("vqa", "vit_pico_patch8_32", ("LLaVA-style", "vit model")),
    ("blip", "llava_tiny", ("--task blip trains a BLIP model", "llava model", "--task caption or --task vqa")),
    ("blip", "vit_pico_patch8_32", ("--task blip trains a BLIP model (blip_*); vit_pico_patch8_32 is a vit model",)),
])
def test_a_model_of_another_family_is_refused_in_one_line(task, model, words, tmp_path, capsys):
    _one_line_error(capsys, ["train", "--task", task, "--model", model, "--output_dir", str(tmp_path / "run"),
                             *TINY[4:]], *words)
    assert not (tmp_path / "run").exists()


def test_answers_get_the_whole_budget_or_the_prompt_is_refused(vqa_run):
    """A prompt that nearly fills the context still gets max_new_tokens to answer in (never an answer cut short
    without a word); one longer than the context is refused."""
    from vitlab.data import DataError
    from vitlab.train.evaluate import load_model
    from vitlab.train.task import create_task

    model, record, _ = load_model(vqa_run / "last", device="cpu")
    task = create_task("vqa")
    n = record.extra["context_length"]
    budgets = []
    orig = model.generate
    model.generate = lambda *a, **k: budgets.append(k["max_new_tokens"]) or orig(*a, **k)
    x = torch.zeros(1, 3, record.img_size, record.img_size)
    task.generate(model, record, x, [[2, 4] + [1] * (n - 3)], 8, "cpu")  # one token short of the context
    assert budgets == [4]  # TINY's max_new_tokens
    with pytest.raises(DataError, match=f"a prompt of {n + 1} tokens exceeds the run's context of {n} tokens"):
        task.generate(model, record, x, [[2, 4] + [1] * (n - 1)], 8, "cpu")


def test_eval_train_split_is_the_runs_training_scenes(vqa_run, caption_run, tmp_path, capsys):
    """--split train scores the scenes the run trained on, drawn as training drew them: fixed questions of the
    training templates (vqa), every scene's captions (caption)."""
    from vitlab.vlm.data import make_scenes

    train = make_scenes("train", 0, 16)  # TINY's scenes_train, drawn as training drew them
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(vqa_run), "--split", "train", "--output-dir", str(tmp_path / "v"),
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["split"] == "train" and r["questions"] == len(train.questions)
    assert [a["question"] for a in r["answers"]] == [s.turns[-1][0] for s in train.questions]
    assert main(["eval", "--checkpoint", str(caption_run), "--split", "train", "--output-dir", str(tmp_path / "c"),
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["split"] == "train" and r["images"] == 16
    assert [c["refs"] for c in r["captions"]] == [s.refs for s in train.captions]


def test_init_maps_the_vocabulary_by_word(vqa_run, tmp_path, capsys):
    """A run whose data brings new words starts from another run: the rows of the words both know are copied to
    their new ids (stage 1 keeps the language model as loaded), the log says how many were mapped and new."""
    from vitlab.train.evaluate import load_model

    _pictures(tmp_path, 6)
    rows = [{"image": f"{i}.png", "question": "is there a zebra", "answer": "maybe"} for i in range(6)]
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--task", "vqa", "--data", f"vqa:{tmp_path / 'q.jsonl'}", "--output_dir", str(run), *TINY,
                 "--stage", "1", "--init", str(vqa_run)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("--init")]
    assert len(lines) == 1 and lines[0].endswith("6 words mapped, 2 new"), lines  # zebra, maybe
    best = vitlab_checkpoint.resolve_checkpoint_dir(vqa_run).name  # a run gives its best checkpoint, named
    assert f"the whole model (checkpoint {best}); vocabulary" in lines[0]
    assert "frozen at random" not in out  # stage 1 freezes parts --init loaded
    (old, old_rec, _), (new, new_rec, _) = (load_model(r / "last", device="cpu") for r in (vqa_run, run))
    old_tok, new_tok = (WordTokenizer(r.extra["tokenizer"]["words"]) for r in (old_rec, new_rec))
    assert old_tok.encoder["user"] != new_tok.encoder["user"]  # the ids moved
    for w in ("<s>", "<image>", "is", "there", "a", "user", ":", "assistant"):
        for part in ("embed_tokens", "lm_head"):
            torch.testing.assert_close(getattr(new.language_model, part).weight[new_tok.encoder[w]],
                                       getattr(old.language_model, part).weight[old_tok.encoder[w]], msg=w)


# a CLIP run whose image tower is llava_tiny's (a CLIP ViT: QuickGELU, width 48, 3 blocks of 4 heads, 8-pixel patches)
_CLIP_OF_LLAVA_TINY = {"image_embed_dim": 48, "image_depth": 3, "image_num_heads": 4, "image_mlp_ratio": 2.0,
                       "image_patch_size": 8, "text_width": 32, "text_depth": 1, "text_num_heads": 4,
                       "quick_gelu": True}


@pytest.mark.parametrize("change, refused", [
    ({}, None),
    ({"quick_gelu": False}, "blocks.0.mlp.act: GELU(approximate='none') (this run QuickGELU())"),
    ({"image_num_heads": 8}, "blocks.0.attn: MultiHeadSelfAttention(num_heads=8) (this run "
                             "MultiHeadSelfAttention(num_heads=4))")])
def test_init_from_a_clip_run_gives_the_image_tower_of_the_same_function(change, refused, tmp_path, capsys):
    """A vitlab CLIP run starts a LLaVA's image tower when its tower computes the same function; one whose weights
    fit but whose activation or heads differ (no weight shows either) is refused in one line, nothing written."""
    from vitlab.train.evaluate import load_model

    _pictures(tmp_path / "images", 4)
    (tmp_path / "captions.csv").write_text("image,caption,split\n" + "".join(
        f"images/{i}.png,a scene number {i},{'train' if i < 3 else 'val'}\n" for i in range(4)))
    clip = tmp_path / "clip"
    assert main(["train", "--task", "clip", "--model", "clip_vit_base_patch32", "--model_kwargs",
                 json.dumps({**_CLIP_OF_LLAVA_TINY, **change}), "--task_args.tokenizer", "word", "--data.img_size",
                 "32", "--data", f"captions:{tmp_path / 'captions.csv'}", "--epochs", "1", "--output_dir",
                 str(clip)]) == 0
    argv = ["train", "--task", "caption", "--model", "llava_tiny", "--task_args.coord_channels", "false", "--data",
            f"captions:{tmp_path / 'captions.csv'}", "--epochs", "1", "--stage", "1", "--task_args.max_new_tokens",
            "4", "--init", str(clip), "--output_dir", str(tmp_path / "run")]
    capsys.readouterr()
    if refused:
        _one_line_error(capsys, argv, f"--init {clip}: its image tower computes another function than this run's",
                        refused)
        assert not (tmp_path / "run").exists()
        return
    assert main(argv) == 0
    assert any(ln.startswith(f"--init {clip}: the image tower") for ln in capsys.readouterr().out.splitlines())
    trained, _, _ = load_model(clip, device="cpu")
    model, _, _ = load_model(tmp_path / "run" / "last", device="cpu")
    want = trained.visual.trunk.state_dict()
    for k, v in model.vision_tower.state_dict().items():  # stage 1 trains the projector only
        torch.testing.assert_close(v, want[k], msg=k)


def test_a_towers_function_ignores_dropout_and_stochastic_depth():
    """Dropout and drop-path rates (the identity at inference) never refuse an --init; the heads' split does."""
    from vitlab.data import DataError
    from vitlab.vlm.tasks import _check_same_function

    plain = vitlab.create_model("vit_pico_patch8_32")
    _check_same_function(plain, vitlab.create_model("vit_pico_patch8_32", drop_path_rate=0.2, drop_rate=0.1), "run")
    with pytest.raises(DataError, match=r"--init run: its image tower computes another function than this run's: "
                                        r"blocks.0.attn: MultiHeadSelfAttention\(num_heads=2\)"):
        _check_same_function(plain, vitlab.create_model("vit_pico_patch8_32", num_heads=2), "run")


def test_init_from_a_transformers_clip_directory_gives_the_image_tower(tmp_path, capsys):
    """LLaVA's recipe: the image tower from a pretrained CLIP (here transformers' CLIPVisionModel of llava_tiny's
    tower, random weights), stage 1 training the projector only, so the tower stays the CLIP's. The language
    model, frozen too, keeps its random weights: the log says so."""
    transformers = pytest.importorskip("transformers")
    from vitlab.models import convert_hf_clip_vision_state_dict
    from vitlab.train.evaluate import load_model

    ref = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        image_size=32, patch_size=8, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4))
    ref.save_pretrained(tmp_path / "clip")
    run = tmp_path / "run"
    assert main(["train", "--task", "vqa", "--model", "llava_tiny", "--task_args.coord_channels", "false",
                 "--task_args.scenes_train", "16", "--task_args.scenes_eval", "6", "--epochs", "1", "--batch_size",
                 "8", "--task_args.max_new_tokens", "4", "--stage", "1", "--init", str(tmp_path / "clip"),
                 "--output_dir", str(run)]) == 0
    notes = [ln for ln in capsys.readouterr().out.splitlines() if "frozen at random" in ln]
    assert notes == ["note: language_model stays frozen at random initial weights (--stage 1, --task_args.freeze "
                     "[]): --init loaded nothing into it"]
    model, _, _ = load_model(run / "last", device="cpu")
    want = convert_hf_clip_vision_state_dict(ref.state_dict())
    got = model.vision_tower.state_dict()
    for k in ("patch_embed.proj.weight", "blocks.2.attn.qkv.weight", "pos_drop.norm.weight", "norm.bias"):
        torch.testing.assert_close(got[k], want[k], msg=k)


def _subword_tokenizer(folder, vocab_size=100):
    """A byte-pair tokenizer.json trained on the scenes' words (Llama's layout: Metaspace spaces, <unk>, <s>, </s>
    and <image> as special tokens), small enough that some words are split into pieces."""
    tokenizers = pytest.importorskip("tokenizers")
    from vitlab.vlm.data import scenes_vocabulary

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<image>"])
    tok.train_from_iterator(scenes_vocabulary() * 3, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok


@pytest.mark.parametrize("kind", ["llava", "llama"])
def test_init_from_a_transformers_llava_or_llama_carries_the_rows_through_its_tokenizer(kind, tmp_path, capsys):
    """An imported LLaVA (the whole model) or Llama (the language model: LLaVA's Vicuna) with its own subword
    tokenizer: every tensor but the token rows as saved, each word's rows the mean of its pieces' rows (one piece:
    a copy), the special tokens' by text; stage 1 keeps them as loaded."""
    transformers = pytest.importorskip("transformers")
    from vitlab.models.llama import hf_to_llama_state_dict
    from vitlab.train.evaluate import load_model
    from vitlab.vlm.llava import convert_hf_llava_state_dict

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    if kind == "llava":
        ref = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=48,
                                                        intermediate_size=96, num_hidden_layers=3,
                                                        num_attention_heads=4),
            text_config=transformers.LlamaConfig(**text), image_token_index=110))
    else:
        ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**text))
    ref.save_pretrained(tmp_path / "hf")
    sub = _subword_tokenizer(tmp_path / "hf")
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--task", "vqa", "--model", "llava_tiny", "--task_args.coord_channels", "false",
                 "--task_args.scenes_train", "16", "--task_args.scenes_eval", "6", "--epochs", "1", "--batch_size",
                 "8", "--task_args.max_new_tokens", "4", "--stage", "1", "--init", str(tmp_path / "hf"),
                 "--output_dir", str(run)]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("--init")]
    assert len(line) == 1 and ("the whole model (transformers' LLaVA)" if kind == "llava" else
                               "the language model (transformers' Llama)") in line[0], line
    model, rec, _ = load_model(run / "last", device="cpu")
    words = WordTokenizer(rec.extra["tokenizer"]["words"])
    unk = sub.token_to_id("<unk>")  # a character the tokenizer never saw: its unknown piece is left out
    pieces = {w: [i for i in sub.encode(w, add_special_tokens=False).ids if i != unk] for w in words.words}
    pieces = {w: ids for w, ids in pieces.items() if sub.decode(ids).strip()}  # nothing left: a fresh row
    whole, split = sum(len(p) == 1 for p in pieces.values()), sum(len(p) > 1 for p in pieces.values())
    new = len(words.words) - whole - split
    assert whole and split and line[0].endswith(f"{whole} words whole, {split} as the mean of their pieces, {new} new")
    ours = model.language_model
    if kind == "llava":  # transformers' keys through the converter its own test checks against transformers
        converted = convert_hf_llava_state_dict(ref.state_dict(), model)
        mine = model.state_dict()
        for k in [k for k in converted if k.startswith("vision_tower.")]:  # stage 1 trains the projector
            torch.testing.assert_close(mine[k], converted[k], msg=k)
        want = {k.removeprefix("language_model."): v for k, v in converted.items() if k.startswith("language_model.")}
    else:
        want = hf_to_llama_state_dict(ref.state_dict(), ours.config)
    embed, head = want["embed_tokens.weight"], want["lm_head.weight"]
    for w, ids in pieces.items():
        torch.testing.assert_close(ours.embed_tokens.weight[words.encoder[w]], embed[ids].mean(0), msg=w)
        torch.testing.assert_close(ours.lm_head.weight[words.encoder[w]], head[ids].mean(0), msg=w)
    for w, t in (("<s>", "<s>"), ("</s>", "</s>"), ("<unk>", "<unk>")):
        torch.testing.assert_close(ours.embed_tokens.weight[words.encoder[w]], embed[sub.token_to_id(t)], msg=w)
    # <image>: the config's image_token_index where a LLaVA names one, else the tokenizer's
    image = 110 if kind == "llava" else sub.token_to_id("<image>")
    torch.testing.assert_close(ours.embed_tokens.weight[words.encoder["<image>"]], embed[image])
    got = ours.state_dict()
    for k in ("layers.1.attn.qkv.weight", "layers.0.mlp.fc2.weight", "norm.weight"):
        torch.testing.assert_close(got[k], want[k], msg=k)


def test_init_from_a_transformers_blip_captioner(tmp_path, capsys):
    """transformers' BLIP captioner with its WordPiece tokenizer starts a blip run: the image tower and the text
    decoder as saved (its position table cut to the run's context), each word's rows through the tokenizer, the
    retrieval parts it does not hold fresh, said in the log."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from vitlab.train.evaluate import load_model
    from vitlab.vlm.blip import convert_hf_blip_state_dict
    from vitlab.vlm.data import scenes_vocabulary

    text = dict(vocab_size=96, hidden_size=32, encoder_hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=40)
    vision = dict(image_size=64, patch_size=8, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4)
    torch.manual_seed(0)
    ref = transformers.BlipForConditionalGeneration(transformers.BlipConfig(
        text_config=text, vision_config=vision, image_text_hidden_size=16))
    ref.save_pretrained(tmp_path / "hf")
    sub = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    sub.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    sub.train_from_iterator(scenes_vocabulary() * 3, tokenizers.trainers.WordPieceTrainer(
        vocab_size=90, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[DEC]", "[ENC]"]))
    sub.save(str(tmp_path / "hf" / "tokenizer.json"))
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--task", "blip", "--model", "blip_tiny", "--task_args.scenes_train", "16",
                 "--task_args.scenes_eval", "6", "--epochs", "1", "--batch_size", "8", "--task_args.freeze",
                 "vision_tower,text_decoder",
                 "--task_args.max_new_tokens", "4", "--init", str(tmp_path / "hf"), "--output_dir", str(run)]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("--init")]
    assert len(line) == 1 and "transformers' BLIP, " in line[0] and "tensors it lacks fresh" in line[0], line
    model, rec, _ = load_model(run / "last", device="cpu")
    words = WordTokenizer(rec.extra["tokenizer"]["words"])
    want = convert_hf_blip_state_dict(ref.state_dict())
    got = model.state_dict()
    rows = got["text_decoder.position_embeddings.weight"].shape[0]
    assert rows < 40
    torch.testing.assert_close(got["text_decoder.position_embeddings.weight"],
                               want["text_decoder.position_embeddings.weight"][:rows])
    for k in [k for k in want if k.startswith("vision_tower.")][:6]:
        torch.testing.assert_close(got[k], want[k], msg=k)
    embed = want["text_decoder.word_embeddings.weight"]
    for w in words.words:
        ids = [i for i in sub.encode(w, add_special_tokens=False).ids if i != sub.token_to_id("[UNK]")]
        torch.testing.assert_close(got["text_decoder.word_embeddings.weight"][words.encoder[w]], embed[ids].mean(0),
                                   msg=w)
    for w, t in (("<pad>", "[PAD]"), ("<s>", "[CLS]"), ("</s>", "[SEP]"), ("[DEC]", "[DEC]")):
        torch.testing.assert_close(got["text_decoder.word_embeddings.weight"][words.encoder[w]],
                                   embed[sub.token_to_id(t)], msg=w)


def test_transfer_vocabulary_counts_whole_pieces_and_unspellable_words(tmp_path):
    """A word the tokenizer spells as one token, one it splits, and one of letters it never saw (only unknown pieces
    and the word-start mark): a copy, a mean, a fresh row."""
    from vitlab.text.subword import HFTokenizer
    from vitlab.vlm.tasks import transfer_vocabulary

    sub = _subword_tokenizer(tmp_path / "tok")
    tok = HFTokenizer(tmp_path / "tok" / "tokenizer.json")
    whole_word = next(w for w in ("red", "blue", "circle", "a") if len(sub.encode(w).ids) == 1)
    split_word = next(w for w in ("triangles", "checkerboard", "bottom", "square") if len(sub.encode(w).ids) > 1)
    words = WordTokenizer([whole_word, split_word, "жжж"])
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(words.vocab_size, 8)
    rows = torch.randn(100, 8)
    sd, whole, pieces, new = transfer_vocabulary(model, {"embed_tokens.weight": rows}, tok, words, "src")
    assert (whole, pieces, new) == (1, 1, 1)
    got = sd["embed_tokens.weight"]
    torch.testing.assert_close(got[words.encoder[whole_word]], rows[sub.encode(whole_word).ids[0]])
    torch.testing.assert_close(got[words.encoder[split_word]], rows[sub.encode(split_word).ids].mean(0))
    torch.testing.assert_close(got[words.encoder["жжж"]], model.embed_tokens.weight[words.encoder["жжж"]])
    torch.testing.assert_close(got[words.bos_id], rows[sub.token_to_id("<s>")])
    assert torch.equal(got[words.pad_id], model.embed_tokens.weight[words.pad_id])  # no <pad> in it: fresh


def test_init_from_an_imported_checkpoint_of_another_architecture_is_named(tmp_path, capsys):
    """Differences the shapes cannot show (a layer more, another feature selection) or a BLIP part not whole:
    refused in one line before training."""
    transformers = pytest.importorskip("transformers")
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
    flags = ["--model", "llava_tiny", "--task_args.coord_channels", "false", *TINY[6:]]
    out = tmp_path / "run"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**text)).save_pretrained(tmp_path / "llama")
    _subword_tokenizer(tmp_path / "llama")
    llava = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=48, intermediate_size=96,
                                                    num_hidden_layers=3, num_attention_heads=4),
        text_config=transformers.LlamaConfig(**{**text, "num_hidden_layers": 2}),
        vision_feature_select_strategy="full"))
    llava.save_pretrained(tmp_path / "llava")
    _subword_tokenizer(tmp_path / "llava")
    llava.config.vision_feature_select_strategy = "default"
    llava.config.projector_hidden_act = "gelu_pytorch_tanh"  # nn.GELU as well, with another function
    llava.save_pretrained(tmp_path / "llava_tanh")
    _subword_tokenizer(tmp_path / "llava_tanh")
    blip = transformers.BlipForConditionalGeneration(transformers.BlipConfig(
        text_config=dict(vocab_size=96, hidden_size=32, encoder_hidden_size=48, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=40),
        vision_config=dict(image_size=64, patch_size=8, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4), image_text_hidden_size=16))
    blip.save_pretrained(tmp_path / "blip")
    _subword_tokenizer(tmp_path / "blip", vocab_size=90)
    capsys.readouterr()  # transformers' own progress lines
    _one_line_error(capsys, ["train", "--task", "vqa", "--init", str(tmp_path / "llama"), "--output_dir", str(out),
                             *flags], "another Llama architecture: n_layers 3 (this model 2)")
    _one_line_error(capsys, ["train", "--task", "vqa", "--init", str(tmp_path / "llava"), "--output_dir", str(out),
                             *flags], "another LLaVA architecture: vision_feature_select_strategy 'full' (this model "
                                      "'default')")
    _one_line_error(capsys, ["train", "--task", "vqa", "--init", str(tmp_path / "llava_tanh"), "--output_dir",
                             str(out), *flags],
                    "another LLaVA architecture: projector_hidden_act 'gelu_pytorch_tanh' (this model 'gelu')")
    _one_line_error(capsys, ["train", "--task", "blip", "--model", "blip_tiny", "--init", str(tmp_path / "blip"),
                             "--output_dir", str(out), *TINY[6:]],
                    "another BLIP architecture than this run's: unexpected ['text_decoder.layers.2.")
    assert not out.exists()


@pytest.mark.parametrize("kind,change,words", [
    ("blip", {"vision_config": {"hidden_act": "quick_gelu"}},
     "another BLIP architecture: vision_config.hidden_act 'quick_gelu' (this model 'gelu')"),
    ("blip", {"text_config": {"layer_norm_eps": 1e-6}},
     "another BLIP architecture: text_config.layer_norm_eps 1e-06 (this model 1e-12)"),
    ("llava", {"text_config": {"model_type": "mistral", "sliding_window": 4}},
     "only Llama language models are supported, not text_config.model_type 'mistral'"),
    ("llava", {"vision_config": {"num_attention_heads": 2}},
     "another LLaVA architecture: vision_config.num_attention_heads 2 (this model 4)"),
])
def test_init_checks_what_the_shapes_cannot_show_but_not_the_token_ids(kind, change, words, tmp_path, capsys):
    """--init compares an imported BLIP's or LLaVA's config.json with the run's model as create_model does, all
    but the special tokens' ids: those of the checkpoint's tokenizer (BLIP's [DEC] 30522, LLaVA's <image> 32000
    here) reach the run's word ids through the vocabulary transfer, so only the function's difference is named."""
    transformers = pytest.importorskip("transformers")
    change = copy.deepcopy(change)  # the parameters' dicts are shared: popped from a copy
    vision = dict(image_size=64 if kind == "blip" else 32, patch_size=8, hidden_size=48, intermediate_size=96,
                  num_hidden_layers=2 if kind == "blip" else 3, num_attention_heads=4)
    vision.update(change.pop("vision_config", {}))
    if kind == "blip":
        text = dict(vocab_size=96, hidden_size=32, encoder_hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=40, **change.pop("text_config", {}))
        ref = transformers.BlipForConditionalGeneration(transformers.BlipConfig(
            text_config=text, vision_config=vision, image_text_hidden_size=16))
        flags = ["--task", "blip", "--model", "blip_tiny", *TINY[6:]]
    else:
        text = change.pop("text_config", {})
        mistral = text.pop("model_type", "llama") == "mistral"
        text = (transformers.MistralConfig if mistral else transformers.LlamaConfig)(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, **text)
        ref = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(**vision), text_config=text, **change))
        flags = ["--task", "vqa", "--model", "llava_tiny", "--task_args.coord_channels", "false", *TINY[6:]]
    ref.save_pretrained(tmp_path / "hf")
    _subword_tokenizer(tmp_path / "hf", vocab_size=90)
    out = tmp_path / "run"
    capsys.readouterr()  # transformers' own progress lines
    line = _one_line_error(capsys, ["train", *flags, "--init", str(tmp_path / "hf"), "--output_dir", str(out)],
                           f"{tmp_path / 'hf'}: {words}")
    assert "token" not in line and not out.exists()


def test_init_from_an_imported_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "bert"}))
    out = tmp_path / "run"
    tiny_blip = ["--model_kwargs.vision_depth", "1", "--model_kwargs.text_depth", "1", *TINY[6:]]
    for task, flags, model in (("vqa", TINY, "LLaVA"), ("blip", tiny_blip, "BLIP")):
        _one_line_error(capsys, ["train", "--task", task, "--init", str(hf), "--output_dir", str(out), *flags],
                        f"{hf}: a transformers checkpoint of model_type 'bert' cannot start a {model}")
        assert not out.exists()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    _one_line_error(capsys, ["train", "--task", "vqa", "--init", str(hf), "--output_dir", str(out), *TINY],
                    f"{hf}: no tokenizer.json or tokenizer.model beside its weights")
    _subword_tokenizer(hf)  # a tokenizer but a decoder of another size: the differences named
    transformers = pytest.importorskip("transformers")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    ).save_pretrained(hf)
    capsys.readouterr()  # transformers' own progress lines
    _one_line_error(capsys, ["train", "--task", "vqa", "--init", str(hf), "--output_dir", str(out), *TINY],
                    f"{hf}: another Llama architecture: dim 32 (this model 128)")
    assert not out.exists()
    # a CLIP directory of OpenAI's activation for the scenes' tower (GELU, a convolutional stem): refused by the
    # tower's own check of config.json
    (hf / "config.json").write_text(json.dumps({"model_type": "clip_vision_model"}))
    _one_line_error(capsys, ["train", "--task", "vqa", "--init", str(hf), "--output_dir", str(out), *TINY],
                    f"{hf}: its image tower uses hidden_act 'quick_gelu'")
    assert not out.exists()


def test_init_that_names_nothing_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    import vitlab.vlm.tasks as tasks

    def built(*args, **kwargs):
        raise AssertionError("the model was built before --init was checked")

    monkeypatch.setattr(tasks, "build_vl_model", built)  # a 7B model would take minutes and most of the memory
    monkeypatch.setattr(tasks.BlipTask, "_model", built)
    out, missing = tmp_path / "run", tmp_path / "llava-1.5-7b-hf"
    tiny_blip = ["--model_kwargs.vision_depth", "1", "--model_kwargs.text_depth", "1", *TINY[6:]]
    for task, flags in (("vqa", TINY), ("caption", TINY), ("blip", tiny_blip)):
        _one_line_error(capsys, ["train", "--task", task, "--init", str(missing), "--output_dir", str(out), *flags],
                        f"--init {missing}: no such file or folder")
        assert not out.exists()


def test_caption_train_eval_predict(caption_run, scene_png, tmp_path, capsys):
    summary = json.loads((caption_run / "summary.json").read_text())
    assert "test_cider" in summary and "test_bleu4" in summary
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(caption_run), "--split", "val", "--output-dir", str(tmp_path),
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["split"] == "val" and r["cider"] >= 0.0 and len(r["captions"]) == r["images"] == 6
    assert main(["predict", "--checkpoint", str(caption_run), str(scene_png)]) == 0
    assert capsys.readouterr().out.startswith(f"{scene_png}:")
    _one_line_error(capsys, ["predict", "--checkpoint", str(caption_run), str(scene_png), "--prompt", "what"],
                    "(caption) takes no prompt")


@pytest.mark.slow
def test_prompt_refused_by_a_task_without_questions(tmp_path, scene_png, capsys):
    run = tmp_path / "cls"
    assert main(["train", "--model", "vit_pico_patch8_32", "--data.img_size", "16", "--epochs", "1",
                 "--batch_size", "256", "--output_dir", str(run), "--quiet"]) == 0
    _one_line_error(capsys, ["predict", "--checkpoint", str(run), str(scene_png), "--prompt", "what"],
                    "takes no prompt; a prompt is for blip, vqa runs")


def test_wrong_data_for_the_task(tmp_path, capsys):
    (tmp_path / "q.jsonl").write_text("")
    captions = "reads scenes, coco:PATH or captions:PATH"
    for task in ("caption", "blip"):  # each message names its own task and exactly the sources it reads
        _one_line_error(capsys, ["train", "--task", task, "--data", f"vqa:{tmp_path / 'q.jsonl'}", *TINY],
                        "holds questions", f"--task {task} {captions}")
        err = _one_line_error(capsys, ["train", "--task", task, "--data", "digits", *TINY], f"--task {task} {captions}")
        assert "vqa:" not in err and "llava:" not in err
    _one_line_error(capsys, ["train", "--task", "vqa", "--data", f"captions:{tmp_path}", *TINY], "holds captions",
                    "--task vqa reads scenes, vqa:PATH or llava:PATH")
    err = _one_line_error(capsys, ["train", "--task", "vqa", "--data", "digits", *TINY], "reads scenes")
    assert "coco:" not in err and "captions:" not in err
    _one_line_error(capsys, ["train", "--task", "vqa", "--stage", "1", "--task_args.freeze", "projector", *TINY],
                    "leaves nothing to train")
    from vitlab.data import DataConfig, DataError

    with pytest.raises(DataError, match="dataset captions needs a path: captions:PATH"):  # declared by vitlab.data
        DataConfig(dataset="captions")


def test_corrupt_coco_image_is_one_line(tmp_path, capsys):
    (tmp_path / "images").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "a.png")
    (tmp_path / "images" / "b.png").write_bytes(b"\x89PNG broken")
    d = {"images": [{"id": 1, "file_name": "a.png"}, {"id": 2, "file_name": "b.png"}],
         "annotations": [{"image_id": 1, "caption": "a thing"}, {"image_id": 2, "caption": "another"}]}
    (tmp_path / "c.json").write_text(json.dumps(d))
    out = tmp_path / "run"
    _one_line_error(capsys, ["train", "--task", "caption", "--data", f"coco:{tmp_path / 'c.json'}",
                             "--output_dir", str(out), *TINY], "corrupt image", "b.png")
    assert not out.exists()
    # half a JPEG: its header and PIL's verify() pass, its decoding fails; named before training, and an output
    # directory that was there before is left as it was
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    (tmp_path / "images" / "b.jpg").write_bytes(buf.getvalue()[:len(buf.getvalue()) // 2])
    d["images"][1]["file_name"] = "b.jpg"
    (tmp_path / "c.json").write_text(json.dumps(d))
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _one_line_error(capsys, ["train", "--task", "caption", "--data", f"coco:{tmp_path / 'c.json'}",
                             "--output_dir", str(out), *TINY], "corrupt image", "b.jpg", "truncated")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def _pictures(folder, n):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.fromarray(draw_scene(i)[0].permute(1, 2, 0).numpy()).save(folder / f"{i}.png")


def test_the_test_split_sizes_the_context(tmp_path, capsys):
    """A test question longer than every training one: the run trains and tests (the context holds it), and a
    context that cannot hold it is refused before training starts."""
    _pictures(tmp_path, 6)
    rows = [{"image": f"{i}.png", "question": "is it red", "answer": "yes"} for i in range(6)]
    rows.append({"image": "0.png", "question": "what colour is the small dog on the left", "answer": "red",
                 "split": "test"})
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    data = ["--data", f"vqa:{tmp_path / 'q.jsonl'}"]
    run = tmp_path / "run"
    assert main(["train", "--task", "vqa", *data, "--output_dir", str(run), *TINY, "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    # <s> user : what colour is the small dog on the left <image> assistant : red </s>
    assert summary["context_length"] == 17 and "test_accuracy" in summary
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--output-dir", str(tmp_path / "eval"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["questions"] == 1
    short = tmp_path / "short"
    _one_line_error(capsys, ["train", "--task", "vqa", *data, "--output_dir", str(short), *TINY,
                             "--task_args.context_length", "12"], "context_length 12", "test split (17 tokens)")
    assert not short.exists()


def test_captions_files_train_caption_and_blip(tmp_path, capsys):
    """CLIP's captions files (CSV and JSONL) as captioning data: one training epoch each through the command line,
    a tenth of the images held out for validation."""
    _pictures(tmp_path / "csv", 10)
    (tmp_path / "csv" / "captions.csv").write_text(
        "image,caption\n" + "".join(f'{i}.png,"scene {i}, on grass"\n{i}.png,another view\n' for i in range(10)))
    run = tmp_path / "caption"
    assert main(["train", "--task", "caption", "--data", f"captions:{tmp_path / 'csv'}", "--output_dir", str(run),
                 *TINY, "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    # one sequence per caption: <s> <image> scene 0 , on grass </s>
    assert summary["finished"] and summary["context_length"] == 8
    capsys.readouterr()
    # no test split: the validation split is scored, and the result and its file say so
    assert main(["eval", "--checkpoint", str(run), "--output-dir", str(tmp_path / "eval"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["split"] == "val" and r["images"] == 1 and len(r["captions"][0]["refs"]) == 2
    assert (tmp_path / "eval" / "eval-val.json").is_file()
    # 12 images: validation holds one, where BLIP's ITM has no negative to draw (no val_itm, with a note)
    _pictures(tmp_path / "jsonl", 12)
    file = tmp_path / "jsonl" / "captions.jsonl"
    file.write_text("\n".join(json.dumps({"image": f"{i}.png", "caption": f"scene {i} ☃"}) for i in range(12)))
    run = tmp_path / "blip"
    tiny = ["--model_kwargs.vision_depth", "1", "--model_kwargs.text_depth", "1", *TINY[6:]]
    assert main(["train", "--task", "blip", "--data", f"captions:{file}", "--output_dir", str(run), *tiny]) == 0
    assert "no ITM negative to draw, no val_itm (val_loss is ITC + LM)" in capsys.readouterr().out
    last = read_metrics(run, "epoch")[-1]
    assert "val_itm" not in last and last["val_loss"] == pytest.approx(last["val_itc"] + last["val_lm"])
    assert main(["eval", "--checkpoint", str(run), "--split", "test", "--output-dir", str(tmp_path / "eval"),
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["split"] == "val" and r["images"] == 1 and r["texts"] == 1


@pytest.mark.parametrize("after", [False, True])
def test_loss_only_on_answers_equals_the_models_labelled_loss(after):
    tok = WordTokenizer.from_texts(["user : how many cats are there assistant : 2 is there a cat yes"])
    seqs = Sequences(tok, 24, instruct=True, image_after_question=after)
    turns = [("how many cats are there", "2"), ("is there a cat", "yes")]
    ids, labels = seqs.padded(turns)
    scored = [int(i) for i, lab in zip(ids, labels, strict=True) if lab != IGNORE]
    assert [tok.decode(scored[:2]), tok.decode(scored[2:])] == ["2", "yes"] and scored[-1] == tok.eos_id
    # one placeholder, after the first question or right after <s>; a prompt is the start of its conversation
    pos = ids.tolist().index(tok.image_id)
    assert (pos > 2) == after and (ids == tok.image_id).sum() == 1
    assert seqs.prompt(turns[0][0]) == seqs.encode(turns[:1])[0][:-2]
    assert seqs.prompt(turns[1][0], turns[:1]) == seqs.encode(turns)[0][:-2]
    model = vitlab.create_model("llava_scenes", vocab_size=tok.vocab_size, image_token_id=tok.image_id,
                                max_seq_len=24, vision_depth=1, text_n_layers=1)
    x = torch.randn(2, 3, 64, 64)
    # rows with the placeholder in different places: the loss aligns each row's labels past its image
    other, other_labels = Sequences(tok, 24, instruct=True, image_after_question=not after).padded(turns)
    ids2, labels2 = torch.stack([ids, other]), torch.stack([labels, other_labels])
    out = model(ids2, x, labels=labels2)
    loss, stats = answer_loss(out.logits, labels2, (ids2 == tok.image_id).int().argmax(1))
    assert torch.allclose(loss, out.loss) and stats["tokens"] == 8


def test_coordinate_channels_follow_the_image():
    x = torch.randn(2, 3, 4, 6)
    y = with_coords(x)
    assert y.shape == (2, 5, 4, 6) and torch.equal(y[:, :3], x)
    assert torch.equal(y[1, 3, :, 2], torch.linspace(-1, 1, 4)) and torch.equal(y[0, 4, 3], torch.linspace(-1, 1, 6))
    assert (y[:, 3] == y[:, 3, :, :1]).all() and (y[:, 4] == y[:, 4, :1]).all()


def test_vqa_model_reads_the_coordinates(vqa_run):
    from vitlab.train.evaluate import load_model

    model, record, _ = load_model(vqa_run / "last", device="cpu")
    assert record.task_args["coord_channels"] and record.model_kwargs["in_chans"] == 5
    assert model.vision_tower.patch_embed.in_chans == 5


@pytest.mark.parametrize("stage, trained", [(0, {"vision_tower", "projector", "language_model"}),
                                            (1, {"projector"}), (2, {"projector", "language_model"})])
def test_llava_stages_freeze_parts(stage, trained):
    model = vitlab.create_model("llava_tiny")
    apply_freezing(model, VLArgs(stage=stage))
    model.train()  # a frozen part stays in eval mode (its BatchNorm and dropout as at inference)
    for part in ("vision_tower", "projector", "language_model"):
        grads = {p.requires_grad for p in getattr(model, part).parameters()}
        assert grads == {part in trained}, part
        assert {m.training for m in getattr(model, part).modules()} == {part in trained}, part


def test_blip_freeze_keeps_the_frozen_parts_in_eval_mode(tmp_path):
    """A blip run's --task_args.freeze freezes as LLaVA's stages do: no gradients, and eval mode (dropout off)
    whatever mode the model is put in; the other parts train."""
    cfg = TrainConfig.for_task("blip", task_args={"freeze": ["vision_tower"], "scenes_train": 4, "scenes_eval": 2},
                               model_kwargs={"vision_depth": 1, "text_depth": 1}, output_dir=str(tmp_path / "r"))
    from vitlab.train.task import create_task

    task = create_task("blip")
    task.build(cfg, torch.device("cpu"))
    model = task.model
    model.train()
    assert {m.training for m in model.vision_tower.modules()} == {False}
    assert {p.requires_grad for p in model.vision_tower.parameters()} == {False}
    others = [m for n, m in model.named_children() if n != "vision_tower" and any(True for _ in m.parameters())]
    assert others and all(m.training and all(p.requires_grad for p in m.parameters()) for m in others)


def test_blind_runs_see_zeros():
    cfg = TrainConfig.for_task("vqa", task_args={"blind": True, "scenes_train": 4, "scenes_eval": 2},
                               model_kwargs={"vision_depth": 1, "text_n_layers": 1})
    from vitlab.train.task import create_task

    task = create_task("vqa")
    task.build(cfg, torch.device("cpu"))
    x, ids, labels = task.data.train[0]
    assert x.abs().sum() == 0
    # a training conversation asks one question of each kind the scene has (position needs a pair, locate an object
    # of a class the scene has once): 3 to 5 answers
    assert (labels == task.tokenizer.eos_id).sum() in (3, 4, 5) and (labels != IGNORE).sum() >= 6
    cfg.task_args.blind = False
    task.build(cfg, torch.device("cpu"))
    assert task.data.train[0][0].abs().sum() > 0


@pytest.mark.parametrize("weight", [1, 3])
def test_scenes_with_a_position_question_count_position_weight_times(weight):
    from vitlab.train.task import create_task
    from vitlab.vlm.data import position_pairs

    cfg = TrainConfig.for_task("vqa", task_args={"scenes_train": 24, "scenes_eval": 2,
                                                 "scenes_position_weight": weight},
                               model_kwargs={"vision_depth": 1, "text_n_layers": 1})
    task = create_task("vqa")
    task.build(cfg, torch.device("cpu"))
    scenes = task.splits.scenes["train"]
    paired = [i for i, s in enumerate(scenes) if position_pairs(s)]
    assert 0 < len(paired) < len(scenes)
    listed = [s.image for s in task.data.train.samples]
    assert sorted(listed) == sorted([*range(len(scenes)), *paired * (weight - 1)])


def test_training_step_drops_the_padding_columns_and_unscored_positions_only():
    """A batch is cut to its longest sequence before the model sees it, and the logits are computed at the
    answers only; the loss and its gradients are those over the whole context (causal attention: no real token
    sees the padding after it)."""
    from vitlab.train.task import create_task
    from vitlab.vlm.tasks import _logits

    cfg = TrainConfig.for_task("vqa", task_args={"scenes_train": 8, "scenes_eval": 2},
                               model_kwargs={"vision_depth": 1, "text_n_layers": 1})
    task = create_task("vqa")
    task.build(cfg, torch.device("cpu"))
    x, ids, labels = (torch.stack(t) for t in zip(*(task.data.train[i] for i in range(8)), strict=True))
    longest = int((ids != task.tokenizer.pad_id).sum(1).max())
    assert longest < ids.shape[1]
    shapes = []

    def forward(i, img, **kw):
        shapes.append(i.shape)
        return task.model(i, img, **kw)

    grads = []
    for step in (lambda: task.training_step((x, ids, labels), forward)[0],
                 lambda: answer_loss(_logits(task.model(ids, with_coords(x))), labels, task._image_pos(ids))[0]):
        task.model.zero_grad()
        loss = step()
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in task.model.parameters() if p.grad is not None]))
    assert shapes == [(8, longest)]
    (loss, g), (whole, g_whole) = grads
    torch.testing.assert_close(loss, whole, rtol=1e-5, atol=1e-6)
    assert len(g) == len(g_whole) > 0
    for a, b in zip(g, g_whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_stage_two_starts_from_a_stage_one_run(vqa_run, tmp_path):
    run = tmp_path / "s2"
    assert main(["train", "--task", "vqa", "--output_dir", str(run), *TINY, "--stage", "2", "--init",
                 str(vqa_run), "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["frozen"] == ["vision_tower"]
    # the frozen tower is the stage-one run's, its BatchNorm statistics included
    from vitlab.train.evaluate import load_model

    before, after = (load_model(r / "last", device="cpu")[0].vision_tower.state_dict() for r in (vqa_run, run))
    assert any("running_mean" in k for k in before)
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, msg=k)


def test_blip_three_objectives_retrieval_and_captions(tmp_path, scene_png, capsys):
    run = tmp_path / "blip"
    tiny = ["--model_kwargs.vision_depth", "1", "--model_kwargs.text_depth", "1", *TINY[6:]]
    assert main(["train", "--task", "blip", "--output_dir", str(run), *tiny, "--quiet"]) == 0
    assert {"val_itc", "val_itm", "val_lm", "val_loss"} <= set(read_metrics(run, "epoch")[-1])
    summary = json.loads((run / "summary.json").read_text())
    assert {"test_i2t_r1", "test_t2i_r5", "test_i2t_itm_r1", "test_cider"} <= set(summary)
    capsys.readouterr()
    # --split train: the run's 16 training scenes (TINY), not one
    assert main(["eval", "--checkpoint", str(run), "--split", "train", "--output-dir", str(tmp_path / "e"),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["images"] == 16
    assert main(["predict", "--checkpoint", str(run), str(scene_png), "--prompt", "a picture of", "--json"]) == 0
    row, = json.loads(capsys.readouterr().out)
    assert row["output"].startswith("a picture of")
    # the image is the input file: one placeholder in the prompt is taken out, a second refused (as vqa's)
    assert main(["predict", "--checkpoint", str(run), str(scene_png), "--prompt", "<image> a picture of",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["output"] == row["output"]
    _one_line_error(capsys, ["predict", "--checkpoint", str(run), str(scene_png), "--prompt",
                             "<image> <image> a picture of"], "2 <image> placeholders for one image")


def test_language_model_learning_rate_is_scaled():
    cfg = TrainConfig.for_task("caption", task_args={"scenes_train": 4, "scenes_eval": 2, "language_lr_scale": 0.1},
                               model_kwargs={"vision_depth": 1, "text_n_layers": 1})
    from vitlab.train.task import create_task

    task = create_task("caption")
    task.build(cfg, torch.device("cpu"))
    groups = task.param_groups(0.05)
    lm = {id(p) for p in task.model.language_model.parameters()}
    for g in groups:
        inside = {id(p) in lm for p in g["params"]}
        assert len(inside) == 1 and g.get("lr_scale", 1.0) == (0.1 if inside == {True} else 1.0)
    assert sum(len(g["params"]) for g in groups) == len(list(task.model.parameters()))


def test_blip_rows_follow_the_words():
    """BLIP's token rows -- both text embeddings and the LM head's decoder, weight and bias -- are re-indexed by
    word; the rest of the state dict passes as it is."""
    from vitlab.vlm.tasks import VOCAB_ROWS, BlipTask, map_vocabulary

    old, new = WordTokenizer(["a", "cat", "dog"]), WordTokenizer(["a", "bird", "cat"])
    torch.manual_seed(0)
    src, dst = (BlipTask._model("blip_tiny", {"text_depth": 1, "vision_depth": 1}, t, 32, 16) for t in (old, new))
    sd = src.state_dict()
    out, mapped, fresh = map_vocabulary(dst, sd, old, new, "src")
    assert (mapped, fresh) == (2, 1)
    rows = [k for k in sd if k.endswith(VOCAB_ROWS)]
    assert {"text_encoder.word_embeddings.weight", "lm_head.decoder.bias"} <= set(rows)
    for k in rows:
        for w in ("<s>", "[DEC]", "a", "cat"):
            torch.testing.assert_close(out[k][new.encoder[w]], sd[k][old.encoder[w]], msg=f"{k} {w}")
        torch.testing.assert_close(out[k][new.encoder["bird"]], dst.state_dict()[k][new.encoder["bird"]])
    dst.load_state_dict(out)


def test_vqa_scores_answers_in_the_annotations_own_form(vqa_run, scene_png, tmp_path, capsys, monkeypatch):
    """A file's answer "Yes." (ten agreeing annotators) against the word tokenizer's "yes .": both sides are
    normalised (the official script would compare the agreeing answers as written and score 0)."""
    from vitlab.vlm.tasks import VQATask

    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"image": str(scene_png), "question": f"is it {w}",
                                                          "answer": "Yes.", "split": split}) + "\n"
                                              for w in ("red", "blue", "green") for split in ("train", "val", "test")))
    monkeypatch.setattr(VQATask, "generate", lambda self, model, record, x, prompts, *a, **k: ["yes ."] * len(prompts))
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(vqa_run), "--data", f"vqa:{tmp_path / 'q.jsonl'}", "--output-dir",
                 str(tmp_path / "out"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == 100.0


def test_blip_validation_leaves_lone_image_batches_out_of_itm():
    """A validation batch of one image scores ITM 0 (no negative to draw): it counts for ITC and LM, not for the
    ITM mean, and val_loss is the sum of the objectives' means."""
    from vitlab.vlm.tasks import BlipTask

    task = BlipTask.__new__(BlipTask)
    task.device = "cpu"
    sums = {}
    for n, groups, itm in ((4, [0, 1, 2, 3], 2.0), (2, [5, 5], 0.0)):
        batch = (torch.zeros(n, 3, 8, 8), torch.zeros(n, 4), torch.ones(n, 4), torch.tensor(groups))
        out = {"itc": torch.tensor(1.0), "itm": torch.tensor(itm), "lm": torch.tensor(3.0)}
        step = task.validation_step(batch, lambda *b, out=out: {**out, "loss": sum(out.values())})
        sums = {k: sums.get(k, 0) + v for k, v in step.items()}
    assert task.validation_metrics(sums) == pytest.approx({"itc": 1.0, "itm": 2.0, "lm": 3.0, "loss": 6.0})


def test_eval_split_scores_test_or_else_val_and_refuses_a_missing_one(tmp_path):
    """``split`` None or 'test' scores the test split, or val when the data has none; a train or val split the
    data lacks is refused naming the splits it has."""
    from vitlab.data import DataError
    from vitlab.vlm.tasks import VLSplits, eval_split

    splits = VLSplits(train=["a"], val=["b"], test=None, images={})
    assert eval_split(splits, None, "d") == "val" and eval_split(splits, "train", "d") == "train"
    assert eval_split(splits, "test", "d") == "val"
    with pytest.raises(DataError, match=r"^d has no train split \(it has val\); pass --split val$"):
        eval_split(VLSplits(train=None, val=["b"], test=None, images={}), "train", "d")
    with pytest.raises(DataError, match=r"^d has no val split \(it has train\); pass --split train$"):
        eval_split(VLSplits(train=["a"], val=[], test=None, images={}), None, "d")  # no test, and no val either
    assert eval_split(VLSplits(["a"], ["b"], ["c"], {}), None, "d") == "test"


def test_vqa_question_placeholders_taken_out_or_refused(tmp_path, capsys):
    """A VQA JSONL question's one <image> placeholder is taken out (the image is the row's; never the words '<',
    'image', '>'), a second one is refused naming the file and line, in training and in vitlab eval. The start
    line counts the questions as samples (several share an image)."""
    _pictures(tmp_path, 6)
    rows = [{"image": f"{i}.png", "question": q, "answer": a} for i in range(6)
            for q, a in (("<image> is it red", "yes"), ("<image>\nwhat is it", "a scene"))]
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--task", "vqa", "--data", f"vqa:{tmp_path / 'q.jsonl'}", "--output_dir", str(run),
                 *TINY]) == 0
    out = capsys.readouterr().out
    assert "(10 train / 2 val samples, " in out, out
    words = json.loads((run / "checkpoints" / "epoch-0001" / "meta.json").read_text())["tokenizer"]["words"]
    assert not {"image", "<", ">"} & set(words), words
    rows[3]["question"] = "<image> <image> what is it"
    (tmp_path / "two.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    where = f"{tmp_path / 'two.jsonl'} line 4: 2 <image> placeholders for one image"
    _one_line_error(capsys, ["train", "--task", "vqa", "--data", f"vqa:{tmp_path / 'two.jsonl'}", "--output_dir",
                             str(tmp_path / "bad"), *TINY], where)
    assert not (tmp_path / "bad").exists()
    _one_line_error(capsys, ["eval", "--checkpoint", str(run), "--data", f"vqa:{tmp_path / 'two.jsonl'}",
                             "--split", "val", "--output-dir", str(tmp_path / "e")], where)


def test_init_refuses_a_tokenizer_of_another_vocabulary(tmp_path, capsys):
    """An imported Llama whose tokenizer.json does not fit its embedding's rows (a tokenizer of another model) is
    refused as vitlab generate refuses it (vitlab.text.check_vocab), before the run writes anything."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)).save_pretrained(tmp_path / "hf")
    sub = _subword_tokenizer(tmp_path / "hf")
    run = tmp_path / "run"
    capsys.readouterr()
    _one_line_error(capsys, ["train", "--task", "vqa", "--model", "llava_tiny", "--task_args.coord_channels", "false",
                             "--task_args.scenes_train", "16", "--task_args.scenes_eval", "6", "--epochs", "1",
                             "--init", str(tmp_path / "hf"), "--output_dir", str(run)],
                    f"has {sub.get_vocab_size()} tokens but --init {tmp_path / 'hf'}'s embedding has 400 rows")
    assert not run.exists()


def test_init_from_a_llama_with_a_tensor_its_config_has_no_place_for_is_refused(tmp_path, capsys):
    """An imported Llama holding a bias its config.json does not declare: named in one line with the --init
    directory (as a missing tensor is), never dropped, and the run writes nothing."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)).save_pretrained(tmp_path / "hf")
    _subword_tokenizer(tmp_path / "hf")
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.randn(64)
    save_file(sd, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    run = tmp_path / "run"
    capsys.readouterr()
    _one_line_error(capsys, ["train", "--task", "vqa", "--model", "llava_tiny", "--task_args.coord_channels", "false",
                             *TINY[6:], "--init", str(tmp_path / "hf"), "--output_dir", str(run)],
                    f"--init {tmp_path / 'hf'}: the checkpoint holds 1 tensor(s)",
                    "'model.layers.0.self_attn.q_proj.bias'")
    assert not run.exists()


def test_in_memory_images_are_transformed_once_as_the_files_are_one_by_one(tmp_path, monkeypatch):
    """The scenes' images, transformed as one batch when the source is made, equal each image transformed alone
    (what a file gets), at the working size and resized; past the cache's size, each is transformed when read."""
    from vitlab.data.transforms import eval_transform
    from vitlab.vlm import tasks
    from vitlab.vlm.data import make_scenes

    images = make_scenes("val", 0, 6).images
    Image.fromarray(images[2].permute(1, 2, 0).numpy()).save(tmp_path / "2.png")
    for size, cache in ((64, tasks.IMAGE_CACHE_BYTES), (48, tasks.IMAGE_CACHE_BYTES), (64, 5 * 3 * 64 * 64 * 4)):
        monkeypatch.setattr(tasks, "IMAGE_CACHE_BYTES", cache)
        tf = eval_transform(size, crop_pct=1.0, mean=[0.5] * 3, std=[0.25] * 3)
        source = tasks.ImageSource(images, tf)
        assert (source.ready is None) == (cache < 6 * 3 * size * size * 4)
        for i in range(6):
            assert torch.equal(source(i), tf(images[i]))
        assert torch.equal(tasks.ImageSource(None, tf)(str(tmp_path / "2.png")), source(2))
