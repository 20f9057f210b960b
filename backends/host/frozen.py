"""The host state of a frozen base (LoRA): one pinned copy of the base in the compute dtype, and the adapters.

No fp32 master, no gradient buffer or ring, no moments: the base never changes, so every LOAD uploads
the same bytes (version 0 always) and no GRAD_OUT or OPT_STEP exists. In bf16 that is 2 bytes a
parameter (`tinypipe.estimate.lora_costs.frozen_host_bytes`), carved from one slab. The adapters and their
AdamW state live on the rank's device (`adapters.Adapters`); this state holds them so that checkpoints,
resumption and the saved files go the way they go for the other layouts.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from tinypipe.policy.lora_spec import LoraSpec
from tinypipe.policy.modes import HostMemory

from ..model.layers import LayerStack
from ..model.lora_adapters import LoraError, inject, peft_name
from .adapters import Adapters
from .heldbytes import HeldBytes, view_bytes
from .state import AdamWConfig, HostState, _to


class FrozenHostState(HostState):
    """`params`: {layer: {name: fp32 tensor}} of the base (copied into the compute dtype, not kept; meta
    tensors give the shapes only, and `fill` stores each layer's weights later);
    `renames`: per layer, base name -> its name in the injected module (what LOAD hands out)."""

    host_memory = HostMemory.COMPACT  # HeldBytes' label: the bytes are the frozen copy's (`held`)

    def __init__(self, params: dict[int, dict[str, torch.Tensor]], adapters: Adapters, lora: LoraSpec, *,
                 compute_dtype: torch.dtype, renames: dict[int, dict[str, str]], pin: bool = False) -> None:
        super().__init__(params, compute_dtype=compute_dtype, optim=AdamWConfig(), pin=pin)
        slab = self._new_slab([((self._numel[i],), compute_dtype) for i in self.layers], "the frozen base")
        self._base = {i: slab.take((self._numel[i],), compute_dtype) for i in self.layers}
        for i in self.layers:
            if not any(t.is_meta for t in params[i].values()):
                self.fill(i, params[i])
        self._renames = renames
        self.adapters = adapters
        self.lora = lora

    def fill(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        """Store `layer`'s base weights in the frozen copy (at construction, or later for a state made from meta
        tensors: the shapes first, then the weights one layer at a time; the caller may drop them)."""
        views = self._views(layer, self._base[layer])
        with torch.no_grad():
            for n, t in tensors.items():
                views[n].copy_(t)

    def _load_locked(self, layer: int, want: int, device: torch.device, non_blocking: bool, *, writing: bool,
                     aside: bool = False) -> dict[str, torch.Tensor]:
        if want != 0:
            raise self._bad_version(layer, want, "the frozen base (version 0)")
        names = self._renames.get(layer, {})
        return {names.get(n, n): _to(v, device, non_blocking) for n, v in self._views(layer, self._base[layer]).items()}

    def _land_grads(self, layer: int) -> torch.Tensor:
        raise LoraError(f"layer {layer}: a GRAD_OUT on a frozen base (the schedule was not compiled for LoRA)")

    def _grads_of(self, layer: int) -> torch.Tensor:
        raise LoraError(f"layer {layer}: an OPT_STEP on a frozen base (the schedule was not compiled for LoRA)")

    def _update(self, layer: int, grads: torch.Tensor, *, keep_previous: bool, ready: threading.Event) -> None:
        raise LoraError(f"layer {layer}: a host optimizer step on a frozen base")

    def take_grad_sq(self) -> dict[int, float]:
        """The adapters' share of each finished step's gradient norm (backends/rank/metrics.py)."""
        return self.adapters.take_grad_sq()

    def master(self, layer: int) -> dict[str, torch.Tensor]:
        """The base's weights of `layer` (fp32 copies of the held compute-dtype values)."""
        return {n: v.float().clone() for n, v in self._views(layer, self._base[layer]).items()}

    def merged(self) -> dict[int, dict[str, torch.Tensor]]:
        """The base with each adapter folded in: W + (alpha / r) B A, fp32, by the base's own names."""
        out = self.masters()
        for i, own in self.adapters.params.items():
            for n, a in own.items():
                if ".lora_A." not in n:
                    continue
                module = n.partition(".lora_A.")[0]
                b = own[n.replace(".lora_A.", ".lora_B.")]
                out[i][f"{module}.weight"] += self.lora.scaling * (b.detach().float().cpu() @ a.detach().float().cpu())
        return out

    def state_dict(self) -> dict[str, Any]:
        """The adapters and their AdamW state (the base is the model's own and does not change)."""
        return {"host_memory": "frozen", "lora": self.lora.text(), "adapters": self.adapters.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("host_memory") != "frozen" or state.get("lora") != self.lora.text():
            raise ValueError(f"checkpoint holds host memory {state.get('host_memory')} (LoRA {state.get('lora')}); "
                             f"this run trains LoRA {self.lora.text()} on a frozen base")
        self.adapters.load_state_dict(state["adapters"])

    def _layout_state(self) -> dict[str, Any]:
        return {}

    def _load_layout_state(self, state: dict[str, Any]) -> None:
        return None

    def _held(self, seen: set[int], optim: int, padding: int) -> HeldBytes:
        return HeldBytes(self.host_memory, self.params, 0, view_bytes(self._base.values()), 0, 0, 0, 0, padding)


def frozen_host_state(stack: LayerStack, lora: LoraSpec, layers: list[int], *, device: torch.device,
                      compute_dtype: torch.dtype, optim: AdamWConfig, seed: int, pin: bool = False,
                      adapter_state: dict[str, torch.Tensor] | None = None, adapter_where: str = "adapter"
                      ) -> FrozenHostState:
    """peft's modules into the owned blocks of `stack`, their adapters on `device` (initialised, or from
    `adapter_state`, peft's keys), and the host's frozen copy of the owned layers' base."""
    base = stack.state()  # before injection: the base's own names
    renames, initial = inject(stack, lora, layers, seed=seed)
    names = {i: {n: peft_name(stack, i, n) for n in own} for i, own in initial.items()}
    adapters = Adapters(initial, device, optim, names)
    if adapter_state is not None:
        adapters.load_peft_state(adapter_state, adapter_where)
    return FrozenHostState(base, adapters, lora, compute_dtype=compute_dtype, renames=renames, pin=pin)
