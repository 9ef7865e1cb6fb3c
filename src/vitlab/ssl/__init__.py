"""Self-supervised pre-training (seed 001, section 21.3)."""
