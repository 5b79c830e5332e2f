"""Tiny random Hugging Face checkpoints (text and VL) and seeded test pictures for tests, demos and benchmarks, and `warmfleet make-tiny-model`; uses models and multimodal, which never import it."""
