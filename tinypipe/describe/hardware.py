"""Hardware: a graph of host DRAM, root complexes, PCIe switches, GPUs and their links; routing over it.

Units: bandwidths are `*_gbps` = 10^9 bytes per second (GB/s, not gigabits), per direction;
latencies `*_s` in seconds; memory `*_bytes`; compute `*_flops` in FLOP/s.

Nodes: `host` (DRAM and the DMA cap), root complexes `rc*`, PCIe switches `sw*`, GPUs `gpu0..gpuN-1`.
Links: `mem` (host DRAM to a root complex, i.e. one socket's memory controllers), `pcie`, `upi`
(socket to socket), `nvlink` (GPU to GPU). A copy costs the sum of its hops' `latency_s` plus
bytes over the bottleneck; the simulator also applies the host DMA cap to every route through `host`.
Presets and their derivations live in `traces/hardware/*.json`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tinypipe.traces as shipped
from tinypipe.common.errors import InputError
from tinypipe.common.jsonio import Fields, load_json

HOST = "host"
PROVENANCES = ("measured", "spec")
LINK_KINDS = ("mem", "pcie", "upi", "nvlink")
SWITCH_PREFIXES = {"rc": "rc", "sw": "switch"}  # name prefix -> node kind
MAX_GPUS = 4096  # keeps a mistyped gpu_count from building a million-node graph
# PyTorch's allocator holds bytes reserved but unallocated at a peak, and the memory or `--gpu-mem` caps the
# reserved bytes: the ledger stays this far below (three 8B H200 runs capped at 24 GiB died holding 205-347 MiB
# so, ledgers within 0.2 GiB of the cap: bench/results/cuda_h200.jsonl). Default of a hardware JSON's GPUs.
ALLOCATOR_SLACK_BYTES = 512 << 20

if TYPE_CHECKING:
    import networkx as nx


@dataclass(frozen=True)
class GPU:
    name: str  # node name, "gpu0", "gpu1", ... in index order
    model: str  # "H200", "RTX 4090"
    memory_bytes: int  # total device memory as CUDA reports it (measured) or the nameplate size (spec)
    matmul_flops: float  # achieved dense bf16 matmul rate, FLOP/s
    mem_gbps: float  # device memory bandwidth, for memory-bound parts
    allocator_slack_bytes: int = 0  # kept free below the capacity for the allocator (ALLOCATOR_SLACK_BYTES)

    def usable_bytes(self, cap: int | None = None) -> int:
        """What a schedule's ledger may hold here: the memory (or `--gpu-mem` cap) less the allocator's slack."""
        return usable_gpu_bytes(self.memory_bytes if cap is None else cap, kept_bytes=self.allocator_slack_bytes)


@dataclass(frozen=True)
class Host:
    memory_bytes: int  # DRAM
    dma_gbps: float  # cap on the sum of all host<->device copy traffic, both directions
    cpu_cores: int
    adam_params_per_s: float  # CPU fused AdamW rate over fp32 parameters with all cores
    # The optimizer step of each host layout as `tinypipe profile` measured it (params/s; None: not
    # measured, `hostmem.optimizer_time_factor` x the fused AdamW rate stands in)
    replicated_params_per_s: float | None = None
    compact_params_per_s: float | None = None
    # the compact step with bf16 / 8-bit AdamW moments (`--optimizer-state`), as `tinypipe profile` measured it
    compact_bf16_params_per_s: float | None = None
    compact_8bit_params_per_s: float | None = None
    # DRAM bandwidth (bytes read + written per second, a large host memcpy on all cores) that the host optimizer's
    # passes and every host <-> device copy share (sim/durations.py); None: not modelled, each runs at its own rate
    mem_gbps: float | None = None


HOST_OPTIONAL = ("replicated_params_per_s", "compact_params_per_s", "compact_bf16_params_per_s",
                 "compact_8bit_params_per_s", "mem_gbps")  # Host's measured figures, each absent when unknown

@dataclass(frozen=True)
class Link:
    a: str
    b: str
    kind: str  # mem | pcie | upi | nvlink
    gbps: float  # per direction
    latency_s: float  # per-copy fixed cost contributed by this hop


@dataclass(frozen=True)
class Route:
    """How a copy travels. A GPU-to-GPU copy staged through host memory visits `host` once and
    crosses the host DMA cap twice (device to host, then host to device)."""

    nodes: tuple[str, ...]
    edges: tuple[tuple[str, str], ...]  # directed hops (u, v) in travel order
    bottleneck_gbps: float  # slowest hop (math.inf for a route from a node to itself)
    latency_s: float  # sum over hops
    through_host: bool  # True when the host DMA cap applies (an endpoint or a hop is "host")


@dataclass(frozen=True)
class Hardware:
    """One server. Construction checks the topology (InputError naming the field); routes are cached."""

    name: str
    provenance: str  # "measured" | "spec"
    source: str  # what the numbers come from
    host: Host
    gpus: tuple[GPU, ...]
    switches: tuple[str, ...]  # "rc0", "sw0", ... (root complexes and PCIe switches)
    links: tuple[Link, ...]
    gpu_p2p: bool = True  # GPUs may copy to each other over PCIe; False: such copies stage through host

    def __post_init__(self) -> None:
        _check_topology(self)

    # ---- lookups -------------------------------------------------------------------------------
    def gpu(self, i: int) -> GPU:
        """The GPU with index `i` (node name `gpu{i}`)."""
        if not 0 <= i < len(self.gpus):
            raise InputError(f"hardware {self.name}: no GPU {i}; it has gpu0..gpu{len(self.gpus) - 1}")
        return self.gpus[i]

    @property
    def nodes(self) -> tuple[str, ...]:
        return (HOST, *self.switches, *(g.name for g in self.gpus))

    def node_kind(self, node: str) -> str:
        """host | rc | switch | gpu."""
        return self._kinds[self._known(node)]

    def link(self, a: str, b: str) -> Link:
        """The link joining `a` and `b` (either order)."""
        key = frozenset((a, b))
        if key not in self._links_by_pair:
            raise InputError(f"hardware {self.name}: no link between {a!r} and {b!r}")
        return self._links_by_pair[key]

    # ---- graph and routes ------------------------------------------------------------------------
    def graph(self) -> nx.Graph:
        """Nodes with attribute `kind` (host | rc | switch | gpu); edges with kind, gbps, latency_s.

        The graph is built once and frozen (read-only); copy it (`nx.Graph(g)`) to modify it.
        """
        return self._graph

    def route(self, src: str, dst: str) -> Route:
        """Path and bottleneck between two nodes ("host", "gpu3"); GPU<->GPU prefers NVLink.

        host<->GPU follows the PCIe tree. GPU<->GPU uses a direct NVLink if there is one; else, with
        `gpu_p2p`, the PCIe path through the lowest common switch or root complex (crossing UPI
        if the GPUs hang off different sockets); without `gpu_p2p` the copy is staged through host
        memory (GPU -> host -> GPU). O(1) after the first call for a pair.
        """
        r = self._routes.get((src, dst))
        if r is None:
            r = self._routes[(src, dst)] = self._compute_route(src, dst)
        return r

    def host_to_gpu_gbps(self) -> tuple[float, ...]:
        """Upload rate per GPU when all GPUs upload at once: each link split among the GPUs crossing it."""
        bw: dict[frozenset[str], float] = {frozenset((ln.a, ln.b)): ln.gbps for ln in self.links}
        routes = [self.route(HOST, gpu.name) for gpu in self.gpus]
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
            out.append(min(rate, self.host.dma_gbps / max(1, len(routes))))
        return tuple(out)

    @cached_property
    def _kinds(self) -> dict[str, str]:
        kinds = {HOST: "host"}
        kinds.update({s: _switch_kind(s) for s in self.switches})
        kinds.update({g.name: "gpu" for g in self.gpus})
        return kinds

    @cached_property
    def _links_by_pair(self) -> dict[frozenset[str], Link]:
        return {frozenset((x.a, x.b)): x for x in self.links}

    @cached_property
    def _graph(self) -> nx.Graph:
        import networkx as nx  # ~0.3 s to import, and only `graph()` needs it (routes are ours)

        g = nx.Graph(name=self.name)
        g.add_node(HOST, kind="host", memory_bytes=self.host.memory_bytes, dma_gbps=self.host.dma_gbps)
        for s in self.switches:
            g.add_node(s, kind=_switch_kind(s))
        for gpu in self.gpus:
            g.add_node(gpu.name, kind="gpu", model=gpu.model, memory_bytes=gpu.memory_bytes,
                       matmul_flops=gpu.matmul_flops, mem_gbps=gpu.mem_gbps)
        for x in self.links:
            g.add_edge(x.a, x.b, kind=x.kind, gbps=x.gbps, latency_s=x.latency_s)
        return nx.freeze(g)

    @cached_property
    def _routes(self) -> dict[tuple[str, str], Route]:
        return {}

    @cached_property
    def _pcie_adj(self) -> dict[str, list[str]]:
        """Neighbours over every link but NVLink, in link order (so routes are deterministic)."""
        adj: dict[str, list[str]] = {n: [] for n in self.nodes}
        for x in self.links:
            if x.kind != "nvlink":
                adj[x.a].append(x.b)
                adj[x.b].append(x.a)
        return adj

    def _known(self, node: str) -> str:
        if node not in self._kinds:
            raise InputError(f"hardware {self.name}: no node {node!r}; nodes are {', '.join(self.nodes)}")
        return node

    def _compute_route(self, src: str, dst: str) -> Route:
        self._known(src)
        self._known(dst)
        if src == dst:
            return Route((src,), (), math.inf, 0.0, src == HOST)
        path: list[str] | None = None
        if self._kinds[src] == "gpu" and self._kinds[dst] == "gpu":
            x = self._links_by_pair.get(frozenset((src, dst)))
            if x is not None and x.kind == "nvlink":
                path = [src, dst]
            elif self.gpu_p2p:
                path = self._pcie_path(src, dst, avoid={HOST})
            if path is None:  # staged through host memory
                up, down = self._pcie_path(src, HOST), self._pcie_path(HOST, dst)
                path = None if up is None or down is None else up + down[1:]
        else:
            path = self._pcie_path(src, dst)
        if path is None:
            raise InputError(f"hardware {self.name}: no route from {src} to {dst}")
        return self._route_of(path)

    def _pcie_path(self, src: str, dst: str, avoid: Iterable[str] = ()) -> list[str] | None:
        """Fewest-hop path over non-NVLink links that passes through no GPU and no node in `avoid`."""
        blocked = set(avoid) | {g.name for g in self.gpus}
        prev: dict[str, str | None] = {src: None}
        todo = deque([src])
        while todo:
            u = todo.popleft()
            if u == dst:
                path = [u]
                while (p := prev[path[-1]]) is not None:
                    path.append(p)
                return path[::-1]
            if u != src and u in blocked:
                continue
            for v in self._pcie_adj[u]:
                if v not in prev:
                    prev[v] = u
                    todo.append(v)
        return None

    def _route_of(self, path: list[str]) -> Route:
        edges = tuple(zip(path[:-1], path[1:], strict=True))
        hops = [self._links_by_pair[frozenset(e)] for e in edges]
        return Route(nodes=tuple(path), edges=edges, bottleneck_gbps=min(x.gbps for x in hops),
                     latency_s=sum(x.latency_s for x in hops), through_host=HOST in path)

    # ---- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The preset JSON form (GPUs listed explicitly); `from_json(to_json(hw)) == hw`."""
        return {
            "name": self.name, "provenance": self.provenance, "source": self.source, "gpu_p2p": self.gpu_p2p,
            "host": {"memory_bytes": self.host.memory_bytes, "dma_gbps": self.host.dma_gbps,
                     "cpu_cores": self.host.cpu_cores, "adam_params_per_s": self.host.adam_params_per_s,
                     **{k: getattr(self.host, k) for k in HOST_OPTIONAL if getattr(self.host, k) is not None}},
            "gpus": [{"name": g.name, "model": g.model, "memory_bytes": g.memory_bytes,
                      "matmul_flops": g.matmul_flops, "mem_gbps": g.mem_gbps,
                      "allocator_slack_bytes": g.allocator_slack_bytes} for g in self.gpus],
            "switches": list(self.switches),
            "links": [{"a": x.a, "b": x.b, "kind": x.kind, "gbps": x.gbps, "latency_s": x.latency_s}
                      for x in self.links],
        }

    @classmethod
    def from_json(cls, obj: Any, where: str = "hardware") -> Hardware:
        """Parse the preset form; GPUs as a `gpus` list, or a `gpu` template with `gpu_count`."""
        f = Fields(obj, where).only("name", "provenance", "source", "gpu_p2p", "host", "gpus", "gpu", "gpu_count",
                                    "switches", "links")
        name = f.str("name")
        provenance = f.str("provenance", choices=PROVENANCES)
        source = f.str("source")
        gpu_p2p = f.bool("gpu_p2p", True)
        h = f.obj_("host").only("memory_bytes", "dma_gbps", "cpu_cores", "adam_params_per_s", *HOST_OPTIONAL)
        host = Host(memory_bytes=h.int("memory_bytes", minimum=1),
                    dma_gbps=h.float("dma_gbps", positive=True), cpu_cores=h.int("cpu_cores", minimum=1),
                    adam_params_per_s=h.float("adam_params_per_s", positive=True),
                    **{k: h.float(k, None, positive=True) for k in HOST_OPTIONAL})
        gpus = _parse_gpus(f)
        switches = f.list("switches", [])
        for i, s in enumerate(switches):
            if not isinstance(s, str):
                raise InputError(f"{f._at(f'switches[{i}]')}: expected a string such as 'rc0' or 'sw0'")
        links = [Link(a=x.str("a"), b=x.str("b"), kind=x.str("kind", choices=LINK_KINDS),
                      gbps=x.float("gbps", positive=True), latency_s=x.float("latency_s", minimum=0.0))
                 for x in (y.only("a", "b", "kind", "gbps", "latency_s") for y in f.items("links", nonempty=True))]
        try:
            return cls(name=name, provenance=provenance, source=source, host=host, gpus=tuple(gpus),
                       switches=tuple(switches), links=tuple(links), gpu_p2p=gpu_p2p)
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None


