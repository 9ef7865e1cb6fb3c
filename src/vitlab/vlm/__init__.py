"""Vision-language models: BLIP (Li et al., 2022) and LLaVA (Liu et al., 2023; LLaVA-1.5), built from vitlab's image
models and the Llama decoder, loading transformers' checkpoints.

    import vitlab
    vitlab.list_models(task=["caption", "blip"])      # blip_*, llava15_7b, llava_tiny, llava_scenes
    llava = vitlab.create_model("llava_tiny")          # or checkpoint_path=a LlavaForConditionalGeneration directory
    logits, loss = llava(input_ids, pixel_values, attention_mask=None, labels=labels)
    new_tokens = llava.generate(input_ids, pixel_values, max_new_tokens=32)
    blip = vitlab.create_model("blip_base")            # ITC + ITM + captioning
    losses = blip.losses(pixel_values, input_ids, attention_mask)   # {"itc", "itm", "lm", "loss"}
    caption_ids = blip.generate_caption(pixel_values, max_new_tokens=30)
    llava = vitlab.vlm.llava.LLaVA.from_pretrained(DIR)  # any transformers LLaVA / BLIP directory, its own sizes

The interface the training tasks use (registered model task ``caption`` for LLaVA and BLIP's captioner, ``blip``
for BLIP with ITC / ITM):

- :class:`~vitlab.vlm.llava.LLaVA` -- parts ``vision_tower``, ``projector``, ``language_model`` (freeze by name);
  ``forward(input_ids, pixel_values=None, attention_mask=None, labels=None) -> LlavaOutput(logits, loss)`` (a
  named tuple: ``out.logits`` or ``logits, loss = out``; ``labels`` aligned with ``input_ids``, -100 unscored;
  the loss is the mean next-token cross-entropy); ``generate(input_ids, pixel_values=None, max_new_tokens=32,
  temperature=0.0, top_k=None, top_p=None, eos_token_id=None, *, attention_mask=None, pad_token_id=None,
  generator=None, on_token=None) -> (B, n_new)`` new tokens. Each prompt holds ``image_token_id`` once (widened
  into the image's ``num_image_tokens`` tokens: the logits are T - 1 positions longer than ``input_ids``, right
  after the placeholder) or T times (overwritten in place). ``create_model(name, vocab_size=..., image_token_id=...,
  img_size=..., max_seq_len=TEXT_TOKENS)`` sizes it for a tokenizer.
- :class:`~vitlab.vlm.blip.BLIP` -- parts ``vision_tower``, ``text_encoder`` (ITC / ITM), ``text_decoder`` and
  ``lm_head`` (captioning), ``vision_proj`` / ``text_proj`` / ``temp`` (ITC), ``itm_head``;
  ``losses(pixel_values, input_ids, attention_mask=None, *, image_ids=None, prompt_length=0, generator=None)
  -> {"itc", "itm", "lm", "loss"}`` (the heads it has; ``input_ids`` start with [CLS]); ``forward(pixel_values,
  input_ids, attention_mask=None, labels=None) -> (logits, loss)`` (captioning, ids starting with [DEC]);
  ``caption_labels(input_ids, attention_mask, prompt_length) -> (decoder ids, labels)``;
  ``generate_caption(pixel_values, input_ids=None, max_new_tokens=30, temperature=0.0, top_k=None, top_p=None,
  generator=None) -> (B, prompt + new)`` ids; ``itc_scores`` / ``itm_scores(pixel_values, input_ids,
  attention_mask)``.

Modules: ``blip``, ``llava`` (the models and their transformers key maps), ``model_configs`` (the registered
configurations, imported by the registry on demand), ``data`` / ``tasks`` / ``metrics`` (training and scoring).
CLIP's ViT image tower and its transformers key map are in :mod:`vitlab.models.clip_vit`.
"""
