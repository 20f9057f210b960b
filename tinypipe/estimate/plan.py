"""The Plan: one policy for one model, trace and machine, as the numbers that the cost model, the packers
and the compiler's passes read; the packs, their GPUs and the resident layers once they are chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.describe.hardware import Hardware, usable_gpu_bytes
from tinypipe.describe.model import DTYPE_BYTES, ModelSpec
from tinypipe.describe.trace import ProfileTrace
from tinypipe.estimate import lora_costs as lora_
from tinypipe.estimate.calibration import CostModel
from tinypipe.estimate.hostmem import DEFAULT_GRAD_RING_SLOTS, host_bytes, optimizer_steps_s
from tinypipe.ir.schedule import recomputes
from tinypipe.policy.lora_spec import LoraSpec
from tinypipe.policy.modes import (
    ActivationHome,
    HostMemory,
    OptimizerMode,
    OptimizerState,
    ResidentMode,
    SwapMode,
    coerce_modes,
)
from tinypipe.policy.policy import Policy


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything the estimates and the passes need, as flat tuples. Per-layer values are per microbatch.

    `base_plan` builds it without packs (what the packers score their candidates against);
    `with_packs` adds the packs, their GPUs and the resident layers that `partition.resolve` chose
    (what the passes compile). `pre_*` are prefix sums (index l = sum over layers < l).
    """

    microbatches: int
    iterations: int = 1
    # per layer
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]  # with recompute when the policy recomputes
    weight_bytes: tuple[int, ...]  # w.L{l} on the GPU (compute dtype), what a LOAD allocates; also gr.L{l}, GRAD_OUT
    input_bytes: tuple[int, ...]  # x.L{l}.m and dx.L{l}.m (0 for the first layer: token ids)
    saved_bytes: tuple[int, ...]  # a.L{l}.m, kept from FWD to BWD without recompute
    layer_workspace_bytes: tuple[int, ...]  # ws of each FWD and of a layer's first BWD in a step
    host_grad_bytes: tuple[int, ...]  # host gring.L{l} slot (compute dtype), compact layout only
    master_bytes: tuple[int, ...]  # OPT_STEP nbytes: fp32 master of the layer's own parameters
    opt_s: tuple[float, ...]  # CPU optimizer time per layer (hostmem.optimizer_steps_s)
    # the machine
    num_gpus: int
    h2d_gbps: tuple[float, ...]  # per GPU, host -> GPU, with shared links split between GPUs
    p2p_gbps: float  # slowest GPU <-> GPU route
    p2p_through_host: bool  # GPU <-> GPU copies stage through host memory (no peer-to-peer)
    gpu_memory_bytes: tuple[int, ...]
    host_memory_bytes: int
    host_dma_gbps: float
    host_static_bytes: int
    host_dynamic_bytes: int  # gradient ring slots and offloaded activations at their peak
    # the policy's modes
    swap: SwapMode = SwapMode.LAYER
    prefetch_depth: int = 1
    resident: ResidentMode | tuple[int, ...] = ResidentMode.NONE  # as the policy says; `kept` / `pinned` once resolved
    activation_home: ActivationHome = ActivationHome.GPU
    optimizer: OptimizerMode = OptimizerMode.SYNC
    host_memory: HostMemory = HostMemory.COMPACT
    optimizer_state: OptimizerState = OptimizerState.FP32
    recompute: bool = True
    tied: bool = False  # the last layer (head) uses the first layer's (embedding's) matrix
    # clipping by the global gradient norm: every OPT_STEP of an iteration waits for all its GRAD_OUTs
    # (compiler.optimizer), and the compact layout holds a whole gradient instead of the ring
    grad_clip: bool = False
    ring_slots: int = DEFAULT_GRAD_RING_SLOTS
    cost: CostModel = field(default_factory=CostModel)
    # chosen by partition.resolve (empty before)
    pack_layers: tuple[tuple[int, ...], ...] = ()
    pack_gpu: tuple[int, ...] = ()
    kept: frozenset[int] = frozenset()  # held from their forward to their backward
    pinned: frozenset[int] = frozenset()  # held for the whole iteration
    # ws.acc of each later BWD (into the gradient accumulator; KindProfile.accumulate_workspace); () = ws
    accumulate_workspace_bytes: tuple[int, ...] = ()
    # what a GRAD_OUT moves; () = weight_bytes. The replicated layout lands the gradients in fp32 host
    # buffers, and torch converts a GPU -> host copy across dtypes on the GPU first: twice the bytes in
    # bf16 (on an H200, a Qwen3-1.7B block's GRAD_OUT took 4.65 ms replicated, 2.0 ms compact)
    grad_out_bytes: tuple[int, ...] = ()
    # LoRA on a frozen base (`estimate/lora_costs.py`): no base gradient (gr.L{l} is 0 bytes, no GRAD_OUT, no host
    # OPT_STEP); each layer's adapters and their AdamW state stay on its GPU (`gpu_state_bytes`), and
    # `master_bytes` / `opt_s` are their fp32 weights and their step on that GPU
    lora: LoraSpec | None = None
    grad_acc_bytes: tuple[int, ...] = ()  # gr.L{l}; () = weight_bytes
    gpu_state_bytes: tuple[int, ...] = ()  # held on the owner GPU all run; () = none
    # what a LOAD uploads, and the time it then takes on the GPU's upload stream; () = weight_bytes and none. A 4-bit
    # base (`LoraSpec.nf4`) uploads NF4 codes and dequantises them there (`lora_costs.base_load_bytes`, `dequant_s`)
    load_bytes: tuple[int, ...] = ()
    load_s: tuple[float, ...] = ()

    num_layers: int = field(init=False)
    owner: tuple[int, ...] = field(init=False, repr=False, compare=False)  # GPU of each layer
    pack_of: tuple[int, ...] = field(init=False, repr=False, compare=False)  # pack of each layer
    pre_fwd: tuple[float, ...] = field(init=False, repr=False, compare=False)
    pre_bwd: tuple[float, ...] = field(init=False, repr=False, compare=False)
    pre_weight: tuple[float, ...] = field(init=False, repr=False, compare=False)
    pre_load: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.weight_bytes)
        if not self.accumulate_workspace_bytes:
            object.__setattr__(self, "accumulate_workspace_bytes", self.layer_workspace_bytes)
        if not self.grad_out_bytes:
            object.__setattr__(self, "grad_out_bytes", self.weight_bytes)
        if not self.grad_acc_bytes:
            object.__setattr__(self, "grad_acc_bytes", self.weight_bytes)
        if not self.gpu_state_bytes:
            object.__setattr__(self, "gpu_state_bytes", (0,) * n)
        if not self.load_bytes:
            object.__setattr__(self, "load_bytes", self.weight_bytes)
        if not self.load_s:
            object.__setattr__(self, "load_s", (0.0,) * n)
        coerce_modes(self, "plan")
        if isinstance(self.resident, str):
            object.__setattr__(self, "resident", ResidentMode.parse(self.resident, "plan: resident"))
        for name in ("fwd_s", "bwd_s", "input_bytes", "saved_bytes", "layer_workspace_bytes", "host_grad_bytes",
                     "master_bytes", "opt_s", "accumulate_workspace_bytes", "grad_out_bytes", "grad_acc_bytes",
                     "gpu_state_bytes", "load_bytes", "load_s"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"plan: {name} has {len(getattr(self, name))} layers, weight_bytes {n}")
        owner: list[int] = []
        pack_of: list[int] = []
        for s, layers in enumerate(self.pack_layers):
            if layers != tuple(range(len(owner), len(owner) + len(layers))):
                raise ValueError(f"pack {s} is not the next run of consecutive layers: {layers}")
            owner += [self.pack_gpu[s]] * len(layers)
            pack_of += [s] * len(layers)
        if self.pack_layers and len(owner) != n:
            raise ValueError(f"the packs hold {len(owner)} layers, the plan has {n}")
        set_ = object.__setattr__
        set_(self, "num_layers", n)
        set_(self, "owner", tuple(owner))
        set_(self, "pack_of", tuple(pack_of))
        for name, src in (("pre_fwd", self.fwd_s), ("pre_bwd", self.bwd_s), ("pre_weight", self.weight_bytes),
                          ("pre_load", self.load_bytes)):
            set_(self, name, (0.0, *accumulate(float(x) for x in src)))

    @property
    def layer_time_s(self) -> tuple[float, ...]:
        """Compute time of each layer over one iteration (all microbatches, forward + backward)."""
        return tuple(self.microbatches * (f + b) for f, b in zip(self.fwd_s, self.bwd_s))

    @property
    def usable_gpu_bytes(self) -> tuple[int, ...]:
        """The bytes of each GPU the plan may fill: its memory (or `--gpu-mem` cap) less the calibration's reserve."""
        return tuple(usable_gpu_bytes(mem, kept_bytes=self.cost.gpu_reserve_bytes) for mem in self.gpu_memory_bytes)

    def recomputes(self, layer: int) -> bool:
        """Whether BWD of `layer` recomputes its forward (`schedule.recomputes`)."""
        return recomputes(self.recompute, layer, self.num_layers)

    def with_packs(self, sizes: tuple[int, ...], mapping: tuple[int, ...], *, kept: frozenset[int] = frozenset(),
                   pinned: frozenset[int] = frozenset()) -> Plan:
        """This plan with packs of `sizes` layers in order, pack s on GPU `mapping[s]`, and residency."""
        starts = [0, *accumulate(sizes)]
        packs = tuple(tuple(range(a, b)) for a, b in zip(starts, starts[1:]))
        return replace(self, pack_layers=packs, pack_gpu=tuple(mapping), kept=kept, pinned=pinned)

    @classmethod
    def toy(cls, sizes: tuple[int, ...], gpus: tuple[int, ...], microbatches: int, *,
            iterations: int = 1, **kw: Any) -> Plan:
        """A plan with small made-up sizes and times, for testing one pass alone."""
        n, g = sum(sizes), max(gpus) + 1
        base = cls(microbatches=microbatches, iterations=iterations, fwd_s=(1e-3,) * n, bwd_s=(2e-3,) * n,
                   weight_bytes=(100,) * n, input_bytes=(0,) + (10,) * (n - 1), saved_bytes=(30,) * n,
                   layer_workspace_bytes=(5,) * n, host_grad_bytes=(200,) * n, master_bytes=(200,) * n,
                   opt_s=(1e-3,) * n, num_gpus=g, h2d_gbps=(10.0,) * g, p2p_gbps=10.0, p2p_through_host=False,
                   gpu_memory_bytes=(10**6,) * g, host_memory_bytes=10**9, host_dma_gbps=10.0,
                   host_static_bytes=0, host_dynamic_bytes=0)
        return replace(base.with_packs(sizes, gpus), **kw)



