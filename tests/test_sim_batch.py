"""Policies simulated side by side in worker processes get what the Mobius guard gives each one alone."""

from __future__ import annotations

from typing import Any

from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.trace import trace_for
from tinypipe.policy import load_policy
from tinypipe.sim.batch import Task, simulate_policies
from tinypipe.sim.guard import simulate_policy


def _json(res: Any) -> dict[str, Any]:
    out = res.to_json()
    out.pop("wall_s")
    return dict(out)


def test_processes_give_what_the_guard_gives_one_policy_after_the_other() -> None:
    """Over two processes, each policy gets the partition and the simulation `simulate_policy` gives it alone,
    the Mobius pick weighed against its uniform partitions (tasks of their own) included; the timeline comes
    back only where asked. One GPU: the MILP closes its gap at once, so its partition is the same each time."""
    model, hw = load_model("llama-3.1-8b"), load_hardware("h200x1")
    tasks = []
    for i, name in enumerate(("mobius", "resident", "tinypipe")):
        policy = load_policy(name).replace(microbatches=4)
        trace = trace_for(model, hw.gpus[0], policy.microbatch_size, 2048, "bf16")
        tasks.append(Task(policy, model, hw, trace, 2, gpu_mem_bytes=24 << 30, timeline=i == 0))
    alone = [simulate_policy(t.policy, model, hw, t.trace, iterations=2, gpu_mem_bytes=24 << 30) for t in tasks]
    together = simulate_policies(tasks, workers=2)
    assert [s for s, _ in together] == [tuple(len(p) for p in sched.pack_layers) for sched, _ in alone]
    assert [_json(r) for _, r in together] == [_json(r) for _, r in alone]
    assert together[0][1].timeline.records == alone[0][1].timeline.records
    assert not together[1][1].timeline.records
