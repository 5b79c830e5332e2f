"""Engine: block pool, KV cache manager, scheduler, model runner and the engine-core process."""
