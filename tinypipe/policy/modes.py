"""The policy's modes as typed values: each a `Mode` (a str-valued enum) with the behaviour code asks of it.

A mode is spelled by its value in JSON, on the command line and in a schedule's text form (`compact`,
`async`, ...); `Mode.parse` turns such a string into the member or raises a one-line InputError naming
where it came from, so an unknown value is an error, never a fallback. Code asks a member what it
means (`OptimizerMode.staleness`, `SwapMode.whole_packs`, ...) instead of comparing strings.
The packer and mapper names are solver names, not modes: they stay `Literal` types.
"""

from __future__ import annotations

from dataclasses import fields
from enum import Enum
from typing import Any, Literal, TypeVar, get_args, get_type_hints

from tinypipe.common.errors import InputError

PackerName = Literal["uniform", "balanced", "mobius", "holistic", "per-gpu"]
MapperName = Literal["round-robin", "cross"]
PACKERS: tuple[PackerName, ...] = get_args(PackerName)
MAPPERS: tuple[MapperName, ...] = get_args(MapperName)

M = TypeVar("M", bound="Mode")


class Mode(str, Enum):
    """A mode: a member compares equal to its value and prints as it."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def choices(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls: type[M], value: object, where: str) -> M:
        """`value` (a member or its string) as a member, or a one-line InputError naming `where`."""
        for m in cls:
            if value == m.value:
                return m
        raise InputError(f"{where}: must be one of {', '.join(cls.choices())}; got {value!r}")


class SwapMode(Mode):
    """How a pack's weights move: whole packs load and evict, or layer by layer within a pack."""

    PACK = "pack"
    LAYER = "layer"

    @property
    def whole_packs(self) -> bool:
        return self is SwapMode.PACK


class ResidentMode(Mode):
    """Which layers stay on their GPU: none, all, or those used again soon when memory allows."""

    NONE = "none"
    ALL = "all"
    AUTO = "auto"


class HostMemory(Mode):
    """How the host holds each parameter's state (`tinypipe.estimate.hostmem` has the bytes of each).

    replicated: an fp32 master, a separate low-precision copy to upload and a full-size gradient buffer.
    compact: one fp32 master stored as two 16-bit planes (the high plane is the upload), gradients
    through a small ring of slots.
    """

    REPLICATED = "replicated"
    COMPACT = "compact"

    @property
    def grad_ring(self) -> bool:
        """Gradients arrive through a ring of slots, not a full-size buffer per parameter."""
        return self is HostMemory.COMPACT

    @property
    def planes(self) -> bool:
        """Each fp32 master is held as two 16-bit planes, stepped chunk by chunk: the layout whose moments may be
        held below fp32 (`OptimizerState`) and whose state is filled layer by layer from the layers' shapes."""
        return self is HostMemory.COMPACT


class OptimizerMode(Mode):
    """When the host optimizer's step lands: before the next iteration uses the layer (sync), or one
    iteration later (async: staleness 1, the step overlaps the next iteration)."""

    SYNC = "sync"
    ASYNC = "async"

    @property
    def staleness(self) -> int:
        """Iterations by which the weights a forward reads lag the last gradient."""
        return 1 if self is OptimizerMode.ASYNC else 0

    @property
    def is_async(self) -> bool:
        return self is OptimizerMode.ASYNC


class OptimizerState(Mode):
    """How the host holds AdamW's two moments (the master stays fp32 whatever this is).

    fp32: exact (torch's fused AdamW, bit for bit). bf16: each moment rounded to bf16 after every step.
    8bit: block-wise quantised moments (Dettmers et al. 2021, "8-bit Optimizers via Block-wise
    Quantization", arXiv:2110.02861): an 8-bit code of the dynamic tree map per element and an fp32
    absmax per block of `tinypipe.estimate.hostmem.QUANT_BLOCK_ELEMS`. Anything but fp32 changes the
    numerics, so the search picks it only when asked to.
    """

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "8bit"

    @property
    def exact(self) -> bool:
        """The moments are kept as fp32 AdamW keeps them (no rounding beyond fp32's)."""
        return self is OptimizerState.FP32

    @property
    def quantised(self) -> bool:
        """The moments are 8-bit codes with an fp32 absmax per block."""
        return self is OptimizerState.INT8


class ActivationHome(Mode):
    """Where layer inputs wait between forward and backward."""

    GPU = "gpu"
    HOST = "host"

    @property
    def on_host(self) -> bool:
        return self is ActivationHome.HOST


_FIELDS: dict[type, dict[str, type[Mode]]] = {}


def mode_fields(cls: type) -> dict[str, type[Mode]]:
    """The fields of dataclass `cls` typed as exactly one mode, with that mode's type (cached per class)."""
    if cls not in _FIELDS:
        hints = get_type_hints(cls)
        _FIELDS[cls] = {f.name: hints[f.name] for f in fields(cls)
                        if isinstance(hints[f.name], type) and issubclass(hints[f.name], Mode)}
    return _FIELDS[cls]


def coerce_modes(obj: Any, where: str) -> None:
    """Turn the mode fields of frozen dataclass `obj` given as strings into members (in place), or a
    one-line InputError naming `where` and the field."""
    for name, mode in mode_fields(type(obj)).items():
        value = getattr(obj, name)
        if not isinstance(value, mode):
            object.__setattr__(obj, name, mode.parse(value, f"{where}: {name}"))
