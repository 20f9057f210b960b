"""`tinypipe simulate` and `tinypipe search`: policies through the simulator."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinypipe.common.errors import InputError
from tinypipe.common.progress import Progress
from tinypipe.policy.modes import HostMemory, OptimizerMode, OptimizerState

if TYPE_CHECKING:
    from tinypipe.describe.hardware import Hardware
    from tinypipe.describe.model import ModelSpec
    from tinypipe.describe.trace import ProfileTrace
    from tinypipe.search.policy_search import SearchResult, SearchSpace, SearchTarget
    from tinypipe.search.prefer import Prefer

from .edge import checked, planning, target_of, workload_of
from .util import LIMITS, at_most, check_outputs, plot_to, policies, positive, print_json, write_new


def cmd_simulate(args: argparse.Namespace) -> int:
    from tinypipe.sim.batch import Task, simulate_policies

    names = args.policy or ["resident", "mobius", "tinypipe"]
    checked(args, "seq_len", "iterations", "microbatches", "microbatch_size", "batch_tokens")
    if args.batch_tokens is not None and args.microbatches is not None:
        raise InputError("--batch-tokens and --microbatches: give one (--batch-tokens sets each policy's "
                         "microbatch count)")
    workers = _workers(args)
    check_outputs(trace=args.trace, plot=args.plot)
    bar = None if args.json else Progress("simulate")
    hardware, given, profiles = planning(args)
    workload = workload_of(args, profiles)
    target, host_note = target_of(args, hardware)
    loads = policies(workload, hardware, names, given)
    if host_note:
        print(host_note, file=sys.stderr)
    if bar is not None:
        bar.phase(f"simulating {', '.join(p.name for p, _ in loads)} ({min(workers, len(loads))} process(es))")
    # a policy that cannot run this model on this hardware is a mistake (InputError, exit 2), not a row
    done = simulate_policies([Task(policy, workload.model, target.hardware, trace, args.iterations,
                                   target.gpu_mem_bytes, target.host_mem_bytes,
                                   timeline=i == 0 and bool(args.trace or args.plot))
                              for i, (policy, trace) in enumerate(loads)], workers=workers)
    rows = [{"policy": policy.name, "tokens_per_step": policy.microbatches * policy.microbatch_size * workload.seq_len,
             "tokens_per_s": res.tokens_per_s, "iteration_s": res.iteration_s,
             "peak_gpu_bytes": res.peak_gpu_bytes, "peak_host_bytes": res.peak_host_bytes,
             "host_bytes_per_param": res.host_bytes_per_param, "fits": res.fits,
             "why": _over_capacity(res.peak_bytes, res.capacity_bytes, target.hardware),
             "first_violation": res.violation or "", "bottleneck": res.critical_path.bottleneck,
             "packs": len(sizes), "trace": _trace_json(trace), "detail": res.to_json()}
            for (policy, trace), (sizes, res) in zip(loads, done)]
    first = done[0][1] if done else None
    if bar is not None:
        bar.close()
    wrote = []
    if first is not None and args.trace:
        write_new(Path(args.trace), json.dumps(first.timeline.to_chrome_trace()))
        wrote.append(f"wrote {args.trace} (Chrome trace of {rows[0]['policy']}; open in Perfetto)")
    if first is not None and args.plot:
        from tinypipe.cli.plot import plot_timeline

        plot_to(plot_timeline, first.timeline, args.plot)
        wrote.append(f"wrote {args.plot} (timeline of {rows[0]['policy']})")
    if args.json:
        for line in wrote:
            print(line, file=sys.stderr)
        return print_json({"model": args.model, "hardware": args.hardware, "seq_len": args.seq_len,
                           "results": rows})
    _print_simulated(args, workload.model, [t for _, t in loads], rows, wrote)
    return 0


def _print_simulated(args: argparse.Namespace, model: ModelSpec, traces: list[ProfileTrace],
                     rows: list[dict[str, Any]], wrote: list[str]) -> None:
    """`simulate`'s report for people: the workload, the traces used, a row per policy, the files written."""
    from tinypipe.common import table
    from tinypipe.describe.layershape import borrowed_from

    print(f"{args.model} on {args.hardware}, seq {args.seq_len}, {args.iterations} iterations simulated")
    for size, t in sorted({t.microbatch_size: t for t in traces}.items()):
        kind = "analytic" if t.analytic else "measured" + borrowed_from(t.model, model)
        print(f"trace for microbatch size {size}: {kind} ({_clip(t.source)})")
    print()
    out = [[r["policy"], r["tokens_per_step"], round(r["tokens_per_s"]), round(r["iteration_s"], 3), r["packs"],
            table.gib(r["peak_gpu_bytes"]), table.gib(r["peak_host_bytes"]), round(r["host_bytes_per_param"], 2),
            r["bottleneck"], "yes" if r["fits"] else "no: " + r["why"]] for r in rows]
    print(table.render(["policy", "tokens/step", "tokens/s", "iteration s", "packs", "peak GPU", "peak host",
                        "host B/param", "bottleneck", "fits"], out, align="lrrrrrrrll"))
    if len({r["tokens_per_step"] for r in rows}) > 1:
        print("\nnote: these policies run different tokens per step (their own microbatch counts and sizes); "
              "--batch-tokens N runs them all on one workload")
    if wrote:
        print("\n" + "\n".join(wrote))


