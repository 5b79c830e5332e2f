"""OpenAI-compatible HTTP API of one replica (FastAPI) and `warmfleet serve`; never imports paddle."""
