"""Per-replica time-to-first-token models fitted online from the replicas' own first tokens; pure, no I/O.

    TTFT(r) ~ s_r * (a + b * prefill_tokens + c * load)

`prefill_tokens` is the prompt work the request waits for on r: the uncached prompt tokens the routers had queued
there (requests still awaiting their first token) plus its own uncached tokens; `load` the requests in flight or
queued there. Each sample is one streamed request's send-to-first-byte time on the replica that answered, with the
figures as they were when it was sent.

One shape (a, b, c) for the fleet, one factor s_r per replica: the engine's costs have the same form everywhere,
and what differs between node pools (an H200 beside an L4) is mostly a factor. The shape is least squares over
exponentially decayed samples, each divided by its replica's factor; s_r is the decayed sum of r's TTFTs over the
decayed sum of what the shape predicted for them. A replica's own three-coefficient fit was tried first and
measured worse: identical replicas fitted fixed costs 17-123 ms apart and per-token costs 1.4x apart (noise the
policy then routed on: 60x more load spills on the Mooncake trace; docs/scale.md). Every coefficient is kept
non-negative (b > 0) when read, so a noisy fit never makes more queued work look faster, and factors within
`alike` of 1 (the estimate's noise) read as 1.

The router fits these models even when the policy does not score by them (no `--ttft-model-samples`) when it
follows node tiers: the fitted slope per prefill token is what a node-tier copy saves (`prefill_s_per_token`).

Until the shape has `min_samples` samples there is no model and the policy keeps its fixed weights; a replica
with fewer than `OWN_SAMPLES` of its own has factor 1 (a joiner starts from its fleet's figures). Images have no
term of their own: their placeholder tokens are prefill like any other (the encoder's share is what the fixed
`encoder_weight` credits for encoder-cache hits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

NUM_FEATURES = 3  # 1, prefill tokens / TOKEN_UNIT, load
TOKEN_UNIT = 1000.0  # prefill tokens enter the fit in thousands (features of like scale condition it)
MIN_B = 1e-9  # seconds per prefill token: the floor that keeps b_r > 0
OWN_SAMPLES = 16  # a replica's own first tokens before its factor departs from 1
CLIP = 4.0  # a sample counts at most this many times above (or below) its prediction
# factors within this of 1 read as 1: ~45 heavy-tailed samples put one of 64 identical replicas at 0.84, and a
# factor off 1 moves that replica's caps (policy.capacity_caps); node pools differ by 2-10x, not by 25 %
ALIKE = 0.25


class Fit:
    """Least squares of y on x over exponentially decayed samples (weight `forget`^age), with a small ridge, so a
    direction no sample excites (a replica whose load is always 0) stays at 0 instead of at whatever one odd
    sample says; solved when read (3 x 3), not per sample."""

    __slots__ = ("xx", "xy", "forget", "n", "ridge", "_w")

    def __init__(self, forget: float, ridge: float = 1e-3):
        self.xx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self.xy = [0.0] * NUM_FEATURES
        self.forget, self.ridge, self.n = forget, ridge, 0
        self._w: Optional[list[float]] = None

    def update(self, x: tuple[float, ...], y: float) -> None:
        lam = self.forget
        for i in range(NUM_FEATURES):
            row, xi = self.xx[i], x[i]
            for j in range(NUM_FEATURES):
                row[j] = lam * row[j] + xi * x[j]
            self.xy[i] = lam * self.xy[i] + xi * y
        self.n += 1
        self._w = None

    def weights(self) -> list[float]:
        if self._w is None:
            a = [[self.xx[i][j] + (self.ridge if i == j else 0.0) for j in range(NUM_FEATURES)] + [self.xy[i]]
                 for i in range(NUM_FEATURES)]
            for col in range(NUM_FEATURES):  # Gauss-Jordan with partial pivoting (positive definite: never 0)
                piv = max(range(col, NUM_FEATURES), key=lambda r: abs(a[r][col]))
                a[col], a[piv] = a[piv], a[col]
                for r in range(NUM_FEATURES):
                    if r != col and a[r][col]:
                        k = a[r][col] / a[col][col]
                        a[r] = [v - k * u for v, u in zip(a[r], a[col])]
            self._w = [a[i][NUM_FEATURES] / a[i][i] for i in range(NUM_FEATURES)]
        return self._w


@dataclass(frozen=True, slots=True)
class Coefficients:
    """A fitted model: seconds of fixed cost, per prefill token, per request of load (all >= 0, per_token > 0)."""

    fixed_s: float
    per_token_s: float
    per_load_s: float

    def predict(self, prefill_tokens: float, load: float) -> float:
        return self.fixed_s + self.per_token_s * prefill_tokens + self.per_load_s * load


def _coefficients(fit: Fit) -> Coefficients:
    a, b, c = fit.weights()
    return Coefficients(max(0.0, a), max(MIN_B, b / TOKEN_UNIT), max(0.0, c))


class TtftModels:
    """The fleet's shape and every replica's factor; `observe` per sample, `coefficients` per decision."""

    def __init__(self, min_samples: int = 64, forget: float = 0.995, alike: float = ALIKE):
        self.min_samples, self.forget, self.alike = min_samples, forget, alike
        self.shape = Fit(forget)
        self.sums: dict[str, list] = {}  # rid -> [decayed sum of its TTFTs, of the shape's predictions, samples]
        self.median = 1.0  # the median replica's raw factor: the unit the others are read against
        self._cache: dict[str, Optional[Coefficients]] = {}  # read per candidate per decision: one lookup

    def observe(self, rid: str, prefill_tokens: int, load: float, ttft_s: float) -> None:
        """One streamed request's first token on `rid`, `ttft_s` after it was sent with those figures."""
        if ttft_s < 0:
            return
        x = (1.0, prefill_tokens / TOKEN_UNIT, float(load))
        f = self.sums.get(rid)
        if f is None:
            f = self.sums[rid] = [0.0, 0.0, 0]
        if self.shape.n >= self.min_samples:  # a factor needs a shape to compare with
            predicted = _coefficients(self.shape).predict(prefill_tokens, load)
            # one stalled step (a 5 s first token where 30 ms was due) must not drag the fit: a sample counts at
            # most CLIP x what the replica's model predicted; a replica that really slows down gets there in steps
            expected = predicted * self.factor(rid)
            ttft_s = min(max(ttft_s, expected / CLIP), expected * CLIP)
            lam = self.forget
            f[0] = lam * f[0] + ttft_s
            f[1] = lam * f[1] + predicted
            f[2] += 1
            if f[2] % OWN_SAMPLES == 0:  # the unit moves slowly: re-read it now and then, not per sample
                raws = sorted(r for r in map(self._raw, self.sums) if r is not None)
                self.median = raws[(len(raws) - 1) // 2] if raws else 1.0
        self.shape.update(x, ttft_s / self.factor(rid))
        self._cache.clear()

    def _raw(self, rid: str) -> Optional[float]:
        f = self.sums.get(rid)
        return f[0] / f[1] if f is not None and f[2] >= OWN_SAMPLES and f[1] > 0 else None

    def relative(self, rid: str) -> float:
        """How much slower than the fleet's median replica `rid` answers (within `alike` of 1, or unknown: 1)."""
        raw = self._raw(rid)
        if raw is None:
            return 1.0
        k = raw / self.median
        return 1.0 if abs(k - 1.0) <= self.alike else k

    def factor(self, rid: str) -> float:
        """`rid`'s factor on the shape: the median's, times its own relative to it."""
        return self.median * self.relative(rid)

    def coefficients(self, rid: str) -> Optional[Coefficients]:
        """`rid`'s model: the shape times its factor; None while the shape has too few samples."""
        try:
            return self._cache[rid]
        except KeyError:
            pass
        out = None
        if self.shape.n >= self.min_samples:
            c, k = _coefficients(self.shape), self.factor(rid)
            out = Coefficients(c.fixed_s * k, c.per_token_s * k, c.per_load_s * k)
        self._cache[rid] = out
        return out

    def prefill_s_per_token(self) -> Optional[float]:
        """Seconds the fleet's median replica takes per prefill token (the shape's slope times the median factor):
        what a prompt token costs to recompute, which prices a node-tier block (pricing.py); None until fitted."""
        if self.shape.n < self.min_samples:
            return None
        return _coefficients(self.shape).per_token_s * self.median

    def fitted(self, rids: Iterable[str]) -> Optional[dict]:
        """The scorer's seam: rid -> its model for every replica of a decision (policy.choose scores by predicted
        TTFT with them); None while the shape has too few samples (the policy's fixed weights then)."""
        if self.shape.n < self.min_samples:
            return None
        return {rid: self.coefficients(rid) for rid in rids}

    def describe(self, rid: str) -> Optional[dict]:
        """The replicas view's entry: the model used for `rid`, its slowdown against the median replica and the
        samples its factor has."""
        c = self.coefficients(rid)
        if c is None:
            return None
        f = self.sums.get(rid)
        return {"fixed_ms": round(c.fixed_s * 1e3, 3), "per_1k_prefill_tokens_ms": round(c.per_token_s * 1e6, 3),
                "per_request_of_load_ms": round(c.per_load_s * 1e3, 3), "slowdown": round(self.relative(rid), 3),
                "samples": f[2] if f else 0}