def cmd_search(args: argparse.Namespace) -> int:
    from tinypipe.search.policy_search import SearchTarget
    from tinypipe.search.prefer import Prefer

    checked(args, "seq_len", "batch_tokens", "top")
    workers = _workers(args)
    if args.batch_tokens % args.seq_len:
        raise InputError(f"--batch-tokens: {args.batch_tokens} is not a multiple of --seq-len {args.seq_len}")
    check_outputs(out=args.out, plot=args.plot)
    hardware, given, profiles = planning(args)
    target, host_note = target_of(args, hardware)
    w = SearchTarget(workload_of(args, profiles), target)
    states = (tuple(OptimizerState) if args.optimizer_state == "auto"
              else (OptimizerState.parse(args.optimizer_state, "--optimizer-state"),))
    if w.workload.lora is not None:  # the adapters' AdamW state is fp32 on their GPU: no precision to choose
        if args.optimizer_state not in ("auto", OptimizerState.FP32):
            raise InputError(f"--optimizer-state {args.optimizer_state}: a LoRA run's AdamW state is its adapters', "
                             "held in fp32 on the GPU (the frozen base has none on the host); leave --optimizer-state "
                             "out")
        states = (OptimizerState.FP32,)
    space = _search_space(args, w, states[0], given, host_note)
    bar = None if args.json else Progress("search")
    if bar is not None:
        bar.phase(f"search: {w.model.name} on {w.hardware.name}, {workers} worker process(es)")
    result, space = _search(w, space, states, workers=workers, prefer=Prefer(args.prefer), bar=bar)
    if bar is not None:
        bar.close()
    return _report_search(args, w, result, space, auto=len(states) > 1)


def _search_space(args: argparse.Namespace, w: SearchTarget, state: OptimizerState,
                  given: tuple[ProfileTrace, ...], host_note: str | None) -> SearchSpace:
    """The candidates' space: optimizers, the state precision, LoRA (one host layout), the microbatch sizes the
    `--profile` traces measured; a `--gpu-mem` no candidate can fit is refused here, before the search."""
    import dataclasses

    from tinypipe.common import table
    from tinypipe.describe.trace import find_trace
    from tinypipe.search.policy_search import SearchSpace, describe, least_gpu_bytes

    lora = w.workload.lora
    space = SearchSpace(optimizers=tuple(OptimizerMode) if args.allow_async else (OptimizerMode.SYNC,),
                        optimizer_state=state, lora=lora)
    if lora is not None:  # a frozen base has one host layout
        space = dataclasses.replace(space, host_memories=(HostMemory.COMPACT,))
    floor = least_gpu_bytes(w, space) if args.gpu_mem else None
    if floor is not None and floor[0] > w.gpu_limit:  # a --gpu-mem no candidate can fit: refused before the search
        raise InputError(f"--gpu-mem {args.gpu_mem}: less than any candidate needs; a layer's backward holds at least "
                         f"{table.gib(floor[0])} on a GPU (its weights, gradient, activations and workspace; "
                         f"{w.model.name}, {describe(floor[1])}); give at least that")
    if host_note:
        print(host_note, file=sys.stderr)
    gpu_model = w.hardware.gpus[0].model
    measured = sorted({t.microbatch_size for t in given
                       if find_trace([t], w.model, gpu_model, t.microbatch_size, w.seq_len, w.dtype)})
    if given and not measured:
        print(f"note: no --profile trace is for {gpu_model} / {w.model.name} / seq {w.seq_len} / {w.dtype}; "
              "the search uses the shipped or analytic traces", file=sys.stderr)
    elif measured and tuple(measured) != space.microbatch_sizes:  # measured and analytic times do not compare
        space = dataclasses.replace(space, microbatch_sizes=tuple(measured))
        print(f"note: searching microbatch sizes {', '.join(map(str, measured))}, those --profile measured",
              file=sys.stderr)
    return space


