"""The `tinypipe` command: inspect, simulate, search, run, replay, profile.

The one core module that may import sim/ and backends/ (inside functions).

User mistakes end in one line `error: ...` and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tinypipe.errors import InputError, TinypipeError
from tinypipe.progress import CLEAR, Progress

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InputError(f"{self.prog}: {message}")


def _common_workload(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.1-8b", help="shipped model name or config.json path")
    p.add_argument("--hardware", default="rtx4090x8-pcie4", help="shipped hardware name or JSON path")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--microbatches", type=int, default=None, help="override the policy's microbatch count")
    p.add_argument("--microbatch-size", type=int, default=None, help="override sequences per microbatch")
    p.add_argument("--iterations", type=int, default=3, help="iterations compiled and simulated (default 3)")
    _dtype_option(p)
    _profile_option(p)
    p.add_argument("--json", action="store_true", help="print JSON for programs instead of tables")


def _dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="compute dtype of the workload, which a --profile trace must match (default bf16)")


def _profile_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", action="append", metavar="DIR_OR_FILE",
                   help="measured traces (`tinypipe profile --out DIR`): a directory or a trace JSON, repeatable; "
                        "a matching one is used before the shipped ones")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="tinypipe", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", parser_class=_Parser)

    ins = sub.add_parser("inspect", help="models, hardware, schedules: sizes, routes, what fits where")
    isub = ins.add_subparsers(dest="what", parser_class=_Parser)
    im = isub.add_parser("model", help="per-layer sizes, pack footprints, host bytes, fit")
    im.add_argument("name", nargs="?", help="shipped model name or config.json path (none: list them)")
    im.add_argument("--seq-len", type=int, default=2048)
    im.add_argument("--microbatch-size", type=int, default=1)
    im.add_argument("--hardware", action="append", help="check fit on this hardware (default: every preset)")
    im.add_argument("--json", action="store_true")
    ih = isub.add_parser("hardware", help="nodes, links, routes (no name: list the shipped presets)")
    ih.add_argument("name", nargs="?")
    ih.add_argument("--json", action="store_true")
    isch = isub.add_parser("schedule", help="compile and validate a policy; action counts and the grid")
    _common_workload(isch)
    isch.add_argument("--policy", default="tinypipe", help="preset name or policy JSON file")
    isch.add_argument("--out", help="write the schedule's text form here")
    isch.add_argument("--steps", type=int, default=24, help="grid rows to print")

    sim = sub.add_parser("simulate", help="simulate policies side by side (one workload with --batch-tokens)")
    _common_workload(sim)
    sim.add_argument("--policy", action="append", help="preset name or policy JSON (repeatable; "
                     "default: resident, mobius, tinypipe)")
    sim.add_argument("--batch-tokens", type=int, default=None,
                     help="tokens per optimizer step for every policy (each policy's microbatch count is set to "
                          "match; default: each policy's own, shown in the tokens/step column)")
    sim.add_argument("--gpu-mem", help="limit per GPU, e.g. 24GiB (default: the hardware's)")
    sim.add_argument("--host-mem", help="host DRAM limit, e.g. 256GiB (default: the hardware's)")
    sim.add_argument("--trace", help="write a Chrome trace (Perfetto) of the first policy")
    sim.add_argument("--plot", help="write a PNG timeline of the first policy")

    se = sub.add_parser("search", help="find the fastest policy that fits (simulated), and the Pareto front")
    se.add_argument("--model", default="llama-3.1-8b", help="shipped model name or config.json path")
    se.add_argument("--hardware", default="rtx4090x8-pcie4", help="shipped hardware name or JSON path")
    se.add_argument("--seq-len", type=int, default=2048)
    se.add_argument("--batch-tokens", type=int, default=65536, help="tokens per optimizer step (default 65536)")
    se.add_argument("--gpu-mem", help="tighter limit per GPU, e.g. 20GiB")
    se.add_argument("--host-mem", help="tighter host DRAM limit, e.g. 128GiB")
    se.add_argument("--workers", type=int, default=None, help="processes evaluating candidates (default: all cores)")
    se.add_argument("--top", type=int, default=10, help="candidates listed (default 10)")
    se.add_argument("--out", help="write the winning policy JSON here (simulate and run accept it)")
    se.add_argument("--plot", help="write the Pareto front as a PNG")
    se.add_argument("--allow-async", action="store_true",
                    help="also consider the async optimizer (staleness 1: changes the training semantics)")
    _dtype_option(se)
    _profile_option(se)
    se.add_argument("--json", action="store_true")

    from tinypipe.replay_command import add_replay_arguments

    add_replay_arguments(sub.add_parser("replay", help="re-run a real run's trace in the simulator with its measured "
                                        "durations; where measurement, replay and prediction diverge"))

    pr = sub.add_parser("profile", help="measure per-layer traces and host rates on this device (PyTorch)")
    from tinypipe.backends.profile.options import add_profile_arguments  # no torch import: always there

    add_profile_arguments(pr)

    run = sub.add_parser("run", help="train through the compiled schedule (PyTorch)")
    try:
        from tinypipe.backends.run import add_run_arguments
    except ImportError as exc:  # torch missing: the subcommand explains itself when used
        run.add_argument("rest", nargs=argparse.REMAINDER)
        run.set_defaults(_run_missing=str(exc))
    else:
        add_run_arguments(run)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        handler = _HANDLERS.get(args.command)
        if handler is None:  # plain `tinypipe`: a request for help
            build_parser().print_help()
            return 0
        return handler(args)
    except TinypipeError as exc:
        if sys.stderr.isatty():
            sys.stderr.write(CLEAR)  # a progress line on the terminal gives way to the error
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


# ---- inspect -------------------------------------------------------------------------------------

def _cmd_inspect(args: argparse.Namespace) -> int:
    from tinypipe import table

    if args.what == "model":
        from tinypipe.hardware import load_hardware, shipped_hardware
        from tinypipe.hfconfig import load_model, shipped_models
        from tinypipe.inspection import model_report

        if not args.name:
            return _print_list("models", shipped_models(), args.json)
        _positive("--seq-len", args.seq_len)
        _positive("--microbatch-size", args.microbatch_size)
        model = load_model(args.name)
        hws = [load_hardware(h) for h in (args.hardware or shipped_hardware())]
        rep = model_report(model, seq_len=args.seq_len, microbatch_size=args.microbatch_size, hardware=hws)
        if args.json:
            return _print_json(rep)
        print(f"{rep['model']} ({rep['family']}): {rep['params']:,} parameters, {rep['blocks']} blocks, "
              f"hidden {rep['hidden_size']}, vocab {rep['vocab_size']}"
              + (", tied embeddings" if rep["tied_embeddings"] else ""))
        print(f"source: {rep['source']}")
        print(f"bf16 weights: {table.gib(rep['bf16_bytes'])}; seq {rep['seq_len']}, microbatch "
              f"{rep['microbatch_size']} sequence(s)\n")
        rows = [[r["name"] if r["count"] == 1 else f"{r['name']}..{r['last'].split('.')[-1]} (x{r['count']})",
                 r["params"], table.human_bytes(r["bf16_bytes"]), r["fwd_flops_per_token"] / 1e6,
                 r["saved_act_bytes_per_token"], r["boundary_bytes_per_token"]] for r in rep["layers"]]
        print(table.render(["layer", "params", "bf16", "fwd MFLOP/token", "saved act B/token",
                            "boundary B/token"], rows, align="lrrrrr"))
        print("\nGPU memory for a pack of k blocks (weights + next pack prefetched + grads + saved inputs):")
        print(table.render(["k", "GPU bytes"], [[p["layers"], table.gib(p["gpu_bytes"])] for p in rep["packs"]],
                           align="rr"))
        print("\nHost memory (fp32 master + AdamW):")
        rows = [[lay, round(h["bytes_per_param"], 2), table.gib(h["total_bytes"])] for lay, h in rep["host"].items()]
        print(table.render(["layout", "bytes/param", "total"], rows, align="lrr"))
        print(f"\nCan it be trained at all? (needs >= {table.gib(rep['min_gpu_bytes'])} per GPU: the largest "
              "layer twice + its gradient + one microbatch's activations)")
        rows = [[f["hardware"], f["gpus"], table.gib(f["gpu_bytes"]), table.gib(f["host_bytes"]), f["gpu_fits"],
                 f["host_fits_replicated"], f["host_fits_compact"], f["resident_fits"]] for f in rep["fit"]]
        print(table.render(["hardware", "GPUs", "GPU mem", "host DRAM", "GPU ok", "host ok (replicated)",
                            "host ok (compact)", "all-resident ok"], rows, align="lrrrllll"))
        return 0
    if args.what == "hardware":
        from tinypipe.hardware import load_hardware, shipped_hardware
        from tinypipe.inspection import hardware_report

        if not args.name:
            hws = [load_hardware(n) for n in shipped_hardware()]
            if args.json:
                return _print_json([hardware_report(h) for h in hws])
            rows = [[h.name, h.provenance, len(h.gpus), h.gpus[0].model, table.gib(h.gpus[0].memory_bytes),
                     table.gib(h.host.memory_bytes), h.route("host", h.gpus[0].name).bottleneck_gbps]
                    for h in hws]
            print(table.render(["name", "provenance", "GPUs", "GPU", "GPU mem", "host DRAM", "host->gpu0 GB/s"],
                               rows, align="llrlrrr"))
            return 0
        rep = hardware_report(load_hardware(args.name))
        if args.json:
            return _print_json(rep)
        print(f"{rep['name']} ({rep['provenance']}): {rep['source']}")
        h = rep["host"]
        print(f"host: {table.gib(h['memory_bytes'])} DRAM, DMA cap {h['dma_gbps']} GB/s, {h['cpu_cores']} cores, "
              f"CPU AdamW {h['adam_params_per_s'] / 1e9:.2f} G params/s\n")
        print(table.render(["gpu", "model", "memory", "bf16 TFLOP/s", "HBM GB/s"],
                           [[g["name"], g["model"], table.gib(g["memory_bytes"]), g["matmul_flops"] / 1e12,
                             g["mem_gbps"]] for g in rep["gpus"]], align="llrrr"))
        print()
        print(table.render(["a", "b", "kind", "GB/s per direction", "latency us"],
                           [[x["a"], x["b"], x["kind"], x["gbps"], x["latency_s"] * 1e6] for x in rep["links"]],
                           align="lllrr"))
        print("\nroutes from host:")
        print(table.render(["to", "path", "GB/s"], [[r["dst"], " > ".join(r["path"]), r["gbps"]]
                                                    for r in rep["routes"]], align="llr"))
        names = [g["name"] for g in rep["gpus"]]
        if len(names) > 1:
            print("\nGPU <-> GPU bottleneck GB/s:")
            print(table.render(["", *names], [[a, *row] for a, row in zip(names, rep["peer_gbps"])]))
        return 0
    if args.what == "schedule":
        return _cmd_inspect_schedule(args)
    raise InputError("inspect: say what to inspect: model, hardware or schedule")


def _workloads(args: argparse.Namespace, policy_names: list[str]) -> list[tuple[Any, Any, Any, Any]]:
    """`_workload` of each policy name, with the `--profile` traces read once; a note on stderr (once)
    for each microbatch size that none of them matches."""
    from tinypipe.trace import load_profiles, unmatched_note

    profiles = load_profiles(args.profile or ())
    out = [_workload(args, name, profiles) for name in policy_names]
    notes = dict.fromkeys(unmatched_note(profiles, trace, model) for model, _, _, trace in out)
    for note in notes:
        if note is not None:
            print(note, file=sys.stderr)
    return out


def _workload(args: argparse.Namespace, policy_name: str, profiles: Any) -> tuple[Any, Any, Any, Any]:
    """Model, hardware, policy (with CLI overrides) and trace (`profiles` first) for one policy name."""
    from tinypipe.hardware import load_hardware
    from tinypipe.hfconfig import load_model
    from tinypipe.policy import load_policy
    from tinypipe.trace import trace_for

    for flag in ("seq_len", "iterations", "microbatches", "microbatch_size"):
        v = getattr(args, flag, None)
        if v is not None:
            _positive("--" + flag.replace("_", "-"), v)
    model = load_model(args.model)
    hw = load_hardware(args.hardware)
    policy = load_policy(policy_name)
    changes = {k: getattr(args, k) for k in ("microbatches", "microbatch_size") if getattr(args, k, None)}
    if changes:
        policy = policy.replace(**changes)
    batch_tokens = getattr(args, "batch_tokens", None)
    if batch_tokens is not None:  # one workload for every policy: its microbatch count follows
        per_mb = policy.microbatch_size * args.seq_len
        if batch_tokens % per_mb:
            raise InputError(f"--batch-tokens {batch_tokens}: not a multiple of policy {policy.name!r}'s microbatch "
                             f"({policy.microbatch_size} sequence(s) x {args.seq_len} tokens = {per_mb})")
        policy = policy.replace(microbatches=batch_tokens // per_mb)
    trace = trace_for(model, hw.gpus[0], microbatch_size=policy.microbatch_size, seq_len=args.seq_len,
                      dtype=args.dtype, profiles=profiles)
    return model, hw, policy, trace


def _cmd_inspect_schedule(args: argparse.Namespace) -> int:
    from tinypipe import table
    from tinypipe.compile import compile_schedule
    from tinypipe.schedule import grid
    from tinypipe.validate import validate

    _positive("--steps", args.steps)
    _check_outputs(out=args.out)
    ((model, hw, policy, trace),) = _workloads(args, [args.policy])
    sched = compile_schedule(policy, model, hw, trace, iterations=args.iterations)
    validate(sched)
    if args.out:
        _write_new(Path(args.out), sched.dumps())
    counts = sched.counts()
    if args.json:
        return _print_json({"actions": len(sched.actions), "packs": [list(p) for p in sched.pack_layers],
                            "pack_gpu": list(sched.pack_gpu),
                            "counts": [{"resource": r, "kind": k, "n": n} for (r, k), n in sorted(counts.items())]})
    print(f"{policy.name}: {len(sched.pack_layers)} packs over {sched.num_gpus} GPUs, {len(sched.actions):,} actions "
          f"in {sched.iterations} iterations; valid")
    print("packs (layers -> gpu): " + ", ".join(f"{p[0]}-{p[-1]}->g{g}" for p, g in zip(sched.pack_layers,
                                                                                     sched.pack_gpu)))
    kinds = sorted({k for _, k in counts})
    rows = [[r, *[counts.get((r, k), 0) for k in kinds]] for r in sched.resources if sched.by_resource()[r]]
    print(table.render(["resource", *kinds], rows))
    print()
    print(grid(sched, max_steps=args.steps))
    if args.out:
        print(f"\nwrote {args.out}")
    return 0


# ---- simulate ------------------------------------------------------------------------------------

def _cmd_simulate(args: argparse.Namespace) -> int:
    from tinypipe import table
    from tinypipe.compile import compile_schedule
    from tinypipe.sim import simulate
    from tinypipe.units import parse_bytes

    names = args.policy or ["resident", "mobius", "tinypipe"]
    gpu_mem = parse_bytes(args.gpu_mem, "--gpu-mem") if args.gpu_mem else None
    host_mem = parse_bytes(args.host_mem, "--host-mem") if args.host_mem else None
    if args.batch_tokens is not None:
        _positive("--batch-tokens", args.batch_tokens)
        if args.microbatches is not None:
            raise InputError("--batch-tokens and --microbatches: give one (--batch-tokens sets each policy's "
                             "microbatch count)")
    _check_outputs(trace=args.trace, plot=args.plot)
    bar = None if args.json else Progress("simulate")
    workloads = _workloads(args, names)
    rows: list[dict[str, Any]] = []
    first = None
    for i, (model, hw, policy, trace) in enumerate(workloads):
        if bar is not None:
            bar.phase(f"simulating {policy.name} ({i + 1}/{len(workloads)})")
        # a policy that cannot run this model on this hardware is a mistake (InputError, exit 2), not a row
        sched = compile_schedule(policy, model, hw, trace, iterations=args.iterations)
        res = simulate(sched, model, hw, trace, gpu_mem_bytes=gpu_mem, host_mem_bytes=host_mem, on_capacity="record")
        rows.append({"policy": policy.name, "tokens_per_step": policy.microbatches * policy.microbatch_size
                     * args.seq_len, "tokens_per_s": res.tokens_per_s, "iteration_s": res.iteration_s,
                     "peak_gpu_bytes": res.peak_gpu_bytes, "peak_host_bytes": res.peak_host_bytes,
                     "host_bytes_per_param": res.host_bytes_per_param, "fits": res.fits,
                     "why": _over_capacity(res.peak_bytes, res.capacity_bytes),
                     "first_violation": res.violation or "", "bottleneck": res.critical_path.bottleneck,
                     "packs": len(sched.pack_layers), "trace": _trace_json(trace), "detail": res.to_json()})
        if first is None:
            first = res
    if bar is not None:
        bar.close()
    wrote = []
    if first is not None and args.trace:
        _write_new(Path(args.trace), json.dumps(first.timeline.to_chrome_trace()))
        wrote.append(f"wrote {args.trace} (Chrome trace of {rows[0]['policy']}; open in Perfetto)")
    if first is not None and args.plot:
        from tinypipe.plot import plot_timeline

        _plot(plot_timeline, first.timeline, args.plot)
        wrote.append(f"wrote {args.plot} (timeline of {rows[0]['policy']})")
    if args.json:
        for line in wrote:
            print(line, file=sys.stderr)
        return _print_json({"model": args.model, "hardware": args.hardware, "seq_len": args.seq_len,
                            "results": rows})
    print(f"{args.model} on {args.hardware}, seq {args.seq_len}, {args.iterations} iterations simulated")
    traces = {t.microbatch_size: t for _, _, _, t in workloads}
    for size, t in sorted(traces.items()):
        print(f"trace for microbatch size {size}: {'analytic' if t.analytic else 'measured'} ({_clip(t.source)})")
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
    return 0


def _cmd_search(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from tinypipe import table
    from tinypipe.hardware import load_hardware
    from tinypipe.hfconfig import load_model
    from tinypipe.search import SearchSpace, SearchTarget, describe, search
    from tinypipe.sim.evaluate import SimEvaluator
    from tinypipe.trace import find_trace, load_profiles
    from tinypipe.units import parse_bytes

    for flag in ("seq_len", "batch_tokens", "top"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.workers is not None:
        _positive("--workers", args.workers)
    if args.batch_tokens % args.seq_len:
        raise InputError(f"--batch-tokens: {args.batch_tokens} is not a multiple of --seq-len {args.seq_len}")
    _check_outputs(out=args.out, plot=args.plot)
    model = load_model(args.model)
    hw = load_hardware(args.hardware)
    w = SearchTarget(model, hw, args.seq_len, args.batch_tokens // args.seq_len,
                     gpu_mem_bytes=parse_bytes(args.gpu_mem, "--gpu-mem") if args.gpu_mem else None,
                     host_mem_bytes=parse_bytes(args.host_mem, "--host-mem") if args.host_mem else None,
                     profiles=load_profiles(args.profile or ()), dtype=args.dtype)
    space = SearchSpace(optimizers=("sync", "async") if args.allow_async else ("sync",))
    measured = sorted({t.microbatch_size for t in w.profiles
                       if find_trace([t], model, hw.gpus[0].model, t.microbatch_size, w.seq_len, w.dtype)})
    if w.profiles and not measured:
        print(f"note: no --profile trace is for {hw.gpus[0].model} / {model.name} / seq {w.seq_len} / {w.dtype}; "
              "the search uses the shipped or analytic traces", file=sys.stderr)
    elif measured and tuple(measured) != space.microbatch_sizes:  # measured and analytic times do not compare
        space = dataclasses.replace(space, microbatch_sizes=tuple(measured))
        print(f"note: searching microbatch sizes {', '.join(map(str, measured))}, those --profile measured",
              file=sys.stderr)
    workers = args.workers or (os.cpu_count() or 1)
    bar = None if args.json else Progress("search")
    if bar is not None:
        bar.phase(f"search: {model.name} on {hw.name}, {workers} worker process(es)")
    evaluate = SimEvaluator(model, hw, args.seq_len, w.gpu_mem_bytes, w.host_mem_bytes, profiles=w.profiles,
                            dtype=w.dtype)
    result = search(w, evaluate, space=space, workers=workers, progress=bar)
    if bar is not None:
        bar.close()
    if args.out and result.winner is not None:
        _write_new(Path(args.out), result.winner.policy.replace(name="searched").dumps())
    if args.plot:
        from tinypipe.plot import plot_pareto

        _plot(plot_pareto, result, args.plot)
        print(f"wrote {args.plot} (Pareto front)", file=sys.stderr)
    if args.json:
        _print_json({"model": model.name, "hardware": hw.name, "seq_len": w.seq_len,
                            "batch_sequences": w.batch_sequences, "considered": result.considered,
                            "pruned": result.pruned, "rejected_by_memory_bound": result.rejected,
                            "simulated": len(result.ranked) - result.rejected,
                            "winner": result.winner.to_json() if result.winner else None,
                            "top": [e.to_json() for e in result.ranked[:args.top]],
                            "pareto": [e.to_json() for e in result.pareto()], "advice": result.advice})
        if result.winner is None:
            raise InputError(f"nothing fits {model.name} on {hw.name} (the advice is in the JSON)")
        return 0
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

    print("top candidates:")
    print(table.render(["#", "tokens/s", "peak GPU", "peak host", "policy"],
                       rows([e for e in result.ranked if e.fits][:args.top]), align="rrrrl"))
    print("\nPareto front (tokens/s vs peak GPU vs peak host):")
    print(table.render(["#", "tokens/s", "peak GPU", "peak host", "policy"], rows(result.pareto()), align="rrrrl"))
    if args.out:
        print(f"\nwrote the winner to {args.out}")
    return 0


def _trace_json(trace: Any) -> dict[str, Any]:
    return {"measured": not trace.analytic, "gpu_model": trace.gpu_model, "model": trace.model, "dtype": trace.dtype,
            "microbatch_size": trace.microbatch_size, "seq_len": trace.seq_len, "source": trace.source}


def _clip(text: str, width: int = 110) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _over_capacity(peak: dict[str, int], capacity: dict[str, int]) -> str:
    """`host 143.75 > 64.00 GiB; GPU 46.42 > 24.00 GiB` for every kind of device over its capacity."""
    from tinypipe.units import GIB

    parts = []
    for label, devs in (("host", [d for d in peak if d == "host"]), ("GPU", [d for d in peak if d != "host"])):
        over = [d for d in devs if peak[d] > capacity.get(d, peak[d])]
        if over:
            d = max(over, key=lambda x: peak[x] - capacity[x])
            parts.append(f"{label} {peak[d] / GIB:.2f} > {capacity[d] / GIB:.2f} GiB")
    return "; ".join(parts)


def _cmd_profile(args: argparse.Namespace) -> int:
    try:
        from tinypipe.backends.profile.command import profile_main
    except ImportError as exc:
        raise InputError(f"`tinypipe profile` needs the torch extra: pip install 'tinypipe[torch]' ({exc})") from None
    status: int = profile_main(args)
    return status


def _cmd_run(args: argparse.Namespace) -> int:
    if getattr(args, "_run_missing", None):
        raise InputError(f"`tinypipe run` needs the torch extra: pip install 'tinypipe[torch]' ({args._run_missing})")
    from tinypipe.backends.run import run_main

    status: int = run_main(args)
    return status


_HANDLERS: dict[str | None, Callable[[argparse.Namespace], int]] = {
    "inspect": _cmd_inspect, "simulate": _cmd_simulate, "run": _cmd_run, "search": _cmd_search,
    "profile": _cmd_profile,
}


def _cmd_replay(args: argparse.Namespace) -> int:
    from tinypipe.replay_command import replay_main
    from tinypipe.sim import simulate
    from tinypipe.sim.rendezvous import pair_sends

    return replay_main(args, simulate=simulate, pair_sends=pair_sends)


_HANDLERS["replay"] = _cmd_replay


# ---- helpers -------------------------------------------------------------------------------------

def _positive(flag: str, v: int) -> None:
    if v < 1:
        raise InputError(f"{flag}: must be >= 1, got {v}")


def _print_json(obj: Any) -> int:
    print(json.dumps(obj, indent=2, default=str))
    return 0


def _print_list(kind: str, names: list[str], as_json: bool) -> int:
    if as_json:
        return _print_json(names)
    print(f"shipped {kind}: " + ", ".join(names))
    return 0


def _check_outputs(**paths: str | None) -> None:
    """Fail before any work when an output file cannot be written (`--plot` also needs matplotlib)."""
    from tinypipe.outputs import check_file

    for flag, value in paths.items():
        if value is None:
            continue
        check_file(Path(value), "--" + flag.replace("_", "-"))
        if flag == "plot":
            from tinypipe.plot import _pyplot

            formats = _pyplot().gcf().canvas.get_supported_filetypes()
            suffix = Path(value).suffix.lower().lstrip(".")
            if suffix and suffix not in formats:
                raise InputError(f"--plot {value}: .{suffix} is not a picture format; end the name with .png "
                                 f"(or .{', .'.join(sorted(f for f in formats if f != 'png'))})")


def _plot(draw: Callable[..., Any], what: Any, path: str) -> None:
    """Draw a PNG; a file that cannot be written is an InputError."""
    try:
        draw(what, path)
    except OSError as exc:
        raise InputError(f"{path}: cannot write: {exc.strerror or exc}") from None


def _write_new(path: Path, text: str) -> None:
    """Write an output file atomically (temp file + rename) so a failure never leaves half a file."""
    if path.is_dir():
        raise InputError(f"{path}: is a directory; give a file name")
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise InputError(f"{path}: cannot write: {exc.strerror}") from None


if __name__ == "__main__":
    raise SystemExit(main())
