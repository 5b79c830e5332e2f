"""PEFT LoRA adapters on the decoder's projections: reading and checking the files, device slots, per-row deltas.

    y = x W (+ b)                                   every row (the base projection)
    y[rows of slot s] += (x[rows] A_sᵀ) (B_sᵀ · scale_s)   per adapter slot present in the step

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` as PEFT writes them.
Supported: LoRA on q/k/v/o/gate/up/down_proj of the language model, rank `r`, `lora_alpha`, rsLoRA
(scale alpha/sqrt(r), else alpha/r). Anything else (DoRA, modules_to_save, bias != "none", rank or
alpha patterns, other targets such as the vision tower or embeddings) is refused with one error,
never silently ignored. A step without adapter rows costs the base path one attribute check per
projection (`LoraState.step` is None).
"""

from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTN_TARGETS + MLP_TARGETS
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT settings that change the arithmetic beyond plain LoRA: refused when set
_OTHER_METHODS = ("trainable_token_indices", "layer_replication", "target_parameters", "alora_invocation_tokens",
                  "use_qalora", "use_bdlora")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(TARGETS) + r")\.lora_([AB])\.weight$")


@dataclass
class LoraWeights:
    """One adapter in host memory (numpy, float32)."""

    name: str
    rank: int
    scale: float  # alpha / r, or alpha / sqrt(r) with rsLoRA
    # (layer index, module name) -> (A [r, in], B [out, r])
    tensors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.tensors.values())


def read_config(path: str | Path, max_rank: Optional[int] = None) -> tuple[int, float]:
    """(rank, scale) of a PEFT adapter directory; ValueError naming the first unsupported setting."""
    d = Path(path)
    cfg_path = d / CONFIG_FILE
    if not cfg_path.is_file() or not (d / WEIGHTS_FILE).is_file():
        raise ValueError(f"{d} is not a PEFT adapter directory: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    problems = []
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"peft_type {cfg.get('peft_type')!r} (only LORA)")
    if cfg.get("use_dora"):
        problems.append("use_dora (DoRA)")
    if cfg.get("modules_to_save"):
        problems.append(f"modules_to_save {cfg['modules_to_save']}")
    if cfg.get("bias", "none") != "none":
        problems.append(f"bias {cfg['bias']!r} (only 'none')")
    if cfg.get("lora_bias"):
        problems.append("lora_bias")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            problems.append(f"{key} (one rank and alpha for every module)")
    for key in _OTHER_METHODS:
        if cfg.get(key):
            problems.append(key)
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        other = sorted(set(targets) - set(TARGETS))
        if other:
            problems.append(f"target modules {other} (supported: {', '.join(TARGETS)})")
    rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    if rank < 1:
        problems.append(f"r {rank}")
    if problems:
        raise ValueError(f"unsupported LoRA adapter {d}: " + "; ".join(problems))
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"LoRA adapter {d} has rank {rank}, above --max-lora-rank {max_rank}")
    return rank, alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def load_adapter(name: str, path: str | Path, max_rank: Optional[int] = None) -> LoraWeights:
    """Read and check an adapter's config and tensors into host memory."""
    from safetensors.numpy import load_file

    rank, scale = read_config(path, max_rank)
    weights = LoraWeights(name, rank, scale)
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in load_file(str(Path(path) / WEIGHTS_FILE)).items():
        m = _KEY.search(key)
        if m is None or "visual" in key:
            raise ValueError(f"unsupported LoRA adapter {path}: tensor {key} is not LoRA A/B of a language-model "
                             f"projection ({', '.join(TARGETS)})")
        parts.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value.astype(np.float32)
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {path}: layer {layer} {module} has A {list(a.shape)}, B {list(b.shape)}; "
                             f"rank {rank} needs A [{rank}, in] and B [out, {rank}]")
        weights.tensors[(layer, module)] = (a, b)
    if not weights.tensors:
        raise ValueError(f"LoRA adapter {path} has no LoRA tensors")
    return weights


