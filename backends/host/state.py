"""Host state of the layers one rank owns: fp32 masters, what is uploaded, gradient landing, AdamW.

This module holds what both layouts share (`HostState`); each layout is its own module
(`replicated.py`, `compact.py`), and `layouts.make_host_state` picks one by name.

Two layouts (docs/architecture.md; the formulas they are checked against live in `tinypipe.estimate.hostmem`):

`replicated` (what peers do): per layer an fp32 master, a separate compute-dtype upload copy and a
full-size fp32 gradient buffer (one block each per layer), AdamW moments. Unlike peers, whose
pinned allocator rounds each block up to a power of two (`hostmem` models that rounding), the
blocks are carved from one slab, so they hold only alignment padding.

`compact`: the fp32 masters of all owned layers as two 16-bit planes in one slab. The high plane
*is* the bf16 value (truncated) and is uploaded as it is; the low plane restores the fp32 bits for
the optimizer, which joins the planes, runs AdamW and splits them again, one parameter tensor at
a time and within it in cache-sized chunks (`planes.compact_adamw_step`, bit-identical to torch's
fused AdamW on the joined tensor). Gradients land in a small ring of
slots (each the size of the largest owned layer) instead of a model-sized buffer; when clipping by the
global norm, in a region per layer (the norm needs them all before any step). With an fp32
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

import dataclasses
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch

from tinypipe.policy.modes import HostMemory

from . import fused_host_adamw
from .adamw import AdamWConfig as AdamWConfig  # the settings a HostState steps with, importable with it
from .gradnorm import GradSquares
from .heldbytes import HeldBytes, storage_bytes, view_bytes
from .pinned import PinnedSlab, Request

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _Param:
    """Where one parameter tensor lives in its layer's flat blocks: offset, size, shape."""

    __slots__ = ("name", "offset", "numel", "shape")

    def __init__(self, name: str, offset: int, numel: int, shape: torch.Size) -> None:
        self.name, self.offset, self.numel, self.shape = name, offset, numel, shape


