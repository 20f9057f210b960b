"""The simulator as a search evaluator: Policy -> Evaluation (compile, validate nothing, simulate)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tinypipe.common.errors import TinypipeError
from tinypipe.describe.hardware import HOST, Hardware
from tinypipe.describe.model import ModelSpec
from tinypipe.describe.trace import ProfileTrace, trace_for
from tinypipe.policy import Policy
from tinypipe.policy.lora_spec import lora_text
from tinypipe.search.policy_search import Evaluation
from tinypipe.sim.guard import simulate_policy


@dataclass(frozen=True)
class SimEvaluator:
    """Picklable, so a process pool can run it; `iterations` compiled and simulated per candidate."""

    model: ModelSpec
    hardware: Hardware
    seq_len: int
    gpu_mem_bytes: int | None = None
    host_mem_bytes: int | None = None
    iterations: int = 2
    profiles: tuple[ProfileTrace, ...] = ()  # measured traces (`--profile`), used before the shipped ones
    dtype: str = "bf16"  # compute dtype (a trace must match it)
    # each (microbatch size, LoRA)'s trace, found once (one object, so sim.guard's cache recognises it)
    _traces: dict[tuple[int, str], ProfileTrace] = field(default_factory=dict, compare=False, repr=False)

    def __call__(self, policy: Policy) -> Evaluation:
        lora = lora_text(policy.lora)
        trace = self._traces.get((policy.microbatch_size, lora))
        if trace is None:
            trace = self._traces[(policy.microbatch_size, lora)] = trace_for(
                self.model, self.hardware.gpus[0], microbatch_size=policy.microbatch_size, seq_len=self.seq_len,
                dtype=self.dtype, profiles=self.profiles, lora=lora)
        try:
            _, res = simulate_policy(policy, self.model, self.hardware, trace, iterations=self.iterations,
                                     gpu_mem_bytes=self.gpu_mem_bytes, host_mem_bytes=self.host_mem_bytes)
        except TinypipeError as exc:
            return Evaluation(policy, False, why=str(exc))
        gpu_short = max((res.peak_bytes[d] - res.capacity_bytes[d] for d in res.peak_bytes if d != HOST),
                        default=0)
        host_short = res.peak_bytes.get(HOST, 0) - res.capacity_bytes.get(HOST, 0)
        return Evaluation(policy, res.fits, tokens_per_s=res.tokens_per_s, iteration_s=res.iteration_s,
                          peak_gpu_bytes=res.peak_gpu_bytes, peak_host_bytes=res.peak_host_bytes,
                          why=res.violation or "", gpu_short_bytes=max(0, gpu_short),
                          host_short_bytes=max(0, host_short))
