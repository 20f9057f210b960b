"""The SimPy simulator of tinypipe schedules (installed as `tinypipe.sim`): `simulate(...) -> SimResult`."""

from .engine import simulate
from .result import SimResult

__all__ = ["SimResult", "simulate"]
