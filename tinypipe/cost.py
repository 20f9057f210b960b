"""Analytic cost model: per-pack compute and upload time, pack overhead, pipeline fill, memory per GPU.

Pure and fast (prefix sums, no simulation): the packers call `estimate` thousands of times. Its
constants live in `CostModel` so that later work can calibrate them against the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate

from tinypipe.errors import InputError
from tinypipe.hardware import Hardware
from tinypipe.hostmem import DEFAULT_GRAD_RING_SLOTS, host_bytes, optimizer_s_per_param
from tinypipe.model import DTYPE_BYTES, ModelSpec
from tinypipe.policy.policy import Policy
from tinypipe.schedule import recomputes
from tinypipe.trace import ProfileTrace
from tinypipe.units import GIB


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """The constants of the analytic model. The defaults are first guesses; `calibrated()` gives the
    constants fitted against the simulator by bench/calibrate_cost.py (shipped as
    traces/calibration/cost_model.json), which is what the packers use."""

    pack_overhead_s: float = 5e-4  # per pack use: stream syncs, launch gaps, bookkeeping (a guess)
    copy_latency_s: float = 5e-6  # fixed cost per copy; DESIGN §8 measured 3-6 us on the H200 host
    h2d_efficiency: float = 1.0  # achieved / route bandwidth for weight uploads
    gpu_reserve_bytes: int = GIB  # CUDA context and allocator slack kept free on every GPU
    host_reserve_bytes: int = 4 * GIB  # OS and process overhead kept free in host DRAM
    memory_weight: float = 0.05  # holistic packing: fraction of time worth trading for a full GPU
    fill_scale: float = 1.0  # multiplies the pipeline fill and drain estimate

    FITTED = ("pack_overhead_s", "h2d_efficiency", "fill_scale")  # what calibration adjusts

    @classmethod
    def calibrated(cls) -> CostModel:
        """The simulator-calibrated constants when shipped, else the defaults."""
        return _calibrated()

    def to_json(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.FITTED}


@lru_cache(maxsize=1)
def _calibrated() -> CostModel:
    import tinypipe.traces as shipped
    from tinypipe.jsonio import Fields, load_json

    p = shipped.path("calibration", "cost_model")
    if p is None:
        return CostModel()
    f = Fields(load_json(p), str(p)).obj_("constants")
    return CostModel(pack_overhead_s=f.float("pack_overhead_s", minimum=0.0),
                     h2d_efficiency=f.float("h2d_efficiency", positive=True),
                     fill_scale=f.float("fill_scale", minimum=0.0))


@dataclass(frozen=True)
class Workload:
    """Everything the estimates need about one model, trace, hardware and policy, as flat tuples.

    Per-layer values are per microbatch; `pre_*` are prefix sums (index l = sum over layers < l).
    """

    num_layers: int
    num_gpus: int
    microbatches: int
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]  # with recompute when the policy recomputes
    weight_bytes: tuple[int, ...]  # compute dtype, what a LOAD moves
    act_bytes: tuple[int, ...]  # kept on the GPU from FWD to BWD when activations live on the GPU
    input_bytes: tuple[int, ...]  # x.L{l}: the layer's input (0 for the first layer)
    opt_s: tuple[float, ...]  # CPU optimizer time per layer
    workspace_bytes: int  # largest transient workspace of any layer
    h2d_gbps: tuple[float, ...]  # per GPU, host -> GPU, with shared links split between GPUs
    p2p_gbps: float  # slowest GPU <-> GPU route
    p2p_through_host: bool  # GPU <-> GPU copies stage through host memory (no peer-to-peer)
    gpu_memory_bytes: tuple[int, ...]
    host_memory_bytes: int
    host_static_bytes: int
    host_dynamic_bytes: int  # gradient ring slots and offloaded activations at their peak
    host_dma_gbps: float
    swap: str
    prefetch_depth: int
    resident: str | tuple[int, ...]
    activation_home: str
    optimizer: str
    cost: CostModel = field(default_factory=CostModel)

    pre_fwd: tuple[float, ...] = field(init=False, repr=False, compare=False)
    pre_bwd: tuple[float, ...] = field(init=False, repr=False, compare=False)
    pre_weight: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, src in (("pre_fwd", self.fwd_s), ("pre_bwd", self.bwd_s), ("pre_weight", self.weight_bytes)):
            object.__setattr__(self, name, (0.0, *accumulate(float(x) for x in src)))

    @property
    def layer_time_s(self) -> tuple[float, ...]:
        """Compute time of each layer over one iteration (all microbatches, forward + backward)."""
        return tuple(self.microbatches * (f + b) for f, b in zip(self.fwd_s, self.bwd_s))


@dataclass(frozen=True)
class Estimate:
    """What the model predicts for one packing and mapping."""

    iteration_s: float
    busy_s: tuple[float, ...]  # per GPU: compute and exposed uploads over one iteration
    fill_s: float  # pipeline fill and drain
    optimizer_s: float  # CPU optimizer time of one iteration
    gpu_peak_bytes: tuple[int, ...]
    host_peak_bytes: int
    gpu_capacity_bytes: tuple[int, ...]  # memory minus the reserve
    host_capacity_bytes: int

    @property
    def fits(self) -> bool:
        return (all(p <= c for p, c in zip(self.gpu_peak_bytes, self.gpu_capacity_bytes))
                and self.host_peak_bytes <= self.host_capacity_bytes)

    @property
    def gpu_fill_fraction(self) -> float:
        """The fullest GPU's estimated peak over its capacity."""
        return max((p / max(1, c) for p, c in zip(self.gpu_peak_bytes, self.gpu_capacity_bytes)), default=0.0)


