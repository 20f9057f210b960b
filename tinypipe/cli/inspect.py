"""`tinypipe inspect`: models, hardware and compiled schedules."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.describe.target import host_mem_bytes

from .edge import checked, lora_of, planning, workload_of
from .util import check_outputs, policies, positive, print_json, print_list, write_new


def cmd_inspect(args: argparse.Namespace) -> int:
    if args.what == "model":
        return cmd_inspect_model(args)
    if args.what == "coverage":
        return cmd_inspect_coverage(args)
    if args.what == "hardware":
        return cmd_inspect_hardware(args)
    if args.what == "schedule":
        return cmd_inspect_schedule(args)
    raise InputError("inspect: say what to inspect: model, hardware or schedule")


def cmd_inspect_model(args: argparse.Namespace) -> int:
    """`inspect model`: per-layer sizes, pack footprints, host bytes and fit on each server (no name: the list)."""
    from tinypipe.cli.inspect_tables import model_report
    from tinypipe.common import table
    from tinypipe.describe.hardware import load_hardware, shipped_hardware
    from tinypipe.describe.hfconfig import load_model, shipped_models

    positive("--seq-len", args.seq_len)  # checked even when only the names are listed: never ignored
    positive("--microbatch-size", args.microbatch_size)
    given = [load_hardware(h) for h in args.hardware or ()]
    if args.name is None:
        return print_list("models", shipped_models(), args.json)
    if not args.name.strip():
        raise InputError("inspect model: the model name is empty; give a shipped name or a config.json path")
    model = load_model(args.name)
    if args.seq_len > model.max_seq_len:
        raise InputError(f"--seq-len {args.seq_len}: {model.name} handles at most {model.max_seq_len:,} positions")
    hws = given or [load_hardware(h) for h in shipped_hardware()]
    if args.host_mem:
        host_bytes = host_mem_bytes(args.host_mem)
        hws = [dataclasses.replace(hw, name=f"{hw.name} ({table.gib(host_bytes)} host)",
                                   host=dataclasses.replace(hw.host, memory_bytes=host_bytes)) for hw in hws]
    rep = model_report(model, seq_len=args.seq_len, microbatch_size=args.microbatch_size, hardware=hws,
                       lora=lora_of(args))
    if args.json:
        return print_json(rep)
    _print_model(rep)
    return 0


def _print_model(rep: dict[str, Any]) -> None:
    """`inspect model`'s report for people."""
    from tinypipe.common import table

    print(f"{rep['model']} ({rep['family']}): {rep['params']:,} parameters, {rep['blocks']} blocks, "
          f"hidden {rep['hidden_size']}, vocab {rep['vocab_size']}"
          + (", tied embeddings" if rep["tied_embeddings"] else ""))
    moe = next((r for r in rep["layers"] if r["experts"]), None)
    if moe is not None:
        print(f"mixture of experts: {rep['active_params']:,} parameters active per token ({moe['experts_per_token']} "
              f"of {moe['experts']} experts, {table.human_bytes(moe['expert_bf16_bytes'])} each in bf16); "
              "FLOPs count the active ones, host memory and whole-layer uploads all of them")
    print(f"source: {rep['source']}")
    print(f"bf16 weights: {table.gib(rep['bf16_bytes'])}; seq {rep['seq_len']}, microbatch "
          f"{rep['microbatch_size']} sequence(s)\n")
    rows = [[r["name"] if r["count"] == 1 else f"{r['name']}..{r['last'].split('.')[-1]} (x{r['count']})",
             r["params"], table.human_bytes(r["bf16_bytes"]), r["fwd_flops_per_token"] / 1e6,
             r["saved_act_bytes_per_token"], r["boundary_bytes_per_token"]] for r in rep["layers"]]
    print(table.render(["layer", "params", "bf16", "fwd MFLOP/token", "saved act B/token",
                        "boundary B/token"], rows, align="lrrrrr"))
    print("\nGPU memory to train on one GPU in packs of k layers, swapped whole with the next pack prefetched "
          "(the GPU-memory formula: weights, gradients, every microbatch's saved inputs, transients):")
    print(table.render(["k", "GPU bytes"], [[p["layers"], table.gib(p["gpu_bytes"])] for p in rep["packs"]],
                       align="rr"))
    print("\nHost memory (fp32 master + AdamW; compact-bf16 / -8bit: the moments in bf16 / 8-bit blocks, "
          "--optimizer-state):")
    rows = [[lay, round(h["bytes_per_param"], 2), table.gib(h["total_bytes"])] for lay, h in rep["host"].items()]
    print(table.render(["host memory", "bytes/param", "total"], rows, align="lrr"))
    print(f"\nCan it be trained at all? (needs >= {table.gib(rep['min_gpu_bytes'])} per GPU: the largest "
          "layer's backward, with its weights, gradient, activations and workspace)")
    lo = rep["lora"]
    print(f"\nLoRA on a frozen base (r={lo['rank']}, alpha={lo['alpha']:g}, targets {','.join(lo['targets'])}; "
          f"--lora R sets them): {lo['adapter_params']:,} adapter parameters, which stay on the GPUs with "
          f"their AdamW state; the host holds one "
          + (f"copy of the base with its block linears in NF4, {table.gib(lo['host_bytes'])} "
             f"({lo['host_bytes'] / rep['params']:.2f} bytes/param)" if lo.get("nf4") else
             f"bf16 copy of the base, {table.gib(lo['host_bytes'])} (2 bytes/param)")
          + f"; a GPU needs >= {table.gib(lo['min_gpu_bytes'])}")
    rows = [[f["hardware"], f["gpus"], table.gib(f["gpu_bytes"]), table.gib(f["host_bytes"]), f["gpu_fits"],
             f["host_fits_replicated"], f["host_fits_compact"], f["host_fits_compact-bf16"],
             f["host_fits_compact-8bit"], f["resident_fits"], f["lora_fits"]] for f in rep["fit"]]
    print(table.render(["hardware", "GPUs", "GPU mem", "host DRAM", "GPU ok", "host ok (replicated)",
                        "host ok (compact)", "(bf16 state)", "(8bit state)", "all-resident ok", "LoRA ok"], rows,
                       align="lrrrlllllll"))


