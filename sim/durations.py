"""What each action costs in the simulator: how it runs (its mode) and its duration, copy or per-phase times.

`action_costs` is the table sim/engine.py runs from, one entry per action, by its kind's cost class
(`tinypipe.ir.kinds.KINDS`; docs/schedule-contract.md): compute (FWD / BWD) from the trace
(`KindProfile.compute_s`, with loop times alone and beside the optimizer and the loop's issue gaps; a
frozen base's from a trace measured with its adapters as it is, from a full-training one scaled:
`estimate.lora.trace_for_policy`), a free kind no time, a GPU optimizer step (ADAPT_STEP)
`estimate.lora.adapter_step_s`, the optimizer `hostmem.optimizer_step_s` (or, measured by phase,
`hostmem.optimizer_step_phases_s` and the rank whose compute phase sets its rate), and copies as
(bytes, latency, the capacities of the route they cross: every directed link and the host's DMA cap). A 4-bit
base's LOAD carries its NF4 bytes and adds its dequantisation on the GPU (`estimate.lora_costs.dequant_s`,
analytic) to the copy's fixed cost.

Host memory bandwidth: where the hardware gives the host's DRAM bandwidth (`Host.mem_gbps`), every pass of a
copy through host memory also crosses it, and an OPT_STEP not measured by phase runs as a flow of its bytes
(`hostmem.optimizer_step_bytes`) over it, capped at its own rate (its bytes over `hostmem.optimizer_step_s`): alone
it takes its step time, beside copies the two share DRAM max-min fairly (sim/network.py), as the kernel's passes
and the DMA engines share it on a real host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tinypipe.common.errors import InputError, ScheduleError
from tinypipe.describe.hardware import HOST, Hardware
from tinypipe.describe.model import LayerSpec, ModelSpec
from tinypipe.describe.trace import KindProfile, ProfileTrace
from tinypipe.estimate.hostmem import optimizer_step_bytes, optimizer_step_phases_s, optimizer_steps_s
from tinypipe.estimate.lora_costs import adapter_step_s, dequant_s, trace_for_policy
from tinypipe.ir.kinds import Cost, Direction, Kind
from tinypipe.ir.order import layer_owner
from tinypipe.ir.schedule import Action, Schedule, resource_gpu

HOST_DMA = "host.dma"  # the capacity name of the host's DMA cap in Network and link_bytes
HOST_MEM = "host.mem"  # the host's DRAM bandwidth, where the hardware gives one (`Host.mem_gbps`)
# How an action runs (its mode; what `action_costs` gives with it): a fixed time (s); a copy (Copy); a SEND /
# RECV half (Copy); an OPT_STEP (s, or with the host's DRAM modelled (s alone, bytes, capacities); counted as
# running); a FWD / BWD with loop times ((alone, beside the
# optimizer, issue gap alone, beside), picked when it is ready); an OPT_STEP whose rate follows its rank's
# compute phase ((StepPhases, rank), counted as running). Plain ints: the engine's loop compares them.
TIMED, COPY, PAIR, OPT, LOOP, PHASED = 0, 1, 2, 3, 4, 5

Copy = tuple[float, float, tuple[str, ...]]  # bytes, latency_s, capacities crossed


def edge_name(u: str, v: str) -> str:
    """Name of the directed edge u -> v as a capacity and in `SimResult.link_bytes`."""
    return f"{u}->{v}"


def link_capacities(hardware: Hardware) -> dict[str, float]:
    """Bytes/s of every directed edge (each link, both directions), of the host DMA cap and, where the hardware
    gives it, of the host's DRAM."""
    cap = {HOST_DMA: hardware.host.dma_gbps * 1e9}
    if hardware.host.mem_gbps is not None:
        cap[HOST_MEM] = hardware.host.mem_gbps * 1e9
    for link in hardware.links:
        cap[edge_name(link.a, link.b)] = link.gbps * 1e9
        cap[edge_name(link.b, link.a)] = link.gbps * 1e9
    return cap


