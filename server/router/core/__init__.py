"""The router's core, shared by its front doors: members, KV index, policy, warm-up/drain, peers, dialects; no HTTP."""
