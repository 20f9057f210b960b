"""What `tinypipe inspect` reports: per-layer sizes, pack footprints, host bytes, fit, hardware routes."""

from __future__ import annotations

from typing import Any

from tinypipe.hardware import HOST, Hardware
from tinypipe.hostmem import host_bytes
from tinypipe.model import LayerSpec, ModelSpec
from tinypipe.policy.modes import HOST_LAYOUTS


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
        "fwd_flops_per_token": layer.fwd_flops_per_token(seq_len),
        "saved_act_bytes_per_token": layer.saved_act_bytes_per_token,
        "boundary_bytes_per_token": layer.boundary_bytes_per_token,
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("params", "gpu_params", "fwd_flops_per_token", "saved_act_bytes_per_token", "boundary_bytes_per_token")
    return all(a[k] == b[k] for k in keys)


def pack_footprint(model: ModelSpec, k: int, *, tokens: int, microbatches: int = 1, recompute: bool = True,
                   prefetch_packs: int = 1) -> int:
    """GPU bytes to run a pack of the k largest consecutive blocks while the next pack uploads.

    Weights of the pack and of `prefetch_packs` more (bf16), their gradients (bf16), and the saved
    activations of every microbatch (layer inputs under recompute, full activations otherwise) plus
    one microbatch of full activations during a backward.
    """
    blocks = [x for x in model.layers if x.kind.value == "block"] or list(model.layers)
    k = max(1, min(k, len(blocks)))
    biggest = max(blocks, key=lambda x: x.gpu_params)
    w = biggest.param_bytes("bf16")
    per_mb_saved = (biggest.boundary_bytes_per_token if recompute else biggest.saved_act_bytes_per_token) * tokens
    return (k * (1 + prefetch_packs) * w + k * w + k * microbatches * per_mb_saved
            + biggest.saved_act_bytes_per_token * tokens)


def model_report(model: ModelSpec, *, seq_len: int, microbatch_size: int,
                 hardware: list[Hardware]) -> dict[str, Any]:
    """Everything `inspect model` shows, as plain data (the `--json` form)."""
    tokens = seq_len * microbatch_size
    host = {lay: host_bytes(model, lay) for lay in HOST_LAYOUTS}
    packs = [{"layers": k, "gpu_bytes": pack_footprint(model, k, tokens=tokens)} for k in (1, 2, 4, 8, 16)
             if k <= model.num_blocks]
    largest = max(model.layers, key=lambda x: x.gpu_params)
    min_gpu = 2 * largest.param_bytes("bf16") + largest.param_bytes("bf16") + largest.saved_act_bytes_per_token * tokens
    fit = []
    for hw in hardware:
        gpu_mem = min(g.memory_bytes for g in hw.gpus)
        fit.append({
            "hardware": hw.name, "gpus": len(hw.gpus), "gpu_bytes": gpu_mem, "host_bytes": hw.host.memory_bytes,
            "gpu_fits": min_gpu <= gpu_mem,
            **{f"host_fits_{lay}": host[lay].total_bytes <= hw.host.memory_bytes for lay in HOST_LAYOUTS},
            "resident_fits": _resident_bytes(model) <= gpu_mem * len(hw.gpus),
        })
    return {
        "model": model.name, "family": model.family, "source": model.source, "params": model.params,
        "blocks": model.num_blocks, "hidden_size": model.hidden_size, "vocab_size": model.vocab_size,
        "tied_embeddings": model.tied_embeddings, "seq_len": seq_len, "microbatch_size": microbatch_size,
        "bf16_bytes": model.params * 2,
        "layers": layer_groups(model, seq_len),
        "packs": packs, "min_gpu_bytes": min_gpu,
        "host": {lay: {"total_bytes": h.total_bytes, "bytes_per_param": h.bytes_per_param,
                       "parts": dict(h.rows())} for lay, h in host.items()},
        "fit": fit,
    }


def _resident_bytes(model: ModelSpec) -> int:
    """GPU bytes to keep every layer resident: bf16 weights and bf16 gradients."""
    return sum(2 * x.param_bytes("bf16") for x in model.layers)


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
