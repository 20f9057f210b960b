"""The policy's modes, each a `Literal` type defined once: mypy catches a misspelled mode, and policy
JSON is parsed against the same types (`parse_mode`), so an unknown value is an error, never a fallback.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from tinypipe.common.errors import InputError

PackerName = Literal["uniform", "balanced", "mobius", "holistic", "per-gpu"]
MapperName = Literal["round-robin", "cross"]
SwapMode = Literal["pack", "layer"]  # whole packs load and evict, or layer by layer within a pack
ResidentMode = Literal["none", "all", "auto"]
HostLayout = Literal["replicated", "compact"]  # tinypipe.estimate.hostmem has the bytes of each
OptimizerMode = Literal["sync", "async"]  # async: the CPU optimizer's step lags one iteration (staleness 1)
ActivationHome = Literal["gpu", "host"]  # where layer inputs wait between forward and backward

PACKERS: tuple[PackerName, ...] = get_args(PackerName)
MAPPERS: tuple[MapperName, ...] = get_args(MapperName)
SWAP_MODES: tuple[SwapMode, ...] = get_args(SwapMode)
RESIDENT_MODES: tuple[ResidentMode, ...] = get_args(ResidentMode)
HOST_LAYOUTS: tuple[HostLayout, ...] = get_args(HostLayout)
OPTIMIZER_MODES: tuple[OptimizerMode, ...] = get_args(OptimizerMode)
ACT_HOMES: tuple[ActivationHome, ...] = get_args(ActivationHome)

M = TypeVar("M", bound=str)


def parse_mode(value: object, choices: tuple[M, ...], where: str) -> M:
    """`value` as one of `choices` (typed), or a one-line InputError naming `where` and the choices."""
    for c in choices:
        if value == c:
            return c
    raise InputError(f"{where}: must be one of {', '.join(choices)}; got {value!r}")


def mode_fields(cls: Any) -> dict[str, tuple[str, ...]]:
    """The fields of dataclass `cls` typed as exactly one mode, with their allowed values."""
    return {n: get_args(t) for n, t in get_type_hints(cls).items() if get_origin(t) is Literal}
