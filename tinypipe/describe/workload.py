"""Workload: what is trained, the model, sequence length, batch, LoRA adapters, optimizer state and traces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.policy import Policy
from tinypipe.policy.lora_spec import LoraSpec, lora_text
from tinypipe.policy.modes import OptimizerState

from .hardware import GPU
from .model import ModelSpec
from .trace import ProfileTrace, trace_for


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A training workload, typed once where a command line is read. The optional fields override what a
    policy says (None: the policy's own): `batch_tokens` sets each policy's microbatch count."""

    model: ModelSpec
    seq_len: int  # tokens per sequence
    batch_tokens: int | None = None  # tokens per optimizer step (None: each policy's own)
    microbatches: int | None = None
    microbatch_size: int | None = None  # sequences per microbatch
    optimizer_state: OptimizerState | None = None  # how the host holds AdamW's moments
    lora: LoraSpec | None = None  # adapters on a frozen base (None: every parameter trains)
    dtype: str = "bf16"  # compute dtype (a trace must match it)
    profiles: tuple[ProfileTrace, ...] = ()  # measured traces (`--profile`), used before the shipped ones

    def __post_init__(self) -> None:
        if self.seq_len > self.model.max_seq_len:
            raise InputError(f"--seq-len {self.seq_len}: {self.model.name} handles at most "
                             f"{self.model.max_seq_len:,} positions")

    @property
    def batch_sequences(self) -> int:
        """Sequences per optimizer step: `batch_tokens` over `seq_len` (0 without a batch)."""
        return (self.batch_tokens or 0) // self.seq_len

    def policy(self, base: Policy) -> Policy:
        """`base` with this workload's overrides: microbatches, microbatch size, optimizer state, LoRA, and the
        microbatch count that makes `batch_tokens`; InputError when the batch is not whole microbatches."""
        changes: dict[str, Any] = {k: v for k, v in (("microbatches", self.microbatches),
                                                     ("microbatch_size", self.microbatch_size),
                                                     ("optimizer_state", self.optimizer_state)) if v}
        policy = base.replace(**changes) if changes else base
        if self.lora is not None:
            policy = policy.replace(lora=self.lora)
        if self.batch_tokens is not None:  # one workload for every policy: its microbatch count follows
            per_mb = policy.microbatch_size * self.seq_len
            if self.batch_tokens % per_mb:
                raise InputError(f"--batch-tokens {self.batch_tokens}: not a multiple of policy {policy.name!r}'s "
                                 f"microbatch ({policy.microbatch_size} sequence(s) x {self.seq_len} tokens = "
                                 f"{per_mb})")
            policy = policy.replace(microbatches=self.batch_tokens // per_mb)
        return policy

    def trace(self, policy: Policy, gpu: GPU) -> ProfileTrace:
        """The trace `policy` runs this workload with on `gpu`: a measured one of `profiles` first (`trace_for`)."""
        return trace_for(self.model, gpu, microbatch_size=policy.microbatch_size, seq_len=self.seq_len,
                         dtype=self.dtype, profiles=self.profiles, lora=lora_text(policy.lora))
