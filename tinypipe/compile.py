"""Compile a Policy for a model on hardware into a Schedule, as small list-to-list passes.

compute_plan -> swap_pass -> transfer_pass -> gradient_pass -> optimizer_pass -> memory_pass ->
lower. Every pass keeps one invariant: the list is a topological order of the dependencies, and
the list filtered by resource is that resource's execution order (docs/schedule-contract.md). A
pass inserts new ops next to the op they serve (a LOAD just before its first use, an EVICT just
after its last), so stream orders follow need and the final ids point dependencies backwards.
"""

from __future__ import annotations

from tinypipe.cost import CostModel, Workload, workload
from tinypipe.errors import InputError
from tinypipe.hardware import Hardware
from tinypipe.model import DTYPE_BYTES, ModelSpec
from tinypipe.ops import Op, Plan, lower
from tinypipe.passes import compute_plan, gradient_pass, memory_pass, optimizer_pass, swap_pass, transfer_pass
from tinypipe.policy.policy import Policy
from tinypipe.policy.resolve import residency, resolve
from tinypipe.schedule import Action, Schedule
from tinypipe.trace import ProfileTrace

# Iterations `tinypipe run` compiles and executes per window (backends/worker.py; fewer when the run has
# fewer steps): overlap between iterations is kept inside a window, and the window repeats.
WINDOW_ITERATIONS = 4

PASSES = (swap_pass, transfer_pass, gradient_pass, optimizer_pass, memory_pass)

__all__ = ["PASSES", "WINDOW_ITERATIONS", "Op", "Plan", "compile_schedule", "compute_plan", "gradient_pass", "lower",
           "make_plan", "memory_pass", "optimizer_pass", "run_passes", "swap_pass", "transfer_pass"]

def run_passes(plan: Plan) -> tuple[Action, ...]:
    """compute_plan, then every pass in PASSES, then lower."""
    ops = compute_plan(plan)
    for p in PASSES:
        ops = p(plan, ops)
    return lower(ops)


# ---- the entry point ----------------------------------------------------------------------------

def make_plan(policy: Policy, model: ModelSpec, hardware: Hardware, trace: ProfileTrace, *,
              iterations: int = 3, cost: CostModel | None = None) -> tuple[Plan, Workload]:
    """Check the policy against the model, pack, map and choose residency: the passes' input."""
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise InputError(f"iterations must be an integer >= 1; got {iterations!r}")
    if policy.microbatch_size != trace.microbatch_size:
        raise InputError(f"policy {policy.name!r}: microbatch_size: {policy.microbatch_size} sequences, but "
                         f"the trace was profiled with {trace.microbatch_size}; use a matching trace")
    if not model.layers:
        raise InputError(f"model {model.name!r} has no layers")
    w = workload(policy, model, hardware, trace, cost=cost)
    sizes, mapping = resolve(policy, w, hardware, model_name=f"model {model.name!r}",
                            tied=model.tied_embeddings and len(model.layers) > 1)
    kept, pinned = residency(policy, w, sizes, mapping)
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    plan = Plan(
        pack_layers=tuple(tuple(range(a, a + k)) for a, k in zip(starts, sizes)), pack_gpu=mapping,
        microbatches=policy.microbatches, iterations=iterations, weight_bytes=w.weight_bytes,
        input_bytes=w.input_bytes, saved_bytes=tuple(trace.layer(x).saved_act_bytes for x in model.layers),
        workspace_bytes=tuple(trace.layer(x).workspace_bytes for x in model.layers),
        host_grad_bytes=tuple(x.gpu_params * DTYPE_BYTES[trace.dtype] for x in model.layers),
        master_bytes=tuple(x.params * 4 for x in model.layers),
        swap=policy.swap, prefetch_depth=policy.prefetch_depth, kept=kept, pinned=pinned,
        activation_home=policy.activation_home, optimizer=policy.optimizer, host_memory=policy.host_memory,
        recompute=policy.recompute, tied=model.tied_embeddings)
    return plan, w


def compile_schedule(policy: Policy, model: ModelSpec, hardware: Hardware, trace: ProfileTrace, *,
                     iterations: int = 3, cost: CostModel | None = None) -> Schedule:
    """Compile `policy` for `model` on `hardware` with timings from `trace` into a Schedule.

    A policy that cannot apply (pack sizes that do not sum to the layer count, a GPU that does not
    exist, more packs than layers, resident layers out of range) is an InputError naming the field.
    """
    plan, w = make_plan(policy, model, hardware, trace, iterations=iterations, cost=cost)
    return Schedule(
        actions=run_passes(plan), num_gpus=len(hardware.gpus), num_layers=plan.num_layers,
        iterations=iterations, microbatches=policy.microbatches,
        tokens_per_microbatch=trace.tokens_per_microbatch, recompute=policy.recompute,
        pack_layers=plan.pack_layers, pack_gpu=plan.pack_gpu, host_memory=policy.host_memory,
        compute_dtype=trace.dtype, static_bytes=(("host", w.host_static_bytes),),
        meta=(("model", model.name), ("hardware", hardware.name), ("policy", policy.name)))
