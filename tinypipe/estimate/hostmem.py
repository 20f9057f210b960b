"""Host memory per parameter under each host memory layout, as formulas in one place (docs/architecture.md).

`replicated` (what peers do): an fp32 master (4 B), a pinned compute-dtype copy for upload (2 B),
a full-size fp32 gradient buffer (4 B), AdamW moments m and v (4 + 4 B), and the pinned caching
allocator's rounding of each pinned block up to a power of two (on the upload copy and the
gradient buffer). 18 B/param plus rounding.

`compact` (tinypipe): the fp32 master stored as two 16-bit planes in one pinned slab — the high
plane is the bf16 value that is uploaded, the low plane restores fp32 for the optimizer (4 B) —
AdamW moments (8 B), and a small pinned ring of gradient slots (in the compute dtype, as the GPU
accumulated them) instead of a model-sized buffer.
12 B/param plus the ring; no rounding (one slab). With the asynchronous optimizer, 2 B/param more
(bf16 compute): the previous version's upload form, kept for the uploads that still want it. Clipping
by the global gradient norm (`--max-grad-norm`) needs every gradient of a step on the host before any
layer steps, so the ring becomes a whole gradient buffer (one region per layer, in the compute dtype):
2 B/param instead of the ring (bf16 compute), 14 B/param in all.

The moments' precision (`OptimizerState`, compact only) sets their bytes: fp32 8 B/param, bf16 4, 8bit
2 + 8 per QUANT_BLOCK_ELEMS (one fp32 absmax per block of each moment): 2.03. So compact holds 12, 8 or
6.03 B/param plus the ring. A checkpoint holds the same state less the gradients (`checkpoint_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tinypipe.describe.hardware import Host
from tinypipe.describe.model import DTYPE_BYTES, LayerSpec, ModelSpec
from tinypipe.describe.optimprofile import OptimizerProfile, StepPhases
from tinypipe.describe.trace import ProfileTrace
from tinypipe.policy.modes import HostMemory, OptimizerMode, OptimizerState

# CPU optimizer cost per parameter relative to torch's fused AdamW on an fp32 master, measured side
# by side for 64M parameters on the 32-core 2xH200 host, 32 threads, median of 7:
# - compact: join the planes -> fused AdamW -> split, in 4M-element chunks so each chunk's fp32
#   master stays in cache (backends/host/planes.py): 1.56x and 1.82x in two runs; the mean is used.
#   (Unfused whole-tensor join/step/split: 2.35x there, 3.4x at 2 threads.)
# - replicated: the step plus the fp32 -> bf16 cast that refreshes the pinned upload copy: 1 + 0.31.
# A profile's measured steps replace these where it has them (`optimizer_step_s`); docs/performance.md.
COMPACT_OPTIM_FACTOR = (1.56 + 1.82) / 2
REPLICATED_OPTIM_FACTOR = 1.0 + 0.31

DEFAULT_GRAD_RING_SLOTS = 4

# 8-bit moments: elements per quantisation block, each with its own fp32 absmax. Dettmers et al. 2021
# (arXiv:2110.02861) use 2048; torchao's 8-bit AdamW uses 256 (torchao/optim/subclass_8bit.py). Smaller
# blocks isolate outliers better for 8 B per 256 elements (0.03 B/param); 256 is also a multiple of the
# chunked step's 64-element alignment (backends/host/planes.py).
QUANT_BLOCK_ELEMS = 256

# The compact step's time with low-precision moments over its time with fp32 ones, where no rate of this host was
# measured for them (a run's calibration and `tinypipe profile` measure each; `state_time_factor` takes those): the
# one-pass kernel (backends/host/fused_host_adamw.c) at 15 threads on a lent 16-core H100 machine, 64M parameters
# (bench/host_optim_precision.py -> bench/results/host_optim_precision_device.json, 2026-12-05): fp32 5.07 G params/s
# (at the host's memory bandwidth), bf16 6.23 (fewer bytes), 8bit 3.15 (its table look-ups make it compute-bound).
# Per core the ratios differ (1 thread, the 2-core dev VM: bf16 1.26, 8bit 3.51;
# bench/results/host_optim_precision.json).
STATE_TIME_FACTOR: dict[OptimizerState, float] = {OptimizerState.FP32: 1.0,
                                                  OptimizerState.BF16: 0.81,
                                                  OptimizerState.INT8: 1.61}


def moment_bytes(params: int, state: OptimizerState = OptimizerState.FP32) -> int:
    """Host bytes of AdamW's two moments for a tensor (or layer) of `params` elements held as `state`."""
    state = OptimizerState(state)
    if state == OptimizerState.FP32:
        return 8 * params
    if state == OptimizerState.BF16:
        return 4 * params
    return 2 * params + 2 * 4 * -(-params // QUANT_BLOCK_ELEMS)


def step_bytes_per_param(state: OptimizerState = OptimizerState.FP32, grad_bytes: int = 2) -> float:
    """Bytes of DRAM one compact AdamW step moves per parameter when it reads and writes each once (what the
    one-pass kernel, backends/host/fused_host_adamw.c, does): the two planes read and written (4 + 4), the gradient
    read (`grad_bytes`: 2 as bf16 leaves the GPU), the moments read and written (2 x `moment_bytes`). fp32 26,
    bf16 18, 8bit 14.06. Its floor on a host is these bytes over the host's copy bandwidth (read + write)."""
    return 8 + grad_bytes + 2 * moment_bytes(1 << 20, state) / (1 << 20)


# The replicated layout's step: torch's fused AdamW on the fp32 master with an fp32 gradient (params, grad, m, v read:
# 16 B; params, m, v written: 12 B), then the bf16 upload copy refreshed from the master (4 B read, 2 B written).
REPLICATED_STEP_BYTES_PER_PARAM = 28 + 6


def optimizer_step_bytes(params: int, host_memory: HostMemory,
                         optimizer_state: OptimizerState = OptimizerState.FP32) -> float:
    """Bytes of DRAM one host optimizer step of `params` parameters moves under `host_memory`: what it shares with
    the DMA copies (sim/durations.py)."""
    if HostMemory(host_memory) == HostMemory.COMPACT:
        return params * step_bytes_per_param(optimizer_state)
    return params * float(REPLICATED_STEP_BYTES_PER_PARAM)


def next_pow2(n: int) -> int:
    """The block size PyTorch's pinned caching allocator hands out for a request of n bytes."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class HostBytes:
    """Host bytes by purpose for one model under one host memory layout."""

    host_memory: HostMemory
    params: int
    master_bytes: int
    upload_copy_bytes: int
    grad_bytes: int
    optim_state_bytes: int
    pinned_rounding_bytes: int

    @property
    def total_bytes(self) -> int:
        return (self.master_bytes + self.upload_copy_bytes + self.grad_bytes + self.optim_state_bytes
                + self.pinned_rounding_bytes)

    @property
    def bytes_per_param(self) -> float:
        return self.total_bytes / max(1, self.params)

    def rows(self) -> list[tuple[str, int]]:
        return [("fp32 master", self.master_bytes), ("upload copy", self.upload_copy_bytes),
                ("gradients", self.grad_bytes), ("AdamW moments", self.optim_state_bytes),
                ("pinned rounding", self.pinned_rounding_bytes)]


def host_bytes(model: ModelSpec, host_memory: HostMemory, *, compute_dtype: str = "bf16",
               grad_ring_slots: int = DEFAULT_GRAD_RING_SLOTS, layers: tuple[int, ...] | None = None,
               optimizer: OptimizerMode = OptimizerMode.SYNC,
               optimizer_state: OptimizerState = OptimizerState.FP32, grad_clip: bool = False) -> HostBytes:
    """Host bytes to train `model` (or only `layers` of it) with an fp32 master and AdamW.

    compact + async optimizer: one more upload-form copy per parameter (the previous version's
    snapshot region, counted as the upload copy); replicated's upload copy already serves.
    `optimizer_state`: the moments' precision (compact only; replicated keeps fp32). `grad_clip`
    (compact): a gradient buffer of every layer instead of the ring (`compact_grad_elems`)."""
    host_memory, optimizer = HostMemory(host_memory), OptimizerMode(optimizer)  # a member or its value
    optimizer_state = OptimizerState(optimizer_state)
    if not optimizer_state.exact and not host_memory.planes:
        raise ValueError(f"{optimizer_state} optimizer state needs the compact host layout")
    chosen = [model.layers[i] for i in layers] if layers is not None else list(model.layers)
    n = sum(x.params for x in chosen)
    cd = DTYPE_BYTES[compute_dtype]
    if host_memory == HostMemory.REPLICATED:
        upload = [x.params * cd for x in chosen]
        grads = [x.params * 4 for x in chosen]
        rounding = sum(next_pow2(b) - b for b in upload + grads if b)
        return HostBytes(host_memory, n, 4 * n, sum(upload), sum(grads), 8 * n, rounding)
    if host_memory == HostMemory.COMPACT:
        ring = compact_grad_elems([x.params for x in chosen], grad_ring_slots, grad_clip=grad_clip) * cd
        snapshots = n * cd if optimizer.is_async else 0
        moments = sum(moment_bytes(x.params, optimizer_state) for x in chosen)
        return HostBytes(host_memory, n, 4 * n, snapshots, ring, moments, 0)
    raise ValueError(f"unknown host memory layout {host_memory!r}")


def compact_grad_elems(layer_params: list[int], grad_ring_slots: int = DEFAULT_GRAD_RING_SLOTS, *,
                       grad_clip: bool = False) -> int:
    """Elements of the compact layout's host gradients for layers of `layer_params` parameters: a ring of
    `grad_ring_slots` slots of the largest layer (slots hold gradients as the GPU made them, in the compute
    dtype), or with `grad_clip` one region per layer, since the global norm needs them all before any step
    (backends/host/compact.py allocates exactly this)."""
    if not layer_params:
        return 0
    return sum(layer_params) if grad_clip else max(grad_ring_slots, 1) * max(layer_params)


def checkpoint_bytes(model: ModelSpec, host_memory: HostMemory, *, compute_dtype: str = "bf16",
                     layers: tuple[int, ...] | None = None, optimizer: OptimizerMode = OptimizerMode.SYNC,
                     optimizer_state: OptimizerState = OptimizerState.FP32) -> int:
    """Bytes of one checkpoint of `layers` (default all) on disk: `host_bytes`' state without the gradients
    or the pinned rounding (masters as held, upload copies / kept snapshots, the moments as held), plus
    CHECKPOINT_SLACK_BYTES for the per-tensor step counters, RNG states and the JSON beside them."""
    hb = host_bytes(model, host_memory, compute_dtype=compute_dtype, layers=layers, optimizer=optimizer,
                    optimizer_state=optimizer_state)
    return hb.master_bytes + hb.upload_copy_bytes + hb.optim_state_bytes + CHECKPOINT_SLACK_BYTES


CHECKPOINT_SLACK_BYTES = 1 << 20  # a rank's small parts: step counters, RNG states, the JSON skeleton


def optimizer_time_factor(host_memory: HostMemory, optimizer_state: OptimizerState = OptimizerState.FP32) -> float:
    """How much longer the CPU optimizer takes per parameter under `host_memory` (and moments held as
    `optimizer_state`) than a plain fused AdamW."""
    base = COMPACT_OPTIM_FACTOR if host_memory == HostMemory.COMPACT else REPLICATED_OPTIM_FACTOR
    return base * STATE_TIME_FACTOR[OptimizerState(optimizer_state)]


def optimizer_s_per_param(host: Host, host_memory: HostMemory,
                          optimizer_state: OptimizerState = OptimizerState.FP32) -> float:
    """Seconds of host optimizer per parameter under `host_memory`: the measured rate of that layout's step
    when the hardware has one (`tinypipe profile`: per moment precision, or fp32's scaled by
    STATE_TIME_FACTOR), else the fused AdamW rate slowed by the layout's factor. What `optimizer_step_s`
    falls back to."""
    state = OptimizerState(optimizer_state)
    rate = _lowp_rate(host, state)
    if host_memory == HostMemory.COMPACT and rate is not None:  # `tinypipe profile` measured this state
        return 1.0 / rate
    measured = host.compact_params_per_s if host_memory == HostMemory.COMPACT else host.replicated_params_per_s
    if measured is not None:
        return STATE_TIME_FACTOR[state] / measured
    return optimizer_time_factor(host_memory, optimizer_state) / host.adam_params_per_s


def optimizer_step_s(layer: LayerSpec, host_memory: HostMemory, host: Host, trace: ProfileTrace | None = None, *,
                     optimizer: OptimizerMode = OptimizerMode.SYNC,
                     optimizer_state: OptimizerState = OptimizerState.FP32) -> float:
    """Seconds of one host optimizer step (OPT_STEP) of `layer` under `host_memory` and `optimizer` mode. The
    one place the simulator, the cost model, the search bound and the floor take it from.

    When `trace` has the step of the layer's kind measured in a run's conditions (`tinypipe profile`:
    `OptimizerProfile.in_run_s`, that layer's own tensors, beside the device's work, at a rank's thread
    count), that time, in proportion to the parameters if the layer differs from the measured one.
    Else (an analytic trace, or one profiled before these measurements) the layer's parameters at
    the host's rate for the layout (`optimizer_s_per_param`). On the H200 host the rate,
    measured in bulk with nothing else running, was 1.13-1.6x too fast for a run's steps
    (docs/fidelity.md). An asynchronous step first keeps the version the next iteration's uploads still
    read (compact: a copy of the high plane; replicated: the upload copy refreshed first); a trace that
    measured that step (`OptimizerProfile.async_in_run_s`) gives its time, else the sync one: on the H200
    the kept copy made a Qwen3-1.7B block's step 1.43x slower."""
    host_memory, optimizer = HostMemory(host_memory), OptimizerMode(optimizer)  # a member or its value
    factor = state_time_factor(host, optimizer_state)  # traces measure the fp32 moments' step
    measured = _measured(layer, trace)
    t = measured.step_s(host_memory, layer.params, asynchronous=optimizer.is_async) if measured else None
    return t * factor if t is not None else layer.params * optimizer_s_per_param(host, host_memory, optimizer_state)


def optimizer_step_phases_s(layer: LayerSpec, host_memory: HostMemory, trace: ProfileTrace | None = None, *,
                            optimizer: OptimizerMode = OptimizerMode.SYNC,
                            optimizer_state: OptimizerState = OptimizerState.FP32,
                            host: Host | None = None) -> StepPhases | None:
    """Seconds of one OPT_STEP of `layer` by what its rank's main thread does meanwhile (the compute stream
    waits / it issues FWDs / BWDs), when `trace` measured them for the layer's kind, host_memory and mode
    (`OptimizerProfile.phases_s`), else None: the simulator then charges `optimizer_step_s` whatever runs."""
    host_memory, optimizer = HostMemory(host_memory), OptimizerMode(optimizer)  # a member or its value
    measured = _measured(layer, trace)
    phases = measured.phases_s(host_memory, layer.params, asynchronous=optimizer.is_async) if measured else None
    factor = state_time_factor(host, optimizer_state)
    return StepPhases(*(x * factor for x in phases)) if phases is not None and factor != 1.0 else phases


def state_time_factor(host: Host | None, optimizer_state: OptimizerState = OptimizerState.FP32) -> float:
    """The compact step's time with `optimizer_state` moments over its time with fp32 ones: this host's own
    ratio where its compact rates were measured for both (a run's calibration, `tinypipe profile`), else
    STATE_TIME_FACTOR. What scales a trace's measured fp32 step to another precision."""
    state = OptimizerState(optimizer_state)
    if state.exact:
        return 1.0
    own = None if host is None else _lowp_rate(host, state)
    if own is not None and host is not None and host.compact_params_per_s is not None:
        return host.compact_params_per_s / own
    return STATE_TIME_FACTOR[state]


def _lowp_rate(host: Host, state: OptimizerState) -> float | None:
    """The compact step's rate with `state` moments as measured on `host` (None: fp32, or not measured)."""
    return {OptimizerState.BF16: host.compact_bf16_params_per_s,
            OptimizerState.INT8: host.compact_8bit_params_per_s}.get(state)


def _measured(layer: LayerSpec, trace: ProfileTrace | None) -> OptimizerProfile | None:
    """The optimizer step `trace` measured for `layer`'s kind, if any."""
    kind = trace.kinds.get(layer.kind.value) if trace is not None else None
    return kind.optimizer if kind is not None else None


def optimizer_steps_s(model: ModelSpec, host_memory: HostMemory, host: Host, trace: ProfileTrace | None = None, *,
                      optimizer: OptimizerMode = OptimizerMode.SYNC, least: bool = False,
                      optimizer_state: OptimizerState = OptimizerState.FP32) -> tuple[float, ...]:
    """`optimizer_step_s` of every layer of `model`, by layer index: what the simulator, the floor, the cost
    model's plan and the search bound read. `least` (the floor's and the search bound's lower bounds): the
    least of that and the step's times by phase (`optimizer_step_phases_s`), which the simulator may charge."""
    host_memory, optimizer = HostMemory(host_memory), OptimizerMode(optimizer)  # a member or its value
    out = []
    for layer in model.layers:
        t = optimizer_step_s(layer, host_memory, host, trace, optimizer=optimizer, optimizer_state=optimizer_state)
        phases = (optimizer_step_phases_s(layer, host_memory, trace, optimizer=optimizer,
                                          optimizer_state=optimizer_state, host=host) if least else None)
        out.append(min(t, *phases) if phases is not None else t)
    return tuple(out)
