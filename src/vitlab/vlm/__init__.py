"""Vision-language models: BLIP (Li et al., 2022) and LLaVA (Liu et al., 2023)."""
