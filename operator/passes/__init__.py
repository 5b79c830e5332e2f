"""Room 3, the passes that do I/O (reconcile, autoscale, adapters, config.json reads, the API client); imports spec/ and planning/, never wiring/."""
