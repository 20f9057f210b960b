"""What LoRA on a frozen base changes in parameters, FLOPs, times and bytes: the one place for its formulas.

A frozen linear's backward computes only its input's gradient (one GEMM, not two); the adapters add
their own small GEMMs (B A x: 2 r (in + out) FLOPs a token forward, twice that backward, where their
weights' gradients are made). The embedding has nothing to train and nothing upstream to send a
gradient to, so its backward does nothing; the chunked head skips its weight's gradient (two of its
backward's three GEMMs remain). These ratios of FLOPs scale a trace's measured times
(`frozen_trace`), which the plan and the simulator both read; they leave the elementwise work
(norms, RoPE, SiLU) at the full backward's share, so they overstate a little what freezing saves.
The host holds one copy of the base in the compute dtype (`frozen_host_bytes`); the adapters and
their AdamW state (fp32: `ADAPTER_STATE_BYTES_PER_PARAM`) stay on the GPU that owns the layer, where
their optimizer step runs (`adapter_step_s`).

A 4-bit base (`LoraSpec.nf4`) holds each block linear as NF4 (`nf4_tensor_bytes`: 4.5 bits a parameter), the rest
in the compute dtype; a LOAD uploads those bytes (`base_load_bytes`) and dequantises them on the GPU into the
compute-dtype weights the layer computes with, in `dequant_s`: the bytes it reads and writes at the streaming
share of the GPU's memory bandwidth, plus a launch per tensor (analytic, not measured).
"""

from __future__ import annotations

from dataclasses import replace

from tinypipe.common.errors import InputError
from tinypipe.describe.hardware import GPU
from tinypipe.describe.model import DTYPE_BYTES, LayerKind, LayerSpec, ModelSpec
from tinypipe.describe.trace import KindProfile, ProfileTrace
from tinypipe.estimate.hostmem import HostBytes
from tinypipe.policy.lora_spec import ADAPTER_STATE_BYTES_PER_PARAM, ADAPTER_WEIGHT_BYTES_PER_PARAM, LoraSpec
from tinypipe.policy.modes import HostMemory

# A fused AdamW step reads weight, gradient and both moments and writes weight and moments (fp32):
# 28 bytes a parameter, at the share of the GPU's memory bandwidth streaming kernels reach
# (`describe.trace.MEM_FRACTION`); plus one multi-tensor launch per layer. Spec-derived, not measured.
ADAM_BYTES_PER_PARAM = 28
ADAPTER_MOMENT_BYTES_PER_PARAM = 8  # AdamW's exp_avg and exp_avg_sq, fp32, in a checkpoint
ADAPTER_STEP_LAUNCH_S = 20e-6
STREAM_FRACTION = 0.8
HEAD_FROZEN_BWD_SHARE = 2 / 3  # the chunked head's backward: logits again, the input's gradient (not the weight's)
# NF4 as bitsandbytes' quantize_4bit holds it at blocksize 64 without double quantisation (Hugging Face's
# BitsAndBytesConfig default): two 4-bit codes a byte and one fp32 absmax per block, 0.5 + 4 / 64 bytes a parameter
NF4_BLOCK = 64
NF4_BYTES_PER_PARAM = 0.5 + 4 / NF4_BLOCK
DEQUANT_LAUNCH_S = 10e-6  # one dequantisation kernel per weight tensor (an assumed launch cost, not measured)


def _wrapped(layer: LayerSpec, lora: LoraSpec, *, per_expert: int = 0) -> list[tuple[int, int, int]]:
    """(in, out, copies of rank r) of each linear of `layer` the adapters wrap: a block's own linears once (a fused
    q/k/v one when any of q, k, v is targeted); an expert's `per_expert` times, each at r per role it fuses (peft
    adapts a MoE layer's fused gate/up expert weight at rank 2 r: backends/model/lora_adapters.py)."""
    out = [(i, o, 1) for roles, i, o in layer.linears if set(roles.split("+")) & set(lora.targets)]
    return out + [(i, o, per_expert * len(set(roles.split("+")) & set(lora.targets)))
                  for roles, i, o in layer.expert_linears if set(roles.split("+")) & set(lora.targets)]


def adapter_params(layer: LayerSpec, lora: LoraSpec) -> int:
    """Parameters of the layer's adapters: A (r x in) and B (out x r) per wrapped linear, per expert of a MoE MLP."""
    return sum(n * lora.rank * (i + o) for i, o, n in _wrapped(layer, lora, per_expert=layer.experts))


def adapter_flops_per_token(layer: LayerSpec, lora: LoraSpec) -> float:
    """Forward FLOPs a token of the layer's adapters: 2 r (in + out) per wrapped linear, of a MoE MLP's experts
    those a token routes to, as `run` computes them (backends/model/lora_experts.py). (peft instead adds B A into
    every expert's weight once per call, 2 E r in out FLOPs and a new copy of every expert's weight: Qwen3-30B-A3B's
    gate/up at r 16, 13 GFLOP and 0.8 GB, a twelfth of its experts' own forward over 2,048 tokens.)"""
    return float(sum(2 * n * lora.rank * (i + o) for i, o, n in _wrapped(layer, lora,
                                                                        per_expert=layer.experts_per_token)))


