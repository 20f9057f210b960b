"""The schedule IR: Actions on per-resource ordered lists, with dependencies and memory effects.

Execution semantics (shared by the simulator and the real backend, like CUDA streams + events):
each resource runs its actions in list order; an action starts when the previous action on its
resource and every action in `deps` have finished. Memory effects: `allocs` are taken when an
action starts, `frees` are returned when it ends.

Resources: per GPU `i`: `g{i}.compute` (FWD, BWD, EVICT), `g{i}.h2d` (LOAD, FETCH_ACT),
`g{i}.d2h` (GRAD_OUT, OFFLOAD_ACT), `g{i}.send` (SEND_F, SEND_B), `g{i}.recv` (RECV_F, RECV_B); on the
host: `host.optim` (OPT_STEP). Sends and receives have a stream each so that a GPU in the middle of the
pipeline can receive microbatch m+1 while it sends microbatch m on (one shared stream serialises the
pipeline). Memory devices: `g{i}` and `host`. What each kind means (its stream, direction, the buffer it
carries, its cost) is one table, `tinypipe.ir.kinds.KINDS`; `tinypipe.ir.order` says when each action may run.

What each kind does:
- LOAD L: upload layer L's weights (compute dtype) host -> GPU; `nbytes` moved.
- EVICT L: drop layer L's weights from the GPU; takes no time.
- FWD L m / BWD L m: forward / backward of layer L for microbatch m (BWD recomputes the forward
  first when `Schedule.recomputes(L)`: under `recompute`, every layer but the head).
- SEND_F / RECV_F, SEND_B / RECV_B: the two halves of one GPU -> GPU copy of a boundary activation
  (forward) or of its gradient (backward); `peer` is the other GPU. A pair moves as one copy, started
  when both halves are ready; pairs between two GPUs match in list order.
- OFFLOAD_ACT / FETCH_ACT: a saved activation GPU -> host after FWD, host -> GPU before BWD.
- GRAD_OUT L: layer L's accumulated gradients GPU -> host (fp32 or compute dtype, see nbytes).
- OPT_STEP L: the CPU optimizer step for layer L.
- ADAPT_STEP L: the AdamW step of layer L's LoRA adapters, on its GPU's compute stream (a frozen base).

Text form, one action per line (round-trips exactly through `Schedule.dumps` / `Schedule.loads`):
`12 g0.compute FWD L3 P1 m2 i0 B=1024 >g1 deps=3,7 +g0:act.L3.m2=1024 -g0:x.L2.m2=512`
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.ir.kinds import GPU_STREAMS as GPU_STREAMS
from tinypipe.ir.kinds import HOST_OPTIM as HOST_OPTIM
from tinypipe.ir.kinds import KIND_STREAM as KIND_STREAM
from tinypipe.ir.kinds import Kind as Kind
from tinypipe.policy.lora_spec import LoraSpec
from tinypipe.policy.modes import HostMemory, OptimizerMode, OptimizerState, coerce_modes


def recomputes(recompute: bool, layer: int, num_layers: int) -> bool:
    """Whether BWD of `layer` re-runs its forward first: under `recompute`, every layer but the head
    (the last one). The chunked head keeps only its normed input and one fp32 per token (32,784 B a
    token for Llama-3.1-8B, against 168,064 for a block), so recomputing it would repeat its forward
    (21.7 ms per 4 x 2048 tokens on an H200) to save ~200 MiB per microbatch."""
    return recompute and layer != num_layers - 1


def gpu_resource(gpu: int, stream: str) -> str:
    """`g{gpu}.{stream}`, e.g. `g1.h2d`."""
    return f"g{gpu}.{stream}"


@lru_cache(maxsize=1024)  # a schedule has a few dozen resources, asked for per action
def resource_device(resource: str) -> str:
    """The memory device a resource belongs to: `g1.h2d` -> `g1`, `host.optim` -> `host`."""
    return resource.split(".", 1)[0]


@lru_cache(maxsize=1024)
def resource_gpu(resource: str) -> int | None:
    """The GPU index of a resource, or None for host resources."""
    dev = resource_device(resource)
    return int(dev[1:]) if dev.startswith("g") else None


@dataclass(frozen=True, slots=True)
class Mem:
    """A memory effect: `nbytes` of buffer `buffer` on `device` (`g0`, `host`)."""

    device: str
    buffer: str
    nbytes: int

    def text(self) -> str:
        return f"{self.device}:{self.buffer}={self.nbytes}"


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work on one resource. `id` is its index in `Schedule.actions`."""

    id: int
    kind: Kind
    resource: str
    layer: int  # every action acts on one layer (a SEND / RECV: the layer whose buffer it moves)
    pack: int | None = None
    microbatch: int | None = None
    iteration: int = 0
    nbytes: int = 0
    peer: int | None = None  # the other GPU of a SEND / RECV
    deps: tuple[int, ...] = ()
    allocs: tuple[Mem, ...] = ()  # taken at start
    frees: tuple[Mem, ...] = ()  # returned at end

    def __str__(self) -> str:
        """Short form for people: `g1.h2d LOAD L12`, `g0.compute FWD L3 m2`, `g0.send SEND_F L3 m0 >g1`."""
        parts = [self.resource, self.kind.value]
        parts.append(f"L{self.layer}")
        if self.microbatch is not None:
            parts.append(f"m{self.microbatch}")
        if self.peer is not None:
            parts.append(f">g{self.peer}")
        return " ".join(parts)

    @property
    def label(self) -> str:
        """Compact cell label for the grid: `F3.2` (FWD L3 m2), `LD12`, `S3.0` (a SEND_F or SEND_B)."""
        s = self.kind.info.label + str(self.layer)
        if self.microbatch is not None:
            s += f".{self.microbatch}"
        return s

    def text(self) -> str:
        """The full one-line text form (see the module docstring)."""
        parts = [str(self.id), self.resource, self.kind.value, f"L{self.layer}"]
        if self.pack is not None:
            parts.append(f"P{self.pack}")
        if self.microbatch is not None:
            parts.append(f"m{self.microbatch}")
        parts.append(f"i{self.iteration}")
        if self.nbytes:
            parts.append(f"B={self.nbytes}")
        if self.peer is not None:
            parts.append(f">g{self.peer}")
        if self.deps:
            parts.append("deps=" + ",".join(map(str, self.deps)))
        parts += ["+" + m.text() for m in self.allocs]
        parts += ["-" + m.text() for m in self.frees]
        return " ".join(parts)


