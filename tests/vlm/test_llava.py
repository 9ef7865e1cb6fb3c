"""LLaVA (Liu et al., 2023) against transformers' ``LlavaForConditionalGeneration`` (a dev-only oracle) with random
weights saved by ``save_pretrained``: the same logits, loss and greedy tokens (within 1e-4), the placeholder given
once (LLaVA's splice) or expanded (transformers' processor); the parts, the feature layer and strategy, and the
refusals."""

from __future__ import annotations

import re

import pytest
import torch

import vitlab
from vitlab.export import smallest_per_family
from vitlab.vlm.llava import LLaVA, convert_hf_llava_state_dict

transformers = pytest.importorskip("transformers")

IMAGE, EOS, PAD = 110, 2, 0
T = 16  # image tokens of llava_tiny: 4 x 4 patches, [CLS] dropped
# transformers' config of the registered llava_tiny (vitlab.vlm.model_configs)
VISION = dict(image_size=32, patch_size=8, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4)
TEXT = dict(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, eos_token_id=EOS, pad_token_id=PAD)


def _hf(tmp_path, vision=None, text=None, **kw):
    """transformers' LLaVA of llava_tiny's shapes (``vision`` / ``text``: changes to its towers' configs), random
    weights, saved to ``tmp_path``."""
    cfg = transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**{**VISION, **(vision or {})}),
                                   text_config=transformers.LlamaConfig(**{**TEXT, **(text or {})}),
                                   **{"image_token_index": IMAGE, **kw})
    ref = transformers.LlavaForConditionalGeneration(cfg)
    torch.manual_seed(0)
    with torch.no_grad():  # every parameter off its init (norms, biases), so no term of the key map hides
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.eval().save_pretrained(tmp_path)
    return ref


def _prompt(b=2, n=7, expanded=False):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 100, (b, n), generator=g)
    ids[:, 0] = 1
    ids[:, 1] = IMAGE
    if expanded:
        ids = torch.cat([ids[:, :1], torch.full((b, T), IMAGE), ids[:, 2:]], 1)
    return ids


def test_logits_loss_and_greedy_tokens_equal_transformers(tmp_path):
    ref = _hf(tmp_path)
    ours = vitlab.create_model("llava_tiny", checkpoint_path=str(tmp_path)).eval()
    x = torch.randn(2, 3, 32, 32)
    expanded, single = _prompt(expanded=True), _prompt()
    labels = expanded.masked_fill(expanded == IMAGE, -100)
    with torch.no_grad():
        out = ref(input_ids=expanded, pixel_values=x, labels=labels)
        for ids, lab in ((expanded, labels), (single, single.masked_fill(single == IMAGE, -100))):
            logits, loss = ours(ids, x, labels=lab)  # one placeholder is widened to the same sequence
            torch.testing.assert_close(logits, out.logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(loss, out.loss, rtol=1e-4, atol=1e-4)
        want = ref.generate(input_ids=expanded, pixel_values=x, max_new_tokens=10, do_sample=False,
                            eos_token_id=EOS, pad_token_id=PAD)[:, expanded.shape[1]:]
        got = ours.generate(single, x, max_new_tokens=10, pad_token_id=PAD)
        assert got.tolist() == want.tolist()
    assert {n for n, _ in ours.named_children()} == {"vision_tower", "projector", "language_model"}


@pytest.mark.parametrize("act", ["relu", "silu", "gelu_pytorch_tanh"])
def test_a_projector_of_another_activation_loads_from_its_directory(act, tmp_path):
    ref = _hf(tmp_path, projector_hidden_act=act)
    ours = LLaVA.from_pretrained(tmp_path).eval()
    x, ids = torch.randn(2, 3, 32, 32), _prompt(expanded=True)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, x).logits, ref(input_ids=ids, pixel_values=x).logits, rtol=1e-4,
                                   atol=1e-4)


def test_scored_only_gives_the_scored_positions_logits_and_transformers_loss(tmp_path):
    ref = _hf(tmp_path)
    ours = vitlab.create_model("llava_tiny", checkpoint_path=str(tmp_path)).eval()
    x = torch.randn(2, 3, 32, 32)
    expanded, single = _prompt(expanded=True), _prompt()

    def answer(ids):  # labels on the last 3 tokens only
        return ids.masked_fill(torch.arange(ids.shape[1]) < ids.shape[1] - 3, -100)

    with torch.no_grad():
        out = ref(input_ids=expanded, pixel_values=x, labels=answer(expanded))
        logits, loss = ours(single, x, labels=answer(single), scored_only=True)
    scored = out.logits[:, :-1][answer(expanded)[:, 1:] != -100]
    assert logits.shape == (2 * 3, TEXT["vocab_size"])
    torch.testing.assert_close(logits, scored, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss, out.loss, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="scored_only needs labels"):
        ours(single, x, scored_only=True)