def _parse_gpus(f: Fields) -> list[GPU]:
    def gpu(g: Fields, name: str) -> GPU:
        g.only("name", "model", "memory_bytes", "matmul_flops", "mem_gbps", "allocator_slack_bytes")
        memory = g.int("memory_bytes", minimum=1)
        slack = g.int("allocator_slack_bytes", ALLOCATOR_SLACK_BYTES, minimum=0)
        if slack >= memory:
            raise InputError(f"{g._at('allocator_slack_bytes')}: must be less than memory_bytes ({memory})")
        return GPU(name=name, model=g.str("model"), memory_bytes=memory,
                   matmul_flops=g.float("matmul_flops", positive=True),
                   mem_gbps=g.float("mem_gbps", positive=True), allocator_slack_bytes=slack)

    if f.has("gpus"):
        if f.has("gpu") or f.has("gpu_count"):
            raise InputError(f"{f._at('gpus')}: give either a `gpus` list or `gpu` with `gpu_count`, not both")
        return [gpu(g, g.str("name")) for g in f.items("gpus", nonempty=True)]
    if not f.has("gpu"):
        raise InputError(f"{f._at('gpus')}: missing required field (or give `gpu` with `gpu_count`)")
    count = f.int("gpu_count", minimum=1)
    if count > MAX_GPUS:
        raise InputError(f"{f._at('gpu_count')}: must be <= {MAX_GPUS}, got {count}")
    template = f.obj_("gpu")
    return [gpu(template, f"gpu{i}") for i in range(count)]