_MEM_RE = re.compile(r"^([+-])([A-Za-z0-9_]+):([^=\s]+)=(\d+)$")


def parse_action(line: str, where: str = "schedule") -> Action:
    """Parse one line of the text form back into an Action; errors name `where`."""
    toks = line.split()
    if len(toks) < 3:
        raise InputError(f"{where}: expected `ID RESOURCE KIND ...`, got {line!r}")
    try:
        aid = int(toks[0])
        kind = Kind(toks[2])
    except ValueError:
        raise InputError(f"{where}: bad action id or kind in {line!r}") from None
    kw: dict[str, Any] = {"id": aid, "kind": kind, "resource": toks[1]}
    deps: tuple[int, ...] = ()
    allocs: list[Mem] = []
    frees: list[Mem] = []
    try:
        for t in toks[3:]:
            if t[0] == "L":
                kw["layer"] = int(t[1:])
            elif t[0] == "P":
                kw["pack"] = int(t[1:])
            elif t[0] == "m":
                kw["microbatch"] = int(t[1:])
            elif t[0] == "i":
                kw["iteration"] = int(t[1:])
            elif t.startswith("B="):
                kw["nbytes"] = int(t[2:])
            elif t.startswith(">g"):
                kw["peer"] = int(t[2:])
            elif t.startswith("deps="):
                deps = tuple(int(x) for x in t[5:].split(","))
            elif (m := _MEM_RE.match(t)) is not None:
                (allocs if m[1] == "+" else frees).append(Mem(m[2], m[3], int(m[4])))
            else:
                raise ValueError(t)
    except ValueError as exc:
        raise InputError(f"{where}: cannot parse token {exc} in {line!r}") from None
    if "layer" not in kw:
        raise InputError(f"{where}: action without a layer (L<n>) in {line!r}")
    return Action(deps=deps, allocs=tuple(allocs), frees=tuple(frees), **kw)


