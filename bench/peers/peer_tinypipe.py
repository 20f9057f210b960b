"""tinypipe through the same calls as `tinypipe run` (bench/cuda_bench.py's way: `make_run_plan`, then
`launch`, with the fine-tuned model's saving switched off): the policy `tinypipe search` finds for this
model, machine and GPU memory cap (variant `searched`), or the `mobius` preset with microbatches of 4
sequences; the optimizer synchronous, or asynchronous (staleness 1) by setting the policy's `optimizer`.
Blocks compiled (`--compile`, the CUDA default), bf16 compute, fp32 masters and AdamW state on the host,
the GPU memory cap by `--gpu-mem` (planned for, and PyTorch's allocator capped at it in each worker).
With `--lora R`: `--lora R --lora-alpha A --lora-dropout 0 --lora-targets all` to the search and the run
(tinypipe's own LoRA linears on the frozen base: the rank, scaling and linears of peft's on RoundPipe).

    python -m peers.peer_tinypipe --config DIR --result PREFIX --variant searched ...   (PYTHONPATH=bench)

Data: tinypipe has no random-token source; it trains on its embedded, seeded addition task (byte-level
token ids, packed into full sequences). What a step costs does not depend on the ids: the embedding
gathers rows and the LM head computes every position over the whole vocabulary whatever the labels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peers.measure import Recorder, guarded, peer_parser, versions
from peers.workload import BETAS, EPS, LORA_DROPOUT, LORA_TARGETS, LR, WEIGHT_DECAY, Workload, workload_of

VARIANTS = ("searched", "mobius", "preset")
HOST_MEM_SHARE = 0.9  # the search may plan for this share of the host memory available when it runs


def main(argv: list[str] | None = None) -> int:
    p = peer_parser(__doc__.splitlines()[0])
    p.add_argument("--variant", choices=VARIANTS, default="searched")
    args = p.parse_args(argv)
    work = workload_of(args)
    backend = "cuda" if args.device == "cuda" else "cpu"
    rec = Recorder(args.result, 0, system="tinypipe", mode=args.mode, variant=args.variant, world=args.gpus,
                   steps=args.steps, warmup_steps=args.warmup, versions=versions("tinypipe", "torch", "transformers"))
    t0 = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="tp-peer-"))
    policy, search = _policy(args, work, backend, scratch)
    run_args = _run_args(args, work, backend, policy, scratch / "run")
    rec.set(cap={"method": "tinypipe --gpu-mem: planned for it, PyTorch's allocator capped at it in each worker"
                 if args.gpu_mem_gib is not None else "uncapped"},
            details={"search": search, "run_options": run_args})

    from tinypipe.backends.launch.prepare import make_run_plan
    from tinypipe.backends.launch.runtrace import timeline
    from tinypipe.backends.launch.spawn import launch
    from tinypipe.backends.options.run_flags import add_run_arguments
    from tinypipe.cli.edge import run_options

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    plan = make_run_plan(run_options(parser.parse_args(run_args)))
    job = dataclasses.replace(plan.job, save_model=False)
    sim = plan.prediction
    if plan.policy.lora is not None:
        from tinypipe.estimate.lora_costs import model_adapter_params

        rec.set(trainable_params=model_adapter_params(plan.spec, plan.policy.lora))
    rec.set(params=plan.spec.params, details={**rec.data["details"], "policy": plan.policy.to_json(),
                                              "packs": [len(x) for x in plan.schedule.pack_layers],
                                              "predicted_tokens_per_s": sim.tokens_per_s,
                                              "predicted_peak_gpu_bytes": sim.peak_gpu_bytes,
                                              "trace": plan.trace.source[:200]})
    try:
        results = launch(job, plan.world)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert results is not None  # not under torchrun
    ranks = sorted(results, key=lambda r: r.rank)
    losses: dict[int, float] = {}
    for r in ranks:
        losses.update(r.losses)
    pinned = [r.pinned_peak_bytes for r in ranks]
    torch_pinned = [x.get("torch_allocator") for x in pinned]
    rec.set(iteration_s_each=timeline(plan, results).iteration_times_s(), losses=[losses[k] for k in sorted(losses)],
            setup_s=time.perf_counter() - t0 - max(r.wall_s for r in ranks), device=_device(backend),
            peak_gpu_bytes=[r.peak_device_bytes for r in ranks],
            peak_gpu_reserved_bytes=[r.peak_reserved_bytes for r in ranks],
            peak_host_rss_bytes=sum(r.peak_rss_bytes for r in ranks),  # the workers (the launcher's apart)
            pinned_host_bytes=sum(int(x.get("slabs") or 0) + int(x.get("torch_allocator") or 0) for x in pinned),
            pinned_note="per worker: its slabs registered with cudaHostRegister (peak) + PyTorch's pinned caching "
                        "allocator (peak" + (", not available in this torch)" if None in torch_pinned else ")")
                        + ", summed over workers: an upper bound",
            host_state_bytes=sum(int(r.held["total_bytes"]) for r in ranks), world=plan.world,
            launcher_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, done=True)
    return 0


def _policy(args: argparse.Namespace, work: Workload, backend: str, scratch: Path) -> tuple[str, dict[str, Any]]:
    """The --policy to run (a file) and what the search did (empty for a preset)."""
    from tinypipe.policy import load_policy

    search: dict[str, Any] = {}
    if args.variant == "searched":
        if backend != "cuda":
            raise SystemExit("peer_tinypipe: --variant searched plans for a CUDA machine; on the CPU use mobius "
                             "or preset")
        from tinypipe.backends.launch.prepare import cuda_hardware

        out = scratch / "searched.json"
        cmd = [sys.executable, "-m", "tinypipe.cli", "search",
               *_search_args(args, work, cuda_hardware(args.gpus, None).name,
                             int(HOST_MEM_SHARE * _available_host_bytes()), out)]
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"tinypipe search failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
        search = {"command": cmd, "seconds": time.perf_counter() - t}
        policy = load_policy(str(out))
    else:
        policy = load_policy("mobius" if args.variant == "mobius" else "tinypipe")
        policy = policy.replace(microbatch_size=work.microbatch_size)
    policy = policy.replace(optimizer=args.mode)
    path = scratch / f"{args.variant}-{args.mode}.json"
    path.write_text(json.dumps(policy.to_json(), indent=2) + "\n")
    return str(path), search


def _search_args(args: argparse.Namespace, work: Workload, hardware: str, host_mem_bytes: int, out: Path) -> list[str]:
    """`tinypipe search`'s options for this configuration."""
    argv = ["--model", _config_json(args.config), "--hardware", hardware, "--seq-len", str(work.seq_len),
            "--batch-tokens", str(work.batch_tokens), "--host-mem", str(host_mem_bytes), "--out", str(out),
            *_lora_args(work)]
    if args.gpu_mem_gib is not None:
        argv += ["--gpu-mem", f"{args.gpu_mem_gib}GiB"]
    return argv