def model_adapter_params(model: ModelSpec, lora: LoraSpec) -> int:
    return sum(adapter_params(layer, lora) for layer in model.layers)


def adapter_state_bytes(layer: LayerSpec, lora: LoraSpec) -> int:
    """GPU bytes the layer's adapters hold for the whole run: fp32 weights, gradients, AdamW moments."""
    return adapter_params(layer, lora) * ADAPTER_STATE_BYTES_PER_PARAM


def adapter_weight_bytes(layer: LayerSpec, lora: LoraSpec) -> int:
    """The adapters' fp32 weights: an adapter step's `nbytes` (its parameters x 4, as OPT_STEP's master)."""
    return adapter_params(layer, lora) * ADAPTER_WEIGHT_BYTES_PER_PARAM


def adapter_checkpoint_bytes(model: ModelSpec, lora: LoraSpec, layers: tuple[int, ...] | None = None) -> int:
    """Bytes of one LoRA checkpoint of `layers` (default all) on disk: the adapters' fp32 weights and AdamW's two
    fp32 moments (the frozen base is the model's own and is not written), plus the rank's
    CHECKPOINT_SLACK_BYTES (step counters, RNG states, the JSON beside them)."""
    from tinypipe.estimate.hostmem import CHECKPOINT_SLACK_BYTES

    chosen = range(len(model.layers)) if layers is None else layers
    params = sum(adapter_params(model.layers[i], lora) for i in chosen)
    return params * (ADAPTER_WEIGHT_BYTES_PER_PARAM + ADAPTER_MOMENT_BYTES_PER_PARAM) + CHECKPOINT_SLACK_BYTES


def adapter_step_s(params: int, gpu: GPU) -> float:
    """Seconds of one fused AdamW step over `params` adapter parameters on `gpu` (0 for none)."""
    if params <= 0:
        return 0.0
    return ADAPTER_STEP_LAUNCH_S + params * ADAM_BYTES_PER_PARAM / (gpu.mem_gbps * 1e9 * STREAM_FRACTION)


def frozen_factors(layer: LayerSpec, lora: LoraSpec, seq_len: int) -> tuple[float, float]:
    """(forward, backward) time of the layer with a frozen base and adapters over its full-training time,
    by FLOPs (module docstring). The backward is the pure backward, without a recomputed forward."""
    if layer.kind is LayerKind.EMBED:
        return 1.0, 0.0
    if layer.kind is LayerKind.HEAD:
        return 1.0, HEAD_FROZEN_BWD_SHARE
    lin = layer.linear_flops_per_token
    att = layer.attn_flops_per_token_per_ctx * seq_len / 2
    ad = adapter_flops_per_token(layer, lora)
    full = lin + att
    if full <= 0:
        return 1.0, 1.0
    return (full + ad) / full, (lin + 2 * att + 2 * ad) / (2 * full)


def _frozen_profile(p: KindProfile, fwd: float, bwd: float) -> KindProfile:
    loop = p.loop
    if loop is not None:
        loop = replace(loop, fwd_s=loop.fwd_s * fwd, fwd_beside_optimizer_s=loop.fwd_beside_optimizer_s * fwd,
                       recompute_bwd_s=loop.fwd_s * fwd + (loop.recompute_bwd_s - loop.fwd_s) * bwd,
                       recompute_bwd_beside_optimizer_s=loop.fwd_beside_optimizer_s * fwd
                       + (loop.recompute_bwd_beside_optimizer_s - loop.fwd_beside_optimizer_s) * bwd)
    # no base gradient: a later backward's transient holds no fresh weight gradients beyond the workspace
    return replace(p, fwd_s=p.fwd_s * fwd, bwd_s=p.bwd_s * bwd,
                   recompute_bwd_s=p.fwd_s * fwd + (p.recompute_bwd_s - p.fwd_s) * bwd if bwd else 0.0,
                   optimizer=None, loop=loop, accumulate_workspace_bytes=p.workspace_bytes)


def frozen_trace(trace: ProfileTrace, model: ModelSpec, lora: LoraSpec) -> ProfileTrace:
    """`trace` with each kind's times scaled for a frozen base with `lora`'s adapters (`frozen_factors`, at
    the first layer of each kind), and no host optimizer step."""
    kinds = dict(trace.kinds)
    for kind in kinds:
        layer = next((x for x in model.layers if x.kind.value == kind), None)
        if layer is not None:
            kinds[kind] = _frozen_profile(kinds[kind], *frozen_factors(layer, lora, trace.seq_len))
    return replace(trace, kinds=kinds, source=f"{trace.source}; frozen base with LoRA {lora.text()} "
                                              "(times scaled by FLOPs: tinypipe.estimate.lora_costs)")