@dataclass(frozen=True)
class Schedule:
    """A compiled schedule: all actions (ids = positions) plus what the executors need to know.

    Per-resource order is the order of `actions` filtered by resource. `static_bytes` is memory
    held for the whole run outside any action (host: master weights, optimizer state, pinned
    buffers; a GPU: nothing unless the policy keeps state there).
    """

    actions: tuple[Action, ...]
    num_gpus: int
    num_layers: int
    iterations: int
    microbatches: int
    tokens_per_microbatch: int
    recompute: bool
    pack_layers: tuple[tuple[int, ...], ...]  # layers of each pack, in order
    pack_gpu: tuple[int, ...]  # GPU of each pack
    host_memory: HostMemory = HostMemory.REPLICATED  # sets the CPU optimizer's cost and host bytes (hostmem)
    optimizer: OptimizerMode = OptimizerMode.SYNC  # what the backend's version checks follow (`staleness`)
    optimizer_state: OptimizerState = OptimizerState.FP32  # how the host holds AdamW's moments (hostmem)
    compute_dtype: str = "bf16"
    static_bytes: tuple[tuple[str, int], ...] = ()  # (device, bytes)
    # gradient clipping by the global norm: every OPT_STEP of an iteration waits for every GRAD_OUT of it,
    # on all GPUs (the backend meets those cross-GPU dependencies with an all-reduce of the norm)
    grad_clip: bool = False
    meta: tuple[tuple[str, str], ...] = ()  # free-form provenance: model, hardware, policy name
    lora: LoraSpec | None = None  # adapters on a frozen base: what the backend builds and trains
    _by_resource: dict[str, tuple[int, ...]] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        coerce_modes(self, "schedule")
        for i, a in enumerate(self.actions):
            if a.id != i:
                raise ValueError(f"action at position {i} has id {a.id}; ids must equal positions")

    @property
    def resources(self) -> tuple[str, ...]:
        """All resources in a stable order: per GPU compute, h2d, d2h, send, recv; then host.optim."""
        names = [gpu_resource(g, s) for g in range(self.num_gpus) for s in GPU_STREAMS] + [HOST_OPTIM]
        return tuple(names)

    def by_resource(self) -> dict[str, tuple[int, ...]]:
        """Action ids per resource, in execution order (cached)."""
        if self._by_resource is not None:
            return self._by_resource
        d: dict[str, list[int]] = defaultdict(list)
        for a in self.actions:
            d[a.resource].append(a.id)
        out = {r: tuple(d.get(r, ())) for r in self.resources}
        object.__setattr__(self, "_by_resource", out)
        return out

    @property
    def tokens_per_iteration(self) -> int:
        return self.microbatches * self.tokens_per_microbatch

    def static(self, device: str) -> int:
        return sum(b for d, b in self.static_bytes if d == device)

    def counts(self) -> dict[tuple[str, str], int]:
        """Number of actions per (resource, kind)."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for a in self.actions:
            out[(a.resource, a.kind.value)] += 1
        return dict(out)

    # ---- text round trip -------------------------------------------------------------------
    def recomputes(self, layer: int) -> bool:
        """Whether BWD of `layer` recomputes its forward (see `recomputes`)."""
        return recomputes(self.recompute, layer, self.num_layers)

    def dumps(self) -> str:
        head = [
            "# tinypipe schedule v1",
            f"# gpus={self.num_gpus} layers={self.num_layers} iterations={self.iterations} "
            f"microbatches={self.microbatches} tokens_per_microbatch={self.tokens_per_microbatch} "
            f"recompute={int(self.recompute)} host_memory={self.host_memory} optimizer={self.optimizer} "
            f"compute_dtype={self.compute_dtype}"
            + ("" if self.optimizer_state.exact else f" optimizer_state={self.optimizer_state}")
            + (f" lora={self.lora.text()}" if self.lora else "")
            + (" grad_clip=1" if self.grad_clip else ""),
            "# packs=" + ";".join(",".join(map(str, p)) for p in self.pack_layers),
            "# pack_gpu=" + ",".join(map(str, self.pack_gpu)),
            "# static=" + ",".join(f"{d}={b}" for d, b in self.static_bytes),
        ]
        head += [f"# meta {k}={v}" for k, v in self.meta]
        return "\n".join(head + [a.text() for a in self.actions]) + "\n"

    @classmethod
    def loads(cls, text: str, where: str = "schedule") -> Schedule:
        hdr: dict[str, str] = {}
        meta: list[tuple[str, str]] = []
        actions: list[Action] = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line:
                continue
            if line.startswith("# meta "):
                k, _, v = line[7:].partition("=")
                meta.append((k, v))
            elif line.startswith("#"):
                for tok in line[1:].split():
                    if "=" in tok:
                        k, _, v = tok.partition("=")
                        hdr[k] = v
            else:
                actions.append(parse_action(line, f"{where}: line {n}"))
        try:
            packs = tuple(tuple(int(x) for x in p.split(",")) for p in hdr["packs"].split(";") if p)
            static = tuple((d, int(b)) for d, _, b in (s.partition("=") for s in hdr["static"].split(",") if s))
            return cls(
                actions=tuple(actions), num_gpus=int(hdr["gpus"]), num_layers=int(hdr["layers"]),
                iterations=int(hdr["iterations"]), microbatches=int(hdr["microbatches"]),
                tokens_per_microbatch=int(hdr["tokens_per_microbatch"]), recompute=hdr["recompute"] == "1",
                pack_layers=packs, pack_gpu=tuple(int(x) for x in hdr["pack_gpu"].split(",") if x),
                host_memory=HostMemory.parse(hdr["host_memory"], f"{where}: host_memory"),
                optimizer=OptimizerMode.parse(hdr["optimizer"], f"{where}: optimizer"),
                optimizer_state=OptimizerState.parse(hdr.get("optimizer_state", "fp32"), f"{where}: optimizer_state"),
                compute_dtype=hdr["compute_dtype"], grad_clip=hdr.get("grad_clip") == "1",
                static_bytes=static, meta=tuple(meta),
                lora=LoraSpec.parse(hdr["lora"], f"{where}: lora") if "lora" in hdr else None,
            )
        except (KeyError, ValueError) as exc:
            raise InputError(f"{where}: bad or missing header field {exc}") from None


def owned_layers(schedule: Schedule, rank: int) -> list[int]:
    """The layers of the packs that run on GPU `rank` (whose host state and optimizer thread this rank holds)."""
    return sorted(L for p, g in enumerate(schedule.pack_gpu) if g == rank for L in schedule.pack_layers[p])


def rank_actions(schedule: Schedule, rank: int) -> list[Action]:
    """The actions rank `rank` issues: those on its GPU's streams and the OPT_STEPs of its layers."""
    owned = set(owned_layers(schedule, rank))
    return [a for a in schedule.actions
            if resource_gpu(a.resource) == rank or (a.kind == Kind.OPT_STEP and a.layer in owned)]