@dataclass
class LoraStep:
    """Which rows of one step use which adapter slot (rows of base requests appear in no group).

    A projection sees either the step's T rows or, in the last layer after attention, the N rows that
    sample; with T == N every request has one row and samples, so both are the same rows in order.
    """

    num_rows: int  # T
    groups: list[tuple[int, object, Optional[object]]]  # (slot, int64 rows of T, int64 rows of N or None)

    @classmethod
    def build(cls, spans: Sequence[tuple[Optional[int], int, bool]]) -> Optional["LoraStep"]:
        """spans: (slot or None, rows, samples) per scheduled request in row order; None if no slot is used."""
        import paddle

        rows: dict[int, list[int]] = {}
        sampled: dict[int, list[int]] = {}
        t = n = 0
        for slot, num, samples in spans:
            if slot is not None:
                rows.setdefault(slot, []).extend(range(t, t + num))
                if samples:
                    sampled.setdefault(slot, []).append(n)
            t += num
            n += bool(samples)
        if not rows:
            return None
        tensor = lambda v: paddle.to_tensor(np.asarray(v, dtype=np.int64))  # noqa: E731
        return cls(t, [(s, tensor(r), tensor(sampled[s]) if s in sampled else None) for s, r in rows.items()])


class LoraLinear:
    """The adapter slots of one projection: slot -> (Aᵀ [in, r], Bᵀ·scale [r, out]) device tensors."""

    def __init__(self, state: "LoraState", in_features: int, out_features: int):
        self.state = state
        self.in_features, self.out_features = in_features, out_features
        self.slots: dict[int, tuple] = {}

    def applies(self) -> bool:
        """Whether an adapter of the running step has weights on this projection (else the base path runs)."""
        return any(slot in self.slots for slot, _, _ in self.state.step.groups)

    def forward(self, linear, x, other=None):
        """linear(x) with this step's deltas added before the packed epilogue (silu, or × other)."""
        import paddle
        import paddle.nn.functional as F

        y = linear.project(x)
        step = self.state.step
        all_rows = x.shape[0] == step.num_rows
        for slot, rows_t, rows_n in step.groups:
            ab = self.slots.get(slot)
            rows = rows_t if all_rows else rows_n
            if ab is None or rows is None:
                continue
            delta = paddle.matmul(paddle.matmul(paddle.gather(x, rows), ab[0]), ab[1])
            y = paddle.index_add(y, rows, 0, delta)
        if linear.packed is not None and linear.epilogue == "silu":
            return F.silu(y)
        if linear.packed is not None and linear.epilogue == "mul":
            return y * other
        return y


class LoraState:
    """A model's adapter slots (`put`/`drop`) and, while a step runs, its rows per slot (`stepping`)."""

    def __init__(self, model, num_slots: int):
        self.num_slots = num_slots
        self.step: Optional[LoraStep] = None
        self.linears: dict[tuple[int, str], LoraLinear] = {}
        for i, layer in enumerate(model.model.layers):
            for module in TARGETS:
                linear = getattr(layer.self_attn if module in ATTN_TARGETS else layer.mlp, module)
                linear.lora = self.linears[(i, module)] = LoraLinear(self, linear.in_features, linear.out_features)

    def check(self, weights: LoraWeights) -> None:
        """ValueError unless every tensor of `weights` fits a projection of this model."""
        for (layer, module), (a, b) in weights.tensors.items():
            lin = self.linears.get((layer, module))
            if lin is None:
                raise ValueError(f"LoRA adapter {weights.name}: the model has no layer {layer}")
            if a.shape[1] != lin.in_features or b.shape[0] != lin.out_features:
                raise ValueError(f"LoRA adapter {weights.name}: layer {layer} {module} is {a.shape[1]} -> {b.shape[0]}, "
                                 f"the model's is {lin.in_features} -> {lin.out_features}")

    def put(self, slot: int, weights: LoraWeights) -> None:
        """Copy an adapter into device slot `slot` (replacing what it held)."""
        import paddle

        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside 0..{self.num_slots - 1}")
        self.check(weights)
        self.drop(slot)
        for key, (a, b) in weights.tensors.items():
            self.linears[key].slots[slot] = (paddle.to_tensor(np.ascontiguousarray(a.T)),
                                             paddle.to_tensor(np.ascontiguousarray((b * np.float32(weights.scale)).T)))

    def drop(self, slot: int) -> None:
        for lin in self.linears.values():
            lin.slots.pop(slot, None)

    @contextmanager
    def stepping(self, step: Optional[LoraStep]) -> Iterator[None]:
        """Projections add `step`'s deltas inside the block (none when `step` is None)."""
        self.step = step
        try:
            yield
        finally:
            self.step = None