def _search(w: SearchTarget, space: SearchSpace, states: tuple[OptimizerState, ...], *, workers: int,
            prefer: Prefer, bar: Progress | None) -> tuple[SearchResult, SearchSpace]:
    """The search, and with more than one optimizer state (`auto`) again with the next while nothing fits; the
    result and the space it searched."""
    import dataclasses

    from tinypipe.search.policy_search import SearchSpace, search
    from tinypipe.sim.evaluate import SimEvaluator

    evaluate = SimEvaluator(w.model, w.hardware, w.seq_len, w.target.gpu_mem_bytes, w.host_limit, profiles=w.profiles,
                            dtype=w.dtype)
    result = search(w, evaluate, space=space, workers=workers, progress=bar, prefer=prefer)
    for state in states[1:]:  # auto: the most precise state for which a policy fits
        if result.winner is not None:
            break
        if bar is not None:
            bar.phase(f"search: nothing fits with {space.optimizer_state} optimizer state; trying {state}")
        space = dataclasses.replace(space, optimizer_state=state, host_memories=SearchSpace().host_memories)
        result = search(w, evaluate, space=space, workers=workers, progress=bar, prefer=prefer)
    return result, space


def _report_search(args: argparse.Namespace, w: SearchTarget, result: SearchResult, space: SearchSpace, *,
                   auto: bool) -> int:
    """The search's outcome: the margin note, the winner written (`--out`), the Pareto plot (`--plot`), then
    JSON or the tables; InputError when nothing fits."""
    from tinypipe.common import table
    from tinypipe.describe.thismachine import HOST_MARGIN_FRACTION

    margin = (f"a candidate's predicted host peak may take {table.human_bytes(w.host_limit)} of the "
              f"{table.human_bytes(w.host_memory)} host limit: {HOST_MARGIN_FRACTION:.0%} is kept for what a "
              "prediction may miss, as `run` keeps it")
    if result.winner is None:
        result.advice.append(margin)
    else:
        print(f"note: {margin}", file=sys.stderr)
    if auto and result.winner is not None and not args.json:
        print(f"optimizer state: {space.optimizer_state} (--optimizer-state auto: the most precise that fits)")
    if args.out and result.winner is not None:
        write_new(Path(args.out), result.winner.policy.replace(name="searched").dumps())
    if args.plot:
        from tinypipe.cli.plot import plot_pareto

        plot_to(plot_pareto, result, args.plot)
        print(f"wrote {args.plot} (Pareto front)", file=sys.stderr)
    if args.json:
        print_json({"model": w.model.name, "hardware": w.hardware.name, "seq_len": w.seq_len,
                    "batch_sequences": w.batch_sequences, "prefer": str(result.prefer), "band": result.band,
                    "rule": result.prefer.rule(result.band), "considered": result.considered,
                    "pruned": result.pruned, "rejected_by_memory_bound": result.rejected,
                    "simulated": len(result.ranked) - result.rejected,
                    "winner": result.winner.to_json() if result.winner else None,
                    "fastest": result.fastest.to_json() if result.fastest else None,
                    "top": [e.to_json() for e in result.ranked[:args.top]],
                    "pareto": [e.to_json() for e in result.pareto()], "advice": result.advice})
        if result.winner is None:
            raise InputError(f"nothing fits {w.model.name} on {w.hardware.name} (the advice is in the JSON)")
        return 0
    _print_search(args, w, result)
    return 0