def _registered_equals(ref, path):
    """llava_tiny loaded from ``path`` by ``checkpoint_path=`` computes ``ref``'s logits (transformers)."""
    ours = vitlab.create_model("llava_tiny", checkpoint_path=str(path)).eval()
    ids, x = _prompt(expanded=True), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, x).logits, ref(input_ids=ids, pixel_values=x).logits,
                                   rtol=1e-4, atol=1e-4)


def test_a_checkpoint_with_tied_embeddings_loads_by_checkpoint_path(tmp_path):
    """save_pretrained leaves the tied head out of the file: the registered (untied) model takes the embedding."""
    text = transformers.LlamaConfig(**TEXT, tie_word_embeddings=True)
    ref = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION), text_config=text, image_token_index=IMAGE,
        tie_word_embeddings=True)).eval()
    ref.save_pretrained(tmp_path)
    _registered_equals(ref, tmp_path)


def test_feature_layers_strategy_and_pretrained_config(tmp_path):
    """Two feature layers concatenated and [CLS] kept ('full'), read from config.json by LLaVA.from_pretrained."""
    ref = _hf(tmp_path, vision_feature_layer=[-3, -1], vision_feature_select_strategy="full")
    ours = LLaVA.from_pretrained(tmp_path)
    assert ours.num_image_tokens == T + 1
    assert ours.language_model.config.eos_token_id == TEXT.get("eos_token_id", 2)
    ref.generation_config.eos_token_id = [2, 7]  # generate's ends, where transformers reads them
    ref.generation_config.save_pretrained(tmp_path)
    assert LLaVA.from_pretrained(tmp_path).language_model.config.eos_token_id == [2, 7]
    x = torch.randn(1, 3, 32, 32)
    ids = torch.cat([torch.tensor([[1]]), torch.full((1, T + 1), IMAGE), torch.tensor([[7, 8, 9]])], 1)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, x).logits, ref(input_ids=ids, pixel_values=x).logits,
                                   rtol=1e-4, atol=1e-4)


def test_splice_widens_mask_and_labels():
    model = vitlab.create_model("llava_tiny").eval()
    ids = _prompt(2, 6)
    mask = torch.ones_like(ids)
    mask[1, :1] = 0  # left padding
    embeds, m, lab = model.merge(ids, torch.randn(2, 3, 32, 32), mask, ids.clone())
    assert embeds.shape == (2, 6 - 1 + T, 64) and m.shape == lab.shape == (2, 6 - 1 + T)
    assert m[1, 0] == 0 and bool(m[:, 1:1 + T].all()) and bool((lab[:, 1:1 + T] == -100).all())
    assert lab[:, 1 + T:].tolist() == ids[:, 2:].tolist()
    # the language model alone: a prompt without placeholder and no image
    assert model(ids[:, 2:]).logits.shape == (2, 4, 120)


def test_splice_places_each_rows_image_at_its_own_placeholder():
    model = vitlab.create_model("llava_tiny")
    ids = torch.tensor([[1, IMAGE, 5, 6, 7, 8], [1, 5, 6, 7, IMAGE, 8]])
    x = torch.randn(2, 3, 32, 32)
    mask, labels = torch.tensor([[1] * 6, [0, 1, 1, 1, 1, 1]]), ids.clone()
    embeds, m, lab = model.merge(ids, x, mask, labels)
    text = model.language_model.embed_tokens(ids.masked_fill(ids == IMAGE, 0))
    feats = model.image_features(x)
    for i, p in enumerate((1, 4)):  # every row: its text before the placeholder, the image's T tokens, the rest
        torch.testing.assert_close(embeds[i], torch.cat([text[i, :p], feats[i], text[i, p + 1:]]), rtol=0, atol=0)
        assert m[i].tolist() == mask[i, :p].tolist() + [1] * T + mask[i, p + 1:].tolist()
        assert lab[i].tolist() == labels[i, :p].tolist() + [-100] * T + labels[i, p + 1:].tolist()
    # the gradient reaches each text and image token once
    embeds.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert "language_model.embed_tokens.weight" in grads and any(n.startswith("projector.") for n in grads)