def trace_for_policy(trace: ProfileTrace, model: ModelSpec, lora: LoraSpec | None) -> ProfileTrace:
    """The trace a policy's estimates read: a trace measured with the policy's adapters (`profile --lora`) as it
    is, a full-training one scaled for a frozen base when the policy trains LoRA (`frozen_trace`); a trace
    measured with other adapters, or with adapters for a full-training policy, is an error."""
    if trace.lora and (lora is None or trace.lora != lora.adapter_text()):
        raise InputError(f"trace for {trace.gpu_model}: measured with LoRA {trace.lora}; the policy trains "
                         f"{'LoRA ' + lora.adapter_text() if lora else 'every parameter'}")
    out = frozen_trace(trace, model, lora) if lora is not None and not trace.lora else trace
    if lora is not None and lora.nf4:  # what the plan and the simulator add at each LOAD, said where the times are
        out = replace(out, source=f"{out.source}; NF4 base: each LOAD uploads the packed bytes and dequantises on "
                                  "the GPU (analytic: bytes at its memory bandwidth, tinypipe.estimate.lora_costs)")
    return out


def frozen_host_bytes(model: ModelSpec, *, compute_dtype: str = "bf16", layers: tuple[int, ...] | None = None,
                      nf4: bool = False) -> HostBytes:
    """Host bytes of a frozen base: one pinned copy in the compute dtype (2 B/param in bf16), or with `nf4` its
    block linears as NF4 (`nf4_tensor_bytes`), carved from one slab (no rounding); no master, no moments, no
    gradients (the adapters live on the GPUs)."""
    chosen = [model.layers[i] for i in layers] if layers is not None else list(model.layers)
    n = sum(x.params for x in chosen)
    held = sum(_base_bytes(x, x.params, compute_dtype, nf4) for x in chosen)
    return HostBytes(HostMemory.COMPACT, n, 0, held, 0, 0, 0)


def nf4_tensors(layer: LayerSpec) -> list[int]:
    """Elements of each weight a 4-bit base holds as NF4: a block's linears, every expert's (bitsandbytes'
    Linear4bit in place of each nn.Linear, as Hugging Face loads a model in 4 bits); none outside the blocks
    (the embedding and the LM head stay in the compute dtype, as Hugging Face keeps `lm_head`)."""
    if layer.kind is not LayerKind.BLOCK:
        return []
    return [i * o for _, i, o in layer.linears] + [i * o for _, i, o in layer.expert_linears] * layer.experts


def nf4_tensor_bytes(numel: int) -> int:
    """Bytes of one weight of `numel` elements as NF4: its codes, two a byte, and an fp32 absmax per block."""
    return -(-numel // 2) + 4 * -(-numel // NF4_BLOCK)


def _base_bytes(layer: LayerSpec, params: int, compute_dtype: str, nf4: bool) -> int:
    """Bytes of `params` of the layer's frozen parameters (its own, or what its LOAD carries) as the base holds
    them: the compute dtype, or with `nf4` its NF4 tensors packed and the rest in the compute dtype."""
    packed = nf4_tensors(layer) if nf4 else []
    return (params - sum(packed)) * DTYPE_BYTES[compute_dtype] + sum(nf4_tensor_bytes(n) for n in packed)


def base_load_bytes(layer: LayerSpec, lora: LoraSpec, compute_dtype: str) -> int:
    """Bytes a LOAD of the frozen layer uploads: its compute-dtype weights, or NF4 codes and absmax for a 4-bit
    base's linears (a tied head's LOAD carries the embedding's matrix too: `gpu_params`)."""
    return _base_bytes(layer, layer.gpu_params, compute_dtype, lora.nf4)


def dequant_s(layer: LayerSpec, lora: LoraSpec, gpu: GPU, compute_dtype: str) -> float:
    """Seconds to dequantise the layer's NF4 tensors on `gpu` at its LOAD (0 without a 4-bit base): the packed
    bytes read and the compute-dtype weights written at the streaming share of its memory bandwidth, and one
    launch per tensor (analytic, as the module docstring says)."""
    packed = nf4_tensors(layer) if lora.nf4 else []
    if not packed:
        return 0.0
    moved = sum(nf4_tensor_bytes(n) + n * DTYPE_BYTES[compute_dtype] for n in packed)
    return len(packed) * DEQUANT_LAUNCH_S + moved / (gpu.mem_gbps * 1e9 * STREAM_FRACTION)


def gpu_adapter_bytes(model: ModelSpec, lora: LoraSpec, owner: tuple[int, ...], num_gpus: int) -> tuple[int, ...]:
    """Adapter state bytes on each GPU, for layers owned as `owner` says (GPU of each layer)."""
    out = [0] * num_gpus
    for layer, g in zip(model.layers, owner):
        out[g] += adapter_state_bytes(layer, lora)
    return tuple(out)