class HostState:
    """Host state of one rank's layers under one host memory layout (`ReplicatedHostState`, `CompactHostState`;
    `layouts.make_host_state` picks one by name): versions, locking beside the optimizer thread,
    gradient shares of a tied layer, checkpoints and the bytes held. See the module docstring.

    `params`: {layer: {name: fp32 tensor}} (e.g. `LayerStack.state()`).
    """

    host_memory: ClassVar[HostMemory]
    snapshots = False  # previous-version regions carved in advance (compact + asynchronous optimizer)

    def __init__(self, params: dict[int, dict[str, torch.Tensor]], *, compute_dtype: torch.dtype,
                 optim: AdamWConfig, pin: bool = False, shared_grad: int | None = None) -> None:
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
        # the second share, copied into pinned staging as it arrives (the device's copy engine, no
        # host wait) and added by the step: (staging views by name) per pending step, oldest first
        self._second: dict[int, deque[dict[str, torch.Tensor]]] = {}
        self._staging_free: list[dict[str, torch.Tensor]] = []  # staging buffers whose share was added
        self._staging_all: list[dict[str, torch.Tensor]] = []
        self._merged: set[int] = set()  # the shared layer, once its second share is in its gradient before its step
        self._landed_sq: dict[int, float] = {}  # layer -> its landed gradient's squares, until its step
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
        # The optimizer step runs on its own thread (backends/rank/hostwork.py) while the issuing thread
        # uploads other layers, and under the asynchronous optimizer the same layer's older version.
        # `_locks[layer]` guards the layer's version bookkeeping; `_writing[layer]` exists while a step
        # updates the layer (set once its snapshot is taken); `_reads[layer]` holds CUDA events of
        # uploads still reading the layer's host memory, which a step waits for before writing it.
        self._locks = {i: threading.Lock() for i in self.layers}  # per layer: other layers never wait
        self._writing: dict[int, threading.Event] = {}
        self._reads: dict[int, list[Any]] = {}
        self._slabs: list[PinnedSlab] = []  # the pinned slab, then any the layout adds later
        self._opt: dict[int, torch.optim.Optimizer] = {}
        self.grad_squares = GradSquares(len(self.layers))  # per step, this rank's share of the gradient norm
        self.measure_grad_norm = True  # one more pass over each layer's gradients (bench/grad_norm_cost.py)

    def _views(self, layer: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {p.name: flat[p.offset:p.offset + p.numel].view(p.shape) for p in self._index[layer]}

    def _new_slab(self, requests: Sequence[Request], what: str) -> PinnedSlab:
        slab = PinnedSlab(requests, pin=self.pin, what=f"the host state of layers {list(self.layers)}: {what}")
        self._slabs.append(slab)
        return slab

    # ---- versions --------------------------------------------------------------------------------
    def version(self, layer: int) -> int:
        """Optimizer steps applied to `layer` so far."""
        return self._steps[layer]

    def _bad_version(self, layer: int, want: int, have: str) -> ValueError:
        return ValueError(f"layer {layer}: a LOAD wants the weights after {want} optimizer steps, but the host "
                          f"holds {have} (the schedule's LOAD/OPT_STEP dependencies do not match the "
                          f"optimizer mode)")

    # ---- LOAD ------------------------------------------------------------------------------------
    def load(self, layer: int, want: int, device: torch.device, *, non_blocking: bool = False, aside: bool = False
             ) -> dict[str, torch.Tensor]:
        """New tensors on `device`, in the compute dtype, holding `layer`'s weights at version `want`.

        Safe beside a `step` of the same layer on another thread: while the step writes, `want`
        equal to the version before it is served from the snapshot the step took first. `aside`: an
        upload outside training's order (an evaluation) that leaves every kept older version in place
        for the training uploads still to come."""
        while True:
            with self._locks[layer]:
                busy = self._writing.get(layer)
                if busy is None or busy.is_set() or want != self._steps[layer]:
                    out = self._load_locked(layer, want, device, non_blocking, writing=busy is not None, aside=aside)
                    if device.type == "cuda" and non_blocking:  # the copies read host memory until this
                        ev = torch.cuda.Event()
                        ev.record(torch.cuda.current_stream(device))
                        self._reads.setdefault(layer, []).append(ev)
                    return out
            busy.wait()  # the step is taking the snapshot this upload wants

    def _load_locked(self, layer: int, want: int, device: torch.device, non_blocking: bool, *, writing: bool,
                     aside: bool = False) -> dict[str, torch.Tensor]:
        """`load` with the layer's lock held; `writing`: a step of this layer is under way; `aside`: as `load`."""
        raise NotImplementedError

    def _wait_reads(self, layer: int) -> None:
        for ev in self._reads.pop(layer, []):
            ev.synchronize()

    def drop_stale(self, layer: int) -> None:
        """Free the kept previous version of `layer`, if the layout keeps one: no LOAD will want it."""

    # ---- GRAD_OUT --------------------------------------------------------------------------------
    def receive_grads(self, layer: int, grads: dict[str, torch.Tensor], *, non_blocking: bool = False) -> None:
        """Copy `layer`'s accumulated gradients (any device, compute dtype) into host memory.

        The `shared_grad` layer takes two shares per step (tied embeddings: the embedding's own
        gradient and the head's gradient of the shared matrix, in either order): the first is
        copied (parameters it lacks are zeroed); the second is copied into pinned staging and added
        by the layer's `step`, so the issuing thread never waits for it (a synchronous copy and
        add of Qwen3-1.7B's 311M-parameter matrix took 0.54 s per step on an H200 host)."""
        if layer == self.shared_grad:
            got = self._shares.get(layer, 0)
            if got >= 2:
                raise ValueError(f"layer {layer}: a third gradient share before its OPT_STEP")
            self._shares[layer] = got + 1
            if got == 1:
                with self._locks[layer]:
                    staged = self._staging(grads)
                with torch.no_grad():
                    for name, g in grads.items():
                        staged[name].copy_(g, non_blocking=non_blocking)
                with self._locks[layer]:
                    self._second.setdefault(layer, deque()).append(staged)
                return
        dst = self._views(layer, self._land_grads(layer))
        with torch.no_grad():
            for n, g in grads.items():
                dst[n].copy_(g, non_blocking=non_blocking)
            if layer == self.shared_grad:
                for n in dst.keys() - grads.keys():
                    dst[n].zero_()

    def _staging(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pinned buffers shaped like `grads` (one set per share still waiting for its step; reused)."""
        shape = {n: (tuple(g.shape), g.dtype) for n, g in grads.items()}
        for k, buf in enumerate(self._staging_free):
            if {n: (tuple(t.shape), t.dtype) for n, t in buf.items()} == shape:
                return self._staging_free.pop(k)
        slab = self._new_slab([(sh, dt) for sh, dt in shape.values()], "staging for a tied gradient's second share")
        buf = {n: slab.take(sh, dt) for n, (sh, dt) in shape.items()}
        self._staging_all.append(buf)
        return buf

    def _add_second_share(self, layer: int, grads: torch.Tensor) -> None:
        """Add the oldest staged second share of `layer` into its gradients (the step's flat buffer), unless
        `landed_grad_sq` has added it already for this step."""
        if layer in self._merged:
            self._merged.discard(layer)
            return
        with self._locks[layer]:
            pending = self._second.get(layer)
            staged = pending.popleft() if pending else None
        if staged is None:
            return
        dst = self._views(layer, grads)
        with torch.no_grad():
            for name, g in staged.items():
                dst[name].add_(g.to(dst[name].dtype))
        with self._locks[layer]:
            self._staging_free.append(staged)

    def _land_grads(self, layer: int) -> torch.Tensor:
        """The flat buffer `layer`'s gradients are copied into now (GRAD_OUT)."""
        raise NotImplementedError

    def _grads_of(self, layer: int) -> torch.Tensor:
        """The flat buffer holding `layer`'s gradients since its GRAD_OUT."""
        raise NotImplementedError

    # ---- OPT_STEP --------------------------------------------------------------------------------
    def step(self, layer: int, *, keep_previous: bool = False, at_step: int | None = None,
             grad_scale: float = 1.0) -> None:
        """One AdamW step of `layer` with the gradients its GRAD_OUT delivered.

        `keep_previous`: a LOAD may still ask for the version before this step (asynchronous
        optimizer, and that LOAD has not run yet); keep it uploadable until `drop_stale`.
        `at_step`: the training step this update belongs to, for the learning-rate schedule.
        `grad_scale`: the gradients are multiplied by it first (clipping by the global norm).
        """
        if at_step is not None:
            for group in self._opt[layer].param_groups:
                group["lr"] = self.optim.lr_at(at_step)
        if layer == self.shared_grad:
            if self._shares.get(layer, 0) != 2:
                raise ValueError(f"layer {layer}: OPT_STEP with {self._shares.get(layer, 0)} of its 2 gradient "
                                 "shares (its own GRAD_OUT and the tied head's)")
            self._shares[layer] = 0
        grads = self._take_grads(layer)
        if layer == self.shared_grad:
            self._add_second_share(layer, grads)  # its copy ended before the step was called
        landed = self._landed_sq.pop(layer, None)
        if at_step is not None and self.measure_grad_norm:
            self.grad_squares.add(at_step, self._sq(grads, layer) if landed is None else landed)
        if grad_scale != 1.0:
            grads[: self._numel[layer]].mul_(grad_scale)
        ready = threading.Event()
        with self._locks[layer]:
            self._writing[layer] = ready
        try:
            self._wait_reads(layer)  # uploads still reading this layer's host memory
            self._update(layer, grads, keep_previous=keep_previous, ready=ready)
        finally:
            with self._locks[layer]:
                del self._writing[layer]
            ready.set()

    def _sq(self, flat: torch.Tensor, layer: int) -> float:
        grads = flat[: self._numel[layer]]
        fused = fused_host_adamw.sum_squares(grads)  # one pass, in double
        return fused if fused is not None else float(torch.linalg.vector_norm(grads, dtype=torch.float32)) ** 2

    def take_grad_sq(self) -> dict[int, float]:
        """Per step all layers here have stepped since the last call: the sum of their gradients' squares."""
        return self.grad_squares.take()

    def landed_grad_sq(self, layer: int) -> float:
        """The sum of squares of `layer`'s gradients now on the host (its GRAD_OUT done, its step not yet; for
        the shared layer of a tied model, both shares, added here so that the matrix counts once, summed, as
        in torch.nn.utils.clip_grad_norm_ over the model's parameters). Its step reuses the figure."""
        grads = self._grads_of(layer)
        if layer == self.shared_grad and layer not in self._merged:
            if self._shares.get(layer, 0) != 2:
                raise ValueError(f"layer {layer}: the gradient norm with {self._shares.get(layer, 0)} of its 2 "
                                 "gradient shares landed (its own GRAD_OUT and the tied head's)")
            self._add_second_share(layer, grads)
            self._merged.add(layer)
        sq = self._landed_sq[layer] = self._sq(grads, layer)
        return sq

    def _take_grads(self, layer: int) -> torch.Tensor:
        """`layer`'s gradients for its step (an error if its GRAD_OUT has not delivered them)."""
        return self._grads_of(layer)

    def _update(self, layer: int, grads: torch.Tensor, *, keep_previous: bool, ready: threading.Event) -> None:
        """Apply the step and count the version; set `ready` once a LOAD of the version before the
        step can be served without waiting (the kept copy is in place)."""
        raise NotImplementedError

    # ---- reading, saving -------------------------------------------------------------------------
    def master(self, layer: int) -> dict[str, torch.Tensor]:
        """A fresh fp32 copy of `layer`'s current master weights."""
        raise NotImplementedError

    def masters(self) -> dict[int, dict[str, torch.Tensor]]:
        return {i: self.master(i) for i in self.layers}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: masters (as held), upload copies, moments, versions.

        The tensors are the live ones, not copies (a copy of an 8B model's state is ~100 GB of host
        memory): write them out before the next step changes them. Checkpoints are taken between
        windows, when no optimizer step runs.
        """
        return {"host_memory": self.host_memory.value, "steps": dict(self._steps),
                "optim": {i: self._opt[i].state_dict() for i in self.layers}, **self._layout_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a loaded checkpoint): the optimizer takes its moment tensors, not copies."""
        if state["host_memory"] != self.host_memory or set(state["steps"]) != set(self.layers):
            raise ValueError(f"checkpoint holds host memory {state['host_memory']} for layers "
                             f"{sorted(state['steps'])}; "
                             f"this run has {self.host_memory} for {list(self.layers)}")
        self._steps = dict(state["steps"])
        with torch.no_grad():
            self._load_layout_state(state)
        for i in self.layers:
            self._load_optim(i, state["optim"][i])

    def _load_optim(self, layer: int, saved: dict[str, Any]) -> None:
        """Continue `layer`'s optimizer from its saved state_dict."""
        self._opt[layer].load_state_dict(saved)

    def _layout_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_layout_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _optim_tensors(self) -> Iterator[torch.Tensor]:
        for opt in self._opt.values():
            for st in opt.state.values():
                yield from (v for v in st.values() if isinstance(v, torch.Tensor))

    def held(self) -> HeldBytes:
        """The bytes this rank's host state really holds now, by purpose."""
        seen: set[int] = set()
        padding = sum(s.padding_bytes for s in self._slabs)  # the views below cover the rest of the slabs
        optim = storage_bytes(self._optim_tensors(), seen)
        held = self._held(seen, optim, padding)
        staging = view_bytes(t for buf in self._staging_all for t in buf.values())  # a tied matrix's second share
        return dataclasses.replace(held, grad_bytes=held.grad_bytes + staging) if staging else held

    def _held(self, seen: set[int], optim: int, padding: int) -> HeldBytes:
        raise NotImplementedError


def _to(t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """A new tensor on `device` with `t`'s values (a copy even when `device` is the CPU)."""
    if device.type == "cpu":
        return t.clone()
    return t.to(device, non_blocking=non_blocking)
