"""The node-tier block weight the policy scores with, and where it came from (flags, measured, fixed); no I/O.

A block a replica loads from its node tier saves recomputing it and costs a copy: it is worth 1 - copy / recompute
of a block already in its primary pool (policy.priced_copy_weight). Each figure comes from the first of:

    copy of one block       --node-tier-copy-s-per-block, else the median over the member replicas that measured
                            it (their Load events' `node_copy_s_per_block`: their node-tier client's get time per
                            KV block served, sent once they have loaded one; server/events.py)
    prefill of one token    --prefill-s-per-token, else the router's fitted TTFT slope per prefill token
                            (ttft.TtftModels.prefill_s_per_token, fitted from streamed first tokens)

With both known the weight is priced: source "flags" when both are flags, else "measured"; with either missing it
is the fixed --node-tier-weight ("fixed"). So a router or picker the operator renders without either flag starts
at the fixed weight and prices node-tier blocks once replicas have loaded from their tiers and 64 streamed first
tokens fitted the slope. The inputs are read again at most every `refresh_s` (on a decision or a scrape), never
per request: a decision reads the weight in effect.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .policy import priced_copy_weight
from .settings import PolicyConfig

REFRESH_S = 1.0  # seconds between two reads of the inputs (the replicas report every 0.25 s; the fit moves slowly)
FLAGS, MEASURED, FIXED = "flags", "measured", "fixed"


@dataclass(frozen=True)
class NodeTierPrice:
    """The node-tier weight in effect and its inputs (None: not known), as `/v1/router/replicas` shows them."""

    weight: float
    source: str  # FLAGS | MEASURED | FIXED
    copy_s_per_block: Optional[float] = None
    copy_from: Optional[str] = None  # "flag" | "replicas"
    prefill_s_per_token: Optional[float] = None
    prefill_from: Optional[str] = None  # "flag" | "ttft"
    replicas_reporting: int = 0  # member replicas that reported a measured copy cost

    def view(self) -> dict:
        return {"weight": round(self.weight, 4), "source": self.source,
                "copy_us_per_block": None if self.copy_s_per_block is None else round(self.copy_s_per_block * 1e6, 3),
                "copy_from": self.copy_from, "replicas_reporting": self.replicas_reporting,
                "prefill_us_per_token": (None if self.prefill_s_per_token is None
                                         else round(self.prefill_s_per_token * 1e6, 4)),
                "prefill_from": self.prefill_from}


def price(cfg: PolicyConfig, block_size: int, copies: Sequence[float],
          fitted_s_per_token: Optional[float]) -> NodeTierPrice:
    """The weight from the flags, else the replicas' measured `copies` (seconds per block) and the fitted prefill
    seconds per token (None: not fitted), else the fixed --node-tier-weight."""
    copy, copy_from = ((cfg.node_copy_s_per_block, "flag") if cfg.node_copy_s_per_block > 0
                       else (statistics.median(copies), "replicas") if copies else (None, None))
    prefill, prefill_from = ((cfg.prefill_s_per_token, "flag") if cfg.prefill_s_per_token > 0
                             else (fitted_s_per_token, "ttft") if fitted_s_per_token else (None, None))
    if copy is None or prefill is None:
        weight, source = cfg.node_weight, FIXED
    else:
        weight = priced_copy_weight(copy, prefill, block_size)
        source = FLAGS if copy_from == prefill_from == "flag" else MEASURED
    return NodeTierPrice(weight, source, copy, copy_from, prefill, prefill_from, len(copies))


class NodeTierPricing:
    """The price in effect, read again from `inputs()` -> (measured copies, fitted prefill s/token) at most every
    `refresh_s` seconds."""

    def __init__(self, cfg: PolicyConfig, block_size: int,
                 inputs: Callable[[], tuple[Sequence[float], Optional[float]]], refresh_s: float = REFRESH_S):
        self.cfg, self.block_size, self.inputs, self.refresh_s = cfg, block_size, inputs, refresh_s
        self._price = price(cfg, block_size, (), None)
        self._next = float("-inf")  # monotonic time of the next read

    def current(self, now: float) -> NodeTierPrice:
        """The price in effect at `now` (monotonic seconds), its inputs read again if `refresh_s` has passed."""
        if now >= self._next:
            self._next = now + self.refresh_s
            copies, fitted = self.inputs()
            self._price = price(self.cfg, self.block_size, copies, fitted)
        return self._price

    def weight(self, now: float) -> float:
        return self.current(now).weight
