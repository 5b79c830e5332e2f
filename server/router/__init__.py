"""Cache-affinity router: one core that decides, and the front doors that ask it.

    core/   the decision, no HTTP server: settings (every flag), registry + discovery + fleet (membership,
            health, drain), subscriber + index (KV events → who holds which block), prompt (render,
            tokenize, hash as a replica does), engines/ (one dialect per engine kind), policy (score),
            warmup (warm-up and hand-off replays), peers (other routers' load), tenants (keys, salts,
            client limits), metrics, router (Router.route: the one decision entry point), runtime
            (what the flags build, started around a door)
    http/   `warmfleet route`: the OpenAI-compatible proxy (FastAPI app, relay, uvicorn transport, CLI)

A second front door (the gRPC Endpoint Picker) is one more folder beside http/ that calls core.runtime.running
and Router.route; nothing in core/ imports a front door (tests/test_router_core.py checks it).
"""