@pytest.mark.parametrize("ids,images,match", [
    (torch.tensor([[1, 5, 6]]), 1, "no image placeholder"),
    (torch.tensor([[1, IMAGE, IMAGE, 6]]), 1, "2 image placeholders for its one image"),
    (torch.tensor([[1, IMAGE, 6]]), 0, "no image is given"),
    (torch.tensor([[1, IMAGE, 6]]), 2, "2 images for 1 prompts"),
    (torch.tensor([[1] + [IMAGE] * 8 + [5] + [IMAGE] * 8 + [6]]), 1, "placeholders of a prompt must stand in a row"),
])
def test_bad_prompts_are_one_line(ids, images, match):
    model = vitlab.create_model("llava_tiny")
    with pytest.raises(ValueError, match=match) as e:
        model(ids, torch.randn(images, 3, 32, 32) if images else None)
    assert "\n" not in str(e.value)


def test_any_image_tower_and_freezing_by_part():
    model = vitlab.create_model("llava_tiny", vision_feature_layer=-1)
    vit = LLaVA(vitlab.create_model("vit_pico_patch8_32", num_classes=0), vitlab.create_model("llama_tiny"),
                image_token_id=7, vision_feature_layer=-1)
    x = torch.randn(2, 1, 32, 32)
    ids = torch.tensor([[1, 7, 9, 10], [1, 7, 11, 12]])
    for p in vit.vision_tower.parameters():
        p.requires_grad_(False)
    vit.set_grad_checkpointing()  # the image tower's blocks
    assert vit.vision_tower.grad_checkpointing
    logits, loss = vit(ids, x, labels=ids)
    loss.backward()
    assert logits.shape[1] == 4 - 1 + vit.num_image_tokens and vit.vision_tower.patch_embed.proj.weight.grad is None
    assert vit.projector.linear_1.weight.grad is not None
    assert model._take == [2]
    swin = vitlab.create_model("swin_tiny_patch4_window7_224", num_classes=0, img_size=64, window_size=4,
                               depths=(1, 1, 1, 1))
    hier = LLaVA(swin, vitlab.create_model("llama_tiny"), image_token_id=7, vision_feature_layer=-2)
    assert hier.num_image_tokens == 4 * 4 and hier.projector.linear_1.in_features == 384  # stage 3: 1/16, C = 384
    assert hier(ids, torch.randn(2, 3, 64, 64)).logits.shape == (2, 4 - 1 + 16, 512)
    with pytest.raises(ValueError, match="vision_feature_layer 0"):
        vitlab.create_model("llava_tiny", vision_feature_layer=0)


@pytest.mark.parametrize("name", smallest_per_family("classify"))
def test_every_image_family_is_a_tower(name):
    """Any registered image model as LLaVA's tower (each family's smallest; its last block's or stage's tokens, a
    plain ViT's prefix dropped): the image tokens it gives are spliced in, and the logits depend on the image."""
    from vitlab.registry import get_model_config

    tower = vitlab.create_model(name, num_classes=0).eval()
    model = LLaVA(tower, vitlab.create_model("llama_tiny"), image_token_id=7, vision_feature_layer=-1).eval()
    images = torch.randn(2, *get_model_config(name).input_size)
    ids = torch.tensor([[1, 7, 9, 10]] * 2)
    with torch.no_grad():
        feats = model.image_features(images)
        logits = model(ids, images).logits
    assert feats.shape == (2, model.num_image_tokens, 64)
    assert logits.shape == (2, 3 + model.num_image_tokens, 512)
    assert not torch.allclose(logits[0], logits[1], atol=1e-4)  # two images, two answers


def test_registered_configs_build_without_weights():
    """llava15_7b has LLaVA-1.5-7B's 7,063,427,072 parameters (llava-hf's release) and 576 image tokens."""
    with torch.device("meta"):
        model = vitlab.create_model("llava15_7b")
    assert sum(p.numel() for p in model.parameters()) == 7_063_427_072 and model.num_image_tokens == 576
    scenes = vitlab.create_model("llava_scenes", vocab_size=50, image_token_id=4, max_seq_len=30)
    assert scenes.num_image_tokens == 16 and type(scenes.vision_tower.patch_embed).__name__ == "ConvStemEmbed"
    assert scenes.language_model.config.max_seq_len == 30 + 16 - 1  # the text context plus the image's tokens


