"""The simulator and the CPU backend keep one ledger (`tinypipe.ir.ledger.Ledger`) and agree on it.

Both apply a schedule's memory effects, allocs when an action starts and frees when it ends, to the
same ledger type. Run in the same order, they must report the same peak per GPU. The order is
pinned down by chaining the compiled schedule: each action also waits for the action before it in
the list and for the one before it on its rank, so the simulator runs the list strictly one action
at a time, and each rank of the backend runs its own actions in list order. (A RECV does not wait
for its SEND, which sits just before it: the two halves rendezvous.) The host is left out: each
rank's ledger holds the whole static host state plus its own gradient slots, and the simulator
holds it once.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from conftest import fixed_cpu_hardware  # noqa: E402
from test_interpreter import MBS, SEQ, K, compiled, job  # noqa: E402

from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.describe.hfconfig import load_model  # noqa: E402
from tinypipe.describe.trace import analytic_trace  # noqa: E402
from tinypipe.ir.schedule import (  # noqa: E402
    Kind,
    Schedule,
    owned_layers,  # noqa: E402
    resource_gpu,
)
from tinypipe.policy import PRESETS  # noqa: E402
from tinypipe.policy.lora_spec import LoraSpec  # noqa: E402
from tinypipe.sim import simulate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def chained(sched: Schedule) -> Schedule:
    """`sched` with every action also waiting for the previous action in the list (a RECV: for the one
    before its SEND) and for the previous action of its rank."""
    owner = {layer: g for g in range(sched.num_gpus) for layer in owned_layers(sched, g)}
    last_of: dict[int, int] = {}
    out = []
    for a in sched.actions:
        rank = owner[a.layer] if a.kind is Kind.OPT_STEP else resource_gpu(a.resource)
        extra = set()
        pair = a.kind.info.is_half and a.kind.info.stream == "recv" and sched.actions[a.id - 1].kind.info.is_half
        before = a.id - 2 if pair else a.id - 1
        if before >= 0:
            extra.add(before)
        if rank in last_of:
            extra.add(last_of[rank])
        last_of[rank] = a.id
        out.append(dataclasses.replace(a, deps=tuple(sorted(set(a.deps) | extra))))
    return dataclasses.replace(sched, actions=tuple(out), _by_resource=None)


@pytest.mark.parametrize(("policy", "lora"), [("tinypipe", None), ("mobius", None), ("tinypipe", LoraSpec(rank=2))])
def test_simulator_and_cpu_backend_ledgers_agree(policy: str, lora: LoraSpec | None) -> None:
    """Two GPUs, tiny-llama, 3 iterations: the backend's ledger peak of each rank's GPU equals the
    simulator's peak of that GPU, and the backend saw no double allocation or stray free (LoRA too: its
    adapters static on their GPU, no gradient accumulator, ADAPT_STEPs on the compute stream)."""
    p = PRESETS[policy].replace(packing=(1, 2, 1, 2), mapping=(0, 1, 0, 1), lora=lora)
    sched = chained(compiled("tiny-llama", p, 2))
    spec, hw = load_model("tiny-llama"), fixed_cpu_hardware(2)
    trace = analytic_trace(spec, hw.gpus[0], microbatch_size=MBS, seq_len=SEQ, dtype="fp32")
    sim = simulate(sched, spec, hw, trace)
    results = run_threads(job("tiny-llama", sched, K), 2)
    for r in results:
        assert not r.ledger_problems, r.ledger_problems[:3]
        assert r.ledger_peak[f"g{r.rank}"] == sim.peak_bytes[f"g{r.rank}"] > 0




@pytest.mark.parametrize("layout", ["compact", "replicated"])
def test_async_ledgers_agree_in_order(layout: str) -> None:
    """The async optimizer, chained: the backend's ledger peak of each GPU equals the simulator's."""
    p = PRESETS["tinypipe"].replace(packing=(1, 2, 1, 2), mapping=(0, 1, 0, 1), optimizer="async", host_memory=layout)
    sched = chained(compiled("tiny-llama", p, 2))
    spec, hw = load_model("tiny-llama"), fixed_cpu_hardware(2)
    trace = analytic_trace(spec, hw.gpus[0], microbatch_size=MBS, seq_len=SEQ, dtype="fp32")
    sim = simulate(sched, spec, hw, trace)
    for r in run_threads(job("tiny-llama", sched, K, staleness=1), 2):
        assert not r.ledger_problems, r.ledger_problems[:3]
        assert r.ledger_peak[f"g{r.rank}"] == sim.peak_bytes[f"g{r.rank}"] > 0


@pytest.mark.parametrize("layout", ["compact", "replicated"])
def test_async_gpu_peak_holds_on_a_slow_host(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Async, one GPU, six packs, the host optimizer slowed to 200 ms a step (slow beside the
    compute even on a loaded 2-core machine, where 50 ms was not): gradients wait on the GPU for
    their steps, and the run's ledger goes above the simulator's ledger at the trace's optimizer rate
    (what was predicted before) but not above the predicted GPU peak (`engine.slow_host_memory`)."""
    import time

    from tinypipe.backends.rank import hostwork

    submit = hostwork.HostWorker.submit

    def slow(self: hostwork.HostWorker, before: object, work: object) -> object:
        def late() -> object:
            time.sleep(0.2)
            return work()  # type: ignore[operator]
        return submit(self, before, late)  # type: ignore[arg-type]

    monkeypatch.setattr(hostwork.HostWorker, "submit", slow)
    p = PRESETS["tinypipe"].replace(packing=(1,) * 6, mapping=(0,) * 6, optimizer="async", host_memory=layout,
                                    resident="none")
    sched = compiled("tiny-llama", p, 1)
    spec, hw = load_model("tiny-llama"), fixed_cpu_hardware(1)
    trace = analytic_trace(spec, hw.gpus[0], microbatch_size=MBS, seq_len=SEQ, dtype="fp32")
    predicted = simulate(sched, spec, hw, trace).peak_bytes["g0"]
    at_trace_rate = simulate(sched, spec, hw, trace, durations={}).peak_bytes["g0"]  # no slow-host pass
    (r,) = run_threads(job("tiny-llama", sched, K, staleness=1), 1)
    assert not r.ledger_problems, r.ledger_problems[:3]
    assert at_trace_rate < r.ledger_peak["g0"] <= predicted