def grid(schedule: Schedule, *, max_steps: int | None = 40, mark: int | None = None,
         resources: tuple[str, ...] | None = None) -> str:
    """Steps x resources for people: column r lists resource r's actions in order, one per row.

    Row k holds each resource's k-th action; `mark` (an action id) is shown as `>>label<<`.
    """
    res = [r for r in (resources or schedule.resources) if schedule.by_resource().get(r)]
    cols = [[schedule.actions[i] for i in schedule.by_resource()[r]] for r in res]
    depth = max((len(c) for c in cols), default=0)
    rows = range(depth)
    if mark is not None:
        a = schedule.actions[mark]
        k = schedule.by_resource()[a.resource].index(mark)
        lo = max(0, k - (max_steps or depth) // 2)
        rows = range(lo, min(depth, lo + (max_steps or depth)))
    elif max_steps is not None:
        rows = range(min(depth, max_steps))

    def cell(c: list[Action], k: int) -> str:
        if k >= len(c):
            return ""
        a = c[k]
        return f">>{a.label}<<" if a.id == mark else a.label

    table = [["step"] + res] + [[str(k)] + [cell(c, k) for c in cols] for k in rows]
    widths = [max(len(r[j]) for r in table) for j in range(len(table[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in table]
    if rows and rows[-1] < depth - 1:
        lines.append(f"... ({depth - rows[-1] - 1} more steps)")
    return "\n".join(lines)