def _print_search(args: argparse.Namespace, w: SearchTarget, result: SearchResult) -> None:
    """The search's tables for people: the top candidates by the rule, and the Pareto front."""
    from tinypipe.common import table
    from tinypipe.search.policy_search import describe

    model, hw = w.model, w.hardware
    print(f"{model.name} on {hw.name}: {w.batch_sequences} x {w.seq_len} tokens per step; "
          f"{result.considered} candidates: {len(result.ranked) - result.rejected} simulated, {result.pruned} pruned "
          f"by the time bound, {result.rejected} rejected by the memory bound\n")
    if result.winner is None:
        print("nothing fits:")
        for line in result.advice:
            print("  - " + line)
        raise InputError(f"nothing fits {model.name} on {hw.name}" + (f": {result.advice[0]}" if result.advice else ""))

    def rows(evals: list[Any]) -> list[list[Any]]:
        return [[i + 1, round(e.tokens_per_s), table.gib(e.peak_gpu_bytes), table.gib(e.peak_host_bytes),
                 describe(e.policy)] for i, e in enumerate(evals)]

    top = alike_groups([e for e in result.ranked if e.fits])[:args.top]
    fastest = result.fastest
    best = fastest.tokens_per_s if fastest is not None else top[0][0].tokens_per_s
    print(result.prefer.rule(result.band))
    print("top candidates, #1 the pick (alike: how many candidates the simulator predicts the same, options apart "
          "that make no difference here):")
    print(table.render(["#", "tokens/s", "vs fastest", "peak GPU", "peak host", "alike", "policy"],
                       [r[:2] + [f"{100 * (g[0].tokens_per_s / best - 1):+.1f}%"] + r[2:4] + [len(g)] + r[4:]
                        for r, g in zip(rows([g[0] for g in top]), top)], align="rrrrrrl"))
    near = sum(1 for g in top if g[0].tokens_per_s >= best * (1 - result.band))
    if near > 1:
        print(f"note: {near} of these are within {100 * result.band:g}% of the fastest, closer than the simulator's "
              "errors and one run's spread on the H200s (docs/fidelity.md): expect them to run alike")
    print("\nPareto front (tokens/s vs peak GPU vs peak host):")
    print(table.render(["#", "tokens/s", "peak GPU", "peak host", "policy"], rows(result.pareto()), align="rrrrl"))
    if args.out:
        print(f"\nwrote the winner to {args.out}")


def _workers(args: argparse.Namespace) -> int:
    """`--workers`, checked; by default every core."""
    if args.workers is not None:
        positive("--workers", args.workers)
        at_most("--workers", args.workers, min(LIMITS["workers"], 4 * (os.cpu_count() or 1)))
    return int(args.workers or (os.cpu_count() or 1))


def alike_groups(evals: list[Any]) -> list[list[Any]]:
    """`evals` (best first) grouped where the simulator predicts the same tokens/s, peak GPU and peak host
    memory (policies one option apart that compile to the same work: on one GPU the mapping, say), in
    order of each group's first."""
    groups: dict[tuple[float, int, int], list[Any]] = {}
    for e in evals:
        groups.setdefault((round(e.tokens_per_s, 3), e.peak_gpu_bytes, e.peak_host_bytes), []).append(e)
    return list(groups.values())


def _trace_json(trace: Any) -> dict[str, Any]:
    return {"measured": not trace.analytic, "gpu_model": trace.gpu_model, "model": trace.model, "dtype": trace.dtype,
            "microbatch_size": trace.microbatch_size, "seq_len": trace.seq_len, "source": trace.source}


def _clip(text: str, width: int = 110) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _over_capacity(peak: dict[str, int], capacity: dict[str, int], hardware: Hardware) -> str:
    """`host 143.75 > 64.00 GiB; GPU 46.42 > 23.50 GiB (24.00 less 0.50 the allocator keeps)` for every kind of
    device over its capacity (a GPU's: its memory or the cap, less `GPU.allocator_slack_bytes`)."""
    from tinypipe.common.units import GIB
    from tinypipe.describe.hardware import HOST

    parts = []
    for label, devs in (("host", [d for d in peak if d == HOST]), ("GPU", [d for d in peak if d != HOST])):
        over = [d for d in devs if peak[d] > capacity.get(d, peak[d])]
        if over:
            d = max(over, key=lambda x: peak[x] - capacity[x])
            slack = 0 if d == HOST else hardware.gpus[int(d[1:])].allocator_slack_bytes
            kept = f" ({(capacity[d] + slack) / GIB:.2f} less {slack / GIB:.2f} the allocator keeps)" if slack else ""
            parts.append(f"{label} {peak[d] / GIB:.2f} > {capacity[d] / GIB:.2f} GiB{kept}")
    return "; ".join(parts)


