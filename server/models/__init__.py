"""Model implementations (Qwen2, Llama, Qwen2-VL) in Paddle and checkpoint loading."""