def _switch_kind(name: str) -> str:
    return SWITCH_PREFIXES[name[:2]]


def _check_topology(hw: Hardware) -> None:
    """Names, link endpoints and reachability; messages name the field (`links[3].b: ...`)."""
    if hw.provenance not in PROVENANCES:
        raise InputError(f"provenance: must be one of {', '.join(PROVENANCES)}; got {hw.provenance!r}")
    if not hw.gpus:
        raise InputError("gpus: must not be empty")
    for i, g in enumerate(hw.gpus):
        if g.name != f"gpu{i}":
            raise InputError(f"gpus[{i}].name: expected 'gpu{i}' (GPUs are named gpu0, gpu1, ... in order), "
                             f"got {g.name!r}")
        if g.memory_bytes <= 0 or not g.matmul_flops > 0 or not g.mem_gbps > 0:
            raise InputError(f"gpus[{i}]: memory_bytes, matmul_flops and mem_gbps must be > 0")
    seen = {HOST, *(g.name for g in hw.gpus)}
    for i, s in enumerate(hw.switches):
        if s[:2] not in SWITCH_PREFIXES:
            raise InputError(f"switches[{i}]: {s!r} must start with 'rc' (root complex) or 'sw' (PCIe switch)")
        if s in seen:
            raise InputError(f"switches[{i}]: duplicate node name {s!r}")
        seen.add(s)
    pairs: set[frozenset[str]] = set()
    for i, x in enumerate(hw.links):
        for end in ("a", "b"):
            node = getattr(x, end)
            if node not in seen:
                raise InputError(f"links[{i}].{end}: unknown node {node!r}; nodes are host, switches and "
                                 f"gpu0..gpu{len(hw.gpus) - 1}")
        if x.a == x.b:
            raise InputError(f"links[{i}]: links {x.a!r} to itself")
        if frozenset((x.a, x.b)) in pairs:
            raise InputError(f"links[{i}]: a second link between {x.a!r} and {x.b!r}")
        pairs.add(frozenset((x.a, x.b)))
        if x.kind not in LINK_KINDS:
            raise InputError(f"links[{i}].kind: must be one of {', '.join(LINK_KINDS)}; got {x.kind!r}")
        if x.kind == "nvlink" and not (x.a.startswith("gpu") and x.b.startswith("gpu")):
            raise InputError(f"links[{i}]: an nvlink must join two GPUs, not {x.a!r} and {x.b!r}")
        if not x.gbps > 0 or not x.latency_s >= 0:
            raise InputError(f"links[{i}]: gbps must be > 0 and latency_s >= 0")
    for i, g in enumerate(hw.gpus):
        if hw._pcie_path(HOST, g.name) is None:
            raise InputError(f"gpus[{i}]: {g.name} is not reachable from host over PCIe; "
                             f"add a link from a root complex or switch to {g.name}")


def shipped_hardware() -> list[str]:
    """Names of the presets in `traces/hardware/`, sorted."""
    return list(shipped.names("hardware"))  # tinypipe.traces: data files, untyped here


def load_hardware(name_or_path: str) -> Hardware:
    """A shipped preset by name (`rtx4090x8-pcie4`) or a path to a hardware JSON file."""
    path = shipped.path("hardware", name_or_path) if "/" not in name_or_path else None
    where = f"{name_or_path}.json" if path is not None else name_or_path
    if path is None:
        path = Path(name_or_path)
        if not path.exists() and path.suffix != ".json" and "/" not in name_or_path:
            raise InputError(f"unknown hardware {name_or_path!r}: not a file, nor a shipped preset "
                             f"({', '.join(shipped_hardware())})")
    return Hardware.from_json(load_json(path), where=where)


def usable_gpu_bytes(room_bytes: int, *, kept_bytes: int) -> int:
    """The one rule for the bytes of a GPU a plan may use: its memory or `--gpu-mem` cap less those kept free."""
    return room_bytes - kept_bytes