def action_costs(schedule: Schedule, model: ModelSpec, hardware: Hardware, trace: ProfileTrace,
                 partner: dict[int, int]) -> tuple[list[int], list[Any], dict[str, float]]:
    """Per action: its mode and what goes with it (the comment above the modes), checking the inputs; and the
    capacities beyond `link_capacities` that its flows cross (each optimizer lane's own rate)."""
    if len(model.layers) != schedule.num_layers:
        raise InputError(f"schedule has {schedule.num_layers} layers but model {model.name!r} has "
                         f"{len(model.layers)}; compile the schedule for this model")
    if schedule.num_gpus > len(hardware.gpus):
        raise InputError(f"schedule uses {schedule.num_gpus} GPUs but hardware {hardware.name!r} has "
                         f"{len(hardware.gpus)}")
    if trace.tokens_per_microbatch != schedule.tokens_per_microbatch:
        raise InputError(f"trace was profiled at {trace.tokens_per_microbatch} tokens per microbatch but the "
                         f"schedule uses {schedule.tokens_per_microbatch}; use a trace for this microbatch size "
                         "(ProfileTrace.scaled_to scales one linearly)")
    costs = _Costs(schedule, model, hardware, trace, partner)
    mode: list[int] = []
    cost: list[Any] = []
    n = len(schedule.actions)
    for a in schedule.actions:
        for d in a.deps:
            if not 0 <= d < n or d == a.id:
                raise ScheduleError(f"`{a}` (action {a.id}) depends on action {d}, which "
                                    + ("is itself" if d == a.id else f"does not exist (ids are 0..{n - 1})"))
        c = a.kind.info.cost
        rule = _RULES.get(c) if isinstance(c, Cost) else None
        if rule is None:
            raise ScheduleError(f"`{a}` (action {a.id}): the simulator has no cost for kind {a.kind.value} "
                                f"(cost {c.value}); add one to sim/durations.py")
        m, x = rule(costs, a)
        mode.append(m)
        cost.append(x)
    return mode, cost, costs.extra


