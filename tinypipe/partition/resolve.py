"""Resolve a Policy for one model and machine: pack sizes, a GPU per pack, and the layers kept resident."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tinypipe.common.errors import InputError
from tinypipe.describe.hardware import Hardware
from tinypipe.estimate.cost import gpu_peak_bytes
from tinypipe.estimate.plan import Plan
from tinypipe.partition import mobius, packing
from tinypipe.partition.mapping import cross, round_robin
from tinypipe.partition.packing import Mapper
from tinypipe.policy.modes import MapperName, PackerName, ResidentMode
from tinypipe.policy.policy import Policy


def resolve(policy: Policy, w: Plan, hardware: Hardware, *, model_name: str = "the model",
            tied: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(pack sizes, GPU of each pack). A policy that cannot apply to this model or hardware is an
    InputError naming the policy field.

    `tied`: the model's LM head computes with the token embedding matrix, so the last pack (the
    head) runs on the GPU of the first pack (the embedding): the real backend keeps the shared
    matrix's master and optimizer state on that one rank. Chosen mappings are adjusted (the last
    pack moves to pack 0's GPU); an explicit mapping that splits them is an error.
    """
    r = _Request(policy, w, hardware, model_name)
    counts, mapper = _mapper(r, tied)
    spec = policy.packing
    if isinstance(spec, tuple):
        if sum(spec) != w.num_layers:
            raise r.bad("packing", f"pack sizes sum to {sum(spec)}, but {model_name} has {w.num_layers} layers")
        sizes = spec
    else:
        sizes = PACKER_TABLE[spec](r, mapper, counts)
    return sizes, mapper(len(sizes))


@dataclass(frozen=True)
class _Request:
    """What `resolve` was asked: the policy, the plan, the hardware and the model's name for messages."""

    policy: Policy
    w: Plan
    hardware: Hardware
    model_name: str

    def bad(self, field: str, why: str) -> InputError:
        return InputError(f"policy {self.policy.name!r}: {field}: {why}")


def _mapper(r: _Request, tied: bool) -> tuple[list[int] | None, Mapper]:
    """(the pack counts an explicit mapping allows, else None; the GPU of each pack for a pack count)."""
    policy, n_layers, n_gpus, hardware = r.policy, r.w.num_layers, r.w.num_gpus, r.hardware
    counts: list[int] | None = None
    if isinstance(policy.mapping, tuple):
        explicit = policy.mapping
        for s, g in enumerate(explicit):
            if g >= n_gpus:
                raise r.bad("mapping", f"pack {s} is mapped to GPU {g}, but {hardware.name} has {n_gpus} "
                            f"GPU{'s' if n_gpus != 1 else ''} (0..{n_gpus - 1})")
        if len(explicit) > n_layers:
            raise r.bad("mapping", f"{len(explicit)} packs mapped, but {r.model_name} has only {n_layers} layers")
        counts = [len(explicit)]
        if tied and len(explicit) > 1 and explicit[-1] != explicit[0]:
            raise r.bad("mapping", f"{r.model_name} ties its LM head to the token embedding, so the last pack "
                        f"must run on the first pack's GPU ({explicit[0]}), not on GPU {explicit[-1]}")

        def mapper(n: int) -> tuple[int, ...]:
            if n != len(explicit):
                raise r.bad("mapping", f"{len(explicit)} GPUs given for {n} packs; give one GPU per pack")
            return explicit
    else:
        by_name = MAPPER_TABLE[policy.mapping]

        def mapper(n: int) -> tuple[int, ...]:
            return by_name(n, hardware, n_gpus)

    if tied:
        chosen = mapper

        def mapper(n: int) -> tuple[int, ...]:
            m = chosen(n)
            return m if len(m) < 2 else (*m[:-1], m[0])

    return counts, mapper


# The mappers by name (`Policy.mapping`): (packs, hardware, GPUs) -> the GPU of each pack.
MAPPER_TABLE: dict[MapperName, Callable[[int, Hardware, int], tuple[int, ...]]] = {
    "round-robin": lambda n, hardware, gpus: round_robin(n, gpus),
    "cross": lambda n, hardware, gpus: cross(n, hardware),
}


