"""PyTorch FSDP2 with CPU offload, as its documentation sets it up: `fully_shard` on every decoder layer
and on the whole model, `CPUOffloadPolicy` (sharded fp32 parameters, their gradients and the optimizer
state in pinned host memory; the optimizer steps on the CPU), `MixedPrecisionPolicy` (bf16 parameters for
compute, fp32 gradient reduction), Hugging Face activation checkpointing of every decoder layer,
`torch.optim.AdamW(fused=True)` over the CPU-resident DTensor parameters (PyTorch's fastest CPU AdamW;
FSDP2 itself brings no optimizer). Synchronous only. One process per GPU (torchrun for more than one).

    python -m peers.peer_fsdp2 --config DIR --result PREFIX [--gpu-mem-gib 24] ...   (PYTHONPATH=bench)
"""

from __future__ import annotations

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
from peers.workload import BETAS, EPS, LR, WEIGHT_DECAY, workload_of


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from peers.hfmodel import build_model, count_params, enable_checkpointing, token_batch

    args = peer_parser(__doc__.splitlines()[0]).parse_args(argv)
    if args.mode != "sync":
        raise SystemExit("peer_fsdp2: FSDP2 has no asynchronous optimizer; --mode sync only")
    work = workload_of(args)
    if work.lora is not None:
        raise SystemExit("peer_fsdp2: trains every parameter; --lora is not set up for it (the runner skips it)")
    rank, world, local = dist_env()
    cuda = args.device == "cuda"
    rec = Recorder(args.result, rank, system="fsdp2", mode="sync", world=world, steps=args.steps,
                   warmup_steps=args.warmup, versions=versions("torch", "transformers"))
    t0 = time.perf_counter()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        rec.set(cap=cap_gpus(args.gpu_mem_gib, [local]))
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    try:
        mesh = init_device_mesh(device.type, (world,))
        model = build_model(args.config, dtype=torch.float32, seed=work.seed, init_device=device)
        params, vocab = count_params(model), model.config.vocab_size
        checkpointing = enable_checkpointing(model)
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=cuda)
        for block in model.model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mixed, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mixed, offload_policy=offload)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                      fused=True)
        passes = work.passes(world)
        rec.set(params=params, setup_s=time.perf_counter() - t0, device=device_name(cuda),
                details=_details(passes, checkpointing))

        def step(k: int) -> Any:
            ids = token_batch(work, vocab, step=k, rank=rank, world=world).to(device)
            total = torch.zeros((), device=device)
            for mb in ids.split(work.microbatch_size):
                loss = model(input_ids=mb, labels=mb).loss / passes
                loss.backward()
                total += loss.detach()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return total

        rec.set(**reset_gpu_peaks([local], cuda))
        timed_steps(step, rec, steps=args.steps, sync=synchronizer([local], cuda))
        rec.set(**gpu_memory([local], cuda), **host_memory(), done=True)
    finally:
        dist.destroy_process_group()
    return 0


def _details(passes: int, checkpointing: str) -> dict[str, Any]:
    return {"sharding": "fully_shard per decoder layer and on the root",
            "offload": "CPUOffloadPolicy(pin_memory=True): fp32 sharded parameters, gradients and AdamW state on "
                       "the host; the optimizer steps there",
            "precision": "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
            "optimizer": "torch.optim.AdamW(fused=True) on CPU DTensor parameters",
            "activation_checkpointing": f"every decoder layer, transformers {checkpointing}",
            "microbatches_per_step": passes, "attention": "sdpa"}


if __name__ == "__main__":
    raise SystemExit(guarded(main))