def test_key_map_of_the_in_memory_layout():
    """transformers 5 names its modules model.vision_tower., model.language_model., lm_head in memory and saves
    the older layout (vision_tower., language_model.model., language_model.lm_head: the tests above); both map."""
    ref = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION), text_config=transformers.LlamaConfig(**TEXT),
        image_token_index=IMAGE))
    model = vitlab.create_model("llava_tiny")
    assert any(k.startswith("model.language_model.") for k in ref.state_dict())
    assert convert_hf_llava_state_dict(ref.state_dict(), model).keys() == model.state_dict().keys()


def test_left_padded_batch_generates_as_each_prompt_alone():
    torch.manual_seed(0)
    model = vitlab.create_model("llava_tiny").eval()
    x = torch.randn(2, 3, 32, 32)
    short, long = [1, IMAGE, 20, 21], [1, IMAGE, 30, 31, 32, 33]
    ids = torch.tensor([[PAD, PAD] + short, long])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    batch = model.generate(ids, x, max_new_tokens=6, attention_mask=mask, eos_token_id=-1)
    for i, p in enumerate((short, long)):
        alone = model.generate(torch.tensor([p]), x[i:i + 1], max_new_tokens=6, eos_token_id=-1)
        assert batch[i].tolist() == alone[0].tolist()


def test_a_clip_model_of_the_registry_as_image_tower():
    from vitlab.vlm.llava import build_llava

    model = build_llava("clip_vit_pico_patch8", "llama_tiny", image_token_id=7, vision_feature_layer=-1,
                        vision_depth=2)
    assert type(model.vision_tower).__name__ == "VisionTransformer" and len(model.vision_tower.blocks) == 2
    logits, _ = model(torch.tensor([[1, 7, 9]]), torch.randn(1, 1, 32, 32))
    assert logits.shape == (1, 3 - 1 + model.num_image_tokens, 512)


def test_a_directory_of_another_architecture_is_refused(tmp_path):
    transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**VISION)).save_pretrained(tmp_path)
    for load in (lambda: vitlab.create_model("llava_tiny", checkpoint_path=str(tmp_path)),
                 lambda: LLaVA.from_pretrained(tmp_path)):
        with pytest.raises(ValueError, match="describes CLIPVisionModel.*not LlavaForConditionalGeneration"):
            load()


@pytest.mark.parametrize("kw", [{}, {"in_chans": 5}, {"max_seq_len": 20}])
def test_flops_are_counted_for_any_tower_input_and_context(kw):
    """The profile's prompt fits a short context, and its image has the tower's channels (e.g. coordinates)."""
    from vitlab.profile import profile_model

    m = vitlab.create_model("llava_tiny", **kw)
    ids, image = m.profile_inputs(torch.zeros(1, 3, 32, 32))
    assert ids.shape[1] + m.num_image_tokens - 1 <= m.language_model.config.max_seq_len
    assert image.shape[1] == kw.get("in_chans", 3)
    assert profile_model(m).gmacs > 0


