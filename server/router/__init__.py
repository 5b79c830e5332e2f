"""Cache-affinity router (`warmfleet route`): index of replicas' KV blocks, scoring policy, streaming proxy."""