def workload(policy: Policy, model: ModelSpec, hardware: Hardware, trace: ProfileTrace, *,
             cost: CostModel | None = None) -> Workload:
    """Flatten model, trace, hardware and policy into the numbers the estimates use."""
    cost = cost or CostModel.calibrated()
    dt = trace.dtype
    if dt not in DTYPE_BYTES:
        raise InputError(f"trace: unknown dtype {dt!r}")
    fwd, bwd, act, inp, ws = [], [], [], [], 0
    for layer in model.layers:
        try:
            kp = trace.layer(layer)
        except KeyError:
            raise InputError(f"trace for {trace.gpu_model}: no profile for layer kind "
                             f"{layer.kind.value!r} (layer {layer.index} of {model.name})") from None
        fwd.append(kp.fwd_s)
        redo = recomputes(policy.recompute, layer.index, len(model.layers))
        bwd.append(kp.backward_s(redo))
        # the layer's input (x.L, and its gradient dx.L) as the trace has it: measured in the compute dtype
        # by `tinypipe profile` (an fp32 CPU run's inputs are twice the bf16 size); the analytic and shipped
        # traces give the previous layer's boundary bytes, which the model spec counts in bf16
        x = kp.saved_act_bytes_recompute if layer.index else 0
        inp.append(x)
        act.append(x + (0 if redo else kp.saved_act_bytes))
        ws = max(ws, kp.workspace_bytes)
    g = len(hardware.gpus)
    h2d = host_to_gpu_gbps(hardware)
    pairs = [hardware.route(f"gpu{a}", f"gpu{b}") for a in range(g) for b in range(g) if a != b]
    p2p = min((r.bottleneck_gbps for r in pairs), default=float("inf"))
    hb = host_bytes(model, policy.host_memory, compute_dtype=dt, optimizer=policy.optimizer)
    ring = hb.grad_bytes if policy.host_memory == "compact" else 0
    grad_fp32 = [layer.gpu_params * 4 for layer in model.layers]
    if policy.host_memory == "compact":
        # Sync: a ring of slots per GPU; async: up to one iteration of gradients waits on the host.
        dyn = sum(grad_fp32) if policy.optimizer == "async" else (
            g * DEFAULT_GRAD_RING_SLOTS * max(grad_fp32, default=0))
    else:
        dyn = 0
    if policy.activation_home == "host":
        dyn += policy.microbatches * sum(inp)
    opt_s_per_param = optimizer_s_per_param(hardware.host, policy.host_memory)
    return Workload(
        num_layers=len(model.layers), num_gpus=g, microbatches=policy.microbatches,
        fwd_s=tuple(fwd), bwd_s=tuple(bwd),
        weight_bytes=tuple(layer.param_bytes(dt) for layer in model.layers),
        act_bytes=tuple(act), input_bytes=tuple(inp),
        opt_s=tuple(layer.params * opt_s_per_param for layer in model.layers),
        workspace_bytes=ws, h2d_gbps=h2d, p2p_gbps=p2p, p2p_through_host=any(r.through_host for r in pairs),
        gpu_memory_bytes=tuple(x.memory_bytes for x in hardware.gpus),
        host_memory_bytes=hardware.host.memory_bytes, host_static_bytes=hb.total_bytes - ring,
        host_dynamic_bytes=dyn, host_dma_gbps=hardware.host.dma_gbps,
        swap=policy.swap, prefetch_depth=policy.prefetch_depth, resident=policy.resident,
        activation_home=policy.activation_home, optimizer=policy.optimizer, cost=cost)