# config.json fields the tensors' shapes do not show, each changed from llava_tiny's, and the refusal's words
ANOTHER_FUNCTION = [
    ({"vision_feature_layer": -1}, "another LLaVA architecture: vision_feature_layer -1 (this model -2)"),
    ({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy 'full' (this model 'default')"),
    ({"projector_hidden_act": "quick_gelu"},
     "projector_hidden_act 'quick_gelu' (this model 'gelu')"),
    ({"text": {"rope_theta": 5000.0}}, "another Llama architecture: rope_theta 5000.0 (this model 10000.0)"),
    ({"vision": {"hidden_act": "gelu"}},
     "another LLaVA architecture: vision_config.hidden_act 'gelu' (this model 'quick_gelu')"),
    ({"vision": {"layer_norm_eps": 0.5}}, "vision_config.layer_norm_eps 0.5 (this model 1e-05)"),
    ({"vision": {"num_attention_heads": 2}}, "vision_config.num_attention_heads 2 (this model 4)"),
    ({"image_token_index": 111}, "image_token_index 111 (this model 110)"),
]


@pytest.mark.parametrize("change,message", ANOTHER_FUNCTION, ids=lambda c: str(c)[:40])
def test_a_checkpoint_of_another_function_is_refused_in_one_line(change, message, tmp_path):
    """create_model(checkpoint_path=) compares config.json with the registered model: the same tensors under
    another activation, eps, RoPE base, head count, feature layer or selection compute transformers' model
    differently (shown below), and another placeholder id misreads every prompt."""
    from vitlab.convert import load_state_dict

    ref = _hf(tmp_path, **change)
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        vitlab.create_model("llava_tiny", checkpoint_path=str(tmp_path))
    assert str(e.value).startswith(f"{tmp_path}: ") and "\n" not in str(e.value)
    if "image_token_index" in change:
        return
    ours = load_state_dict(vitlab.create_model("llava_tiny"), ref.state_dict()).eval()  # unchecked
    x = torch.randn(1, 3, 32, 32)
    t = T + (change.get("vision_feature_select_strategy") == "full")
    ids = torch.cat([torch.tensor([[1]]), torch.full((1, t), IMAGE), torch.tensor([[7, 8, 9]])], 1)
    with torch.no_grad():
        want = ref(input_ids=ids, pixel_values=x).logits
        got = ours(torch.tensor([[1, IMAGE, 7, 8, 9]]), x).logits
    assert got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4)  # the tolerance above


def test_a_feature_layer_counted_from_the_start_names_the_same_block(tmp_path):
    """hidden_states[2] of a 3-block tower is hidden_states[-2], llava_tiny's: the checkpoint loads and computes
    transformers' logits."""
    ref = _hf(tmp_path, vision_feature_layer=2)
    _registered_equals(ref, tmp_path)


def test_a_language_model_other_than_llama_is_refused(tmp_path):
    """Mistral's decoder has Llama's tensors but attends within a sliding window: not loaded as a Llama."""
    transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION),
        text_config=transformers.MistralConfig(**TEXT, sliding_window=4), image_token_index=IMAGE)
    ).save_pretrained(tmp_path)
    for load in (lambda: vitlab.create_model("llava_tiny", checkpoint_path=str(tmp_path)),
                 lambda: LLaVA.from_pretrained(tmp_path)):
        with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path))}: only Llama language models are "
                                             f"supported, not text_config.model_type 'mistral'$"):
            load()


def test_context_overflow_names_the_text_and_image_tokens_before_the_image_tower_runs(monkeypatch):
    """A 100-id prompt with one placeholder is 99 text + 16 image tokens: the count says so, not "115 tokens"."""
    model = vitlab.create_model("llava_tiny").eval()
    assert model.language_model.config.max_seq_len == 128 + T - 1  # 128 text tokens, one placeholder widened
    x = torch.randn(1, 3, 32, 32)
    single = torch.tensor([[1, IMAGE] + [5] * 98])
    expanded = torch.tensor([[1] + [IMAGE] * T + [5] * (99 - T)])
    assert model.generate(single, x, max_new_tokens=28, eos_token_id=[]).shape == (1, 28)  # 115 + 28 fit

    def no_image(*a, **k):
        raise AssertionError("the image tower ran before the refusal")

    monkeypatch.setattr(model, "image_features", no_image)
    for ids, what, k in ((single, "100 ids: 99 text tokens + the image's 16 tokens in place of its one placeholder = "
                                  "115 tokens", 29),
                         (expanded, "100 ids: 84 text tokens + 16 placeholders holding the image's tokens", 44)):
        with pytest.raises(ValueError, match=re.escape(f"the prompt ({what}) plus max_new_tokens ({k}) exceed the "
                                                       f"language model's context of 143 tokens")):
            model.generate(ids, x, max_new_tokens=k)


def test_default_eos_is_the_language_models_and_an_empty_list_never_stops():
    torch.manual_seed(0)
    model = vitlab.create_model("llava_tiny").eval()
    x, ids = torch.randn(2, 3, 32, 32), _prompt()
    free = model.generate(ids, x, max_new_tokens=8, eos_token_id=[])
    assert free.shape == (2, 8)
    model.language_model.config.eos_token_id = eos = int(free[0, 2])
    stopped = model.generate(ids, x, max_new_tokens=8, pad_token_id=PAD)
    assert stopped[0, :3].tolist() == free[0, :3].tolist() and (stopped[0, 3:] == PAD).all()
    # the language model alone defaults the same way, on the merged prompt
    embeds, _, _ = model.merge(ids, x)
    assert torch.equal(model.language_model.generate(inputs_embeds=embeds, max_new_tokens=8, pad_token_id=PAD),
                       stopped)
    assert torch.equal(model.generate(ids, x, max_new_tokens=8, eos_token_id=eos, pad_token_id=PAD), stopped)
