"""The `compact` host memory layout: fp32 masters as two 16-bit planes in one pinned slab, a small ring
of gradient slots, and a chunked AdamW on the planes (`planes.compact_adamw_step`). Clipping by the global
norm (`grad_clip`) needs a step's every gradient on the host before any layer steps: the slots are then one
region per layer (`hostmem.compact_grad_elems`).

The high plane *is* the bf16 value (truncated) and is uploaded as it is; the low plane restores the
fp32 bits for the optimizer. With an fp32 compute dtype the upload is the joined master. A step
that keeps the previous version (asynchronous optimizer) first copies the upload form into a
snapshot (a region of the slab carved in advance when `snapshots`), served until `drop_stale`.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from typing import Any

import torch

from tinypipe.estimate.hostmem import DEFAULT_GRAD_RING_SLOTS, compact_grad_elems
from tinypipe.policy.modes import HostMemory, OptimizerState

from . import fused_host_adamw, moments, planes
from .heldbytes import HeldBytes, storage_bytes, view_bytes
from .state import AdamWConfig, HostState, _Param, _to


class CompactHostState(HostState):
    host_memory = HostMemory.COMPACT

    def __init__(self, params: dict[int, dict[str, torch.Tensor]], *, compute_dtype: torch.dtype,
                 optim: AdamWConfig, pin: bool = False, shared_grad: int | None = None,
                 grad_ring_slots: int = DEFAULT_GRAD_RING_SLOTS, snapshots: bool = False,
                 optimizer_state: OptimizerState = OptimizerState.FP32, grad_clip: bool = False) -> None:
        """Copies `params` into its slab (the caller may drop them). `optimizer_state`: how AdamW's moments are
        held (fp32: `planes.compact_adamw_step`, bit-identical to torch's; bf16 / 8bit: `moments.lowp_adamw_step`)."""
        if sys.byteorder != "little":  # pragma: no cover - the planes assume little-endian fp32
            raise RuntimeError("the compact host memory layout needs a little-endian host")
        super().__init__(params, compute_dtype=compute_dtype, optim=optim, pin=pin, shared_grad=shared_grad)
        # with the asynchronous optimizer: one region per layer in the slab for the previous version's
        # upload form (the "one extra bf16 copy"), so a step never allocates
        self.snapshots = snapshots
        self._offset: dict[int, int] = {}
        off = 0
        for i in self.layers:
            self._offset[i] = off
            off += self._numel[i]
        self._slot_numel = max(self._numel.values(), default=1)
        # the gradient slots: a ring of the largest layer's size, or with clipping a region per layer
        self.grad_clip = grad_clip
        elems = compact_grad_elems(list(self._numel.values()), grad_ring_slots, grad_clip=grad_clip)
        ring = (max(elems, 1),) if grad_clip else (max(grad_ring_slots, 1), self._slot_numel)
        snap_rows = 1 if self.compute_dtype == torch.bfloat16 else 2  # the upload form: the high plane, or both
        snaps = [((snap_rows, self._numel[i]), torch.int16) for i in self.layers] if self.snapshots else []
        # gradient slots in the compute dtype: what the GPU accumulated, copied as it is (no fp32
        # temporary on the GPU, half the PCIe bytes); the optimizer widens them chunk by chunk
        slab = self._new_slab([((2, max(off, 1)), torch.int16), (ring, self.compute_dtype), *snaps],
                              "planes, gradient ring" + (" and previous-version snapshots" if snaps else ""))
        self._slab = slab.take((2, max(off, 1)), torch.int16)  # [high plane; low plane]
        self._ring = slab.take(ring, self.compute_dtype)
        self._snap_region = {i: slab.take((snap_rows, self._numel[i]), torch.int16) for i in self.layers
                             } if self.snapshots else {}
        biggest_tensor = max((p.numel for i in self.layers for p in self._index[i]), default=1)
        # the optimizer's parameters are only keys for its state (the moments, which it checkpoints):
        # views of one element, expanded to each shape, hold no memory
        self._key = torch.zeros(1, dtype=torch.float32)
        self.optimizer_state = OptimizerState(optimizer_state)
        self._chunk_scratch = torch.empty(
            planes.workspace_elems(min(planes.DEFAULT_CHUNK_ELEMS, biggest_tensor)) if self.optimizer_state.exact
            else moments.workspace_elems(min(moments.DEFAULT_CHUNK_ELEMS, biggest_tensor)), dtype=torch.float32)
        self._region = {i: self._ring[self._offset[i]:self._offset[i] + self._numel[i]] for i in self.layers
                        } if grad_clip else {}
        self._free_slots: deque[torch.Tensor] = deque() if grad_clip else deque(self._ring.unbind(0))
        self._extra_slots: list[torch.Tensor] = []  # beyond the ring, when more layers wait than slots
        self._slot_of: dict[int, torch.Tensor] = {}
        self._stale: dict[int, tuple[int, torch.Tensor]] = {}
        self._work: dict[int, dict[str, torch.Tensor]] = {}  # per-parameter state keys
        for i in self.layers:
            if not any(t.is_meta for t in params[i].values()):
                self.fill(i, params[i])
            self._work[i] = {p.name: self._key.expand(p.shape) for p in self._index[i]}
            self._opt[i] = self.optim.make(list(self._work[i].values()), list(self._work[i]))

    def fill(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        """Store `layer`'s fp32 weights in the planes (at construction, or later for a state made from meta
        tensors: the shapes first, then the weights one layer at a time; the caller may drop them)."""
        for p in self._index[layer]:
            hi, lo = self._planes(layer, p)
            planes.split(tensors[p.name].detach().to(torch.float32).reshape(-1), hi, lo)

    def _planes(self, layer: int, p: _Param | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        a = self._offset[layer] + (p.offset if p else 0)
        n = p.numel if p else self._numel[layer]
        return self._slab[0, a:a + n], self._slab[1, a:a + n]

    # ---- LOAD ------------------------------------------------------------------------------------
    def _load_locked(self, layer: int, want: int, device: torch.device, non_blocking: bool, *, writing: bool,
                     aside: bool = False) -> dict[str, torch.Tensor]:
        have = self._steps[layer]
        if want == have and not writing:
            hi, lo = self._planes(layer)
            return self._from_planes(layer, hi, lo, device, non_blocking)
        stale = self._stale.get(layer)
        if stale is None or stale[0] != want:
            snapshot = f" and a snapshot of {stale[0]}" if stale else ""
            raise self._bad_version(layer, want, f"version {have}{snapshot}")
        snap = stale[1]
        if self.compute_dtype == torch.bfloat16:
            flat = snap.reshape(-1)
            return {p.name: _to(flat[p.offset:p.offset + p.numel].view(torch.bfloat16).view(p.shape), device,
                                non_blocking) for p in self._index[layer]}
        return self._from_planes(layer, snap[0], snap[1], device, non_blocking)

    def _from_planes(self, layer: int, hi: torch.Tensor, lo: torch.Tensor, device: torch.device,
                     non_blocking: bool) -> dict[str, torch.Tensor]:
        out = {}
        for p in self._index[layer]:
            h, low = hi[p.offset:p.offset + p.numel], lo[p.offset:p.offset + p.numel]
            if self.compute_dtype == torch.bfloat16:  # the high plane is the upload
                out[p.name] = _to(h.view(torch.bfloat16).view(p.shape), device, non_blocking)
                continue
            if device.type == "cpu":
                t = planes.join(h, low, torch.empty(p.numel, dtype=torch.float32))
            else:  # move both planes, join on the device
                t = join_planes_on(_to(h, device, non_blocking), _to(low, device, non_blocking),
                                   torch.empty(p.numel, dtype=torch.float32, device=device))
            out[p.name] = t.view(p.shape).to(self.compute_dtype)
        return out

    def drop_stale(self, layer: int) -> None:
        with self._locks[layer]:
            self._stale.pop(layer, None)

    # ---- GRAD_OUT, OPT_STEP ----------------------------------------------------------------------
    def _land_grads(self, layer: int) -> torch.Tensor:
        if layer in self._slot_of:
            raise ValueError(f"layer {layer}: GRAD_OUT twice before its OPT_STEP")
        if self.grad_clip:
            slot = self._region[layer]
        elif self._free_slots:
            slot = self._free_slots.popleft()
        else:  # more layers wait for the optimizer than the ring has slots: grow, and say so in held()
            slot = self._new_slab([((self._slot_numel,), self.compute_dtype)], "an extra gradient slot").take(
                (self._slot_numel,), self.compute_dtype)
            self._extra_slots.append(slot)
        self._slot_of[layer] = slot
        return slot

    def _grads_of(self, layer: int) -> torch.Tensor:
        return self._slot_of[layer]

    def _take_grads(self, layer: int) -> torch.Tensor:
        slot = self._slot_of.pop(layer, None)
        if slot is None:
            raise ValueError(f"layer {layer}: OPT_STEP before its GRAD_OUT")
        return slot

    def _update(self, layer: int, grads: torch.Tensor, *, keep_previous: bool, ready: threading.Event) -> None:
        if keep_previous:
            self._snapshot(layer)
        ready.set()
        self._adamw(layer, grads)
        with self._locks[layer]:
            self._steps[layer] += 1
            if not keep_previous:
                self._stale.pop(layer, None)
        if not self.grad_clip:
            self._free_slots.append(grads)

    def _adamw(self, layer: int, slot: torch.Tensor) -> None:
        grads = self._views(layer, slot)
        opt, work = self._opt[layer], self._work[layer]
        group_of = {id(t): g for g in opt.param_groups for t in g["params"]}  # decaying or not (AdamWConfig.make)
        jobs = []
        for p in self._index[layer]:
            w = work[p.name]
            group = group_of[id(w)]
            beta1, beta2 = group["betas"]
            st = opt.state[w]  # kept in the optimizer so that its state_dict checkpoints the moments
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                if self.optimizer_state.exact:  # shaped as the parameter, as torch's AdamW keeps them
                    st["exp_avg"] = torch.zeros(w.shape, dtype=torch.float32)
                    st["exp_avg_sq"] = torch.zeros(w.shape, dtype=torch.float32)
                else:
                    st.update(moments.zero_state(p.numel, self.optimizer_state))
            st["step"] += 1
            hi, lo = self._planes(layer, p)
            hp = fused_host_adamw.Hyper(step=int(st["step"].item()), lr=group["lr"], beta1=beta1, beta2=beta2,
                                        eps=group["eps"], weight_decay=group["weight_decay"])
            held = {k: v.view(-1) if self.optimizer_state.exact else v for k, v in st.items() if k != "step"}
            jobs.append(fused_host_adamw.Job(hi, lo, grads[p.name], held, hp))
        if fused_host_adamw.run(jobs, state=self.optimizer_state):
            return
        for j in jobs:  # the torch operators: where the kernel is not built, or for hyperparameters it does not take
            h = j.hp
            if self.optimizer_state.exact:
                planes.compact_adamw_step(j.hi, j.lo, j.grad, j.held["exp_avg"], j.held["exp_avg_sq"], step=h.step,
                                          lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                                          weight_decay=h.weight_decay, scratch=self._chunk_scratch)
            else:
                moments.lowp_adamw_step(j.hi, j.lo, j.grad, j.held, state=self.optimizer_state, step=h.step, lr=h.lr,
                                        beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
                                        scratch=self._chunk_scratch)

    def _snapshot(self, layer: int) -> None:
        """Keep the layer's current upload form (the high plane, or both planes for fp32 compute)."""
        hi, lo = self._planes(layer)
        region = self._snap_region.get(layer)
        if region is None:
            snap = hi.clone() if self.compute_dtype == torch.bfloat16 else torch.stack([hi, lo])
        else:
            snap = region
            snap[0].copy_(hi)
            if snap.shape[0] == 2:
                snap[1].copy_(lo)
        with self._locks[layer]:
            self._stale[layer] = (self._steps[layer], snap)

    # ---- reading, saving -------------------------------------------------------------------------
    def master(self, layer: int) -> dict[str, torch.Tensor]:
        hi, lo = self._planes(layer)
        flat = planes.join(hi, lo, torch.empty(self._numel[layer], dtype=torch.float32))
        return self._views(layer, flat)

    def _layout_state(self) -> dict[str, Any]:
        return {"slab": self._slab,  # torch.save writes the slab's whole storage: the ring and snapshots too
                "stale": {i: (v, t.clone()) for i, (v, t) in self._stale.items()}}

    def _load_optim(self, layer: int, saved: dict[str, Any]) -> None:
        if self.optimizer_state.exact:
            super()._load_optim(layer, saved)
            return
        # torch's Optimizer.load_state_dict would cast floating state to the keys' fp32: set it as held
        opt = self._opt[layer]
        keys = [t for g in opt.param_groups for t in g["params"]]  # the order torch's state_dict numbers them in
        opt.state.clear()
        for k, st in saved["state"].items():
            opt.state[keys[int(k)]] = {name: t.clone() for name, t in st.items()}

    def _load_layout_state(self, state: dict[str, Any]) -> None:
        self._slab.copy_(state["slab"])
        self._stale = {}
        for i, (v, t) in state["stale"].items():
            region = self._snap_region.get(i)
            if region is not None:
                region.view(-1).copy_(t.reshape(-1))
                t = region
            else:
                t = t.clone()
            self._stale[i] = (v, t)

    def _held(self, seen: set[int], optim: int, padding: int) -> HeldBytes:
        master = view_bytes([self._slab])
        grads = view_bytes([self._ring, *self._extra_slots])
        scratch = storage_bytes([self._chunk_scratch], seen) + (
            0 if self.optimizer_state.exact else moments.pool_workspace_bytes())  # the chunk pool's, shared
        stale = (view_bytes(self._snap_region.values()) if self.snapshots
                 else storage_bytes((t for _, t in self._stale.values()), seen))
        return HeldBytes(self.host_memory, self.params, master, 0, grads, optim, scratch, stale, padding)


def join_planes_on(hi: torch.Tensor, lo: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """fp32 `out` (flat, n) <- int16 planes on any device (a GPU join after uploading both planes);
    on the host, `planes.join` is the vectorized version."""
    o = out.view(torch.int16).view(-1, 2)
    o[:, 0].copy_(lo, non_blocking=True)
    o[:, 1].copy_(hi, non_blocking=True)
    return out


