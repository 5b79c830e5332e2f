"""Cache-affinity router: one core that decides, and the two front doors that ask it.

    core/   the decision, no HTTP server: settings (every flag), registry + discovery + fleet (membership,
            health, drain), subscriber + index (KV events → who holds which block), prompt (render,
            tokenize, hash as a replica does), engines/ (one dialect per engine kind), policy (score),
            lora (adapters per replica), warmup (warm-up and hand-off replays), peers (other routers' load),
            tenants (keys, salts, client limits), metrics, router (Router.route: the one decision entry
            point) and booking (the Booking it returns: the load one request books), runtime (what the flags
            build, started around a door)
    http/   `warmfleet route`: the OpenAI-compatible proxy (FastAPI app, relay, uvicorn transport, CLI)
    epp/    `warmfleet epp`: the Endpoint Picker of a Gateway API InferencePool (Envoy ext_proc over gRPC)
    status  the status and admin routes both doors serve

Each door calls core.runtime.running and Router.route, then reports what happened to its request's Booking;
nothing in core/ imports a door and the doors do not import each other (tests/test_layering.py checks it).
"""