def host_to_gpu_gbps(hardware: Hardware) -> tuple[float, ...]:
    """Upload rate per GPU when all GPUs upload at once: each link split among the GPUs crossing it."""
    bw: dict[frozenset[str], float] = {frozenset((ln.a, ln.b)): ln.gbps for ln in hardware.links}
    routes = [hardware.route("host", gpu.name) for gpu in hardware.gpus]
    users: dict[frozenset[str], int] = {}
    for r in routes:
        for u, v in r.edges:
            users[frozenset((u, v))] = users.get(frozenset((u, v)), 0) + 1
    out = []
    for r in routes:
        rate = r.bottleneck_gbps
        for u, v in r.edges:
            e = frozenset((u, v))
            rate = min(rate, bw.get(e, rate) / users[e])
        out.append(min(rate, hardware.host.dma_gbps / max(1, len(routes))))
    return tuple(out)


def _uses(w: Workload, packs: list[int]) -> list[tuple[int, str]]:
    """One GPU's pack uses in stream order: forward ascending, then backward descending.

    The GPU's last pack is one merged use ("FB") when the policy keeps it between its forward and
    backward (`auto`), so it uploads once.
    """
    if not packs:
        return []
    fwd = [(s, "F") for s in packs]
    bwd = [(s, "B") for s in reversed(packs)]
    if w.resident == "auto":
        return fwd[:-1] + [(packs[-1], "FB")] + bwd[1:]
    return fwd + bwd


