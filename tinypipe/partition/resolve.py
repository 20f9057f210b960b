"""Resolve a Policy for one model and machine: pack sizes, a GPU per pack, and the layers kept resident."""

from __future__ import annotations

from tinypipe.common.errors import InputError
from tinypipe.describe.hardware import Hardware
from tinypipe.estimate.cost import gpu_peak_bytes
from tinypipe.estimate.plan import Plan
from tinypipe.partition import mobius, packing
from tinypipe.partition.mapping import cross, round_robin
from tinypipe.policy.modes import ResidentMode
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
    n_layers, n_gpus = w.num_layers, w.num_gpus

    def bad(field: str, why: str) -> InputError:
        return InputError(f"policy {policy.name!r}: {field}: {why}")

    counts: list[int] | None = None
    if isinstance(policy.mapping, tuple):
        explicit = policy.mapping
        for s, g in enumerate(explicit):
            if g >= n_gpus:
                raise bad("mapping", f"pack {s} is mapped to GPU {g}, but {hardware.name} has {n_gpus} "
                          f"GPU{'s' if n_gpus != 1 else ''} (0..{n_gpus - 1})")
        if len(explicit) > n_layers:
            raise bad("mapping", f"{len(explicit)} packs mapped, but {model_name} has only {n_layers} layers")
        counts = [len(explicit)]
        if tied and len(explicit) > 1 and explicit[-1] != explicit[0]:
            raise bad("mapping", f"{model_name} ties its LM head to the token embedding, so the last pack "
                      f"must run on the first pack's GPU ({explicit[0]}), not on GPU {explicit[-1]}")

        def mapper(n: int) -> tuple[int, ...]:
            if n != len(explicit):
                raise bad("mapping", f"{len(explicit)} GPUs given for {n} packs; give one GPU per pack")
            return explicit
    elif policy.mapping == "round-robin":
        def mapper(n: int) -> tuple[int, ...]:
            return round_robin(n, n_gpus)
    else:
        def mapper(n: int) -> tuple[int, ...]:
            return cross(n, hardware)

    if tied:
        chosen = mapper

        def mapper(n: int) -> tuple[int, ...]:
            m = chosen(n)
            return m if len(m) < 2 else (*m[:-1], m[0])

    times = w.layer_time_s
    spec = policy.packing
    if isinstance(spec, tuple):
        if sum(spec) != n_layers:
            raise bad("packing", f"pack sizes sum to {sum(spec)}, but {model_name} has {n_layers} layers")
        sizes = spec
    elif spec == "uniform":
        if policy.pack_size > n_layers:
            raise bad("pack_size", f"{policy.pack_size} layers per pack, but {model_name} has {n_layers} layers")
        if policy.pack_size:
            sizes = packing.uniform(n_layers, policy.pack_size)
        else:
            cands = {packing.uniform(n_layers, k) for k in range(1, n_layers + 1)}
            cands = {c for c in cands if counts is None or len(c) in counts}
            if not cands:
                raise bad("mapping", f"no uniform packing of {n_layers} layers has {counts} packs")
            sizes = packing.best_of(w, mapper, sorted(cands, key=len))
    elif spec == "balanced":
        if policy.num_packs > n_layers:
            raise bad("num_packs", f"{policy.num_packs} packs, but {model_name} has only {n_layers} layers")
        if policy.num_packs:
            sizes = packing.balanced(times, policy.num_packs)
        else:
            part = packing.Partitioner(times)
            sizes = packing.best_of(w, mapper, (part(n) for n in (counts or range(1, n_layers + 1))))
    elif spec == "per-gpu":
        sizes = packing.per_gpu(times, n_gpus)
    elif spec == "mobius":
        sizes = mobius.mobius(w, mapper, counts=counts)
    else:
        sizes = packing.holistic(w, mapper, counts=counts)
    return sizes, mapper(len(sizes))


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
    caps = [mem - w.cost.gpu_reserve_bytes for mem in w.gpu_memory_bytes]
    extra: set[int] = set()
    for g, ps in sorted(packs_of.items()):
        candidates = [x for s in reversed(ps[:-1]) for x in range(starts[s + 1] - 1, starts[s] - 1, -1)]
        for x in candidates:  # latest first; stop at the first layer that does not fit
            if gpu_peak_bytes(w, sizes, mapping, kept=frozenset(extra | {x}))[g] > caps[g]:
                break
            extra.add(x)
    return frozenset(kept | extra), frozenset()
