"""One rank's part of a mixture-of-experts model's load-balancing loss (`model/moe.py` has the mathematics).

Per (step, microbatch) the rank holds `sums` [2, experts] fp32: the sums of f_l and p_l over the MoE layers the
microbatch's forward has passed so far. A MoE block's FWD adds its layer's (a BWD's recompute adds nothing); a
FWD that keeps its graph also keeps its p_l with the graph, for its BWD. SEND_F sends the sums after the
activation and RECV_F receives them (the next rank adds on); the head's FWD reads them whole and adds the aux
value to the loss it reports; SEND_B / RECV_B carry them back beside the activation's gradient, so every MoE
block's BWD sees the whole F row. A rank forgets a microbatch's sums when it sends them on, and the embedding's
BWD (the microbatch's last) drops what is left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tinypipe.ir.schedule import Action

from ..model.moe import Routing, aux_term, aux_value, layer_stats, routing_of, take_logits
from .comm import Handle

Key = tuple[int, int, int]  # (step, layer, microbatch)


class Both:
    """Two transfers as one handle: complete when both are."""

    def __init__(self, a: Handle, b: Handle) -> None:
        self.a, self.b = a, b

    def is_completed(self) -> bool:
        return self.a.is_completed() and self.b.is_completed()

    def wait(self) -> bool:
        return self.a.wait() and self.b.wait()


class AuxLoss:
    """The load-balancing loss's state on one rank (module docstring)."""

    def __init__(self, r: Routing, device: torch.device) -> None:
        self.r = r
        self.device = device
        self.sums: dict[tuple[int, int], torch.Tensor] = {}
        self.kept: dict[Key, torch.Tensor] = {}

    @classmethod
    def of(cls, layers: list[nn.Module | None], device: torch.device) -> AuxLoss | None:
        """The state for the model whose layers (this rank's, the others None) are `layers`, when it has MoE layers
        and a loss coefficient (`moe.routing_of`); else None."""
        r = routing_of(layers)
        return None if r is None or r.coef == 0 else cls(r, device)

    def _sums(self, step: int, m: int) -> torch.Tensor:
        key = (step, m)
        if key not in self.sums:
            self.sums[key] = torch.zeros((2, self.r.experts), dtype=torch.float32, device=self.device)
        return self.sums[key]

    def forwarded(self, module: nn.Module, step: int, layer: int, m: int, *, keep: bool, count: bool = True) -> None:
        """After a layer's forward: add its routers' f_l and p_l to the sums (`count`), keep p_l with its graph
        for the BWD (`keep`)."""
        for logits in take_logits(module):
            f, p = layer_stats(logits, self.r.top_k)
            if count:
                self._sums(step, m).add_(torch.stack((f, p.detach())))
            if keep:
                self.kept[(step, layer, m)] = p

    # `interp` below is the rank's `interpreter.Interpreter` (typed Any: the interpreter imports this module)
    def after_fwd(self, interp: Any, a: Action, step: int) -> None:
        """After FWD `a`: a block's statistics into the sums (its p_l kept when its graph is); at the head, the
        microbatch's aux value added to the loss it reports."""
        L, m = a.layer, a.microbatch
        assert m is not None
        if L == interp.last_layer:
            key = (step, m)
            interp.losses[key] = interp.losses[key] + self.value(step, m, len(interp.data[step].microbatches))
            return
        module = interp.layers[L]
        assert module is not None
        self.forwarded(module, step, L, m, keep=not interp.schedule.recomputes(L))

    def backward_outputs(self, interp: Any, a: Action, step: int, out: torch.Tensor, dy: torch.Tensor | None
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """What BWD `a` back-propagates, after its forward ran again or its graph was taken: the layer's output
        with its gradient and, for a MoE block, its `aux_term` with 1. The embedding's BWD forgets the sums."""
        L, m = a.layer, a.microbatch
        assert m is not None
        module = interp.layers[L]
        if interp.schedule.recomputes(L) and module is not None:  # the recompute's p_l (its sums already counted)
            self.forwarded(module, step, L, m, keep=True, count=False)
        p = self.kept.pop((step, L, m), None)
        outs: tuple[list[torch.Tensor], list[torch.Tensor | None]] = ([out], [dy])
        if p is not None:
            term = aux_term(p, self._sums(step, m)[0], self.r, len(interp.data[step].microbatches))
            outs = ([out, term], [dy, torch.ones_like(term)])
        if L == 0:
            self.done(step, m)
        return outs

    def done(self, step: int, m: int) -> None:
        """The microbatch's last BWD (the embedding's) ran without `backward_outputs`: forget its sums."""
        self.sums.pop((step, m), None)

    def value(self, step: int, m: int, microbatches: int) -> torch.Tensor:
        """The microbatch's aux loss (`aux_value`), for the loss the head reports."""
        return aux_value(self._sums(step, m), self.r, microbatches)

    def send(self, comm: Any, peer: int, key: Key, sent: Handle) -> Handle:
        """Send the microbatch's sums to `peer` after the activation (or gradient) whose send is `sent`, and forget
        them here."""
        step, _, m = key
        sums = self.sums.pop((step, m), None)
        if sums is None:  # no MoE layer before this point of the forward
            sums = torch.zeros((2, self.r.experts), dtype=torch.float32, device=self.device)
        return Both(sent, comm.isend(sums, peer))

    def recv(self, comm: Any, peer: int, key: Key, got: Handle, arrived: Callable[[], None]
             ) -> tuple[Handle, Callable[[], None]]:
        """Receive the microbatch's sums from `peer` after the activation (or gradient) whose receive is `got`
        (`arrived` stores that)."""
        step, _, m = key
        buf = torch.empty((2, self.r.experts), dtype=torch.float32, device=self.device)

        def both() -> None:
            arrived()
            self.sums[(step, m)] = buf

        return Both(got, comm.irecv(buf, peer)), both
