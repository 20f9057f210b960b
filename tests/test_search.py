"""Policy search: bounds prune, ranking is deterministic, the Pareto front, advice when nothing fits."""

from __future__ import annotations

import dataclasses

from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.target import Target
from tinypipe.describe.workload import Workload
from tinypipe.policy import Policy
from tinypipe.search.policy_search import (
    BAND,
    Evaluation,
    Prefer,
    SearchSpace,
    SearchTarget,
    lower_bound,
    rank,
    search,
    stage1,
)


def _w(host_mem_bytes: int | None = None) -> SearchTarget:
    return SearchTarget(Workload(model=load_model("llama-3.1-8b"), seq_len=2048, batch_tokens=8 * 2048),
                        Target(hardware=load_hardware("rtx4090x8-pcie4"), host_mem_bytes=host_mem_bytes))


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
    """Two runs give the same ranking; under --prefer speed the winner is the fastest fitting candidate."""
    w = _w()
    a = search(w, FakeEvaluator(w), space=SMALL, prefer=Prefer.SPEED)
    b = search(w, FakeEvaluator(w), space=SMALL, prefer=Prefer.SPEED)
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
    w = SearchTarget(Workload(model=model, seq_len=64, batch_tokens=4 * 64), Target(hardware=hw))
    space = SearchSpace(microbatch_sizes=(1, 2), pack_sizes=(1, 3), packers=("holistic",), recompute=(True,),
                        activation_homes=("gpu",), prefetch_depths=(1,), host_memories=("compact",))
    serial = search(w, SimEvaluator(model, hw, 64), space=space, workers=1)
    parallel = search(w, SimEvaluator(model, hw, 64), space=space, workers=2)
    assert serial.winner is not None
    assert [e.to_json() for e in serial.ranked] == [e.to_json() for e in parallel.ranked]


def test_a_pool_starts_the_next_batch_early_and_keeps_what_batches_keep() -> None:
    """With worker processes the next batch's candidates start before this batch's results are in; what is
    evaluated, in which order, and how many are pruned is what one batch after the other gives."""
    from concurrent.futures import ProcessPoolExecutor

    from tinypipe.search import policy_search as ps

    w = _w()
    cands = stage1(w, SMALL)
    alone = ps._evaluate_bounded(w, cands, FakeEvaluator(w), [], None, 2, None)
    with ProcessPoolExecutor(2, initializer=ps._install, initargs=(FakeEvaluator(w),)) as pool:
        pooled = ps._evaluate_bounded(w, cands, FakeEvaluator(w), [], pool, 2, None)
    assert [e.to_json() for e in pooled[0]] == [e.to_json() for e in alone[0]]
    assert pooled[1:] == alone[1:] and alone[1] > 0


def _e(name: str, rate: float, gpu: int, host: int, fits: bool = True) -> Evaluation:
    return Evaluation(Policy(name=name), fits, tokens_per_s=rate, iteration_s=1 / rate, peak_gpu_bytes=gpu,
                      peak_host_bytes=host)


def test_rank_picks_the_smallest_footprint_within_the_band() -> None:
    """Within BAND of the fastest: least GPU memory first, then least host memory; outside the band (or not
    fitting) by speed after them. --prefer speed keeps the fastest first."""
    fast = _e("fast", 100.0, 21, 160)
    small_gpu_big_host = _e("a", 99.8, 8, 160)
    small_gpu_small_host = _e("b", 99.0, 8, 106)
    slow_tiny = _e("slow", 100.0 * (1 - BAND) - 0.1, 4, 50)
    broken = _e("broken", 500.0, 1, 1, fits=False)
    evals = [slow_tiny, fast, broken, small_gpu_big_host, small_gpu_small_host]
    assert [e.policy.name for e in rank(evals)] == ["b", "a", "fast", "slow", "broken"]
    assert [e.policy.name for e in rank(evals, Prefer.SPEED)] == ["fast", "a", "b", "slow", "broken"]
    assert [e.policy.name for e in rank(evals, band=0.05)] == ["slow", "b", "a", "fast", "broken"]
    assert rank([broken]) == [broken]


def test_search_prefers_footprint_among_equals() -> None:
    """By default the winner is within BAND of the fastest candidate and holds no more GPU memory than the
    fastest; the speed winner is the fastest. The rule says both."""
    w = _w()
    foot = search(w, FakeEvaluator(w), space=SMALL)
    speed = search(w, FakeEvaluator(w), space=SMALL, prefer=Prefer.SPEED)
    assert foot.winner is not None and speed.winner is not None and foot.fastest is not None
    assert speed.winner.policy == speed.fastest.policy if speed.fastest else False
    assert foot.winner.tokens_per_s >= foot.fastest.tokens_per_s * (1 - BAND)
    assert foot.winner.peak_gpu_bytes <= speed.winner.peak_gpu_bytes
    near = [e for e in foot.ranked if e.fits and e.tokens_per_s >= foot.fastest.tokens_per_s * (1 - BAND)]
    assert foot.winner.peak_gpu_bytes == min(e.peak_gpu_bytes for e in near)
    assert "2%" in Prefer.FOOTPRINT.rule() and "least peak GPU memory" in Prefer.FOOTPRINT.rule()
    assert "fastest" in Prefer.SPEED.rule()


def test_when_nothing_fits_stage_two_refines_the_closest() -> None:
    """Stage 1 takes resident layers (`auto`) and prefetch depth 1; when every such candidate falls short (here
    the GPU, by bytes that grow with the pack), stage 2 refines the closest on the GPU alone and on the host alone,
    and finds that without resident layers the smallest packs fit; with nothing to refine it would find nothing."""
    w = _w()

    class ResidentsCost(FakeEvaluator):
        def __call__(self, p: Policy) -> Evaluation:
            e = FakeEvaluator.__call__(self, p)
            if p.resident == "none":
                return e
            gpu = e.peak_gpu_bytes + 5 * 10**9  # the layers kept resident
            return dataclasses.replace(e, fits=False, peak_gpu_bytes=gpu, gpu_short_bytes=gpu - 6 * 10**9, why="GPU")

    space = SearchSpace(microbatch_sizes=(1, 2), pack_sizes=(1, 2, 4), packers=(), swaps=("layer",), recompute=(True,),
                        activation_homes=("gpu",), mappings=("cross",), prefetch_depths=(1,),
                        residents=("auto", "none"))
    res = search(w, ResidentsCost(w), space=space)
    assert not any(e.fits for e in res.ranked if e.policy.resident == "auto")
    assert res.winner is not None and res.winner.policy.resident == "none"
    # refined: the three least short on the GPU (pack 1 at microbatch 1, pack 2 at 1, pack 1 at 2)
    assert {(e.policy.pack_size, e.policy.microbatch_size) for e in res.ranked if e.policy.resident == "none"} \
        == {(1, 1), (1, 2), (2, 1)}
