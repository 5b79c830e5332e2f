"""warmfleet's Kubernetes operator. Its rooms, read in data-flow order, live in the top-level operator/ folder, each
mapped by setup.py: spec/ (the InferenceService), planning/ (pure), passes/ (I/O), wiring/ (kopf and the CLI)."""
