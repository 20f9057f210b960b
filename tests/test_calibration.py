"""The simulator-calibrated cost model is shipped, loads, and is what the packers use by default."""

from __future__ import annotations

import json

import tinypipe.traces as shipped
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.trace import trace_for
from tinypipe.estimate.calibration import CostModel
from tinypipe.estimate.plan import base_plan
from tinypipe.policy import PRESETS


def test_calibration_ships_and_improved_the_fit() -> None:
    """traces/calibration/cost_model.json holds the fitted constants and a smaller error than the defaults."""
    p = shipped.path("calibration", "cost_model")
    assert p is not None
    data = json.loads(p.read_text())
    assert set(data["constants"]) == set(CostModel.FITTED)
    assert data["mean_abs_log_error"]["calibrated"] <= data["mean_abs_log_error"]["default"]
    assert CostModel.calibrated().to_json() == data["constants"]


def test_plan_uses_the_calibrated_model() -> None:
    """Without an explicit CostModel, the estimates (and so the holistic packer) use the calibrated one."""
    m, hw = load_model("tiny-llama"), load_hardware("h200x2")
    w = base_plan(PRESETS["tinypipe"], m, hw, trace_for(m, hw.gpus[0], microbatch_size=1, seq_len=64))
    assert w.cost == CostModel.calibrated()
