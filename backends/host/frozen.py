"""The host state of a frozen base (LoRA): one pinned copy of the base in the compute dtype, and the adapters.

No fp32 master, no gradient buffer or ring, no moments: the base never changes, so every LOAD uploads
the same bytes (version 0 always) and no GRAD_OUT or OPT_STEP exists. In bf16 that is 2 bytes a
parameter (`tinypipe.estimate.lora_costs.frozen_host_bytes`), carved from one slab; a 4-bit base
(`LoraSpec.nf4`) holds its block linears as NF4 instead (`Nf4HostState`). The adapters and their
AdamW state live on the rank's device (`adapters.Adapters`); this state holds them so that checkpoints,
resumption and the saved files go the way they go for the other layouts.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from tinypipe.describe.model import LayerKind
from tinypipe.policy.lora_spec import LoraSpec
from tinypipe.policy.modes import HostMemory

from ..model import nf4
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
        self._renames = renames
        self.adapters = adapters
        self.lora = lora
        self._lay_out()
        for i in self.layers:
            if not any(t.is_meta for t in params[i].values()):
                self.fill(i, params[i])

    def _lay_out(self) -> None:
        """The host copy of the base: each layer's parameters in the compute dtype, from one slab."""
        slab = self._new_slab([((self._numel[i],), self.compute_dtype) for i in self.layers], "the frozen base")
        self._base = {i: slab.take((self._numel[i],), self.compute_dtype) for i in self.layers}

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
        return {names.get(n, n): v for n, v in self._upload(layer, device, non_blocking).items()}

    def _upload(self, layer: int, device: torch.device, non_blocking: bool) -> dict[str, torch.Tensor]:
        """New tensors on `device` with the layer's base weights in the compute dtype, by the base's names."""
        return {n: _to(v, device, non_blocking) for n, v in self._views(layer, self._base[layer]).items()}

    def _land_grads(self, layer: int) -> torch.Tensor:
        raise LoraError(f"layer {layer}: a GRAD_OUT on a frozen base (the schedule was not compiled for LoRA)")

    def _grads_of(self, layer: int) -> torch.Tensor:
        raise LoraError(f"layer {layer}: an OPT_STEP on a frozen base (the schedule was not compiled for LoRA)")

    def _update(self, layer: int, grads: torch.Tensor, *, keep_previous: bool, ready: threading.Event) -> None:
        raise LoraError(f"layer {layer}: a host optimizer step on a frozen base")

    def landed_grad_sq(self, layer: int) -> float:
        """The sum of squares of `layer`'s adapter gradients on the device, which clipping by the global norm
        (`rank/gradclip.py`) reads at the step's first adapter step, once every backward of the step has run."""
        return self.adapters.grad_sq(layer)

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


# ---- a 4-bit base (`LoraSpec.nf4`) ---------------------------------------------------------------------------
# Per layer the slab holds three flat regions: the weights that stay in the compute dtype (norms, biases; all of the
# embedding and the head), the NF4 codes of its linears (uint8, two a byte) and their absmax (fp32, one per block
# of 64), which `tinypipe.estimate.lora_costs.frozen_host_bytes` counts. `fill` quantises one layer at a time (on the
# rank's GPU when it has one) from the weights as read or drawn, so the host never holds more of the base in the
# compute dtype than that layer. A LOAD uploads the layer's codes and absmax in one copy each and dequantises them
# on the device, on the upload's stream, into the compute-dtype weights the layer computes with (`nf4.dequantize`;
# on the CPU backend the same call on the host copy).
Spot = tuple[str, int, int, tuple[int, ...]]  # name, offset, elements, shape: a plain weight in its region
Packed = tuple[str, int, int, int, int, tuple[int, ...]]  # name, code offset and bytes, absmax offset and count, shape


