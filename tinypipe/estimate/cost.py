"""Analytic cost model: per-pack compute and upload time, pack overhead, pipeline fill; memory per GPU
from the one GPU-memory formula (`tinypipe.estimate.gpumem`).

Pure and fast (prefix sums, no simulation): the packers call `estimate` thousands of times with the
`Plan` of the policy (`tinypipe.estimate.plan`) and a candidate packing. Its constants live in `CostModel`
(`tinypipe.estimate.calibration`), calibrated against the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from tinypipe.estimate import gpumem
from tinypipe.estimate.plan import Plan
from tinypipe.policy.modes import ResidentMode


@dataclass(frozen=True)
class Estimate:
    """What the model predicts for one packing and mapping."""

    iteration_s: float
    busy_s: tuple[float, ...]  # per GPU: compute and exposed uploads over one iteration
    fill_s: float  # pipeline fill and drain
    optimizer_s: float  # CPU optimizer time of one iteration
    gpu_peak_bytes: tuple[int, ...]
    host_peak_bytes: int
    gpu_capacity_bytes: tuple[int, ...]  # memory less the cost model's reserve (`usable_gpu_bytes`)
    host_capacity_bytes: int

    @property
    def fits(self) -> bool:
        return (all(p <= c for p, c in zip(self.gpu_peak_bytes, self.gpu_capacity_bytes))
                and self.host_peak_bytes <= self.host_capacity_bytes)

    @property
    def gpu_fill_fraction(self) -> float:
        """The fullest GPU's estimated peak over its capacity."""
        return max((p / max(1, c) for p, c in zip(self.gpu_peak_bytes, self.gpu_capacity_bytes)), default=0.0)


def _uses(w: Plan, packs: list[int]) -> list[tuple[int, str]]:
    """One GPU's pack uses in stream order: forward ascending, then backward descending.

    The GPU's last pack is one merged use ("FB") when the policy keeps it between its forward and
    backward (`auto`), so it uploads once.
    """
    if not packs:
        return []
    fwd = [(s, "F") for s in packs]
    bwd = [(s, "B") for s in reversed(packs)]
    if w.resident == ResidentMode.AUTO:
        return fwd[:-1] + [(packs[-1], "FB")] + bwd[1:]
    return fwd + bwd


