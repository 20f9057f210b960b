"""Host state of the layers one rank owns: fp32 masters, what is uploaded, gradient landing, AdamW.

Two layouts (DESIGN §1.2; the formulas they are checked against live in `tinypipe.hostmem`):

`replicated` (what peers do): per layer an fp32 master, a separate compute-dtype upload copy and a
full-size fp32 gradient buffer (one block each per layer), AdamW moments. Unlike peers, whose
pinned allocator rounds each block up to a power of two (`hostmem` models that rounding), the
blocks are carved from one slab, so they hold only alignment padding.

`compact`: the fp32 masters of all owned layers as two 16-bit planes in one slab. The high plane
*is* the bf16 value (truncated) and is uploaded as it is; the low plane restores the fp32 bits for
the optimizer, which joins the planes, runs AdamW and splits them again, one parameter tensor at
a time and within it in cache-sized chunks (`planes.compact_adamw_step`, bit-identical to torch's
fused AdamW on the joined tensor). Gradients land in a small ring of
slots (each the size of the largest owned layer) instead of a model-sized buffer. With an fp32
compute dtype the upload is the joined fp32 master, so training stays exact.

Pinned memory: every block a copy engine reads or writes (the planes and the ring; the upload copies
and gradient buffers) is a view of one `pinned.PinnedSlab` per HostState, allocated at its exact
size and page-locked once when CUDA is available (the same carving without CUDA). Only the ring's
extra slots, allocated when more layers wait than it has slots, get a slab each.

Versions: `version(layer)` counts the optimizer steps applied. A LOAD asks for a version: the
current one, or (asynchronous optimizer, staleness 1, when the step ran before a LOAD that still
wants the weights before it) the previous one. Replicated serves it from its upload copy, left
unrefreshed by such a step; compact keeps a snapshot of the upload form until `drop_stale`.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tinypipe.hostmem import DEFAULT_GRAD_RING_SLOTS

from . import planes
from .pinned import PinnedSlab, Request

LAYOUTS = ("replicated", "compact")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class AdamWConfig:
    """The optimizer's settings. The optimizer itself is `reference.layer_adamw` (torch's AdamW,
    fused on CPU fp32), the same one the single-process reference trains with."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def make(self, params: list[torch.Tensor]) -> torch.optim.AdamW:
        from .reference import layer_adamw

        return layer_adamw(params, lr=self.lr, betas=self.betas, eps=self.eps,  # type: ignore[arg-type]
                           weight_decay=self.weight_decay)


