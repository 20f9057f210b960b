"""Compile a Policy for a model on hardware into a Schedule, as small list-to-list passes.

compute_ops -> swap_pass -> transfer_pass -> gradient_pass -> optimizer_pass -> memory_pass ->
lower. Every pass keeps one invariant: the list is a topological order of the dependencies, and
the list filtered by resource is that resource's execution order (docs/schedule-contract.md). A
pass inserts new ops next to the op they serve (a LOAD just before its first use, an EVICT just
after its last), so stream orders follow need and the final ids point dependencies backwards.
"""

from __future__ import annotations

from dataclasses import replace

from tinypipe.common.errors import InputError
from tinypipe.common.gcpause import collector_paused
from tinypipe.compiler.ops import Op, lower
from tinypipe.compiler.optimizer import optimizer_pass
from tinypipe.compiler.passes import compute_ops, gradient_pass, memory_pass, swap_pass, transfer_pass
from tinypipe.describe.hardware import HOST, Hardware
from tinypipe.describe.model import ModelSpec
from tinypipe.describe.trace import ProfileTrace
from tinypipe.estimate.calibration import CostModel
from tinypipe.estimate.plan import Plan, base_plan
from tinypipe.ir.schedule import Action, Schedule
from tinypipe.partition.resolve import residency, resolve
from tinypipe.policy.policy import Policy

# Iterations `tinypipe run` compiles and executes per window (backends/rank/worker.py; fewer when the run has
# fewer steps, or `window_steps` cuts every window shorter): overlap between iterations is kept inside a
# window, and the window repeats.
WINDOW_ITERATIONS = 4


def window_steps(step: int, *, iterations: int, steps: int, every: tuple[int, ...] = ()) -> int:
    """Steps in `tinypipe run`'s window that starts at `step` (0-based): at most `iterations`, up to the run's
    `steps`, and ending at the next multiple of each period in `every` (checkpoint, save, evaluation every
    N steps; 0: none). `run` compiles `window_steps(0, ...)` iterations, so that its windows run the whole
    schedule (a replay needs one) and the prediction is of the windows that run."""
    n = min(iterations, steps - step)
    for period in every:
        if period > 0:
            n = min(n, period - step % period)
    return n

PASSES = (swap_pass, transfer_pass, gradient_pass, optimizer_pass, memory_pass)

__all__ = ["PASSES", "WINDOW_ITERATIONS", "Op", "compile_schedule", "compute_ops", "gradient_pass", "lower",
           "make_plan", "memory_pass", "optimizer_pass", "run_passes", "swap_pass", "transfer_pass", "window_steps"]

def run_passes(plan: Plan) -> tuple[Action, ...]:
    """compute_ops, then every pass in PASSES, then lower."""
    ops = compute_ops(plan)
    for p in PASSES:
        ops = p(plan, ops)
    return lower(ops)


# ---- the entry point ----------------------------------------------------------------------------

def make_plan(policy: Policy, model: ModelSpec, hardware: Hardware, trace: ProfileTrace, *,
              iterations: int = 3, cost: CostModel | None = None, grad_clip: bool = False,
              gpu_mem_bytes: int | None = None) -> Plan:
    """Check the policy against the model, pack, map and choose residency: the passes' input.
    `grad_clip`: clipping by the global gradient norm (`Plan.grad_clip`); `gpu_mem_bytes`: a cap on each GPU's
    memory (`--gpu-mem`), which the packers, the Mobius MILP and `auto` residency then plan for."""
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise InputError(f"iterations must be an integer >= 1; got {iterations!r}")
    if policy.microbatch_size != trace.microbatch_size:
        raise InputError(f"policy {policy.name!r}: microbatch_size: {policy.microbatch_size} sequences, but "
                         f"the trace was profiled with {trace.microbatch_size}; use a matching trace")
    if not model.layers:
        raise InputError(f"model {model.name!r} has no layers")
    base = base_plan(policy, model, hardware, trace, iterations=iterations, cost=cost, grad_clip=grad_clip)
    if gpu_mem_bytes is not None:
        base = replace(base, gpu_memory_bytes=tuple(min(m, gpu_mem_bytes) for m in base.gpu_memory_bytes))
    sizes, mapping = resolve(policy, base, hardware, model_name=f"model {model.name!r}",
                            tied=model.tied_embeddings and len(model.layers) > 1)
    kept, pinned = residency(policy, base, sizes, mapping)
    return base.with_packs(sizes, mapping, kept=kept, pinned=pinned)


def gpu_static_bytes(plan: Plan) -> tuple[tuple[str, int], ...]:
    """(device, bytes) each GPU holds all run: the adapters and AdamW state of its LoRA layers (none otherwise)."""
    per: dict[int, int] = {}
    for layer, g in enumerate(plan.owner):
        per[g] = per.get(g, 0) + plan.gpu_state_bytes[layer]
    return tuple((f"g{g}", b) for g, b in sorted(per.items()) if b)


def compile_schedule(policy: Policy, model: ModelSpec, hardware: Hardware, trace: ProfileTrace, *,
                     iterations: int = 3, cost: CostModel | None = None, grad_clip: bool = False,
                     gpu_mem_bytes: int | None = None) -> Schedule:
    """Compile `policy` for `model` on `hardware` with timings from `trace` into a Schedule.
    `grad_clip`: clipping by the global gradient norm (`optimizer.optimizer_pass`: the norm barrier);
    `gpu_mem_bytes`: plan for this much memory per GPU (`--gpu-mem`; `make_plan`).

    A policy that cannot apply (pack sizes that do not sum to the layer count, a GPU that does not
    exist, more packs than layers, resident layers out of range) is an InputError naming the field.
    """
    with collector_paused():  # tens of thousands of ops and actions, all kept (common/gcpause.py)
        plan = make_plan(policy, model, hardware, trace, iterations=iterations, cost=cost, grad_clip=grad_clip,
                         gpu_mem_bytes=gpu_mem_bytes)
        actions = run_passes(plan)
    return Schedule(
        actions=actions, grad_clip=plan.grad_clip, num_gpus=plan.num_gpus,
        num_layers=plan.num_layers,
        iterations=plan.iterations, microbatches=plan.microbatches,
        tokens_per_microbatch=trace.tokens_per_microbatch, recompute=plan.recompute,
        pack_layers=plan.pack_layers, pack_gpu=plan.pack_gpu, host_memory=plan.host_memory,
        optimizer=plan.optimizer, optimizer_state=plan.optimizer_state,
        compute_dtype=trace.dtype, lora=plan.lora,
        static_bytes=((HOST, plan.host_static_bytes), *gpu_static_bytes(plan)),
        meta=(("model", model.name), ("hardware", hardware.name), ("policy", policy.name)))