def _uniform(r: _Request, mapper: Mapper, counts: list[int] | None) -> tuple[int, ...]:
    """`pack_size` layers per pack; 0: the uniform packing the cost model likes best."""
    n_layers, size = r.w.num_layers, r.policy.pack_size
    if size > n_layers:
        raise r.bad("pack_size", f"{size} layers per pack, but {r.model_name} has {n_layers} layers")
    if size:
        return packing.uniform(n_layers, size)
    cands = {packing.uniform(n_layers, k) for k in range(1, n_layers + 1)}
    cands = {c for c in cands if counts is None or len(c) in counts}
    if not cands:
        raise r.bad("mapping", f"no uniform packing of {n_layers} layers has {counts} packs")
    return packing.best_of(r.w, mapper, sorted(cands, key=len))


def _balanced(r: _Request, mapper: Mapper, counts: list[int] | None) -> tuple[int, ...]:
    """`num_packs` packs balanced by time; 0: the balanced packing the cost model likes best."""
    n_layers, packs, times = r.w.num_layers, r.policy.num_packs, r.w.layer_time_s
    if packs > n_layers:
        raise r.bad("num_packs", f"{packs} packs, but {r.model_name} has only {n_layers} layers")
    if packs:
        return packing.balanced(times, packs)
    part = packing.Partitioner(times)
    return packing.best_of(r.w, mapper, (part(n) for n in (counts or range(1, n_layers + 1))))


# The packers by name (`Policy.packing`): (request, mapper, pack counts allowed or None) -> pack sizes.
PACKER_TABLE: dict[PackerName, Callable[[_Request, Mapper, list[int] | None], tuple[int, ...]]] = {
    "uniform": _uniform,
    "balanced": _balanced,
    "per-gpu": lambda r, mapper, counts: packing.per_gpu(r.w.layer_time_s, r.w.num_gpus),
    "mobius": lambda r, mapper, counts: mobius.mobius(r.w, mapper, counts=counts),
    "holistic": lambda r, mapper, counts: packing.holistic(r.w, mapper, counts=counts),
}


def residency(policy: Policy, w: Plan, sizes: tuple[int, ...],
              mapping: tuple[int, ...]) -> tuple[frozenset[int], frozenset[int]]:
    """(kept, pinned) layers for the policy's `resident` setting.

    `all`: every layer pinned; explicit: those layers pinned; `auto`: each GPU's last pack kept
    from its forward to its backward (the next thing that GPU computes), then more layers of that
    GPU's earlier packs, latest first, while the cost model's peak still fits the GPU.
    """
    n = w.num_layers
    if policy.resident == ResidentMode.ALL:
        return frozenset(), frozenset(range(n))
    if isinstance(policy.resident, tuple):
        bad = [x for x in policy.resident if x >= n]
        if bad:
            raise InputError(f"policy {policy.name!r}: resident: layer {bad[0]} does not exist; "
                             f"the model has layers 0..{n - 1}")
        return frozenset(), frozenset(policy.resident)
    if policy.resident == ResidentMode.NONE:
        return frozenset(), frozenset()
    starts = [sum(sizes[:s]) for s in range(len(sizes) + 1)]
    packs_of: dict[int, list[int]] = {}
    for s, g in enumerate(mapping):
        packs_of.setdefault(g, []).append(s)
    kept = {x for ps in packs_of.values() for x in range(starts[ps[-1]], starts[ps[-1] + 1])}
    caps = w.usable_gpu_bytes
    extra: set[int] = set()
    for g, ps in sorted(packs_of.items()):
        candidates = [x for s in reversed(ps[:-1]) for x in range(starts[s + 1] - 1, starts[s] - 1, -1)]
        for x in candidates:  # latest first; stop at the first layer that does not fit
            if gpu_peak_bytes(w, sizes, mapping, kept=frozenset(extra | {x}))[g] > caps[g]:
                break
            extra.add(x)
    return frozenset(kept | extra), frozenset()