@dataclass(frozen=True)
class HeldBytes:
    """Host bytes this rank really holds, by purpose (tensor storage sizes; a pinned slab's views by
    their own sizes, the slab's alignment padding apart)."""

    layout: str
    params: int
    master_bytes: int
    upload_copy_bytes: int
    grad_bytes: int
    optim_state_bytes: int  # AdamW moments and step counters
    scratch_bytes: int  # compact: the join/update/split buffer
    stale_bytes: int  # compact + async: snapshots of the previous version awaiting their last LOAD
    pinned_rounding_bytes: int  # alignment padding of the pinned slabs (no allocator rounding: one slab)

    @property
    def total_bytes(self) -> int:
        return (self.master_bytes + self.upload_copy_bytes + self.grad_bytes + self.optim_state_bytes
                + self.scratch_bytes + self.stale_bytes + self.pinned_rounding_bytes)

    @property
    def bytes_per_param(self) -> float:
        return self.total_bytes / max(1, self.params)

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "params": self.params, "master_bytes": self.master_bytes,
                "upload_copy_bytes": self.upload_copy_bytes, "grad_bytes": self.grad_bytes,
                "optim_state_bytes": self.optim_state_bytes, "scratch_bytes": self.scratch_bytes,
                "stale_bytes": self.stale_bytes, "pinned_rounding_bytes": self.pinned_rounding_bytes,
                "total_bytes": self.total_bytes, "bytes_per_param": self.bytes_per_param}


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def view_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the tensors themselves span (views carved from one slab count separately)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def join_planes_on(hi: torch.Tensor, lo: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """fp32 `out` (flat, n) <- int16 planes on any device (a GPU join after uploading both planes);
    on the host, `planes.join` is the vectorized version."""
    o = out.view(torch.int16).view(-1, 2)
    o[:, 0].copy_(lo, non_blocking=True)
    o[:, 1].copy_(hi, non_blocking=True)
    return out


class _Param:
    """Where one parameter tensor lives in its layer's flat blocks: offset, size, shape."""

    __slots__ = ("name", "offset", "numel", "shape")

    def __init__(self, name: str, offset: int, numel: int, shape: torch.Size) -> None:
        self.name, self.offset, self.numel, self.shape = name, offset, numel, shape


class HostState:
    """Host state of one rank's layers under one layout; see the module docstring.

    `params`: {layer: {name: fp32 tensor}} (e.g. `LayerStack.state()`); replicated keeps these
    tensors as its masters (no copy), compact copies them into its slab (the caller may drop them).
    """

    def __init__(self, params: dict[int, dict[str, torch.Tensor]], *, layout: str, compute_dtype: torch.dtype,
                 optim: AdamWConfig, pin: bool = False,
                 grad_ring_slots: int = DEFAULT_GRAD_RING_SLOTS, shared_grad: int | None = None,
                 snapshots: bool = False) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown host memory layout {layout!r}; expected one of {LAYOUTS}")
        if sys.byteorder != "little":  # pragma: no cover - the planes assume little-endian fp32
            raise RuntimeError("the compact host layout needs a little-endian host")
        self.layout = layout
        self.compute_dtype = compute_dtype
        self.optim = optim
        self.pin = pin
        self.layers = tuple(sorted(params))
        if shared_grad is not None and shared_grad not in params:
            raise ValueError(f"shared_grad: layer {shared_grad} is not one of this rank's layers {list(self.layers)}")
        # tied embeddings: the layer whose gradient arrives in two shares per step (its own GRAD_OUT
        # and the head's, for the matrix they share); the first share is copied, the second added
        self.shared_grad = shared_grad
        self._shares: dict[int, int] = {}
        self._steps = {i: 0 for i in self.layers}
        self._index: dict[int, list[_Param]] = {}
        self._numel: dict[int, int] = {}
        for i in self.layers:
            off, index = 0, []
            for name, t in params[i].items():
                if t.dtype != torch.float32:
                    raise ValueError(f"layer {i} parameter {name}: master must be fp32, got {t.dtype}")
                index.append(_Param(name, off, t.numel(), t.shape))
                off += t.numel()
            self._index[i], self._numel[i] = index, off
        self.params = sum(self._numel.values())
        # compact + asynchronous optimizer: one region per layer in the slab for the previous version's
        # upload form (the "one extra bf16 copy"), so a step never allocates
        self.snapshots = snapshots and layout == "compact"
        # The optimizer step runs on its own thread (backends/hostwork.py) while the issuing thread
        # uploads other layers, and under the asynchronous optimizer the same layer's older version.
        # `_locks[layer]` guards the layer's version bookkeeping; `_writing[layer]` exists while a step
        # updates the layer (set once its snapshot is taken); `_reads[layer]` holds CUDA events of
        # uploads still reading the layer's host memory, which a step waits for before writing it.
        self._locks = {i: threading.Lock() for i in self.layers}  # per layer: other layers never wait
        self._writing: dict[int, threading.Event] = {}
        self._reads: dict[int, list[Any]] = {}
        self._slabs: list[PinnedSlab] = []  # the pinned slab, then one per extra ring slot
        if layout == "replicated":
            self._init_replicated(params)
        else:
            self._init_compact(params, grad_ring_slots)

    # ---- construction --------------------------------------------------------------------------
    def _views(self, layer: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {p.name: flat[p.offset:p.offset + p.numel].view(p.shape) for p in self._index[layer]}

    def _init_replicated(self, params: dict[int, dict[str, torch.Tensor]]) -> None:
        self._master = {i: {n: t.detach() for n, t in params[i].items()} for i in self.layers}
        slab = self._new_slab([((self._numel[i],), self.compute_dtype) for i in self.layers]
                              + [((self._numel[i],), torch.float32) for i in self.layers],
                              "upload copies and gradients")
        self._upload_flat = {i: slab.take((self._numel[i],), self.compute_dtype) for i in self.layers}
        self._grad_flat = {i: slab.take((self._numel[i],), torch.float32) for i in self.layers}
        self._upload_version = {i: 0 for i in self.layers}
        self._opt: dict[int, torch.optim.AdamW] = {}
        for i in self.layers:
            grads = self._views(i, self._grad_flat[i])
            for n, t in self._master[i].items():
                t.grad = grads[n]
            self._opt[i] = self.optim.make(list(self._master[i].values()))
            self._refresh_upload(i)

    def _init_compact(self, params: dict[int, dict[str, torch.Tensor]], slots: int) -> None:
        self._offset: dict[int, int] = {}
        off = 0
        for i in self.layers:
            self._offset[i] = off
            off += self._numel[i]
        self._slot_numel = max(self._numel.values(), default=1)
        ring = (max(slots, 1), self._slot_numel)
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
        self._scratch = torch.empty(biggest_tensor, dtype=torch.float32)  # optimizer state keys, joins
        self._chunk_scratch = torch.empty(planes.workspace_elems(min(planes.DEFAULT_CHUNK_ELEMS, biggest_tensor)),
                                          dtype=torch.float32)
        self._free_slots: deque[torch.Tensor] = deque(self._ring.unbind(0))
        self._extra_slots: list[torch.Tensor] = []  # beyond the ring, when more layers wait than slots
        self._slot_of: dict[int, torch.Tensor] = {}
        self._stale: dict[int, tuple[int, torch.Tensor]] = {}
        self._work: dict[int, dict[str, torch.Tensor]] = {}  # per-parameter views of the scratch
        self._opt = {}
        for i in self.layers:
            for p in self._index[i]:
                self._split(i, p, params[i][p.name].detach().reshape(-1))
            self._work[i] = {p.name: self._scratch[:p.numel].view(p.shape) for p in self._index[i]}
            self._opt[i] = self.optim.make(list(self._work[i].values()))

    def _new_slab(self, requests: Sequence[Request], what: str) -> PinnedSlab:
        slab = PinnedSlab(requests, pin=self.pin, what=f"the host state of layers {list(self.layers)}: {what}")
        self._slabs.append(slab)
        return slab

    def _planes(self, layer: int, p: _Param | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        a = self._offset[layer] + (p.offset if p else 0)
        n = p.numel if p else self._numel[layer]
        return self._slab[0, a:a + n], self._slab[1, a:a + n]

    def _split(self, layer: int, p: _Param, src: torch.Tensor) -> None:
        hi, lo = self._planes(layer, p)
        planes.split(src, hi, lo)

    # ---- versions --------------------------------------------------------------------------------
    def version(self, layer: int) -> int:
        """Optimizer steps applied to `layer` so far."""
        return self._steps[layer]

    def _refresh_upload(self, layer: int) -> None:
        up = self._views(layer, self._upload_flat[layer])
        with torch.no_grad():
            for n, t in self._master[layer].items():
                up[n].copy_(t)
        self._upload_version[layer] = self._steps[layer]

    def _bad_version(self, layer: int, want: int, have: str) -> ValueError:
        return ValueError(f"layer {layer}: a LOAD wants the weights after {want} optimizer steps, but the host "
                          f"holds {have} (the schedule's LOAD/OPT_STEP dependencies do not match the "
                          f"optimizer mode)")

    # ---- LOAD ------------------------------------------------------------------------------------
    def load(self, layer: int, want: int, device: torch.device, *, non_blocking: bool = False
             ) -> dict[str, torch.Tensor]:
        """New tensors on `device`, in the compute dtype, holding `layer`'s weights at version `want`.

        Safe beside a `step` of the same layer on another thread: while the step writes, `want`
        equal to the version before it is served from the snapshot the step took first."""
        while True:
            with self._locks[layer]:
                busy = self._writing.get(layer)
                if busy is None or busy.is_set() or want != self._steps[layer]:
                    out = self._load_locked(layer, want, device, non_blocking, writing=busy is not None)
                    if device.type == "cuda" and non_blocking:  # the copies read host memory until this
                        ev = torch.cuda.Event()
                        ev.record(torch.cuda.current_stream(device))
                        self._reads.setdefault(layer, []).append(ev)
                    return out
            busy.wait()  # the step is taking the snapshot this upload wants

    def _wait_reads(self, layer: int) -> None:
        for ev in self._reads.pop(layer, []):
            ev.synchronize()

    def _load_locked(self, layer: int, want: int, device: torch.device, non_blocking: bool, *, writing: bool
                     ) -> dict[str, torch.Tensor]:
        have = self._steps[layer]
        if self.layout == "replicated":
            if self._upload_version[layer] != want:
                if have != want or writing:
                    raise self._bad_version(layer, want, f"versions {self._upload_version[layer]} (upload copy) "
                                                         f"and {have} (master)")
                self._wait_reads(layer)  # uploads of the older version still reading the copy
                self._refresh_upload(layer)
            return {n: _to(v, device, non_blocking) for n, v in self._views(layer, self._upload_flat[layer]).items()}
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
        """Free the snapshot of the previous version of `layer` (compact): no LOAD will want it."""
        if self.layout == "compact":
            with self._locks[layer]:
                self._stale.pop(layer, None)

    # ---- GRAD_OUT --------------------------------------------------------------------------------
    def receive_grads(self, layer: int, grads: dict[str, torch.Tensor], *, non_blocking: bool = False) -> None:
        """Copy `layer`'s accumulated gradients (any device, compute dtype) into host fp32 memory.

        The `shared_grad` layer takes two shares per step (tied embeddings: the embedding's own
        gradient and the head's gradient of the shared matrix, in either order): the first is
        copied (parameters it lacks are zeroed), the second added in fp32."""
        if layer == self.shared_grad:
            got = self._shares.get(layer, 0)
            if got >= 2:
                raise ValueError(f"layer {layer}: a third gradient share before its OPT_STEP")
            self._shares[layer] = got + 1
            if got == 1:
                dst = self._views(layer, self._grad_flat[layer] if self.layout == "replicated"
                                  else self._slot_of[layer])
                with torch.no_grad():
                    for name, g in grads.items():
                        dst[name].add_(g.to(dst[name].device, dst[name].dtype))
                return
        if self.layout == "replicated":
            dst = self._views(layer, self._grad_flat[layer])
        else:
            if layer in self._slot_of:
                raise ValueError(f"layer {layer}: GRAD_OUT twice before its OPT_STEP")
            if self._free_slots:
                slot = self._free_slots.popleft()
            else:  # more layers wait for the optimizer than the ring has slots: grow, and say so in held()
                slot = self._new_slab([((self._slot_numel,), self.compute_dtype)], "an extra gradient slot").take(
                    (self._slot_numel,), self.compute_dtype)
                self._extra_slots.append(slot)
            self._slot_of[layer] = slot
            dst = self._views(layer, slot)
        with torch.no_grad():
            for n, g in grads.items():
                dst[n].copy_(g, non_blocking=non_blocking)
            if layer == self.shared_grad:
                for n in dst.keys() - grads.keys():
                    dst[n].zero_()

    # ---- OPT_STEP --------------------------------------------------------------------------------
    def step(self, layer: int, *, keep_previous: bool = False) -> None:
        """One AdamW step of `layer` with the gradients its GRAD_OUT delivered.

        `keep_previous`: a LOAD may still ask for the version before this step (asynchronous
        optimizer, and that LOAD has not run yet); keep it uploadable until `drop_stale`.
        """
        if layer == self.shared_grad:
            if self._shares.get(layer, 0) != 2:
                raise ValueError(f"layer {layer}: OPT_STEP with {self._shares.get(layer, 0)} of its 2 gradient "
                                 "shares (its own GRAD_OUT and the tied head's)")
            self._shares[layer] = 0
        slot = None
        if self.layout == "compact":
            slot = self._slot_of.pop(layer, None)
            if slot is None:
                raise ValueError(f"layer {layer}: OPT_STEP before its GRAD_OUT")
        ready = threading.Event()
        with self._locks[layer]:
            self._writing[layer] = ready
        try:
            self._wait_reads(layer)  # uploads still reading this layer's host memory
            if self.layout == "replicated":
                if keep_previous and self._upload_version[layer] != self._steps[layer]:
                    self._refresh_upload(layer)
                ready.set()  # the upload copy holds the version before this step
                self._opt[layer].step()
                with self._locks[layer]:
                    self._steps[layer] += 1
                    if not keep_previous:
                        self._refresh_upload(layer)
                return
            if keep_previous:
                self._snapshot(layer)
            ready.set()
            assert slot is not None
            self._compact_update(layer, slot)
            with self._locks[layer]:
                self._steps[layer] += 1
                if not keep_previous:
                    self._stale.pop(layer, None)
            self._free_slots.append(slot)
        finally:
            with self._locks[layer]:
                del self._writing[layer]
            ready.set()

    def _compact_update(self, layer: int, slot: torch.Tensor) -> None:
        grads = self._views(layer, slot)
        opt, work = self._opt[layer], self._work[layer]
        group = opt.param_groups[0]
        beta1, beta2 = group["betas"]
        for p in self._index[layer]:
            w = work[p.name]
            st = opt.state[w]  # kept in the optimizer so that its state_dict checkpoints the moments
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(w, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(w, memory_format=torch.preserve_format)
            st["step"] += 1
            hi, lo = self._planes(layer, p)
            planes.compact_adamw_step(hi, lo, grads[p.name], st["exp_avg"], st["exp_avg_sq"],
                                      step=int(st["step"].item()), lr=group["lr"], beta1=beta1, beta2=beta2,
                                      eps=group["eps"], weight_decay=group["weight_decay"],
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
        """A fresh fp32 copy of `layer`'s current master weights."""
        if self.layout == "replicated":
            return {n: t.detach().clone() for n, t in self._master[layer].items()}
        hi, lo = self._planes(layer)
        flat = planes.join(hi, lo, torch.empty(self._numel[layer], dtype=torch.float32))
        return self._views(layer, flat)

    def masters(self) -> dict[int, dict[str, torch.Tensor]]:
        return {i: self.master(i) for i in self.layers}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: masters (as held), upload copies, moments, versions.

        The tensors are the live ones, not copies (a copy of an 8B model's state is ~100 GB of host
        memory): write them out before the next step changes them. Checkpoints are taken between
        windows, when no optimizer step runs.
        """
        out: dict[str, Any] = {"layout": self.layout, "steps": dict(self._steps),
                               "optim": {i: self._opt[i].state_dict() for i in self.layers}}
        if self.layout == "replicated":
            out["master"] = {i: {n: t.detach() for n, t in m.items()} for i, m in self._master.items()}
            out["upload"] = dict(self._upload_flat)
            out["upload_version"] = dict(self._upload_version)
        else:
            out["slab"] = self._slab  # torch.save writes the slab's whole storage: the ring and snapshots too
            out["stale"] = {i: (v, t.clone()) for i, (v, t) in self._stale.items()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a loaded checkpoint): the optimizer takes its moment tensors, not copies."""
        if state["layout"] != self.layout or set(state["steps"]) != set(self.layers):
            raise ValueError(f"checkpoint holds layout {state['layout']} for layers {sorted(state['steps'])}; "
                             f"this run has {self.layout} for {list(self.layers)}")
        self._steps = dict(state["steps"])
        with torch.no_grad():
            if self.layout == "replicated":
                for i in self.layers:
                    for n, t in self._master[i].items():
                        t.copy_(state["master"][i][n])
                    self._upload_flat[i].copy_(state["upload"][i])
                self._upload_version = dict(state["upload_version"])
            else:
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
        for i in self.layers:
            self._opt[i].load_state_dict(state["optim"][i])

    def _optim_tensors(self) -> Iterator[torch.Tensor]:
        for opt in self._opt.values():
            for st in opt.state.values():
                yield from (v for v in st.values() if isinstance(v, torch.Tensor))

    def held(self) -> HeldBytes:
        """The bytes this rank's host state really holds now, by purpose."""
        seen: set[int] = set()
        padding = sum(s.padding_bytes for s in self._slabs)  # the views below cover the rest of the slabs
        optim = storage_bytes(self._optim_tensors(), seen)
        if self.layout == "replicated":
            master = storage_bytes((t for m in self._master.values() for t in m.values()), seen)
            upload = view_bytes(self._upload_flat.values())
            grads = view_bytes(self._grad_flat.values())
            return HeldBytes(self.layout, self.params, master, upload, grads, optim, 0, 0, padding)
        master = view_bytes([self._slab])
        grads = view_bytes([self._ring, *self._extra_slots])
        scratch = storage_bytes([self._scratch, self._chunk_scratch], seen)
        stale = (view_bytes(self._snap_region.values()) if self.snapshots
                 else storage_bytes((t for _, t in self._stale.values()), seen))
        return HeldBytes(self.layout, self.params, master, 0, grads, optim, scratch, stale, padding)


def _to(t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """A new tensor on `device` with `t`'s values (a copy even when `device` is the CPU)."""
    if device.type == "cpu":
        return t.clone()
    return t.to(device, non_blocking=non_blocking)