def estimate(w: Plan, sizes: tuple[int, ...], mapping: tuple[int, ...],
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
    pf, pb = w.pre_fwd, w.pre_bwd
    n_packs = len(sizes)
    cf = [m * (pf[starts[s + 1]] - pf[starts[s]]) for s in range(n_packs)]
    cb = [m * (pb[starts[s + 1]] - pb[starts[s]]) for s in range(n_packs)]
    busy, up_bytes = _busy(w, sizes, mapping, kept, cf, cb)
    used = sum(1 for g in range(w.num_gpus) if g in mapping)
    fill, handed = _fill(w, sizes, mapping, used, cf, cb)
    # One optimizer lane for all ranks, though the simulator (and the backend) has one per rank
    # (`tinypipe.ir.order.run_lanes`): per rank, the holistic packer would also balance the ranks' steps, and
    # on 2 x H200 it then picks one-layer packs for Llama-3.1-8B, where `gpumem`'s formula is 14% under
    # the simulated peak of g0 (the embedding's upload starts while the last block's gradient is
    # still leaving; tests/test_gpumem.py). Left as it was until that formula covers it.
    opt_total = sum(w.opt_s)
    tail = sum(w.opt_s[: starts[1]]) if not w.optimizer.is_async and n_packs else 0.0
    # uploads, gradients out, and activations out and back when they live on the host
    offloaded = sum(b for i, b in enumerate(w.input_bytes) if w.recomputes(i))  # a kept graph keeps its input
    moved = (up_bytes + sum(w.grad_out_bytes) + 2 * m * offloaded * (w.activation_home.on_host)
             + 2 * handed * w.p2p_through_host)
    dma_s = moved / (w.host_dma_gbps * 1e9)
    it = max(max(busy, default=0.0) + fill + tail, opt_total, dma_s)
    peaks = gpu_peak_bytes(w, sizes, mapping, kept=kept)
    caps = w.usable_gpu_bytes
    return Estimate(
        iteration_s=it, busy_s=tuple(busy), fill_s=fill, optimizer_s=opt_total, gpu_peak_bytes=peaks,
        host_peak_bytes=w.host_static_bytes + w.host_dynamic_bytes, gpu_capacity_bytes=caps,
        host_capacity_bytes=w.host_memory_bytes - c.host_reserve_bytes)


def _busy(w: Plan, sizes: tuple[int, ...], mapping: tuple[int, ...], kept: frozenset[int],
          cf: list[float], cb: list[float]) -> tuple[list[float], float]:
    """Per GPU, its compute and exposed uploads over one iteration (pack overheads included), and the bytes
    uploaded in all."""
    c = w.cost
    m = w.microbatches
    starts = [0, *accumulate(sizes)]
    pw = w.pre_load  # what the LOADs carry (`Plan.load_bytes`)
    n_packs = len(sizes)
    wb = [pw[starts[s + 1]] - pw[starts[s]] for s in range(n_packs)]
    # the upload stream's time beside its copies, per pack's full upload (a 4-bit base's dequantisation)
    extra = [sum(w.load_s[starts[s]:starts[s + 1]]) for s in range(n_packs)]
    pinned = _pinned(w, kept)
    # bytes each pack uploads per use (layers held all iteration upload once, at their first use)
    swapped = [wb[s] - sum(w.load_bytes[x] for x in range(starts[s], starts[s + 1]) if x in pinned)
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
            up += extra[s] * nbytes / wb[s] if wb[s] else 0.0
            if w.swap.whole_packs and w.prefetch_depth == 0:
                t += comp + up
            elif not w.swap.whole_packs and w.prefetch_depth == 0:
                t += max(comp, up) + up / max(1, sizes[s])
            else:
                t += max(comp, up)
        if uses and not w.optimizer.is_async:
            t += wb[uses[0][0]] / rate  # the first upload waits for the previous optimizer step
        busy.append(t + c.pack_overhead_s * len(uses))
    return busy, up_bytes


def _fill(w: Plan, sizes: tuple[int, ...], mapping: tuple[int, ...], used: int, cf: list[float],
          cb: list[float]) -> tuple[float, float]:
    """The pipeline's fill and drain over `used` GPUs (with the hand-offs between GPUs), and the bytes of
    activations and their gradients handed between GPUs per iteration."""
    c = w.cost
    m = w.microbatches
    starts = [0, *accumulate(sizes)]
    n_packs = len(sizes)
    step = sum(cf[s] + cb[s] for s in range(n_packs)) / max(1, n_packs) / m
    wraps = max(0, (n_packs - 1) // max(1, used))
    hop = 0.0
    handed = 0.0
    for s in range(n_packs - 1):
        if mapping[s] != mapping[s + 1]:
            hop += 2 * (c.copy_latency_s + w.input_bytes[starts[s + 1]] / (w.p2p_gbps * 1e9))
            handed += 2 * m * w.input_bytes[starts[s + 1]]
    return c.fill_scale * ((min(used, n_packs) - 1) * step + wraps * max(0, used - m) * step) + hop, handed


def _pinned(w: Plan, kept: frozenset[int]) -> frozenset[int]:
    """Layers held on their GPU for the whole iteration (outside the prefetch window)."""
    if w.resident == ResidentMode.ALL:
        return frozenset(range(w.num_layers))
    if isinstance(w.resident, tuple):
        return frozenset(w.resident) | kept
    return kept


def policy_pinned(w: Plan) -> frozenset[int]:
    """The layers the policy itself pins for the whole iteration (`resident: all` or a list; `auto` decides later)."""
    if w.resident == ResidentMode.ALL:
        return frozenset(range(w.num_layers))
    return frozenset(w.resident) if isinstance(w.resident, tuple) else frozenset()


def gpu_peak_bytes(w: Plan, sizes: tuple[int, ...], mapping: tuple[int, ...],
                   *, kept: frozenset[int] = frozenset()) -> tuple[int, ...]:
    """Peak bytes per GPU by the one GPU-memory formula (`tinypipe.estimate.gpumem`). `kept`: layers held from
    forward to backward besides each GPU's last pack, which `auto` always keeps (`resolve.residency`)."""
    pinned = policy_pinned(w)
    if w.resident == ResidentMode.AUTO:
        starts = [0, *accumulate(sizes)]
        last = {g: s for s, g in enumerate(mapping)}
        kept = kept | {x for s in last.values() for x in range(starts[s], starts[s + 1])}
    return gpumem.gpu_peak_bytes(w, sizes, mapping, w.num_gpus, kept=kept, pinned=pinned)
