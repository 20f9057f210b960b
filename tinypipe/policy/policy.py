"""Policy: a frozen description of how to pack, map, swap, hold host memory and step the optimizer."""

from __future__ import annotations

import json
import types
from dataclasses import asdict, dataclass, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from tinypipe.common.errors import InputError
from tinypipe.common.jsonio import Fields, load_json
from tinypipe.policy.lora_spec import LoraSpec
from tinypipe.policy.modes import (
    MAPPERS,
    PACKERS,
    ActivationHome,
    HostMemory,
    MapperName,
    OptimizerMode,
    OptimizerState,
    PackerName,
    ResidentMode,
    SwapMode,
    coerce_modes,
    mode_fields,
)


@dataclass(frozen=True, kw_only=True)
class Policy:
    """How a model is run through the pipeline. Invariants are checked on construction.

    packing: a packer name (`uniform` with `pack_size` layers per pack, `balanced` by time into
      `num_packs` packs, `mobius`, `holistic`, `per-gpu`: one pack per GPU) or explicit pack
      sizes (layers per pack, in order; they must sum to the model's layer count).
    mapping: `round-robin`, `cross` (neighbouring packs on GPUs sharing the least PCIe path),
      or an explicit GPU per pack.
    swap: `pack` (whole packs load and evict) or `layer` (layer by layer within a pack).
    prefetch_depth: packs (pack mode) or layers (layer mode) uploaded ahead of use.
    resident: `none`, `all` (every layer stays on its GPU), `auto` (keep the layers used again
      soon, the last pack's forward then backward, when memory allows) or explicit layer indices.
    optimizer_state: how the host holds AdamW's moments: `fp32`, `bf16` or `8bit` (block-wise
      quantised); the low-precision ones need the compact host layout (the chunked step on the planes).
    lora: adapters on a frozen base: the host holds one compute-dtype copy of the base, no gradient
      leaves the GPU, and the adapters with their AdamW state (fp32) stay on the GPU that owns their layer.
      A low-precision `optimizer_state` is refused with it; `optimizer` async trains as sync (the adapters
      step in stream order); a policy file's `host_memory` replicated is refused by `run` (one frozen copy).
    """

    name: str = "custom"
    packing: PackerName | tuple[int, ...] = "holistic"
    pack_size: int = 0  # for packing="uniform": layers per pack (0: choose)
    num_packs: int = 0  # for packing="balanced": number of packs (0: choose)
    mapping: MapperName | tuple[int, ...] = "round-robin"
    swap: SwapMode = SwapMode.LAYER
    prefetch_depth: int = 1
    resident: ResidentMode | tuple[int, ...] = ResidentMode.NONE
    host_memory: HostMemory = HostMemory.COMPACT
    microbatches: int = 4
    microbatch_size: int = 1  # sequences per microbatch
    recompute: bool = True
    optimizer: OptimizerMode = OptimizerMode.SYNC
    activation_home: ActivationHome = ActivationHome.GPU
    optimizer_state: OptimizerState = OptimizerState.FP32
    lora: LoraSpec | None = None  # train low-rank adapters on a frozen base (None: every parameter)

    def __post_init__(self) -> None:
        def bad(field_: str, why: str) -> InputError:
            return InputError(f"policy {self.name!r}: {field_}: {why}")

        if isinstance(self.packing, str):
            if self.packing not in PACKERS:
                raise bad("packing", f"unknown packer {self.packing!r}; expected one of {', '.join(PACKERS)} "
                          "or a list of pack sizes")
        else:
            object.__setattr__(self, "packing", tuple(self.packing))
            if not self.packing or any(not isinstance(k, int) or isinstance(k, bool) or k < 1
                                       for k in self.packing):
                raise bad("packing", "pack sizes must be a non-empty list of integers >= 1")
        if isinstance(self.mapping, str):
            if self.mapping not in MAPPERS:
                raise bad("mapping", f"unknown mapper {self.mapping!r}; expected one of {', '.join(MAPPERS)} "
                          "or a list of GPU indices")
        else:
            object.__setattr__(self, "mapping", tuple(self.mapping))
            if not self.mapping or any(not isinstance(g, int) or isinstance(g, bool) or g < 0
                                       for g in self.mapping):
                raise bad("mapping", "explicit mapping must be a non-empty list of GPU indices >= 0")
        if isinstance(self.resident, str):
            if self.resident not in ResidentMode.choices():
                raise bad("resident", f"must be one of {', '.join(ResidentMode.choices())} or a list of layers; "
                          f"got {self.resident!r}")
            object.__setattr__(self, "resident", ResidentMode(self.resident))
        else:
            object.__setattr__(self, "resident", tuple(self.resident))
            if any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in self.resident):
                raise bad("resident", "layer indices must be integers >= 0")
        coerce_modes(self, f"policy {self.name!r}")
        for name, lo in (("prefetch_depth", 0), ("microbatches", 1), ("microbatch_size", 1),
                         ("pack_size", 0), ("num_packs", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise bad(name, f"must be an integer >= {lo}; got {v!r}")
        if self.lora is not None and not isinstance(self.lora, LoraSpec):
            raise bad("lora", "must be a LoraSpec or none")
        if not isinstance(self.recompute, bool):
            raise bad("recompute", "must be true or false")
        if self.lora is not None and not self.optimizer_state.exact:  # the run would hold fp32 moments regardless
            raise bad("optimizer_state", f"{self.optimizer_state} moments are the host optimizer's; with lora the "
                      "adapters' AdamW state is fp32 on their GPU and the frozen base has none: leave optimizer_state "
                      "out (or fp32)")
        if not self.optimizer_state.exact and not self.host_memory.planes:
            raise bad("optimizer_state", f"{self.optimizer_state} moments need host_memory compact (the chunked "
                      "step on the planes); the replicated layout keeps fp32 AdamW state")
        if not self.recompute and self.activation_home.on_host:
            raise bad("activation_home", "host needs recompute (only layer inputs are offloaded)")

    def replace(self, **changes: Any) -> Policy:
        return replace(self, **changes)

    # ---- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
            elif isinstance(v, Enum):
                d[k] = v.value
        d["lora"] = self.lora.to_json() if self.lora is not None else None
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    @classmethod
    def from_json(cls, obj: Any, where: str = "policy") -> Policy:
        f = Fields(obj, where)
        known = {fl.name for fl in fields(cls)}
        unknown = sorted(set(f.obj) - known)
        if unknown:
            raise InputError(f"{where}: unknown field {unknown[0]!r}; known fields: {', '.join(sorted(known))}")
        kw: dict[str, Any] = {}
        for name, tp in _HINTS.items():  # parsed by the field's type
            if not f.has(name):
                continue
            v = f.raw(name)
            if name == "lora":
                v = None if v is None else LoraSpec.from_json(v, f"{where}: lora")
            elif name in _MODE_FIELDS:
                v = _MODE_FIELDS[name].parse(f.str(name), f"{where}: {name}")
            elif _with_list(tp) and isinstance(v, list):
                if any(isinstance(x, bool) or not isinstance(x, int) for x in v):
                    raise InputError(f"{where}: {name}: expected a list of integers")
                v = tuple(v)
            elif tp is bool:
                v = f.bool(name)
            elif tp is int:
                v = f.int(name)
            else:  # a name, or a mode that may also be a list (its value is checked on construction)
                v = f.str(name)
            kw[name] = v
        try:
            return cls(**kw)
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None


def _with_list(tp: Any) -> bool:
    """Whether a field's type admits a list of integers (`PackerName | tuple[int, ...]`)."""
    return get_origin(tp) in (Union, types.UnionType) and any(get_origin(a) is tuple for a in get_args(tp))


_HINTS: dict[str, Any] = get_type_hints(Policy)
_MODE_FIELDS = mode_fields(Policy)  # swap, host_memory, optimizer, activation_home, optimizer_state


PRESETS: dict[str, Policy] = {
    # GPipe-style: one pack per GPU, every layer stays resident; OOMs on big models by design.
    "resident": Policy(name="resident", packing="per-gpu", mapping="round-robin", swap=SwapMode.PACK,
                       prefetch_depth=0, resident=ResidentMode.ALL, host_memory=HostMemory.REPLICATED, recompute=True),
    # Mobius (ASPLOS'23): whole packs swapped, one pack prefetched, MILP partition, cross mapping,
    # replicated host copies.
    "mobius": Policy(name="mobius", packing="mobius", mapping="cross", swap=SwapMode.PACK, prefetch_depth=1,
                     resident=ResidentMode.NONE, host_memory=HostMemory.REPLICATED, recompute=True),
    # tinypipe: holistic packing, layer-wise swapping, compact host memory, turnaround layers resident.
    "tinypipe": Policy(name="tinypipe", packing="holistic", mapping="cross", swap=SwapMode.LAYER, prefetch_depth=2,
                       resident=ResidentMode.AUTO, host_memory=HostMemory.COMPACT, recompute=True),
}


def load_policy(name_or_path: str) -> Policy:
    """A preset name (`resident`, `mobius`, `tinypipe`) or a path to a policy JSON file."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    p = Path(name_or_path)
    if not p.suffix and not p.exists():
        raise InputError(f"unknown policy {name_or_path!r}; presets: {', '.join(PRESETS)}, or a policy JSON file")
    return Policy.from_json(load_json(p), str(p))
