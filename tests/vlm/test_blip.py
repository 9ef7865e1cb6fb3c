"""BLIP (Li et al., 2022) against transformers' ``BlipForConditionalGeneration`` and ``BlipForImageTextRetrieval``
(a dev-only oracle) with random weights saved by ``save_pretrained``: the same logits and loss, greedy captions,
ITM and ITC scores (within 1e-4). Then the three training objectives on the tiny registered config."""

from __future__ import annotations

import re

import pytest
import torch

import vitlab
from vitlab.vlm.blip import BLIP, convert_hf_blip_state_dict

transformers = pytest.importorskip("transformers")

VOCAB, DEC, SEP, PAD = 100, 98, 3, 0
# transformers' config of the registered blip_tiny* models (vitlab.vlm.model_configs)
TINY_TEXT = dict(vocab_size=VOCAB, hidden_size=32, encoder_hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=40, bos_token_id=DEC, sep_token_id=SEP,
                 pad_token_id=PAD, eos_token_id=SEP)
TINY_VISION = dict(image_size=32, patch_size=8, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4)


def _hf_config(**kw):
    return transformers.BlipConfig(text_config={**TINY_TEXT, **kw.pop("text", {})},
                                   vision_config={**TINY_VISION, **kw.pop("vision", {})}, image_text_hidden_size=16,
                                   **kw)


