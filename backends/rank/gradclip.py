"""Clipping by the global gradient norm, as torch.nn.utils.clip_grad_norm_: each step's coefficient, from the
norms of the gradients every rank holds on its host (docs/training.md)."""

from __future__ import annotations

import math

from ..host.state import HostState
from .groups import Group


class GradClip:
    """Clipping by the global gradient norm, as torch.nn.utils.clip_grad_norm_: every gradient of step k is
    multiplied by min(1, max_norm / (norm + 1e-6)), norm the L2 norm over all ranks' gradients of step k.

    Run by the optimizer thread at a step's first OPT_STEP, which the schedule (`grad_clip`) makes wait
    for every GRAD_OUT of the step: this rank's landed gradients give its share (`HostState.landed_grad_sq`,
    a tied matrix's two shares summed first), `norms.all_sum` the total. Under LoRA, by the issuing thread at
    the step's first ADAPT_STEP, which waits for every BWD of the step: the adapters' gradients on the device
    (`FrozenHostState.landed_grad_sq`).
    """

    def __init__(self, max_norm: float, norms: Group | None, host: HostState) -> None:
        self.max_norm, self.norms, self.host = max_norm, norms, host
        self._coef: dict[int, float] = {}

    def coefficient(self, step: int) -> float:
        if step not in self._coef:
            local = sum(self.host.landed_grad_sq(layer) for layer in self.host.layers)
            total = local if self.norms is None else self.norms.all_sum(local)
            self._coef = {k: v for k, v in self._coef.items() if k > step - 4}
            self._coef[step] = min(1.0, self.max_norm / (math.sqrt(total) + 1e-6))
        return self._coef[step]
