"""What `tinypipe inspect` reports: per-layer sizes, pack footprints, host bytes, fit, hardware routes."""

from __future__ import annotations

from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.describe.hardware import HOST, Hardware
from tinypipe.describe.model import LayerSpec, ModelSpec
from tinypipe.describe.target import Target
from tinypipe.describe.trace import ProfileTrace, analytic_trace
from tinypipe.estimate import gpumem
from tinypipe.estimate.hostmem import host_bytes
from tinypipe.estimate.lora_costs import frozen_host_bytes, model_adapter_params
from tinypipe.estimate.plan import Plan, base_plan
from tinypipe.partition.packing import per_gpu, uniform
from tinypipe.policy.lora_spec import ADAPTER_STATE_BYTES_PER_PARAM, LoraSpec
from tinypipe.policy.modes import HostMemory, OptimizerState, ResidentMode, SwapMode
from tinypipe.policy.policy import Policy


def layer_groups(model: ModelSpec, seq_len: int) -> list[dict[str, Any]]:
    """Per-layer rows, with runs of identical consecutive blocks folded into one row (`count`)."""
    rows: list[dict[str, Any]] = []
    for layer in model.layers:
        row = _layer_row(layer, seq_len)
        prev = rows[-1] if rows else None
        if prev is not None and prev["kind"] == "block" == row["kind"] and _same(prev, row):
            prev["count"] += 1
            prev["last"] = layer.name
            continue
        rows.append(row)
    return rows