def _perturbed(model):
    """Every parameter moved off its init (LayerNorms and biases included), so no term of the key map hides."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _text(b=3, n=9):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, VOCAB - 3, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    mask[1, 6:] = 0  # a padded caption
    ids[1, 6:] = PAD
    return ids, mask


def test_captioning_equal_transformers(tmp_path):
    ref = _perturbed(transformers.BlipForConditionalGeneration(_hf_config()))
    ref.save_pretrained(tmp_path)
    ours = vitlab.create_model("blip_tiny_caption", checkpoint_path=str(tmp_path), label_smoothing=0.0).eval()
    x = torch.randn(3, 3, 32, 32)
    ids, mask = _text()
    ids[:, 0] = DEC
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = ref(pixel_values=x, input_ids=ids, attention_mask=mask, labels=labels)
        logits, loss = ours(x, ids, mask, labels)
        torch.testing.assert_close(logits, out.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(loss, out.loss, rtol=1e-4, atol=1e-4)
        # greedy captions, with and without a prompt; the tied LM weight is the word embedding
        for prompt in (None, torch.tensor([[DEC, 7, 8, 9]] * 3)):
            kw = {} if prompt is None else {"input_ids": torch.cat([prompt, torch.full((3, 1), SEP)], 1)}
            want = ref.generate(pixel_values=x, max_new_tokens=12, do_sample=False, **kw)
            got = ours.generate_caption(x, prompt, max_new_tokens=12)
            assert got.tolist() == want.tolist()
    assert ours.lm_head.decoder.weight is ours.text_decoder.word_embeddings.weight


def test_retrieval_equal_transformers(tmp_path):
    ref = _perturbed(transformers.BlipForImageTextRetrieval(_hf_config()))
    ref.save_pretrained(tmp_path)
    ours = BLIP.from_pretrained(tmp_path)
    assert ours.heads == ("itc", "itm")
    x = torch.randn(3, 3, 32, 32)
    ids, mask = _text()
    with torch.no_grad():
        want_itm = ref(input_ids=ids, pixel_values=x, attention_mask=mask).itm_score
        want_itc = ref(input_ids=ids, pixel_values=x, attention_mask=mask, use_itm_head=False).itm_score
        torch.testing.assert_close(ours.itm_scores(x, ids, mask), want_itm, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.itc_scores(x, ids, mask), want_itc, rtol=1e-4, atol=1e-4)
    same = vitlab.create_model("blip_tiny_retrieval", checkpoint_path=str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(same.itm_scores(x, ids, mask), want_itm, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(same(x, ids, mask)[0], want_itm, rtol=1e-4, atol=1e-4)  # its forward


def test_three_objectives_train_and_hard_negatives():
    torch.manual_seed(0)
    model = vitlab.create_model("blip_tiny")
    x = torch.randn(4, 3, 32, 32)
    ids, _ = _text(4, 8)
    ids[:, 0] = 1  # [CLS]
    out = model.losses(x, ids, torch.ones_like(ids), generator=torch.Generator().manual_seed(0))
    assert set(out) == {"itc", "itm", "lm", "loss"} and all(torch.isfinite(v) for v in out.values())
    torch.testing.assert_close(out["loss"], out["itc"] + out["itm"] + out["lm"])
    out["loss"].backward()
    assert all(p.grad is not None for p in model.parameters())  # every part learns from the three objectives
    # hard negatives come from the contrastive similarity: with one image far more similar to text 0 than the
    # others, that image is (almost always) the negative drawn for text 0
    sim = torch.full((4, 4), -50.0)
    sim.fill_diagonal_(0)
    sim[2, 0] = 10.0
    seen = []
    orig = model.itm_logits
    model.itm_logits = lambda img, txt, m: seen.append(img) or orig(img, txt, m)
    model._itm_loss(model.encode_image(x), ids, None, sim, torch.eye(4, dtype=torch.bool), None)
    image = model.encode_image(x)
    torch.testing.assert_close(seen[0][4], image[2])  # rows 4..7: (negative image, text); text 0's is image 2
    with pytest.raises(ValueError, match="at least two different images"):
        model.losses(x[:1], ids[:1])
    # a validation split of one image: ITM has no negative and scores 0, the other objectives as usual
    lone = model.losses(x[:1], ids[:1], lone_image_itm=True)
    assert lone["itm"].item() == 0.0 and lone["lm"].item() > 0
    torch.testing.assert_close(lone["loss"], lone["itc"] + lone["lm"])
    with pytest.raises(ValueError, match="no LM head"):
        vitlab.create_model("blip_tiny_retrieval").generate_caption(x)


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = vitlab.create_model("blip_tiny", heads=("itc", "lm"))
    x = torch.randn(2, 3, 32, 32)
    ids, _ = _text(2, 8)
    grads = []
    for enable in (False, True):
        model.set_grad_checkpointing(enable)
        model.zero_grad(set_to_none=True)
        model.losses(x, ids)["loss"].backward()
        grads.append([p.grad for p in model.parameters() if p.grad is not None])
    assert model.text_decoder.grad_checkpointing and model.vision_tower.grad_checkpointing
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_image_ids_make_same_image_captions_positives():
    model = vitlab.create_model("blip_tiny", heads=("itc",))
    x = torch.randn(4, 3, 32, 32)
    ids, _ = _text(4, 8)
    a = model.losses(x, ids)["itc"]
    b = model.losses(x, ids, image_ids=torch.tensor([0, 0, 1, 2]))["itc"]
    assert not torch.allclose(a, b)


def test_key_map_and_refusals(tmp_path):
    sd = transformers.BlipForConditionalGeneration(_hf_config()).state_dict()
    ours = convert_hf_blip_state_dict(sd)
    assert "lm_head.decoder.weight" in ours and "vision_tower.blocks.1.attn.qkv.weight" in ours
    assert "text_decoder.layers.1.crossattention.key.weight" in ours
    transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**TINY_VISION)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not BlipForConditionalGeneration"):
        vitlab.create_model("blip_tiny_caption", checkpoint_path=str(tmp_path))
    with pytest.raises(ValueError, match="unknown BLIP heads"):
        BLIP("vit_pico_patch8_32", heads=("vqa",))
    with pytest.raises(ValueError, match="needs a \\[CLS\\] token"):
        BLIP("vit_pico_patch8_32", {"class_token": False, "global_pool": "avg"})


@pytest.mark.parametrize("name,cls", [("blip_base_caption", "BlipForConditionalGeneration"),
                                      ("blip_base_retrieval", "BlipForImageTextRetrieval")])
def test_base_configs_take_the_released_layout(name, cls):
    """blip_base_* hold every tensor of transformers' BLIP-base classes (ViT-B/16 384, BERT-base: the layout of
    the released checkpoints), shape for shape (built on meta: nothing is allocated)."""
    with torch.device("meta"):
        ref = getattr(transformers, cls)(transformers.BlipConfig())
        ours = vitlab.create_model(name)
    mapped = {k: tuple(v.shape) for k, v in convert_hf_blip_state_dict(ref.state_dict()).items()}
    own = {k: tuple(v.shape) for k, v in ours.state_dict().items() if k != "temp"}
    assert mapped == own


@pytest.mark.slow
def test_blip_base_caption_equal_transformers_base():
    """The registered blip_base_caption with transformers' BLIP-base weights (random init: no download): the same
    logits at 384 x 384."""
    from vitlab.convert import load_state_dict

    torch.manual_seed(0)
    ref = transformers.BlipForConditionalGeneration(transformers.BlipConfig(
        text_config={"num_attention_heads": 12})).eval()
    ours = load_state_dict(vitlab.create_model("blip_base_caption"), ref.state_dict()).eval()
    x, ids = torch.randn(1, 3, 384, 384), torch.tensor([[30522, 1037, 3861, 1997, 102]])
    with torch.no_grad():
        torch.testing.assert_close(ours(x, ids)[0], ref(pixel_values=x, input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_profile_inputs_fit_a_short_text_context():
    """The profiler's caption fits a decoder of fewer than 32 positions (a run's context plus its answer budget)."""
    model = vitlab.create_model("blip_tiny", text_max_len=20).eval()
    inputs = model.profile_inputs(torch.randn(1, 3, 32, 32))
    assert inputs[1].shape[1] == 20
    with torch.no_grad():
        model(*inputs)


# config.json fields the tensors' shapes do not show, each changed from blip_tiny_caption's, and the refusal's words
ANOTHER_FUNCTION = [
    ({"vision": {"hidden_act": "quick_gelu"}}, "vision_config.hidden_act 'quick_gelu' (this model 'gelu')"),
    ({"vision": {"layer_norm_eps": 0.5}}, "vision_config.layer_norm_eps 0.5 (this model 1e-05)"),
    ({"vision": {"num_attention_heads": 2}}, "vision_config.num_attention_heads 2 (this model 4)"),
    ({"text": {"hidden_act": "gelu_new"}}, "text_config.hidden_act 'gelu_new' (this model 'gelu')"),
    ({"text": {"layer_norm_eps": 0.5}}, "text_config.layer_norm_eps 0.5 (this model 1e-12)"),
    ({"text": {"num_attention_heads": 2}}, "text_config.num_attention_heads 2 (this model 4)"),
    ({"text": {"bos_token_id": 97}}, "text_config.bos_token_id 97 (this model 98)"),
    ({"text": {"sep_token_id": 5}}, "text_config.sep_token_id 5 (this model 3)"),
    ({"text": {"pad_token_id": 1}}, "text_config.pad_token_id 1 (this model 0)"),
]


@pytest.mark.parametrize("change,message", ANOTHER_FUNCTION, ids=lambda c: str(c)[:40])
def test_a_checkpoint_of_another_function_is_refused_in_one_line(change, message, tmp_path):
    """create_model(checkpoint_path=) compares config.json with the registered model: the same tensors under
    another activation, eps or head count compute transformers' logits differently (shown below); another [DEC],
    [SEP] or padding id starts, stops or pads its captions elsewhere."""
    from vitlab.convert import load_state_dict

    ref = _perturbed(transformers.BlipForConditionalGeneration(_hf_config(**change)))
    with torch.no_grad():  # weights large enough for an activation's or a head split's difference to show
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    ref.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path))}: another BLIP architecture: "
                                         f"{re.escape(message)}$"):
        vitlab.create_model("blip_tiny_caption", checkpoint_path=str(tmp_path))
    if "_token_id" in str(change):
        return
    ours = load_state_dict(vitlab.create_model("blip_tiny_caption"), ref.state_dict()).eval()  # unchecked
    x = torch.randn(2, 3, 32, 32)
    ids, mask = _text(2)
    with torch.no_grad():
        want = ref(pixel_values=x, input_ids=ids, attention_mask=mask).logits
        assert not torch.allclose(ours(x, ids, mask)[0], want, rtol=1e-4, atol=1e-4)  # the tolerance above
