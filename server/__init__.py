"""warmfleet server: engine, API, router, multimodal and models; import `warmfleet.server`."""