def _layer_row(layer: LayerSpec, seq_len: int) -> dict[str, Any]:
    return {
        "name": layer.name, "last": layer.name, "count": 1, "kind": layer.kind.value,
        "params": layer.params, "gpu_params": layer.gpu_params, "bf16_bytes": layer.param_bytes("bf16"),
        "active_params": layer.active_params, "experts": layer.experts, "experts_per_token": layer.experts_per_token,
        "expert_bf16_bytes": layer.expert_bytes("bf16"),
        "fwd_flops_per_token": layer.fwd_flops_per_token(seq_len),
        "saved_act_bytes_per_token": layer.saved_act_bytes_per_token,
        "boundary_bytes_per_token": layer.boundary_bytes_per_token,
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("params", "gpu_params", "fwd_flops_per_token", "saved_act_bytes_per_token", "boundary_bytes_per_token",
            "experts")
    return all(a[k] == b[k] for k in keys)


def _plan(model: ModelSpec, hw: Hardware, trace: ProfileTrace, **policy: Any) -> Plan:
    return base_plan(Policy(name="inspect", microbatch_size=trace.microbatch_size, **policy), model, hw, trace)


def pack_footprint(model: ModelSpec, hw: Hardware, trace: ProfileTrace, k: int, *, microbatches: int = 1,
                   recompute: bool = True, prefetch_packs: int = 1) -> int:
    """GPU bytes, by the GPU-memory formula, to train `model` on one GPU in packs of k layers swapped
    whole, `prefetch_packs` ahead: a pack, the next ones uploading, its gradients, every microbatch's
    kept activations, and a backward's transients."""
    plan = _plan(model, hw, trace, swap=SwapMode.PACK, prefetch_depth=prefetch_packs, microbatches=microbatches,
                 recompute=recompute)
    sizes = uniform(len(model.layers), max(1, min(k, len(model.layers))))
    return gpumem.gpu_peak_bytes(plan, sizes, (0,) * len(sizes), 1)[0]


# The host layouts `inspect model` sizes: replicated (fp32 state) and compact with each moment precision.
HOST_VARIANTS: dict[str, tuple[HostMemory, OptimizerState]] = {
    "replicated": (HostMemory.REPLICATED, OptimizerState.FP32),
    "compact": (HostMemory.COMPACT, OptimizerState.FP32),
    "compact-bf16": (HostMemory.COMPACT, OptimizerState.BF16),
    "compact-8bit": (HostMemory.COMPACT, OptimizerState.INT8),
}


def model_report(model: ModelSpec, *, seq_len: int, microbatch_size: int,
                 hardware: list[Hardware], lora: LoraSpec | None = None) -> dict[str, Any]:
    """Everything `inspect model` shows, as plain data (the `--json` form). GPU bytes come from the
    GPU-memory formula over the analytic trace's sizes (the same on every GPU), the packs' on the first
    hardware's GPUs. `lora` (default: peft's LoraConfig defaults) sizes LoRA on a frozen base beside them."""
    lora = lora or LoraSpec()
    if not hardware:
        raise InputError("inspect model: name at least one hardware preset to size the model against")
    host = {name: host_bytes(model, lay, optimizer_state=st) for name, (lay, st) in HOST_VARIANTS.items()}
    trace = analytic_trace(model, hardware[0].gpus[0], microbatch_size=microbatch_size, seq_len=seq_len)
    packs = [{"layers": k, "gpu_bytes": pack_footprint(model, hardware[0], trace, k)} for k in (1, 2, 4, 8, 16)
             if k <= model.num_blocks]
    min_gpu = gpumem.least_peak_bytes(_plan(model, hardware[0], trace))
    lora_host = frozen_host_bytes(model, nf4=lora.nf4).total_bytes
    lora_gpu = gpumem.least_peak_bytes(_plan(model, hardware[0], trace, lora=lora))
    lora_state = model_adapter_params(model, lora) * ADAPTER_STATE_BYTES_PER_PARAM
    fit = []
    for hw in hardware:
        gpu_mem = min(g.memory_bytes for g in hw.gpus)
        room = Target(hardware=hw).gpu_usable_bytes  # less what the allocator keeps, as the simulator checks
        fit.append({
            "hardware": hw.name, "gpus": len(hw.gpus), "gpu_bytes": gpu_mem, "host_bytes": hw.host.memory_bytes,
            "gpu_fits": min_gpu <= room,
            **{f"host_fits_{name}": host[name].total_bytes <= hw.host.memory_bytes for name in HOST_VARIANTS},
            "resident_fits": max(_resident_bytes(model, hw, trace)) <= room,
            # every GPU holds its layers' adapters (fp32, with gradients and moments) on top of a backward
            "lora_fits": (lora_gpu + lora_state // len(hw.gpus) <= room and lora_host <= hw.host.memory_bytes),
        })
    return {
        "model": model.name, "family": model.family, "source": model.source, "params": model.params,
        "active_params": model.active_params,
        "blocks": model.num_blocks, "hidden_size": model.hidden_size, "vocab_size": model.vocab_size,
        "tied_embeddings": model.tied_embeddings, "seq_len": seq_len, "microbatch_size": microbatch_size,
        "bf16_bytes": model.params * 2,
        "layers": layer_groups(model, seq_len),
        "packs": packs, "min_gpu_bytes": min_gpu,
        "host": {lay: {"total_bytes": h.total_bytes, "bytes_per_param": h.bytes_per_param,
                       "parts": dict(h.rows())} for lay, h in host.items()},
        "fit": fit,
        "lora": {**lora.to_json(), "adapter_params": model_adapter_params(model, lora), "host_bytes": lora_host,
                 "min_gpu_bytes": lora_gpu},
    }


def _resident_bytes(model: ModelSpec, hw: Hardware, trace: ProfileTrace) -> tuple[int, ...]:
    """GPU bytes per GPU of `hw`, by the GPU-memory formula, to keep every layer resident (the `resident`
    policy: one pack per GPU, here balanced by weight bytes)."""
    plan = _plan(model, hw, trace, swap=SwapMode.PACK, prefetch_depth=0, resident=ResidentMode.ALL)
    sizes = per_gpu(plan.weight_bytes, len(hw.gpus))
    return gpumem.gpu_peak_bytes(plan, sizes, tuple(range(len(sizes))), len(hw.gpus),
                                 pinned=frozenset(range(len(model.layers))))


def hardware_report(hw: Hardware) -> dict[str, Any]:
    """Everything `inspect hardware NAME` shows, as plain data."""
    gpus = [g.name for g in hw.gpus]
    routes = []
    for g in gpus:
        r = hw.route(HOST, g)
        routes.append({"src": HOST, "dst": g, "path": list(r.nodes), "gbps": r.bottleneck_gbps,
                       "latency_s": r.latency_s})
    peer = [[0.0 if a == b else hw.route(a, b).bottleneck_gbps for b in gpus] for a in gpus]
    return {
        "name": hw.name, "provenance": hw.provenance, "source": hw.source,
        "host": {"memory_bytes": hw.host.memory_bytes, "dma_gbps": hw.host.dma_gbps,
                 "cpu_cores": hw.host.cpu_cores, "adam_params_per_s": hw.host.adam_params_per_s},
        "gpus": [{"name": g.name, "model": g.model, "memory_bytes": g.memory_bytes,
                  "matmul_flops": g.matmul_flops, "mem_gbps": g.mem_gbps} for g in hw.gpus],
        "links": [{"a": x.a, "b": x.b, "kind": x.kind, "gbps": x.gbps, "latency_s": x.latency_s} for x in hw.links],
        "routes": routes, "peer_gbps": peer,
    }
