"""Policy search: bounds prune, ranking is deterministic, the Pareto front, advice when nothing fits."""

from __future__ import annotations

from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.policy import Policy
from tinypipe.search.policy_search import Evaluation, SearchSpace, SearchTarget, lower_bound, search, stage1


def _w(**kw: object) -> SearchTarget:
    return SearchTarget(load_model("llama-3.1-8b"), load_hardware("rtx4090x8-pcie4"), 2048, 8, **kw)  # type: ignore[arg-type]


SMALL = SearchSpace(microbatch_sizes=(1, 2), pack_sizes=(2, 4), packers=("holistic",), swaps=("layer", "pack"),
                    recompute=(True, False), activation_homes=("gpu",), mappings=("cross",), prefetch_depths=(1, 2),
                    residents=("none",), host_memories=("compact", "replicated"), optimizers=("sync",))


class FakeEvaluator:
    """Iteration time = lower bound x a factor from the policy; GPU bytes grow with pack size."""

    def __init__(self, w: SearchTarget) -> None:
        self.w = w
        self.calls: list[str] = []

    def __call__(self, p: Policy) -> Evaluation:
        self.calls.append(p.dumps())
        lb, _ = lower_bound(self.w, p)
        t = lb * (1.3 if p.swap == "pack" else 1.1) * (1.0 if p.prefetch_depth == 2 else 1.05)
        gpu = (p.pack_size or 3) * 10**9 * p.microbatch_size
        return Evaluation(p, gpu <= 6 * 10**9, tokens_per_s=self.w.batch_sequences * 2048 / t, iteration_s=t,
                          peak_gpu_bytes=gpu, peak_host_bytes=10**11, why="" if gpu <= 6 * 10**9 else "GPU",
                          gpu_short_bytes=max(0, gpu - 6 * 10**9))


def test_stage1_respects_the_batch() -> None:
    """Microbatch sizes that do not divide the global batch are not generated; counts multiply out."""
    w = _w()
    c = stage1(w, SearchSpace(microbatch_sizes=(1, 3), pack_sizes=(2,), packers=(), swaps=("layer",),
                              recompute=(True, False), activation_homes=("gpu", "host")))
    assert [(p.microbatch_size, p.microbatches, p.recompute, p.activation_home) for p in c] == [
        (1, 8, True, "gpu"), (1, 8, True, "host"), (1, 8, False, "gpu")]


def test_lower_bound_is_compute_upload_or_optimizer() -> None:
    """The bound is at least the optimizer time and grows when the optimizer layout is slower."""
    w = _w()
    fast, _ = lower_bound(w, Policy(host_memory="replicated"))
    slow, _ = lower_bound(w, Policy(host_memory="compact"))
    assert slow >= fast > 0


def test_search_is_deterministic_and_ranks_by_throughput() -> None:
    """Two runs give the same ranking; the winner is the fastest fitting candidate."""
    w = _w()
    a = search(w, FakeEvaluator(w), space=SMALL)
    b = search(w, FakeEvaluator(w), space=SMALL)
    assert [e.policy for e in a.ranked] == [e.policy for e in b.ranked]
    assert a.winner is not None and a.winner.fits
    fits = [e for e in a.ranked if e.fits]
    assert all(fits[0].tokens_per_s >= e.tokens_per_s for e in fits)
    assert a.winner.policy.swap == "layer" and a.winner.policy.prefetch_depth == 2


def test_bounds_prune() -> None:
    """Candidates whose lower bound exceeds the best simulated time are never evaluated."""
    w = _w()
    ev = FakeEvaluator(w)
    r = search(w, ev, space=SMALL)
    assert r.pruned > 0
    assert len(ev.calls) < r.considered


def test_pareto_front_is_not_dominated() -> None:
    """No Pareto point is beaten on all three axes by another fitting evaluation."""
    w = _w()
    r = search(w, FakeEvaluator(w), space=SMALL)
    front = r.pareto()
    assert front
    for e in front:
        for o in r.ranked:
            if o.fits and o is not e:
                assert not (o.tokens_per_s > e.tokens_per_s and o.peak_gpu_bytes < e.peak_gpu_bytes
                            and o.peak_host_bytes < e.peak_host_bytes)


def test_nothing_fits_says_which_memory_and_how_much() -> None:
    """With too little host DRAM the advice names host memory and the shortfall."""
    w = _w(host_mem_bytes=50 * 2**30)
    r = search(w, FakeEvaluator(w), space=SMALL)
    assert r.winner is None
    assert any(line.startswith("host memory falls short") and "GiB" in line for line in r.advice)


def test_simulated_search_is_the_same_serial_and_parallel() -> None:
    """With the simulator as evaluator, two worker processes give exactly the serial ranking."""
    from tinypipe.sim.evaluate import SimEvaluator

    model, hw = load_model("tiny-llama"), load_hardware("h200x2")
    w = SearchTarget(model, hw, 64, 4)
    space = SearchSpace(microbatch_sizes=(1, 2), pack_sizes=(1, 3), packers=("holistic",), recompute=(True,),
                        activation_homes=("gpu",), prefetch_depths=(1,), host_memories=("compact",))
    serial = search(w, SimEvaluator(model, hw, 64), space=space, workers=1)
    parallel = search(w, SimEvaluator(model, hw, 64), space=space, workers=2)
    assert serial.winner is not None
    assert [e.to_json() for e in serial.ranked] == [e.to_json() for e in parallel.ranked]