class _Costs:
    """What `action_costs` reads, made once per schedule, and the rule of each cost class (`_RULES`)."""

    def __init__(self, schedule: Schedule, model: ModelSpec, hardware: Hardware, trace: ProfileTrace,
                 partner: dict[int, int]) -> None:
        # a frozen base: a trace measured with the adapters as it is, a full one as LoRA changes it
        # (estimate/lora_costs.py)
        trace = trace_for_policy(trace, model, schedule.lora)
        self.schedule, self.model, self.hardware, self.trace, self.partner = schedule, model, hardware, trace, partner
        self.cap = link_capacities(hardware)
        self.routes: dict[tuple[str, str], tuple[float, tuple[str, ...]]] = {}
        self.gpu_node = [g.name for g in hardware.gpus]
        self.gpu_of = {r: resource_gpu(r) for r in schedule.by_resource()}
        self.profiles: dict[int, KindProfile] = {}
        self.computes: dict[tuple[int, bool], tuple[int, Any]] = {}  # (layer, forward) -> its mode and cost, once
        self.opt_s = optimizer_steps_s(model, schedule.host_memory, hardware.host, trace, optimizer=schedule.optimizer,
                                       optimizer_state=schedule.optimizer_state)
        self.opt_phases = [optimizer_step_phases_s(layer, schedule.host_memory, trace, optimizer=schedule.optimizer,
                                                   optimizer_state=schedule.optimizer_state, host=hardware.host)
                           for layer in model.layers]
        self.owner = layer_owner(schedule)
        self.extra: dict[str, float] = {}
        self.step_bytes = [optimizer_step_bytes(layer.params, schedule.host_memory, schedule.optimizer_state)
                           for layer in model.layers] if HOST_MEM in self.cap else []

    def route(self, src: str, dst: str) -> tuple[float, tuple[str, ...]]:
        """(latency, capacities crossed) of a copy src -> dst, made once per pair."""
        if (src, dst) not in self.routes:
            cap, hardware = self.cap, self.hardware
            r = hardware.route(src, dst)
            # The DMA cap counts every pass through host memory: once for host<->GPU, twice for a
            # GPU -> host -> GPU copy staged in host memory.
            dma = sum(1 for u, v in r.edges if HOST in (u, v)) if r.through_host else 0
            passes = max(dma, int(r.through_host))
            links = tuple(edge_name(u, v) for u, v in r.edges) + (HOST_DMA,) * passes + (HOST_MEM,) * (
                passes if HOST_MEM in cap else 0)
            missing = [x for x in links if x not in cap]
            if missing:
                raise InputError(f"hardware {hardware.name!r}: route {src} -> {dst} crosses {missing[0]}, "
                                 "which is not a link")
            self.routes[(src, dst)] = (r.latency_s, links)
        return self.routes[(src, dst)]

    def _layer(self, a: Action) -> LayerSpec:
        if not 0 <= a.layer < len(self.model.layers):
            raise ScheduleError(f"`{a}` (action {a.id}) needs a layer in 0..{len(self.model.layers) - 1}")
        return self.model.layers[a.layer]

    def optimizer(self, a: Action) -> tuple[int, Any]:
        """An OPT_STEP: by phase where measured so (and its layer has an owner), else its time or a DRAM flow."""
        self._layer(a)
        phases = self.opt_phases[a.layer]
        if phases is not None and a.layer in self.owner:
            return PHASED, (phases, self.owner[a.layer])
        opt_s, step_bytes = self.opt_s, self.step_bytes
        return OPT, (opt_s[a.layer] if not step_bytes or opt_s[a.layer] <= 0
                     else _opt_flow(f"{a.resource}.r{self.owner.get(a.layer, 0)}", step_bytes[a.layer],
                                    opt_s[a.layer], self.extra))

    def compute(self, a: Action) -> tuple[int, Any]:
        """A FWD / BWD: the trace's time, or its loop times where they differ (made once per layer and direction)."""
        layer = self._layer(a)
        if a.layer not in self.profiles:
            try:
                self.profiles[a.layer] = self.trace.layer(layer)
            except KeyError:
                raise InputError(f"trace has no profile for layer kind {layer.kind.value!r} "
                                 f"(layer {a.layer}); it has {', '.join(self.trace.kinds)}") from None
        p = self.profiles[a.layer]
        k = a.kind
        if k.info.direction is Direction.NONE:
            raise ScheduleError(f"`{a}` (action {a.id}): compute kind {k.value} is neither forward nor backward")
        forward = k.info.direction is Direction.FORWARD
        got = self.computes.get((a.layer, forward))
        if got is None:
            redo = self.schedule.recomputes(a.layer)
            alone, beside = p.compute_s(forward, redo), p.compute_s(forward, redo, beside_optimizer=True)
            gaps = p.issue_gap_s(forward, redo), p.issue_gap_s(forward, redo, beside_optimizer=True)
            timed = alone == beside and not any(gaps)
            got = self.computes[a.layer, forward] = (TIMED, alone) if timed else (LOOP, (alone, beside, *gaps))
        return got

    def free(self, a: Action) -> tuple[int, Any]:
        """A kind that takes no time (EVICT)."""
        return TIMED, 0.0

    def device_optimizer(self, a: Action) -> tuple[int, Any]:
        """ADAPT_STEP: a fused AdamW over nbytes / 4 fp32 parameters on its GPU."""
        g = self.gpu_of.get(a.resource)
        if g is None:
            raise ScheduleError(f"`{a}` (action {a.id}) is a device optimizer step and must run on a GPU")
        return TIMED, adapter_step_s(a.nbytes // 4, self.hardware.gpus[g])

    def copy(self, a: Action) -> tuple[int, Any]:
        """An upload, a download or a SEND / RECV half: (bytes, latency, capacities) of the copy it makes."""
        g = self.gpu_of.get(a.resource)
        if g is None:
            raise ScheduleError(f"`{a}` (action {a.id}) is a copy and must run on a GPU stream")
        c = a.kind.info.cost
        if c is Cost.UPLOAD:
            src, dst = HOST, self.gpu_node[g]
            nbytes = a.nbytes
        elif c is Cost.DOWNLOAD:
            src, dst = self.gpu_node[g], HOST
            nbytes = a.nbytes
        else:  # a SEND / RECV half: one copy sender -> receiver, of the SEND's bytes
            send = a if a.kind.info.stream == "send" else self.schedule.actions[self.partner[a.id]]
            sg = self.gpu_of.get(send.resource)
            assert sg is not None and send.peer is not None
            src, dst = self.gpu_node[sg], self.gpu_node[send.peer]
            nbytes = send.nbytes
        lat, links = self.route(src, dst)
        lora = self.schedule.lora
        if a.kind is Kind.LOAD and lora is not None and lora.nf4:  # dequantised on the GPU after the copy
            lat += dequant_s(self._layer(a), lora, self.hardware.gpus[g], self.schedule.compute_dtype)
        return (PAIR if c is Cost.PEER else COPY), (float(nbytes), lat, links)


# The rule of each cost class (`tinypipe.ir.kinds.Cost`); a class with none is an error in `action_costs`.
_RULES: dict[Cost, Callable[[_Costs, Action], tuple[int, Any]]] = {
    Cost.COMPUTE: _Costs.compute, Cost.OPTIMIZER: _Costs.optimizer, Cost.FREE: _Costs.free,
    Cost.DEVICE_OPTIMIZER: _Costs.device_optimizer, Cost.UPLOAD: _Costs.copy, Cost.DOWNLOAD: _Costs.copy,
    Cost.PEER: _Costs.copy,
}


def _opt_flow(lane: str, nbytes: float, step_s: float, extra: dict[str, float]) -> tuple[float, float, tuple[str, ...]]:
    """An OPT_STEP as a flow: (its time alone, its bytes, the capacities it crosses: its lane at its own rate
    (registered in `extra`), then the host's DRAM)."""
    rate = nbytes / step_s
    own = f"{lane}@{rate:.6g}"
    extra[own] = rate
    return step_s, nbytes, (own, HOST_MEM)