def cmd_inspect_hardware(args: argparse.Namespace) -> int:
    """`inspect hardware`: a server's nodes, links and routes (no name: the shipped presets)."""
    from tinypipe.cli.inspect_tables import hardware_report
    from tinypipe.common import table
    from tinypipe.describe.hardware import HOST, load_hardware, shipped_hardware

    if args.name is not None and not args.name.strip():
        raise InputError("inspect hardware: the name is empty; give a preset name or a hardware JSON path")
    if args.name is None:
        hws = [load_hardware(n) for n in shipped_hardware()]
        if args.json:
            return print_json([hardware_report(h) for h in hws])
        rows = [[h.name, h.provenance, len(h.gpus), h.gpus[0].model, table.gib(h.gpus[0].memory_bytes),
                 table.gib(h.host.memory_bytes), h.route(HOST, h.gpus[0].name).bottleneck_gbps]
                for h in hws]
        print(table.render(["name", "provenance", "GPUs", "GPU", "GPU mem", "host DRAM", "host->gpu0 GB/s"],
                           rows, align="llrlrrr"))
        return 0
    rep = hardware_report(load_hardware(args.name))
    if args.json:
        return print_json(rep)
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


def cmd_inspect_coverage(args: argparse.Namespace) -> int:
    """`inspect coverage`: per server and host size, the largest model each system fully fine-tunes."""
    from tinypipe.common import table
    from tinypipe.describe.hardware import load_hardware, shipped_hardware
    from tinypipe.describe.hfconfig import load_model
    from tinypipe.estimate.coverage import (
        COVERAGE_MODELS,
        LORA,
        MOE_COVERAGE_MODELS,
        PEER_BYTES_PER_PARAM,
        PEER_LORA_BYTES_PER_PARAM,
        coverage,
        moe_coverage,
    )

    positive("--seq-len", args.seq_len)
    models = [load_model(n) for n in COVERAGE_MODELS]
    moe_models = [load_model(n) for n in MOE_COVERAGE_MODELS]
    out: list[dict[str, Any]] = []
    for name in args.hardware or shipped_hardware():
        hw = load_hardware(name)
        out.append({"hardware": hw.name, "gpus": len(hw.gpus), "gpu_model": hw.gpus[0].model,
                    "rows": coverage(hw, models, seq_len=args.seq_len),
                    "moe": moe_coverage(hw, moe_models, seq_len=args.seq_len)})
    if args.json:
        return print_json({"models": list(COVERAGE_MODELS), "moe_models": list(MOE_COVERAGE_MODELS),
                           "seq_len": args.seq_len, "lora": LORA.text(),
                           "peer_bytes_per_param": {**PEER_BYTES_PER_PARAM, **PEER_LORA_BYTES_PER_PARAM},
                           "servers": out})
    print(f"The largest of {', '.join(COVERAGE_MODELS)} that each system fine-tunes (AdamW), fully or with LoRA "
          f"({LORA.text()}), by host DRAM; tinypipe: compact host state + gradient ring (LoRA: one bf16 copy of "
          f"the base; LoRA 4-bit: its block linears as NF4, 4.5 bits a parameter, --load-in-4bit), a layer's "
          f"backward at seq {args.seq_len} on one GPU; peers: "
          + ", ".join(f"{k} {v:g} B/param" for k, v in {**PEER_BYTES_PER_PARAM, **PEER_LORA_BYTES_PER_PARAM}.items())
          + " of host memory (tinypipe/estimate/coverage.py cites each)")
    for server in out:
        rows = server["rows"]
        keys = [k for k in rows[0] if k not in ("host_gib", "gpu_bytes")]
        print(f"\n{server['hardware']} ({server['gpus']} x {server['gpu_model']}, "
              f"{table.gib(rows[0]['gpu_bytes'])} each)")
        print(table.render(["host DRAM", *keys], [[f"{r['host_gib']} GiB", *(r[k] or "-" for k in keys)]
                                                  for r in rows], align="r" + "l" * len(keys)))
    _print_moe_coverage(out)
    return 0


