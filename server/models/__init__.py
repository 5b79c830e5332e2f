"""Model implementations (Qwen2, Llama), checkpoint loading and the tiny random checkpoints for tests."""
