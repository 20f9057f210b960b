"""Coverage: the largest model a server can fine-tune, by host memory, fully for tinypipe's optimizer-state
precisions and with LoRA, and for peers as their bytes per parameter predict.

tinypipe fits a model on a server when the host holds its state and a gradient ring (`hostmem.host_bytes`
of the compact layout with that moment precision, bf16 compute, sync optimizer: the search's memory bound)
and one GPU holds a layer's backward (`gpumem.least_peak_bytes`, for one sequence of `seq_len` tokens). Both
are floors: the search then simulates candidates (activations, a ring per GPU) and may find none fits. With
LoRA (`LORA`: r 16 on all seven linears) the host holds one compute-dtype copy of the base
(`lora_costs.frozen_host_bytes`) and the GPU a frozen layer's backward beside its adapters; with LoRA 4-bit
(`LORA_4BIT`) the host holds the base's block linears as NF4 (4.5 bits a parameter) and the rest in bf16. A peer
fits when its host bytes per parameter times the parameters fit the host; both peers stream layers, so
their GPU need is left aside (it favours them).

Peers' bytes per parameter (host, full fine-tuning with AdamW):
- RoundPipe 0.1.1: 21.9, measured on the 2xH200 host (163.8 GiB peak RSS for Llama-3.1-8B; DESIGN §8, from
  bench/results/peers_h200.json).
- RoundPipe 0.1.1 with peft LoRA (r=16, alpha 32, the seven linears of every block): 36 GiB peak host RSS for
  Llama-3.1-8B on one H200 (DESIGN §9, 2026-12-02): 4.8 bytes per parameter of the base.
- DeepSpeed ZeRO-Offload: at least 16: an fp32 master (4), fp32 gradients (4) and AdamW's two fp32 moments (8)
  in host memory (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC 2021,
  §4.1; DeepSpeed's ZeRO stage 2 CPU offload keeps fp32 gradient partitions on the host), before pinned
  buffers and allocator rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tinypipe.describe.hardware import Hardware
from tinypipe.describe.model import ModelSpec
from tinypipe.describe.trace import analytic_trace
from tinypipe.estimate import gpumem
from tinypipe.estimate.hostmem import host_bytes
from tinypipe.estimate.lora_costs import frozen_host_bytes
from tinypipe.estimate.plan import base_plan
from tinypipe.policy.lora_spec import ROLES, LoraSpec
from tinypipe.policy.modes import ActivationHome, HostMemory, OptimizerMode, OptimizerState
from tinypipe.policy.policy import PRESETS

COVERAGE_MODELS = ("qwen3-1.7b", "qwen3-4b", "llama-3.1-8b", "qwen3-14b", "qwen3-32b", "llama-3.1-70b")
# mixture-of-experts models, sized on each server as it is (`moe_coverage`): their host state follows the total
# parameters and their compute the active ones, so "the largest model" by parameters says little of them
MOE_COVERAGE_MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b")
HOST_SIZES_GIB = (64, 128, 256, 512, 1024)
PEER_BYTES_PER_PARAM = {"RoundPipe": 21.9, "ZeRO-Offload": 16.0}
PEER_LORA_BYTES_PER_PARAM = {"RoundPipe+peft LoRA": 4.8}
LORA = LoraSpec(rank=16, alpha=32.0, targets=ROLES)
LORA_4BIT = replace(LORA, nf4=True)  # the same adapters on a base held in 4 bits (`--load-in-4bit`)
GIB = 1 << 30


@dataclass(frozen=True)
class Need:
    """What one model needs to be fully fine-tuned by tinypipe with one optimizer state: host and GPU bytes."""

    model: str
    params: int
    state: OptimizerState | LoraSpec | None  # None: LoRA (`LORA`) on a frozen base; a LoraSpec: LoRA with it
    host_bytes: int
    gpu_bytes: int


def tinypipe_need(model: ModelSpec, hardware: Hardware, state: OptimizerState | LoraSpec | None, *,
                  seq_len: int = 2048) -> Need:
    """Host and GPU bytes `model` needs on `hardware` under tinypipe's compact layout with `state` moments, or
    with LoRA on a frozen base: `LORA` when `state` is None, the LoraSpec `state` otherwise (`LORA_4BIT`)."""
    lora = LORA if state is None else state if isinstance(state, LoraSpec) else None
    moments = state if isinstance(state, OptimizerState) else OptimizerState.FP32
    policy = PRESETS["tinypipe"].replace(microbatch_size=1, microbatches=1, optimizer=OptimizerMode.SYNC,
                                         host_memory=HostMemory.COMPACT, activation_home=ActivationHome.GPU,
                                         optimizer_state=moments, lora=lora)
    trace = analytic_trace(model, hardware.gpus[0], microbatch_size=1, seq_len=seq_len)
    plan = base_plan(policy, model, hardware, trace)
    host = (frozen_host_bytes(model, compute_dtype=trace.dtype, nf4=lora.nf4) if lora is not None else
            host_bytes(model, HostMemory.COMPACT, compute_dtype=trace.dtype, optimizer_state=moments)).total_bytes
    return Need(model.name, model.params, state, host, gpumem.least_peak_bytes(plan))


def coverage(hardware: Hardware, models: list[ModelSpec], *, host_sizes_gib: tuple[int, ...] = HOST_SIZES_GIB,
             seq_len: int = 2048) -> list[dict[str, object]]:
    """Per host size: the largest of `models` (by parameters) each system fits, or None.

    Rows: {"host_gib", "gpu_bytes", "tinypipe fp32" / "tinypipe bf16" / "tinypipe 8bit", "RoundPipe",
    "ZeRO-Offload", "tinypipe LoRA", "tinypipe LoRA 4-bit", "RoundPipe+peft LoRA"} with a model name or None."""
    ordered = sorted(models, key=lambda m: m.params)
    gpu_mem = min(g.memory_bytes for g in hardware.gpus)
    room = min(g.usable_bytes() for g in hardware.gpus)  # less what the allocator keeps, as the simulator checks
    states: tuple[OptimizerState | LoraSpec | None, ...] = (*OptimizerState, None, LORA_4BIT)
    needs = {(m.name, s): tinypipe_need(m, hardware, s, seq_len=seq_len) for m in ordered for s in states}
    rows: list[dict[str, object]] = []

    def ours(state: OptimizerState | LoraSpec | None, host: int) -> str | None:  # by size: the last that fits
        return next((m.name for m in reversed(ordered) if needs[(m.name, state)].host_bytes <= host
                     and needs[(m.name, state)].gpu_bytes <= room), None)

    def peers(per_param: dict[str, float], host: int) -> dict[str, str | None]:
        return {peer: next((m.name for m in reversed(ordered) if bpp * m.params <= host), None)
                for peer, bpp in per_param.items()}

    for size in host_sizes_gib:
        host = size * GIB
        row: dict[str, object] = {"host_gib": size, "gpu_bytes": gpu_mem,
                                  **{f"tinypipe {s}": ours(s, host) for s in OptimizerState},
                                  **peers(PEER_BYTES_PER_PARAM, host),
                                  "tinypipe LoRA": ours(None, host), "tinypipe LoRA 4-bit": ours(LORA_4BIT, host),
                                  **peers(PEER_LORA_BYTES_PER_PARAM, host)}
        rows.append(row)
    return rows


def moe_coverage(hardware: Hardware, models: list[ModelSpec], *, seq_len: int = 2048) -> list[dict[str, object]]:
    """What tinypipe can do with each of `models` on `hardware` as it is (its own host memory and GPUs): per
    optimizer state whether full fine-tuning fits (`tinypipe_need`: host state and ring, a layer's backward on
    one GPU), and whether LoRA (`LORA`) does. A MoE layer's experts all live on the host and upload with the
    layer, so host and GPU needs follow the total parameters; the FLOPs, the active ones.

    Rows: {"model", "params", "active_params", "host_bytes", "tinypipe fp32" / "tinypipe bf16" / "tinypipe 8bit",
    "tinypipe LoRA"} with a bool for each system."""
    room = min(g.usable_bytes() for g in hardware.gpus)
    host = hardware.host.memory_bytes
    rows: list[dict[str, object]] = []
    for model in models:
        row: dict[str, object] = {"model": model.name, "params": model.params, "active_params": model.active_params,
                                  "host_bytes": host}
        for state in (*OptimizerState, None):
            need = tinypipe_need(model, hardware, state, seq_len=seq_len)
            row["tinypipe LoRA" if state is None else f"tinypipe {state}"] = (need.host_bytes <= host
                                                                             and need.gpu_bytes <= room)
        rows.append(row)
    return rows