class Nf4HostState(FrozenHostState):
    """A frozen base whose `quantised` weights (per layer, by name) are held as NF4 (the comment above);
    `quantize_on`: the device `fill` quantises on (None: where the weights are)."""

    def __init__(self, params: dict[int, dict[str, torch.Tensor]], adapters: Adapters, lora: LoraSpec, *,
                 compute_dtype: torch.dtype, renames: dict[int, dict[str, str]], quantised: dict[int, frozenset[str]],
                 pin: bool = False, quantize_on: torch.device | None = None) -> None:
        self._quantised = quantised
        self._quantize_on = quantize_on
        self._shapes = {i: {n: tuple(t.shape) for n, t in own.items()} for i, own in params.items()}
        super().__init__(params, adapters, lora, compute_dtype=compute_dtype, renames=renames, pin=pin)

    def _lay_out(self) -> None:
        self._plain_at: dict[int, list[Spot]] = {}
        self._packed_at: dict[int, list[Packed]] = {}
        sizes: dict[int, tuple[int, int, int]] = {}
        for i in self.layers:
            plain, packed, n, c, a = [], [], 0, 0, 0
            for name, shape in self._shapes[i].items():
                numel = int(torch.Size(shape).numel())
                if name in self._quantised.get(i, frozenset()):
                    codes, blocks = nf4.packed_sizes(numel)
                    packed.append((name, c, codes, a, blocks, shape))
                    c, a = c + codes, a + blocks
                else:
                    plain.append((name, n, numel, shape))
                    n += numel
            self._plain_at[i], self._packed_at[i], sizes[i] = plain, packed, (n, c, a)
        kinds = (self.compute_dtype, torch.uint8, torch.float32)
        slab = self._new_slab([((k,), dt) for i in self.layers for k, dt in zip(sizes[i], kinds)],
                              "the frozen base (NF4 linears)")
        self._plain, self._codes, self._absmax = {}, {}, {}
        for i in self.layers:
            self._plain[i], self._codes[i], self._absmax[i] = (slab.take((k,), dt) for k, dt in zip(sizes[i], kinds))

    def fill(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        """Store `layer`'s base weights: the plain ones cast, the linears quantised from their compute-dtype values
        (on `quantize_on`), one weight at a time."""
        plain = {name: (off, k, shape) for name, off, k, shape in self._plain_at[layer]}
        packed = {p[0]: p[1:] for p in self._packed_at[layer]}
        with torch.no_grad():
            for name, t in tensors.items():
                if name in plain:
                    off, k, shape = plain[name]
                    self._plain[layer][off:off + k].view(shape).copy_(t)
                    continue
                c, nc, a, na, _ = packed[name]
                codes, absmax = nf4.quantize(t.to(self._quantize_on or t.device, self.compute_dtype))
                self._codes[layer][c:c + nc].copy_(codes)
                self._absmax[layer][a:a + na].copy_(absmax)

    def _upload(self, layer: int, device: torch.device, non_blocking: bool) -> dict[str, torch.Tensor]:
        """The plain weights copied to `device`; the linears' codes and absmax in one copy each, dequantised
        there (the host copy itself on the CPU, which the dequantisation only reads)."""
        out = {name: _to(self._plain[layer][off:off + k].view(shape), device, non_blocking)
               for name, off, k, shape in self._plain_at[layer]}
        if self._packed_at[layer]:
            on_host = device.type == "cpu"
            codes = self._codes[layer] if on_host else _to(self._codes[layer], device, non_blocking)
            absmax = self._absmax[layer] if on_host else _to(self._absmax[layer], device, non_blocking)
            for name, c, nc, a, na, shape in self._packed_at[layer]:
                out[name] = nf4.dequantize(codes[c:c + nc], absmax[a:a + na], shape, self.compute_dtype)
        return {name: out[name] for name in self._shapes[layer]}  # the base's own order

    def master(self, layer: int) -> dict[str, torch.Tensor]:
        """The base's weights of `layer` as the run computes with them (the linears dequantised into the compute
        dtype), as fp32 copies."""
        return {n: v.float() for n, v in self._upload(layer, torch.device("cpu"), False).items()}

    def _held(self, seen: set[int], optim: int, padding: int) -> HeldBytes:
        regions = [*self._plain.values(), *self._codes.values(), *self._absmax.values()]
        return HeldBytes(self.host_memory, self.params, 0, view_bytes(regions), 0, 0, 0, 0, padding)


def frozen_host_state(stack: LayerStack, lora: LoraSpec, layers: list[int], *, device: torch.device,
                      compute_dtype: torch.dtype, optim: AdamWConfig, seed: int, pin: bool = False,
                      adapter_state: dict[str, torch.Tensor] | None = None, adapter_where: str = "adapter"
                      ) -> FrozenHostState:
    """peft's modules into the owned blocks of `stack`, their adapters on `device` (initialised, or from
    `adapter_state`, peft's keys), and the host's frozen copy of the owned layers' base (with `lora.nf4`, its
    block linears as NF4, quantised on `device` when it is a GPU)."""
    base = stack.state()  # before injection: the base's own names
    linears = {i: linear_weights(stack, i) for i in layers}
    renames, initial = inject(stack, lora, layers, seed=seed, device=device)
    names = {i: {n: peft_name(stack, i, n) for n in own} for i, own in initial.items()}
    adapters = Adapters(initial, device, optim, names)
    if adapter_state is not None:
        adapters.load_peft_state(adapter_state, adapter_where)
    if lora.nf4:
        return Nf4HostState(base, adapters, lora, compute_dtype=compute_dtype, renames=renames, pin=pin,
                            quantised=linears, quantize_on=device if device.type == "cuda" else None)
    return FrozenHostState(base, adapters, lora, compute_dtype=compute_dtype, renames=renames, pin=pin)


def linear_weights(stack: LayerStack, layer: int) -> frozenset[str]:
    """Names of the weights of layer `layer`'s `nn.Linear`s when it is a decoder block (none otherwise): what a
    4-bit base holds as NF4, as Hugging Face's 4-bit loading puts a Linear4bit in place of each (but `lm_head`)."""
    module = stack.layers[layer]
    if module is None or stack.spec.layers[layer].kind is not LayerKind.BLOCK:
        return frozenset()
    return frozenset(f"{n}.weight" for n, m in module.named_modules() if isinstance(m, torch.nn.Linear))
