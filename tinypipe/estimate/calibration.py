"""CostModel: the analytic cost model's constants, and the set calibrated against the simulator.

They live apart from the estimates (`tinypipe.estimate.cost`) because the resolved `Plan` carries them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tinypipe.common.units import GIB


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """The constants of the analytic model. The defaults are first guesses; `calibrated()` gives the
    constants fitted against the simulator by bench/calibrate_cost.py (shipped as
    traces/calibration/cost_model.json), which is what the packers use."""

    pack_overhead_s: float = 5e-4  # per pack use: stream syncs, launch gaps, bookkeeping (a guess)
    copy_latency_s: float = 5e-6  # fixed cost per copy: 3-6 us measured on the H200 host (traces/hardware/h200x2.json)
    h2d_efficiency: float = 1.0  # achieved / route bandwidth for weight uploads
    gpu_reserve_bytes: int = GIB  # CUDA context and allocator slack kept free on every GPU
    host_reserve_bytes: int = 4 * GIB  # OS and process overhead kept free in host DRAM
    memory_weight: float = 0.05  # holistic packing: fraction of time worth trading for a full GPU
    fill_scale: float = 1.0  # multiplies the pipeline fill and drain estimate

    FITTED = ("pack_overhead_s", "h2d_efficiency", "fill_scale")  # what calibration adjusts

    @classmethod
    def calibrated(cls) -> CostModel:
        """The simulator-calibrated constants when shipped, else the defaults."""
        return _calibrated()

    def to_json(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.FITTED}


@lru_cache(maxsize=1)
def _calibrated() -> CostModel:
    import tinypipe.traces as shipped
    from tinypipe.common.jsonio import Fields, load_json

    p = shipped.path("calibration", "cost_model")
    if p is None:
        return CostModel()
    f = Fields(load_json(p), str(p)).obj_("constants")
    return CostModel(pack_overhead_s=f.float("pack_overhead_s", minimum=0.0),
                     h2d_efficiency=f.float("h2d_efficiency", positive=True),
                     fill_scale=f.float("fill_scale", minimum=0.0))
