"""DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU (ZeRO-Offload / ZeRO-Infinity's
CPU tier): bf16 compute, fp32 master partitions and AdamW state on the host, DeepSpeed's own CPU AdamW
(`DeepSpeedCPUAdam`, a C++ op that DeepSpeed builds with the host compiler the first time it is used),
Hugging Face activation checkpointing of every decoder layer, DeepSpeed's gradient accumulation over
microbatches of 4 sequences. Every other ZeRO-3 setting is DeepSpeed's default. Synchronous only. One
process per GPU (torchrun for more than one).

    python -m peers.peer_deepspeed --config DIR --result PREFIX ...  (PYTHONPATH=<deepspeed site>:bench)

DeepSpeed is imported here, inside the run: it is installed (bench/device/peers.sh) into a directory of
its own, which only this script's process sees.
"""

from __future__ import annotations

import os
import time
from typing import Any

from peers.measure import (
    Recorder,
    cap_gpus,
    device_name,
    dist_env,
    gpu_memory,
    guarded,
    host_memory,
    peer_parser,
    reset_gpu_peaks,
    synchronizer,
    timed_steps,
    versions,
)
from peers.workload import BETAS, EPS, LR, WEIGHT_DECAY, Workload, workload_of

INSTALL_LOG_ENV = "PEERS_INSTALL_LOG"  # the runner names the install's log here; its tail explains an import error


def ds_config(work: Workload, world: int) -> dict[str, Any]:
    """The DeepSpeed config: the workload's batch, bf16, ZeRO-3 with both offloads to pinned CPU memory."""
    return {
        "train_micro_batch_size_per_gpu": work.microbatch_size,
        "gradient_accumulation_steps": work.passes(world),
        "train_batch_size": work.sequences,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "gradient_clipping": 0.0,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def _import_deepspeed() -> Any:
    try:
        import deepspeed
    except Exception as exc:  # noqa: BLE001 - any import failure is reported with the install's log
        log = os.environ.get(INSTALL_LOG_ENV)
        tail = ""
        if log and os.path.exists(log):
            with open(log, errors="replace") as f:
                tail = "".join(f.readlines()[-15:])
        raise RuntimeError(f"deepspeed is not importable ({type(exc).__name__}: {exc}); the install's log "
                           f"{log or '(none given)'} ends:\n{tail}") from exc
    return deepspeed


def main(argv: list[str] | None = None) -> int:
    import torch

    from peers.hfmodel import build_model, count_params, enable_checkpointing, token_batch

    args = peer_parser(__doc__.splitlines()[0]).parse_args(argv)
    if args.mode != "sync":
        raise SystemExit("peer_deepspeed: ZeRO-3 steps its optimizer synchronously; --mode sync only")
    if args.device != "cuda":
        raise SystemExit("peer_deepspeed: CUDA only")
    work = workload_of(args)
    if work.lora is not None:
        raise SystemExit("peer_deepspeed: trains every parameter; --lora is not set up for it (the runner skips it)")
    rank, world, local = dist_env()
    rec = Recorder(args.result, rank, system="deepspeed", mode="sync", world=world, steps=args.steps,
                   warmup_steps=args.warmup, versions=versions("torch", "transformers", "deepspeed"))
    t0 = time.perf_counter()
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    rec.set(cap=cap_gpus(args.gpu_mem_gib, [local]))
    deepspeed = _import_deepspeed()
    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
    model = build_model(args.config, dtype=torch.bfloat16, seed=work.seed, init_device=device)
    params, vocab = count_params(model), model.config.vocab_size
    checkpointing = enable_checkpointing(model)
    config = ds_config(work, world)
    t_init = time.perf_counter()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                                   config=config)
    inner = getattr(optimizer, "optimizer", optimizer)
    rec.set(params=params, setup_s=time.perf_counter() - t0, device=device_name(True),
            details={"ds_config": config, "initialize_s": time.perf_counter() - t_init,
                     "optimizer": f"{type(optimizer).__name__} over {type(inner).__name__}",
                     "activation_checkpointing": f"every decoder layer, transformers {checkpointing}",
                     "microbatches_per_step": work.passes(world), "attention": "sdpa"})

    def step(k: int) -> Any:
        ids = token_batch(work, vocab, step=k, rank=rank, world=world).to(device)
        total = torch.zeros((), device=device)
        for mb in ids.split(work.microbatch_size):
            loss = engine(input_ids=mb, labels=mb).loss
            engine.backward(loss)  # scales by 1 / gradient_accumulation_steps
            engine.step()  # the optimizer steps at the accumulation boundary only
            total += loss.detach() / work.passes(world)
        return total

    rec.set(**reset_gpu_peaks([local], True))
    timed_steps(step, rec, steps=args.steps, sync=synchronizer([local], True))
    rec.set(**gpu_memory([local], True), **host_memory(), done=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(guarded(main))
