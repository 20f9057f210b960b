"""Offline policy search: candidates, analytic lower bounds that prune, parallel evaluation, ranking.

Pure: it takes an `Evaluator` (a picklable callable Policy -> Evaluation); the CLI passes the
simulator's. The search is a branch-and-bound beam search:

1. Stage 1 enumerates the structural choices (packing, microbatch size, swap mode, recompute and
   activation home) with default secondary choices.
2. Each candidate gets a lower bound on its iteration time (`lower_bound`): the busiest GPU's
   compute, the weight uploads over the host links, and the CPU optimizer. Candidates are
   evaluated in order of that bound; once a bound exceeds the best simulated time found so far
   the rest of that stage is pruned (a lower bound above a real time cannot win).
3. Stage 2 refines the best `beam` fitting candidates over the secondary choices (mapping,
   prefetch depth, resident layers, host memory layout, optimizer mode), again pruned by bound; when
   none fits, the `beam` that fall shortest of fitting on the GPU alone and on the host alone (a tight
   GPU can need no resident layers).

Ranking (`Prefer.FOOTPRINT`, the default): by tokens/s; then, among the fitting candidates within the
simulator's error band (`BAND`) of the fastest, the least peak GPU memory, then the least peak host memory:
at equal speed the promise is the smallest footprint. `Prefer.SPEED` takes the fastest (ties: peak GPU,
peak host). Last, the policy's JSON text, so the same inputs give the same answer on every run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.describe.hardware import HOST
from tinypipe.describe.thismachine import limit_for_peak
from tinypipe.describe.trace import ProfileTrace, trace_for
from tinypipe.estimate.gpumem import least_peak_bytes
from tinypipe.estimate.hostmem import host_bytes, optimizer_steps_s
from tinypipe.estimate.lora_costs import base_load_bytes, frozen_host_bytes, trace_for_policy
from tinypipe.estimate.plan import base_plan
from tinypipe.ir.schedule import recomputes
from tinypipe.policy import Policy
from tinypipe.policy.lora_spec import lora_text
from tinypipe.policy.modes import (
    HostMemory,
    OptimizerState,
    ResidentMode,
)
from tinypipe.search.prefer import BAND, Prefer
from tinypipe.search.space import Evaluation as Evaluation
from tinypipe.search.space import Evaluator as Evaluator
from tinypipe.search.space import SearchResult as SearchResult
from tinypipe.search.space import SearchSpace as SearchSpace
from tinypipe.search.space import SearchTarget as SearchTarget


def rank(evals: Iterable[Evaluation], prefer: Prefer = Prefer.FOOTPRINT, band: float = BAND) -> list[Evaluation]:
    """`evals` in the search's order: under `Prefer.FOOTPRINT` the fitting ones within `band` of the fastest
    first, least peak GPU then peak host memory first, then the rest by speed; under `Prefer.SPEED` by speed."""
    by_speed = sorted(evals, key=Evaluation.key)
    if prefer is Prefer.SPEED or not by_speed or not by_speed[0].fits:
        return by_speed
    floor = by_speed[0].tokens_per_s * (1 - band)
    near = [e for e in by_speed if e.fits and e.tokens_per_s >= floor]
    ids = {id(e) for e in near}
    return sorted(near, key=Evaluation.footprint_key) + [e for e in by_speed if id(e) not in ids]


# ---- candidates ------------------------------------------------------------------------------------

def stage1(w: SearchTarget, space: SearchSpace) -> list[Policy]:
    """Structural candidates: packing x microbatch size x swap mode x recompute/activation home."""
    out: list[Policy] = []
    blocks = w.model.num_blocks
    packings: list[dict[str, Any]] = [{"packing": "uniform", "pack_size": k} for k in space.pack_sizes if k <= blocks]
    packings += [{"packing": p} for p in space.packers]
    for mbs in space.microbatch_sizes:
        if w.batch_sequences % mbs:
            continue
        for pk in packings:
            for swap in space.swaps:
                for rc in space.recompute:
                    for home in space.activation_homes:
                        if home.on_host and not rc:
                            continue
                        out.append(Policy(name="search", microbatch_size=mbs, microbatches=w.batch_sequences // mbs,
                                          swap=swap, recompute=rc, activation_home=home, mapping=space.mappings[0],
                                          prefetch_depth=1, resident=space.residents[0],
                                          host_memory=space.host_memories[0], optimizer=space.optimizers[-1],
                                          optimizer_state=space.optimizer_state, lora=space.lora, **pk))
    return out


def stage2(best: Sequence[Policy], space: SearchSpace, gpus: int = 2) -> list[Policy]:
    """Secondary choices around each of the best structural candidates (on one GPU every mapping is the
    same: only the candidate's own)."""
    out: list[Policy] = []
    seen: set[str] = set()
    for p in best:
        for m in (space.mappings if gpus > 1 else (p.mapping,)):
            for d in space.prefetch_depths:
                for r in space.residents:
                    for lay in space.host_memories:
                        for opt in space.optimizers:
                            q = p.replace(mapping=m, prefetch_depth=d, resident=r, host_memory=lay, optimizer=opt)
                            k = q.dumps()
                            if k not in seen:
                                seen.add(k)
                                out.append(q)
    return out


# ---- bounds ----------------------------------------------------------------------------------------

def lower_bound(w: SearchTarget, p: Policy) -> tuple[float, str]:
    """A lower bound on the iteration time of `p` (seconds), and a reason when it cannot fit at all.

    max of: all compute spread perfectly over the GPUs; every non-resident layer uploaded twice
    (forward and backward) through the slower of the summed host links and the host DMA cap; the
    CPU optimizer's step of every layer (once per iteration even when asynchronous) spread perfectly
    over the ranks' optimizer threads (one per GPU), and no shorter than the longest step. It cannot fit
    when the host memory layout exceeds host memory, or when a layer's backward alone holds more than a GPU
    (`gpumem.least_peak_bytes`, the GPU-memory formula's floor under any packing).
    """
    hw, model = w.hardware, w.model
    trace = raw = _trace(w, p)
    # a frozen base (LoRA): its measured or scaled times, no host step, one compute-dtype copy on the host
    trace = trace_for_policy(trace, model, p.lora)
    compute = 0.0
    for layer in model.layers:
        kp = trace.layer(layer)
        redo = recomputes(p.recompute, layer.index, len(model.layers))
        compute += kp.least_compute_s(True, redo) + kp.least_compute_s(False, redo)
    compute *= p.microbatches / len(hw.gpus)
    links = sum(hw.route(HOST, g.name).bottleneck_gbps for g in hw.gpus)
    up_gbps = min(links, hw.host.dma_gbps) * 1e9
    carried = sum(x.param_bytes(w.dtype) if p.lora is None else base_load_bytes(x, p.lora, w.dtype)
                  for x in model.layers)
    uploads = 0.0 if p.resident == ResidentMode.ALL else 2 * carried / up_gbps
    steps = (optimizer_steps_s(model, p.host_memory, hw.host, trace, optimizer=p.optimizer, least=True,
                               optimizer_state=p.optimizer_state)
             if p.lora is None else (0.0,))
    optim = max(sum(steps) / len(hw.gpus), max(steps, default=0.0))
    why = ""
    hb = (host_bytes(model, p.host_memory, compute_dtype=w.dtype, optimizer=p.optimizer,
                     optimizer_state=p.optimizer_state) if p.lora is None
          else frozen_host_bytes(model, compute_dtype=w.dtype, nf4=p.lora.nf4)).total_bytes
    if hb > w.host_limit:
        why = (f"host memory: needs at least {hb:,} bytes for the {p.host_memory} host_memory, limit {w.host_limit:,} "
               "(the host memory less its margin)")
    least = least_peak_bytes(base_plan(p, model, hw, raw))
    if least > w.gpu_limit:
        why = why or (f"GPU memory: a layer's backward holds at least {least:,} bytes (its weights, gradient, "
                      f"activations and workspace), limit {w.gpu_limit:,}")
    return max(compute, uploads, optim), why


def _trace(w: SearchTarget, p: Policy) -> ProfileTrace:
    """The trace `p`'s plan is made with (measured or analytic, for its microbatch size and adapters)."""
    return trace_for(w.model, w.hardware.gpus[0], microbatch_size=p.microbatch_size, seq_len=w.seq_len,
                     dtype=w.dtype, profiles=w.profiles, lora=lora_text(p.lora))


def least_gpu_bytes(w: SearchTarget, space: SearchSpace) -> tuple[int, Policy] | None:
    """The least GPU memory a stage-1 candidate of `space` needs (`gpumem.least_peak_bytes`, by which
    `lower_bound` rejects one) and that candidate; None when there is none. Stage 2 refines only stage-1
    candidates that were simulated, so with less GPU memory than this nothing can fit."""
    floors = ((least_peak_bytes(base_plan(p, w.model, w.hardware, _trace(w, p))), p) for p in stage1(w, space))
    return min(floors, key=lambda t: (t[0], t[1].dumps()), default=None)


# ---- the search ------------------------------------------------------------------------------------

def search(w: SearchTarget, evaluate: Evaluator, *, space: SearchSpace | None = None, beam: int = 3,
           workers: int = 1, progress: Callable[[int, int], None] | None = None,
           prefer: Prefer = Prefer.FOOTPRINT, band: float = BAND) -> SearchResult:
    """Find the best fitting policy for `w` under `prefer`; see the module docstring for the method.

    Under `Prefer.FOOTPRINT` a candidate is pruned only when its bound exceeds the best time found over
    (1 - band): one within the band may still win on memory. Stage 2 refines the `beam` fastest and the
    `beam` first in the footprint order."""
    space = space or SearchSpace()
    slack = 1.0 if prefer is Prefer.SPEED else 1 / (1 - band)
    if w.batch_sequences < 1:
        raise InputError("batch: must hold at least one sequence")
    evals: list[Evaluation] = []
    pruned = 0
    considered = 0
    rejected = 0
    pool = (ProcessPoolExecutor(max_workers=workers, initializer=_install, initargs=(evaluate,))
            if workers > 1 else None)
    try:
        for stage in (1, 2):
            if stage == 1:
                cands = stage1(w, space)
            else:
                top = [e.policy for e in sorted(evals, key=Evaluation.key) if e.fits][:beam]
                small = [e.policy for e in rank(evals, prefer, band) if e.fits][:beam]
                if not top:  # nothing fits with stage 1's defaults (resident layers, prefetch): refine the closest
                    top = _closest(evals, beam)
                cands = stage2(list({p.dumps(): p for p in top + small}.values()), space, len(w.hardware.gpus))
                done = {e.policy.dumps() for e in evals}
                cands = [c for c in cands if c.dumps() not in done]
            considered += len(cands)
            new, n_pruned, n_rejected = _evaluate_bounded(w, cands, evaluate, evals, pool, workers, progress, slack)
            evals += new
            pruned += n_pruned
            rejected += n_rejected
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    result = SearchResult(w, rank(evals, prefer, band), pruned, considered, rejected, prefer=prefer, band=band)
    if result.winner is None:
        result.advice = advise(w, result.ranked)
    return result


def _closest(evals: list[Evaluation], beam: int) -> list[Policy]:
    """The `beam` candidates short of GPU memory only, least short first, and the `beam` short of host memory
    only: what stage 2's choices (resident layers, prefetch depth, host layout) may still make fit."""
    simulated = [e for e in evals if e.peak_gpu_bytes > 0]
    gpu = sorted((e for e in simulated if not e.host_short_bytes), key=lambda e: (e.gpu_short_bytes, e.key()))
    host = sorted((e for e in simulated if not e.gpu_short_bytes), key=lambda e: (e.host_short_bytes, e.key()))
    return [e.policy for e in gpu[:beam] + host[:beam]]


def _evaluate_bounded(w: SearchTarget, cands: list[Policy], evaluate: Evaluator, prior: list[Evaluation],
                      pool: ProcessPoolExecutor | None, workers: int,
                      progress: Callable[[int, int], None] | None,
                      slack: float = 1.0) -> tuple[list[Evaluation], int, int]:
    """Evaluate candidates in order of their lower bound, in batches, pruning once bounds pass the best
    time found times `slack`. With a pool, the next batch's candidates start while this batch's last ones
    still run, so that no worker idles at a batch's end; those the batch's results then prune are dropped
    unused, so what is evaluated and kept is the same as one batch after the other."""
    bounded = []
    out: list[Evaluation] = []
    for c in cands:
        lb, why = lower_bound(w, c)
        if why:
            out.append(Evaluation(c, False, why=why))
        else:
            bounded.append((lb, c.dumps(), c))
    bounded.sort(key=lambda t: (t[0], t[1]))
    best = slack * min((e.iteration_s for e in prior + out if e.fits), default=float("inf"))
    batch = max(1, workers) * 2
    started: dict[int, Future[Evaluation]] = {}  # index into `bounded` -> its evaluation in the pool

    def start(first: int) -> None:
        """The batch from `first` on, as far as the best time so far keeps it (it only falls, so a batch chosen
        later holds none that this one leaves out)."""
        if pool is None:
            return
        for j in range(first, min(first + batch, len(bounded))):
            if bounded[j][0] < best and j not in started:
                started[j] = pool.submit(_installed, bounded[j][2])

    start(0)
    i = 0
    while i < len(bounded):
        if bounded[i][0] >= best:
            break
        chunk = [j for j in range(i, min(i + batch, len(bounded))) if bounded[j][0] < best]
        start(i + batch)
        results: Iterable[Evaluation] = (started.pop(j).result() for j in chunk) if pool is not None else (
            evaluate(bounded[j][2]) for j in chunk)
        for e in results:
            out.append(e)
            if e.fits:
                best = min(best, slack * e.iteration_s)
        i += batch
        if progress is not None:
            progress(min(i, len(bounded)), len(bounded))
    for f in started.values():  # started ahead and then pruned
        f.cancel()
    rejected = len(cands) - len(bounded)
    return out, len(bounded) - min(i, len(bounded)), rejected


# A worker process's evaluator, installed once when the pool starts it (`_install`), so that tasks carry only a
# policy: sent with every task, the evaluator would be unpickled afresh each time, and with it its model,
# hardware and traces, whose identity the simulator's cache of equal schedules keys on (sim/guard.py).
_INSTALLED: list[Evaluator] = []


def _install(evaluate: Evaluator) -> None:
    _INSTALLED[:] = [evaluate]


def _installed(policy: Policy) -> Evaluation:
    return _INSTALLED[0](policy)


def describe(p: Policy) -> str:
    """A policy in one short line for tables."""
    pk = p.packing if isinstance(p.packing, str) else "sizes " + "/".join(map(str, p.packing))
    if p.packing == "uniform":
        pk = f"uniform {p.pack_size}"
    return (f"{pk}, {p.mapping}, swap {p.swap} d{p.prefetch_depth}, resident {p.resident}, "
            f"{p.microbatches}x{p.microbatch_size} mb, {'recompute' if p.recompute else 'keep acts'}"
            f"{', acts on host' if p.activation_home.on_host else ''}, {p.host_memory}, {p.optimizer}"
            f"{'' if p.optimizer_state.exact else f', {p.optimizer_state} state'}")


def advise(w: SearchTarget, ranked: list[Evaluation]) -> list[str]:
    """When nothing fits: which memory falls short, by how much, and the smallest change that fits."""
    from tinypipe.common.table import gib

    lines = []
    gpu_short = [e.gpu_short_bytes for e in ranked if e.gpu_short_bytes > 0]
    host_short = [e.host_short_bytes for e in ranked if e.host_short_bytes > 0]
    state = ranked[0].policy.optimizer_state if ranked else OptimizerState.FP32
    lora = ranked[0].policy.lora if ranked else None
    compact = host_bytes(w.model, HostMemory.COMPACT, optimizer_state=state).total_bytes
    replicated = host_bytes(w.model, HostMemory.REPLICATED).total_bytes
    nf4 = lora is not None and lora.nf4
    frozen = frozen_host_bytes(w.model, compute_dtype=w.dtype, nf4=nf4).total_bytes
    if lora is not None and frozen > w.host_limit:
        in4 = frozen_host_bytes(w.model, compute_dtype=w.dtype, nf4=True).total_bytes
        lines.append(f"host memory falls short: the frozen base needs {gib(frozen)} (one {'NF4' if nf4 else w.dtype} "
                     f"copy), the limit is {gib(w.host_limit)} ({gib(w.host_memory)} less its margin); add at least "
                     f"{gib(limit_for_peak(frozen) - w.host_memory)} of host DRAM"
                     + (f", or hold the base in 4 bits ({gib(in4)}: --load-in-4bit)" if not nf4 else ""))
    elif lora is not None and host_short:
        closest = min((e for e in ranked if e.host_short_bytes > 0), key=lambda e: (e.host_short_bytes, e.key()))
        lines.append(f"host memory falls short by {gib(closest.host_short_bytes)} in the closest candidate "
                     f"({describe(closest.policy)}): the frozen base ({gib(frozen)}) and the activations parked "
                     "on the host")
    elif lora is None and compact > w.host_limit:
        lines.append(f"host memory falls short: the compact layout needs {gib(compact)} for parameters and "
                     f"{state} optimizer state, the limit is {gib(w.host_limit)} ({gib(w.host_memory)} less its "
                     f"margin); add at least {gib(limit_for_peak(compact) - w.host_memory)} of host DRAM")
        smaller = [s for s in OptimizerState if host_bytes(w.model, HostMemory.COMPACT, optimizer_state=s).total_bytes
                   <= w.host_limit and s != state]
        if smaller:
            lines.append(f"or hold AdamW's moments in {smaller[0]} (--optimizer-state {smaller[0]}, or auto: the most "
                         "precise that fits; it changes the numerics)")
    elif host_short and replicated > w.host_limit:
        lines.append(f"host memory falls short for the replicated layout by {gib(replicated - w.host_limit)}; "
                     "use host_memory=compact")
    if gpu_short:
        closest = min((e for e in ranked if e.gpu_short_bytes > 0), key=lambda e: (e.gpu_short_bytes, e.key()))
        lines.append(f"GPU memory falls short by {gib(closest.gpu_short_bytes)} per GPU in the closest candidate "
                     f"({describe(closest.policy)}); use fewer tokens per microbatch (a shorter --seq-len), "
                     f"or GPUs with at least that much more memory")
    if not lines:
        reasons = sorted({e.why for e in ranked if e.why})
        lines.append("no candidate fits: " + ("; ".join(reasons[:3]) if reasons else "no candidates were generated"))
    return lines
