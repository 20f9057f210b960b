"""tinypipe: fine-tune LLMs larger than GPU memory by streaming layers from host DRAM through a pipeline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinypipe.cli.python_api import TrainResult, train
    from tinypipe.common.errors import StopTraining

__version__ = "0.1.0"
__all__ = ["StopTraining", "TrainResult", "__version__", "train"]

# the Python API (docs/python_api.md), imported on first use: `import tinypipe` stays light
_LAZY = {"train": "tinypipe.cli.python_api", "TrainResult": "tinypipe.cli.python_api",
         "StopTraining": "tinypipe.common.errors"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tinypipe' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
