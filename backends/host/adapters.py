"""A LoRA run's adapters and their optimizer: fp32 on the rank's device, one fused AdamW per layer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..model.lora_adapters import LoraError
from .adamw import AdamWConfig


class Adapters:
    """One rank's adapters: fp32 parameters on its device, one fused AdamW per layer, steps counted."""

    def __init__(self, tensors: dict[int, dict[str, torch.Tensor]], device: torch.device, optim: AdamWConfig,
                 names: dict[int, dict[str, str]]) -> None:
        self.params = {i: {n: nn.Parameter(t.to(device), requires_grad=True) for n, t in own.items()}
                       for i, own in tensors.items()}
        self.names = names  # per layer: name in layer -> peft key
        # every adapter is a matrix, which weight decay applies to (`optim_rules.decays`)
        self.opt = {i: torch.optim.AdamW(list(p.values()), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                         weight_decay=optim.weight_decay, fused=True)
                    for i, p in self.params.items() if p}
        self.optim = optim
        self.steps = {i: 0 for i in self.params}
        self._grad_sq: dict[int, tuple[int, float]] = {}  # training step -> (layers stepped, sum of squares)

    def of(self, layer: int) -> dict[str, nn.Parameter]:
        return self.params.get(layer, {})

    def step(self, layer: int, *, at_step: int, grad_scale: float = 1.0) -> None:
        """AdamW over the layer's adapters with the gradients its BWDs accumulated, at the learning rate of
        training step `at_step`; then clear them. `grad_scale`: the gradients are multiplied by it first (clipping
        by the global norm); the step's gradient norm for the metrics is the one before."""
        opt = self.opt.get(layer)
        if opt is None:
            raise LoraError(f"layer {layer} has no adapters to step")
        grads = [p.grad for p in self.params[layer].values()]
        if any(g is None for g in grads):
            raise LoraError(f"layer {layer}: an adapter step without gradients (no BWD before it)")
        for group in opt.param_groups:
            group["lr"] = self.optim.lr_at(at_step)
        sq = float(sum(torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads if g is not None))
        n, total = self._grad_sq.get(at_step, (0, 0.0))
        self._grad_sq[at_step] = (n + 1, total + sq)
        if grad_scale != 1.0:
            for g in grads:
                if g is not None:
                    g.mul_(grad_scale)
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.steps[layer] += 1

    def grad_sq(self, layer: int) -> float:
        """The sum of squares of the layer's adapter gradients now (0 for a layer without adapters or gradients)."""
        grads = [p.grad for p in self.params.get(layer, {}).values() if p.grad is not None]
        return float(sum(torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads))

    def drop_grads(self, layer: int) -> None:
        """Clear the layer's adapter gradients without a step (an evaluation window's backward made them)."""
        for p in self.params.get(layer, {}).values():
            p.grad = None

    def note_step(self, at_step: int) -> None:
        """Training step `at_step` ran here (its gradient-norm share is complete once its adapters stepped)."""
        self._grad_sq.setdefault(at_step, (0, 0.0))

    def take_grad_sq(self) -> dict[int, float]:
        """Per training step whose every adapter layer here has stepped: the sum of their gradients' squares."""
        done = {k: t for k, (n, t) in self._grad_sq.items() if n == len(self.opt)}
        for k in done:
            del self._grad_sq[k]
        return done

    def peft_state(self) -> dict[str, torch.Tensor]:
        """The adapters as peft saves them (CPU fp32 copies keyed by peft's names)."""
        return {self.names[i][n]: p.detach().float().cpu().clone()
                for i, own in self.params.items() for n, p in own.items()}

    def load_peft_state(self, state: dict[str, torch.Tensor], where: str) -> None:
        """Take the values of `state` (peft's keys) for this rank's adapters; a missing key is an error."""
        with torch.no_grad():
            for i, own in self.params.items():
                for n, p in own.items():
                    key = self.names[i][n]
                    if key not in state:
                        raise LoraError(f"{where}: no tensor {key!r}; the adapter was made for other targets "
                                        "or another model")
                    if tuple(state[key].shape) != tuple(p.shape):
                        raise LoraError(f"{where}: {key!r} has shape {tuple(state[key].shape)}, this model's "
                                        f"rank-{p.shape[0] if '.lora_A.' in key else p.shape[1]} adapter needs "
                                        f"{tuple(p.shape)}")
                    p.copy_(state[key])

    def state_dict(self) -> dict[str, Any]:
        return {"adapters": {i: {n: p.detach() for n, p in own.items()} for i, own in self.params.items()},
                "optim": {i: o.state_dict() for i, o in self.opt.items()}, "steps": dict(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for i, own in self.params.items():
                for n, p in own.items():
                    p.copy_(state["adapters"][i][n])
        for i, o in self.opt.items():
            o.load_state_dict(state["optim"][i])
        self.steps = dict(state["steps"])

    def device_bytes(self) -> int:
        """Adapters, their gradients and AdamW moments on the device now."""
        total = 0
        for own in self.params.values():
            for p in own.values():
                total += p.numel() * p.element_size() * (2 if p.grad is not None else 1)
        for o in self.opt.values():
            for st in o.state.values():
                total += sum(v.numel() * v.element_size() for v in st.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0)
        return total
