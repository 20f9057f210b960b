"""RoundPipe 0.1.1 through its public API: `wrap_model_to_roundpipe` with its Llama sequential preset
(`use_sequential_preset=True`), the model in bf16 on the host (RoundPipe pins it and streams it through the
GPUs), fp32 optimizer copies (`optim_dtype=torch.float32`), stage recompute, RoundPipe's own CPU Adam
(`roundpipe.optim.Adam(decoupled_weight_decay=True)`, i.e. AdamW; a C++ op it builds on first use; torch's
fused CPU AdamW stands in, and the record says so, where that build fails), one `forward_backward` per step
over all the step's sequences in microbatches of 4, its chunked LM-head loss (`return_logits=False`), and
`RoundPipe.step(..., is_async=...)`: asynchronous (its default; the next step runs on weights one step
stale) or synchronous. RoundPipe drives every visible GPU from one process.

With `--lora R`: peft's LoRA adapters injected into the bare causal LM before wrapping, as RoundPipe's own
LoRA benchmark does (`LoraModel(hf_model, config, "default").model`, benchmark/train_lora.py in its
repository; `peft.inject_adapter_in_model` is that call), so that `wrap_model_to_roundpipe` still finds its
preset for the model's class. peft leaves only the adapters requiring grad; `optim_parameters()` makes fp32
optimizer copies of just those (roundpipe/roundpipe.py, `optim_named_parameters`), so AdamW steps the
adapters only. The adapters take the base's dtype (bf16, peft's tuner casts them to the base layer's):
bf16 compute, fp32 masters, like the full model here; `get_peft_model`'s fp32 upcast is not applied.

    python -m peers.peer_roundpipe --config DIR --result PREFIX ...  (PYTHONPATH=<roundpipe site>:bench)

RoundPipe needs transformers 4.5x (it breaks on 5.x); bench/device/peers.sh installs it, with
transformers 4.57, into a directory of its own that only this script's process sees.
"""

from __future__ import annotations

import time
from typing import Any

from peers.measure import (
    Recorder,
    cap_gpus,
    device_name,
    gpu_memory,
    guarded,
    host_memory,
    peer_parser,
    reset_gpu_peaks,
    synchronizer,
    timed_steps,
    versions,
)
from peers.workload import BETAS, EPS, LORA_DROPOUT, LORA_TARGETS, LR, WEIGHT_DECAY, Lora, workload_of

RECOMPUTE_GRAIN = "stage"  # RoundPipe's default


