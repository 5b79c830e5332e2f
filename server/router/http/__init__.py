"""`warmfleet route`, the OpenAI-compatible HTTP front door: FastAPI app, streaming relay, uvicorn transport, CLI."""
