"""bench/scaleout.py's workload (seeded multi-turn token-id prompts) and the configurations it compares."""

from __future__ import annotations

import random

BLOCK = 16
SPEEDUP = 10.0  # the calibrated engine x10, as bench/trace_replay.py
PRESTOP_S = 1.0  # time between the router's drain notice and the replica's SIGTERM (a preStop sleep)
# config -> extra `warmfleet route` flags (None: no router, client-side round-robin)
CONFIG_FLAGS = {"warmfleet": [], "nowarm": ["--no-warmup"], "rr": None}
# variant -> router flags, the figure fed to the real `decide` as its queue, hit-ratio protection, scale-in choice
AUTOSCALERS = {
    "cache_aware": {"router": [], "metric": "queued_prefill_tokens", "protect_hit_ratio": True, "victim": "coldest"},
    "queue_only": {"router": ["--no-warmup"], "metric": "in_flight_requests", "protect_hit_ratio": False,
                   "victim": "newest"},
}



class Workload:
    """Endless seeded requests: token-id prompts with shared system prompts, growing conversations, a hot prefix."""

    def __init__(self, seed: int, tenants: int = 8, conversations: int = 48):
        self.rng = random.Random(seed)
        self.systems = [self.ids(256) for _ in range(tenants)]
        self.hot = self.ids(320)
        self.zipf = [1 / (i + 1) for i in range(tenants)]
        self.convs = [self.new_conv() for _ in range(conversations)]

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 1014) for _ in range(n)]

    def new_conv(self) -> dict:
        t = self.rng.choices(range(len(self.systems)), self.zipf)[0]
        return {"hist": list(self.systems[t]), "turns_left": self.rng.randint(3, 8), "tenant": t}

    def next(self) -> tuple[list[int], str]:
        """(prompt ids, cache salt)"""
        if self.rng.random() < 0.3:
            return self.hot + self.ids(16), "hot"
        k = self.rng.randrange(len(self.convs))
        c = self.convs[k]
        c["hist"] += self.ids(32)
        prompt = list(c["hist"])
        c["hist"] += self.ids(16)  # the answer joins the history
        c["turns_left"] -= 1
        if c["turns_left"] == 0:
            self.convs[k] = self.new_conv()
        return prompt, f"tenant-{c['tenant']}"

