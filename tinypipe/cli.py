"""The `tinypipe` command: inspect, simulate, search, run. The one core module that may import sim/backends.

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
    p.add_argument("--json", action="store_true", help="print JSON for programs instead of tables")


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

    sim = sub.add_parser("simulate", help="simulate policies side by side on one workload")
    _common_workload(sim)
    sim.add_argument("--policy", action="append", help="preset name or policy JSON (repeatable; "
                     "default: resident, mobius, tinypipe)")
    sim.add_argument("--gpu-mem", help="limit per GPU, e.g. 24GiB (default: the hardware's)")
    sim.add_argument("--host-mem", help="host DRAM limit, e.g. 256GiB (default: the hardware's)")
    sim.add_argument("--trace", help="write a Chrome trace (Perfetto) of the first policy")
    sim.add_argument("--plot", help="write a PNG timeline of the first policy")

    try:
        from tinypipe.search_cli import add_search_parser
    except ImportError:  # pragma: no cover - search not built yet
        pass
    else:
        add_search_parser(sub)

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
        if handler is None:
            build_parser().print_help()
            return EXIT_USAGE
        return handler(args)
    except TinypipeError as exc:
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
        from tinypipe.inspection import model_report
        from tinypipe.model import load_model, shipped_models

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
                 r["params"], table.human_bytes(r["bf16_bytes"]), round(r["fwd_flops_per_token"] / 1e6, 1),
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


def _workload(args: argparse.Namespace, policy_name: str) -> tuple[Any, Any, Any, Any]:
    """Model, hardware, policy (with CLI overrides) and trace for one policy name."""
    from tinypipe.hardware import load_hardware
    from tinypipe.model import load_model
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
    trace = trace_for(model, hw.gpus[0], microbatch_size=policy.microbatch_size, seq_len=args.seq_len)
    return model, hw, policy, trace


def _cmd_inspect_schedule(args: argparse.Namespace) -> int:
    from tinypipe import table
    from tinypipe.compile import compile_schedule
    from tinypipe.schedule import grid
    from tinypipe.validate import validate

    model, hw, policy, trace = _workload(args, args.policy)
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
    results = []
    first = None
    for name in names:
        model, hw, policy, trace = _workload(args, name)
        try:
            sched = compile_schedule(policy, model, hw, trace, iterations=args.iterations)
        except InputError as exc:
            results.append({"policy": policy.name, "fits": False, "why": str(exc)})
            continue
        res = simulate(sched, model, hw, trace, gpu_mem_bytes=gpu_mem, host_mem_bytes=host_mem, on_capacity="record")
        row = {"policy": policy.name, **res.to_json()}
        results.append(row)
        if first is None:
            first = (sched, res)
    if first is not None and (args.trace or args.plot):
        tl = first[1].timeline
        if args.trace:
            _write_new(Path(args.trace), json.dumps(tl.to_chrome_trace()))
        if args.plot:
            from tinypipe.plot import plot_timeline

            plot_timeline(tl, args.plot)
    if args.json:
        return _print_json({"model": args.model, "hardware": args.hardware, "seq_len": args.seq_len,
                            "results": results})
    print(f"{args.model} on {args.hardware}, seq {args.seq_len}\n")
    rows = []
    for r in results:
        if "tokens_per_s" not in r:
            rows.append([r["policy"], "-", "-", "-", "-", "-", "no: " + r["why"]])
            continue
        rows.append([r["policy"], round(r["tokens_per_s"]), round(r["iteration_s"], 3),
                     table.gib(r["peak_gpu_bytes"]), table.gib(r["peak_host_bytes"]),
                     round(r["host_bytes_per_param"], 2), "yes" if r["fits"] else "no: " + r["why"]])
    print(table.render(["policy", "tokens/s", "iteration s", "peak GPU", "peak host", "host B/param", "fits"],
                       rows, align="lrrrrrl"))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    if getattr(args, "_run_missing", None):
        raise InputError(f"`tinypipe run` needs the torch extra: pip install 'tinypipe[torch]' ({args._run_missing})")
    from tinypipe.backends.run import run_main

    return run_main(args)


def _cmd_search(args: argparse.Namespace) -> int:
    from tinypipe.search_cli import search_main

    return search_main(args)


_HANDLERS: dict[str | None, Callable[[argparse.Namespace], int]] = {
    "inspect": _cmd_inspect, "simulate": _cmd_simulate, "run": _cmd_run, "search": _cmd_search,
}


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