def _print_moe_coverage(servers: list[dict[str, Any]]) -> None:
    """The mixture-of-experts part of `inspect coverage`: each server as it is, each MoE model, what fits."""
    from tinypipe.common import table

    print("\nMixture-of-experts models on each server as it is (its own host DRAM): full fine-tuning with each "
          "moment precision, and LoRA; host state and uploads follow the total parameters, FLOPs the active ones")
    keys = [k for k in servers[0]["moe"][0] if k.startswith("tinypipe")]
    rows = [[s["hardware"], table.gib(r["host_bytes"]), r["model"], f"{r['params'] / 1e9:.1f}B",
             f"{r['active_params'] / 1e9:.1f}B", *("yes" if r[k] else "no" for k in keys)]
            for s in servers for r in s["moe"]]
    print(table.render(["server", "host DRAM", "model", "params", "active", *keys], rows,
                       align="lrlrr" + "l" * len(keys)))


def cmd_inspect_schedule(args: argparse.Namespace) -> int:
    from tinypipe.common import table
    from tinypipe.compiler import compile_schedule
    from tinypipe.compiler.validate import validate
    from tinypipe.ir.schedule import grid

    positive("--steps", args.steps)
    checked(args, "seq_len", "iterations", "microbatches", "microbatch_size")
    check_outputs(out=args.out)
    hardware, given, profiles = planning(args)
    workload = workload_of(args, profiles)
    ((policy, trace),) = policies(workload, hardware, [args.policy], given)
    sched = compile_schedule(policy, workload.model, hardware, trace, iterations=args.iterations)
    validate(sched)
    if args.out:
        write_new(Path(args.out), sched.dumps())
    counts = sched.counts()
    if args.json:
        return print_json({"actions": len(sched.actions), "packs": [list(p) for p in sched.pack_layers],
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


