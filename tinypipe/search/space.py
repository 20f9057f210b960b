"""What the search is for and over: the target workload, the space of choices, an evaluation, the result."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tinypipe.describe.hardware import Hardware
from tinypipe.describe.model import ModelSpec
from tinypipe.describe.target import Target
from tinypipe.describe.trace import ProfileTrace
from tinypipe.describe.workload import Workload
from tinypipe.policy import Policy
from tinypipe.policy.lora_spec import LoraSpec
from tinypipe.policy.modes import (
    ActivationHome,
    HostMemory,
    MapperName,
    Mode,
    OptimizerMode,
    OptimizerState,
    PackerName,
    ResidentMode,
    SwapMode,
)
from tinypipe.search.prefer import BAND, Prefer


@dataclass(frozen=True)
class SearchTarget:
    """What is being searched for: a workload (with its global batch) on a target (hardware and its limits), the
    records the CLI builds; the properties read through to them."""

    workload: Workload
    target: Target

    @property
    def model(self) -> ModelSpec:
        return self.workload.model

    @property
    def hardware(self) -> Hardware:
        return self.target.hardware

    @property
    def seq_len(self) -> int:
        return self.workload.seq_len

    @property
    def batch_sequences(self) -> int:
        """Sequences per optimizer step (the global batch)."""
        return self.workload.batch_sequences

    @property
    def profiles(self) -> tuple[ProfileTrace, ...]:
        return self.workload.profiles

    @property
    def dtype(self) -> str:
        return self.workload.dtype

    @property
    def gpu_limit(self) -> int:
        return self.target.gpu_limit

    @property
    def host_memory(self) -> int:
        return self.target.host_memory

    @property
    def host_limit(self) -> int:
        return self.target.host_limit


@dataclass(frozen=True)
class Evaluation:
    """One candidate's simulated outcome (or why it could not be compiled)."""

    policy: Policy
    fits: bool
    tokens_per_s: float = 0.0
    iteration_s: float = float("inf")
    peak_gpu_bytes: int = 0
    peak_host_bytes: int = 0
    why: str = ""
    gpu_short_bytes: int = 0  # how far GPU memory falls short (0 when it fits)
    host_short_bytes: int = 0

    def key(self) -> tuple[Any, ...]:
        """Speed order: fitting first, tokens/s down, then peak GPU, peak host, the policy's text."""
        return (not self.fits, -self.tokens_per_s, self.peak_gpu_bytes, self.peak_host_bytes,
                json.dumps(self.policy.to_json(), sort_keys=True))

    def footprint_key(self) -> tuple[Any, ...]:
        """Footprint order among equals: peak GPU, peak host, then speed order."""
        return (self.peak_gpu_bytes, self.peak_host_bytes) + self.key()

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy.to_json(), "fits": self.fits, "tokens_per_s": self.tokens_per_s,
                "iteration_s": self.iteration_s, "peak_gpu_bytes": self.peak_gpu_bytes,
                "peak_host_bytes": self.peak_host_bytes, "why": self.why,
                "gpu_short_bytes": self.gpu_short_bytes, "host_short_bytes": self.host_short_bytes}


Evaluator = Callable[[Policy], Evaluation]


@dataclass(frozen=True)
class SearchSpace:
    """The choices searched. Stage 1: the first group; stage 2 refines over the second."""

    microbatch_sizes: tuple[int, ...] = (1, 2, 4)
    pack_sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    packers: tuple[PackerName, ...] = ("holistic", "mobius")
    swaps: tuple[SwapMode, ...] = (SwapMode.LAYER, SwapMode.PACK)
    recompute: tuple[bool, ...] = (True, False)
    activation_homes: tuple[ActivationHome, ...] = (ActivationHome.GPU, ActivationHome.HOST)
    mappings: tuple[MapperName, ...] = ("cross", "round-robin")
    prefetch_depths: tuple[int, ...] = (1, 2, 3)
    residents: tuple[ResidentMode, ...] = (ResidentMode.AUTO, ResidentMode.NONE)
    host_memories: tuple[HostMemory, ...] = (HostMemory.COMPACT, HostMemory.REPLICATED)
    # Only sync by default: async (staleness 1) changes the training semantics, so a user opts in.
    optimizers: tuple[OptimizerMode, ...] = (OptimizerMode.SYNC,)
    # How the host holds AdamW's moments, for every candidate: fp32 unless a user asks (it changes the
    # numerics); a low-precision one keeps only the compact layout (the only one that holds it).
    optimizer_state: OptimizerState = OptimizerState.FP32
    lora: LoraSpec | None = None  # every candidate trains these adapters on a frozen base

    def __post_init__(self) -> None:
        modes: dict[str, type[Mode]] = {"swaps": SwapMode, "activation_homes": ActivationHome,
                                        "residents": ResidentMode, "host_memories": HostMemory,
                                        "optimizers": OptimizerMode}
        for name, mode in modes.items():  # members, or their values
            object.__setattr__(self, name, tuple(mode.parse(v, f"search space: {name}") for v in getattr(self, name)))
        state = OptimizerState.parse(self.optimizer_state, "search space: optimizer_state")
        object.__setattr__(self, "optimizer_state", state)
        if not state.exact:
            object.__setattr__(self, "host_memories", (HostMemory.COMPACT,))


@dataclass
class SearchResult:
    """Every evaluation (ranked), what was pruned, and the winner (None when nothing fits)."""

    workload: SearchTarget
    ranked: list[Evaluation]
    pruned: int  # never evaluated: their lower bound exceeded the best time found
    considered: int
    rejected: int = 0  # not simulated: a memory bound showed they cannot fit
    advice: list[str] = field(default_factory=list)
    prefer: Prefer = Prefer.FOOTPRINT
    band: float = BAND

    @property
    def winner(self) -> Evaluation | None:
        return self.ranked[0] if self.ranked and self.ranked[0].fits else None

    @property
    def fastest(self) -> Evaluation | None:
        """The fastest fitting candidate (the winner under `Prefer.SPEED`)."""
        return min((e for e in self.ranked if e.fits), key=Evaluation.key, default=None)

    def pareto(self) -> list[Evaluation]:
        """Fitting evaluations not dominated in (tokens/s up, peak GPU down, peak host down)."""
        fit = [e for e in self.ranked if e.fits]
        front = [e for e in fit if not any(_dominates(o, e) for o in fit if o is not e)]
        seen: set[tuple[float, int, int]] = set()
        out = []
        for e in front:  # equal points: keep the best-ranked one
            k = (round(e.tokens_per_s, 6), e.peak_gpu_bytes, e.peak_host_bytes)
            if k not in seen:
                seen.add(k)
                out.append(e)
        return out


def _dominates(a: Evaluation, b: Evaluation) -> bool:
    ge = (a.tokens_per_s >= b.tokens_per_s and a.peak_gpu_bytes <= b.peak_gpu_bytes
          and a.peak_host_bytes <= b.peak_host_bytes)
    gt = (a.tokens_per_s > b.tokens_per_s or a.peak_gpu_bytes < b.peak_gpu_bytes
          or a.peak_host_bytes < b.peak_host_bytes)
    return ge and gt
