"""`import tinypipe` without torch: the Python API is there, and calling it says how to install the backend."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_layering import BLOCKER


def test_the_api_imports_without_torch_and_asks_for_the_extra() -> None:
    """With torch unimportable, `tinypipe.train`, `TrainResult` and `StopTraining` import; `train` raises the
    one-line InputError naming the torch extra, and nothing imported torch."""
    code = BLOCKER + """
import tinypipe
from tinypipe.common.errors import InputError
assert tinypipe.TrainResult.__name__ == 'TrainResult' and issubclass(tinypipe.StopTraining, Exception)
try:
    tinypipe.train(steps=2)
except InputError as exc:
    print('refused:', exc)
assert 'torch' not in sys.modules
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("refused: tinypipe.train needs the torch extra: pip install "
                                                   "'tinypipe[torch]'"), r.stdout


def test_an_unknown_attribute_of_the_package_is_an_attribute_error() -> None:
    """The lazy attributes are only the API's: anything else is the usual AttributeError."""
    import tinypipe

    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        tinypipe.trian  # noqa: B018 - the access is the test