def estimate(w: Workload, sizes: tuple[int, ...], mapping: tuple[int, ...],
             *, kept: frozenset[int] = frozenset()) -> Estimate:
    """Predict iteration time and memory peaks of packing `sizes` on GPUs `mapping` (one per pack).

    Per GPU, each pack use costs max(compute, upload) (upload overlapped by prefetch; compute +
    upload for pack swapping without prefetch) plus the per-pack overhead; the first upload of an
    iteration is exposed under `sync`. Fill: (GPUs - 1) microbatch steps, plus a bubble each time
    the pipeline wraps around a GPU with fewer microbatches than GPUs. The iteration is bounded
    below by the CPU optimizer and by the host DMA cap (uploads, gradients, offloaded
    activations, and GPU-to-GPU hand-offs when they stage through host memory). `kept`: extra
    layers held from forward to backward (the `auto` resident choice).
    """
    c = w.cost
    m = w.microbatches
    starts = [0, *accumulate(sizes)]
    pf, pb, pw = w.pre_fwd, w.pre_bwd, w.pre_weight
    n_packs = len(sizes)
    cf = [m * (pf[starts[s + 1]] - pf[starts[s]]) for s in range(n_packs)]
    cb = [m * (pb[starts[s + 1]] - pb[starts[s]]) for s in range(n_packs)]
    wb = [pw[starts[s + 1]] - pw[starts[s]] for s in range(n_packs)]
    pinned = _pinned(w, kept)
    # bytes each pack uploads per use (layers held all iteration upload once, at their first use)
    swapped = [wb[s] - sum(w.weight_bytes[x] for x in range(starts[s], starts[s + 1]) if x in pinned)
               for s in range(n_packs)] if pinned else wb
    by_gpu: list[list[int]] = [[] for _ in range(w.num_gpus)]
    for s, g in enumerate(mapping):
        by_gpu[g].append(s)
    # activations received over the GPU's host link when GPU-to-GPU copies stage through the host:
    # x of the pack's first layer in forward, dx of the next pack's first layer in backward
    recv_f = [m * w.input_bytes[starts[s]] if w.p2p_through_host and s and mapping[s - 1] != mapping[s] else 0
              for s in range(n_packs)]
    recv_b = [m * w.input_bytes[starts[s + 1]] if w.p2p_through_host and s + 1 < n_packs
              and mapping[s + 1] != mapping[s] else 0 for s in range(n_packs)]
    busy = []
    up_bytes = 0.0
    for g, packs in enumerate(by_gpu):
        rate = w.h2d_gbps[g] * 1e9 * c.h2d_efficiency
        t = 0.0
        uses = _uses(w, packs)
        for s, phase in uses:
            comp = (cf[s] if "F" in phase else 0.0) + (cb[s] if "B" in phase else 0.0)
            nbytes = swapped[s] + ((wb[s] - swapped[s]) if "F" in phase else 0.0)
            up_bytes += nbytes
            up = (nbytes + (recv_f[s] if "F" in phase else 0) + (recv_b[s] if "B" in phase else 0)) / rate
            if w.swap == "pack" and w.prefetch_depth == 0:
                t += comp + up
            elif w.swap == "layer" and w.prefetch_depth == 0:
                t += max(comp, up) + up / max(1, sizes[s])
            else:
                t += max(comp, up)
        if uses and w.optimizer == "sync":
            t += wb[uses[0][0]] / rate  # the first upload waits for the previous optimizer step
        busy.append(t + c.pack_overhead_s * len(uses))
    used = sum(1 for p in by_gpu if p)
    step = sum(cf[s] + cb[s] for s in range(n_packs)) / max(1, n_packs) / m
    wraps = max(0, (n_packs - 1) // max(1, used))
    hop = 0.0
    handed = 0.0  # bytes of activations and their gradients between GPUs per iteration
    for s in range(n_packs - 1):
        if mapping[s] != mapping[s + 1]:
            hop += 2 * (c.copy_latency_s + w.input_bytes[starts[s + 1]] / (w.p2p_gbps * 1e9))
            handed += 2 * m * w.input_bytes[starts[s + 1]]
    fill = c.fill_scale * ((min(used, n_packs) - 1) * step + wraps * max(0, used - m) * step) + hop
    opt_total = sum(w.opt_s)
    tail = sum(w.opt_s[: starts[1]]) if w.optimizer == "sync" and n_packs else 0.0
    # uploads, gradients out, and activations out and back when they live on the host
    moved = (up_bytes + sum(wb) + 2 * m * sum(w.input_bytes) * (w.activation_home == "host")
             + 2 * handed * w.p2p_through_host)
    dma_s = moved / (w.host_dma_gbps * 1e9)
    it = max(max(busy, default=0.0) + fill + tail, opt_total, dma_s)
    peaks = gpu_peak_bytes(w, sizes, mapping, kept=kept)
    caps = tuple(mem - c.gpu_reserve_bytes for mem in w.gpu_memory_bytes)
    return Estimate(
        iteration_s=it, busy_s=tuple(busy), fill_s=fill, optimizer_s=opt_total, gpu_peak_bytes=peaks,
        host_peak_bytes=w.host_static_bytes + w.host_dynamic_bytes, gpu_capacity_bytes=caps,
        host_capacity_bytes=w.host_memory_bytes - c.host_reserve_bytes)


def _pinned(w: Workload, kept: frozenset[int]) -> frozenset[int]:
    """Layers held on their GPU for the whole iteration (outside the prefetch window)."""
    if w.resident == "all":
        return frozenset(range(w.num_layers))
    if isinstance(w.resident, tuple):
        return frozenset(w.resident) | kept
    return kept


def gpu_peak_bytes(w: Workload, sizes: tuple[int, ...], mapping: tuple[int, ...],
                   *, kept: frozenset[int] = frozenset()) -> tuple[int, ...]:
    """Estimated peak bytes per GPU: activations, the prefetch window of weights, gradients, workspace.

    Activations on the GPU: every owned layer's input (and saved activations without recompute)
    for all microbatches, held at the turnaround; on the host: about two microbatches of the
    largest pack. Weights: layer swapping holds a pack plus `prefetch_depth` layers; pack swapping
    holds `prefetch_depth + 1` consecutive pack uses; layers held all iteration are added whole.
    Gradient accumulators: the largest pack in compute dtype.
    """
    m = w.microbatches
    starts = [0, *accumulate(sizes)]
    pinned = _pinned(w, kept)
    by_gpu: list[list[int]] = [[] for _ in range(w.num_gpus)]
    for s, g in enumerate(mapping):
        by_gpu[g].append(s)
    out = []
    for packs in by_gpu:
        if not packs:
            out.append(0)
            continue
        layers = [x for s in packs for x in range(starts[s], starts[s + 1])]
        if w.activation_home == "gpu":
            act = m * sum(w.act_bytes[x] for x in layers)
        else:
            act = 2 * max(sum(w.input_bytes[x] for x in range(starts[s], starts[s + 1])) for s in packs)
        held = sum(w.weight_bytes[x] for x in layers if x in pinned)
        win = [sum(w.weight_bytes[x] for x in range(starts[s], starts[s + 1]) if x not in pinned)
               for s, _ in _uses(w, packs)]
        if w.swap == "layer":
            biggest = max((w.weight_bytes[x] for x in layers if x not in pinned), default=0)
            window = max(win) + w.prefetch_depth * biggest
        else:
            d = w.prefetch_depth + 1
            ring = win + win
            window = max(sum(ring[u:u + d]) for u in range(len(win)))
        grads = max(sum(w.weight_bytes[x] for x in range(starts[s], starts[s + 1])) for s in packs)
        out.append(int(act + held + window + grads + w.workspace_bytes))
    return tuple(out)