def base_plan(policy: Policy, model: ModelSpec, hardware: Hardware, trace: ProfileTrace, *,
              iterations: int = 1, cost: CostModel | None = None, grad_clip: bool = False) -> Plan:
    """Flatten model, trace, hardware and policy into the numbers the estimates and passes use (no packs yet).
    `grad_clip`: clipping by the global gradient norm (`Plan.grad_clip`)."""
    cost = cost or CostModel.calibrated()
    trace = lora_.trace_for_policy(trace, model, policy.lora)
    dt = trace.dtype
    if dt not in DTYPE_BYTES:
        raise InputError(f"trace: unknown dtype {dt!r}")
    fwd, bwd, inp, saved, ws, ws_acc = [], [], [], [], [], []
    for layer in model.layers:
        try:
            kp = trace.layer(layer)
        except KeyError:
            raise InputError(f"trace for {trace.gpu_model}: no profile for layer kind "
                             f"{layer.kind.value!r} (layer {layer.index} of {model.name})") from None
        # the trace's rule (`KindProfile.compute_s`, as the simulator's): a recomputed block's loop times, alone
        redo = recomputes(policy.recompute, layer.index, len(model.layers))
        fwd.append(kp.compute_s(True, redo))
        bwd.append(kp.compute_s(False, redo))
        # the layer's input (x.L, and its gradient dx.L) as the trace has it: measured in the compute dtype
        # by `tinypipe profile` (an fp32 CPU run's inputs are twice the bf16 size); the analytic and shipped
        # traces give the previous layer's boundary bytes, which the model spec counts in bf16
        inp.append(kp.saved_act_bytes_recompute if layer.index else 0)
        saved.append(kp.saved_act_bytes)
        ws.append(kp.workspace_bytes)
        ws_acc.append(kp.accumulate_workspace(layer.param_bytes(dt)))
    g = len(hardware.gpus)
    pairs = [hardware.route(f"gpu{a}", f"gpu{b}") for a in range(g) for b in range(g) if a != b]
    hb = host_bytes(model, policy.host_memory, compute_dtype=dt, optimizer=policy.optimizer,
                    optimizer_state=policy.optimizer_state, grad_clip=grad_clip)
    ring = hb.grad_bytes if policy.host_memory.grad_ring else 0
    grad_fp32 = [layer.gpu_params * 4 for layer in model.layers]
    if policy.host_memory.grad_ring:
        # Sync: a ring of slots per GPU; async, or clipping: up to one iteration of gradients waits on the host.
        dyn = sum(grad_fp32) if policy.optimizer.is_async or grad_clip else (
            g * DEFAULT_GRAD_RING_SLOTS * max(grad_fp32, default=0))
    else:
        dyn = 0
    lora_fields: dict[str, Any] = {}
    if policy.lora is not None:
        hb, ring, dyn = lora_.frozen_host_bytes(model, compute_dtype=dt, nf4=policy.lora.nf4), 0, 0
        lora_fields = dict(
            load_bytes=tuple(lora_.base_load_bytes(x, policy.lora, dt) for x in model.layers),
            load_s=tuple(lora_.dequant_s(x, policy.lora, hardware.gpus[0], dt) for x in model.layers),
            lora=policy.lora, grad_acc_bytes=(0,) * len(model.layers), grad_out_bytes=(0,) * len(model.layers),
            gpu_state_bytes=tuple(lora_.adapter_state_bytes(x, policy.lora) for x in model.layers),
            master_bytes=tuple(lora_.adapter_weight_bytes(x, policy.lora) for x in model.layers),
            opt_s=tuple(lora_.adapter_step_s(lora_.adapter_params(x, policy.lora), hardware.gpus[0])
                        for x in model.layers))
    if policy.activation_home.on_host:
        dyn += policy.microbatches * sum(b for i, b in enumerate(inp) if recomputes(policy.recompute, i, len(inp)))
    fields_: dict[str, Any] = dict(
        microbatches=policy.microbatches, iterations=iterations, fwd_s=tuple(fwd), bwd_s=tuple(bwd),
        weight_bytes=tuple(layer.param_bytes(dt) for layer in model.layers), input_bytes=tuple(inp),
        saved_bytes=tuple(saved), layer_workspace_bytes=tuple(ws), accumulate_workspace_bytes=tuple(ws_acc),
        host_grad_bytes=tuple(x.gpu_params * DTYPE_BYTES[dt] for x in model.layers),
        grad_out_bytes=tuple(grad_fp32) if policy.host_memory == HostMemory.REPLICATED else (),
        master_bytes=tuple(x.params * 4 for x in model.layers),
        opt_s=optimizer_steps_s(model, policy.host_memory, hardware.host, trace, optimizer=policy.optimizer,
                                optimizer_state=policy.optimizer_state),
        num_gpus=g, h2d_gbps=hardware.host_to_gpu_gbps(),
        p2p_gbps=min((r.bottleneck_gbps for r in pairs), default=float("inf")),
        p2p_through_host=any(r.through_host for r in pairs),
        gpu_memory_bytes=tuple(x.memory_bytes for x in hardware.gpus), host_memory_bytes=hardware.host.memory_bytes,
        host_dma_gbps=hardware.host.dma_gbps, host_static_bytes=hb.total_bytes - ring, host_dynamic_bytes=dyn,
        swap=policy.swap, prefetch_depth=policy.prefetch_depth, resident=policy.resident,
        activation_home=policy.activation_home, optimizer=policy.optimizer, host_memory=policy.host_memory,
        optimizer_state=policy.optimizer_state,
        recompute=policy.recompute, tied=model.tied_embeddings, grad_clip=grad_clip, cost=cost)
    return Plan(**{**fields_, **lora_fields})
