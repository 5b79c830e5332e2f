"""Images: SSRF-safe media loading, Qwen2-VL preprocessing, placeholder expansion, processor cache; no paddle."""