def _run_args(args: argparse.Namespace, work: Workload, backend: str, policy: str, out: Path) -> list[str]:
    """`tinypipe run`'s options for this configuration."""
    argv = ["--backend", backend, "--gpus", str(args.gpus), "--model", _config_json(args.config), "--policy", policy,
            "--seq-len", str(work.seq_len), "--batch-tokens", str(work.batch_tokens), "--steps", str(args.steps),
            "--lr", str(LR), "--betas", str(BETAS[0]), str(BETAS[1]), "--eps", str(EPS),
            "--weight-decay", str(WEIGHT_DECAY), "--seed", str(work.seed), "--out", str(out),
            "--checkpoint-minutes", "0", *_lora_args(work)]
    if backend == "cuda":
        argv += ["--dtype", "bf16", "--compile"]
    if args.gpu_mem_gib is not None:
        argv += ["--gpu-mem", f"{args.gpu_mem_gib}GiB"]
    return argv


def _lora_args(work: Workload) -> list[str]:
    """`tinypipe run`'s and `search`'s LoRA options for the workload's adapters (none without --lora)."""
    from tinypipe.policy.lora_spec import ROLES

    if work.lora is None:
        return []
    roles = tuple(t.removesuffix("_proj") for t in LORA_TARGETS)
    targets = "all" if set(roles) == set(ROLES) else ",".join(roles)
    return ["--lora", str(work.lora.rank), "--lora-alpha", f"{work.lora.alpha:g}", "--lora-dropout",
            f"{LORA_DROPOUT:g}", "--lora-targets", targets]


def _config_json(directory: str) -> str:
    """The config.json itself: given a directory, `tinypipe run` looks for safetensors there; given the
    file (named config.json, so the model is named after its directory) it initialises from the seed."""
    return str(Path(directory) / "config.json")


def _available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (bytes)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def _device(backend: str) -> str:
    import torch

    if backend != "cuda":
        return "cpu"
    return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"


if __name__ == "__main__":
    raise SystemExit(guarded(main))