def main(argv: list[str] | None = None) -> int:
    import torch

    from peers.hfmodel import build_model, count_params, token_batch

    args = peer_parser(__doc__.splitlines()[0]).parse_args(argv)
    if args.device != "cuda":
        raise SystemExit("peer_roundpipe: CUDA only")
    work = workload_of(args)
    devices = list(range(torch.cuda.device_count()))
    if len(devices) != args.gpus:
        raise SystemExit(f"peer_roundpipe: {len(devices)} visible GPUs, --gpus {args.gpus} (set CUDA_VISIBLE_DEVICES)")
    rec = Recorder(args.result, 0, system="roundpipe", mode=args.mode, world=1, steps=args.steps,
                   warmup_steps=args.warmup,
                   versions=versions("torch", "transformers", "roundpipe", "huggingface_hub", "tokenizers", "beartype",
                                     *(("peft", "accelerate") if work.lora else ())))
    t0 = time.perf_counter()
    # before RoundPipe is imported: it sizes its stages from the free GPU memory it sees at import
    rec.set(cap=cap_gpus(args.gpu_mem_gib, devices))
    import roundpipe
    from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

    model = build_model(args.config, dtype=torch.bfloat16, seed=work.seed, init_device=torch.device("cuda", 0))
    params, vocab = count_params(model), model.config.vocab_size
    lora = _inject_lora(model, work.lora, work.seed) if work.lora else None
    torch.cuda.empty_cache()
    microbatches = work.passes(1)
    wrapped = wrap_model_to_roundpipe(model, use_sequential_preset=True, optim_dtype=torch.float32,
                                      model_run_config=RoundPipeRunConfig(num_microbatch=microbatches,
                                                                          recompute_grain=RECOMPUTE_GRAIN))
    optimizer_params = list(wrapped.optim_parameters())  # fp32 copies of the parameters that require grad
    optimizer, optimizer_name = _optimizer(optimizer_params)
    is_async = args.mode == "async"
    rec.set(params=params, setup_s=time.perf_counter() - t0, device=device_name(True),
            details={"optimizer": optimizer_name, "optim_dtype": "float32", "model_dtype": "bfloat16",
                     "num_microbatch": microbatches, "recompute_grain": RECOMPUTE_GRAIN,
                     "step": f"RoundPipe.step(fn, is_async={is_async})", "loss": "chunked (return_logits=False)",
                     "pin_model": "alloc (its default)", "attention": "sdpa",
                     "beartype_runtime_checks": bool(getattr(roundpipe, "ENABLE_BEAR", False)),
                     **({"lora": lora} if lora else {})},
            trainable_params=sum(p.numel() for p in optimizer_params))

    def step(k: int) -> Any:
        ids = token_batch(work, vocab, step=k, rank=0, world=1)
        loss = wrapped.forward_backward(input_kwargs={"input_ids": ids, "labels": ids, "return_logits": False},
                                        loss_fn=lambda outputs, _: outputs.loss / microbatches)
        wrapped.step(lambda: _step_and_zero(optimizer), is_async=is_async)
        return loss

    rec.set(**reset_gpu_peaks(devices, True))
    timed_steps(step, rec, steps=args.steps, sync=synchronizer(devices, True))
    wrapped.synchronize()  # let the last asynchronous step finish before the process ends
    rec.set(**gpu_memory(devices, True), **host_memory(), done=True)
    return 0


def _inject_lora(model: Any, lora: Lora, seed: int) -> dict[str, Any]:
    """peft's adapters into `model` in place (seeded); what was done, for the record. RuntimeError if
    anything but the adapters would train."""
    import peft
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(seed)  # peft draws A from the global generator (B starts at zero)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=LORA_DROPOUT,
                        target_modules=list(LORA_TARGETS), bias="none")
    inject_adapter_in_model(config, model)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not trainable or any("lora_" not in n for n in trainable):
        raise RuntimeError(f"after peft's injection the trainable parameters are not the adapters alone: "
                           f"{sorted(trainable)[:5]}")
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in trainable.values()})
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": LORA_DROPOUT, "targets": list(LORA_TARGETS),
            "how": "peft.inject_adapter_in_model(LoraConfig(...), model) before wrap_model_to_roundpipe (RoundPipe's "
                   "benchmark/train_lora.py: LoraModel(model, config, 'default').model)",
            "peft": peft.__version__, "adapter_tensors": len(trainable),
            "adapter_params": sum(p.numel() for p in trainable.values()),
            "adapter_dtype": "/".join(dtypes), "optimizer_copies": "float32 (optim_dtype)"}


def _optimizer(params: Any) -> tuple[Any, str]:
    """RoundPipe's CPU Adam in AdamW form; torch's fused CPU AdamW where RoundPipe's op does not build."""
    import torch

    params = list(params)
    try:
        from roundpipe.optim import Adam

        return (Adam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, decoupled_weight_decay=True),
                "roundpipe.optim.Adam(decoupled_weight_decay=True)")
    except Exception as exc:  # noqa: BLE001 - the build of its C++ op; recorded, not fatal
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        return (torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True),
                f"torch.optim.AdamW(fused=True) on the CPU: roundpipe.optim.Adam failed to build ({why})")


def _step_and_zero(optimizer: Any) -> None:
    optimizer.step()
    optimizer.zero_grad()


if __name__ == "__main__":
    raise SystemExit(guarded(main))
