"""The `replicated` host memory layout (what peers do): per layer an fp32 master, a compute-dtype upload
copy and a full-size fp32 gradient buffer, carved from one pinned slab, plus AdamW moments.

A step that keeps the previous version (asynchronous optimizer) leaves the upload copy at that
version; the next LOAD of the current version refreshes it (an evaluation's, `aside`, casts the master
instead, leaving the kept version to the training uploads still to come).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from tinypipe.policy.modes import HostMemory

from .heldbytes import HeldBytes, storage_bytes, view_bytes
from .state import AdamWConfig, HostState, _to


class ReplicatedHostState(HostState):
    host_memory = HostMemory.REPLICATED

    def __init__(self, params: dict[int, dict[str, torch.Tensor]], *, compute_dtype: torch.dtype,
                 optim: AdamWConfig, pin: bool = False, shared_grad: int | None = None) -> None:
        """Keeps the tensors of `params` as its masters (no copy)."""
        super().__init__(params, compute_dtype=compute_dtype, optim=optim, pin=pin, shared_grad=shared_grad)
        self._master = {i: {n: t.detach() for n, t in params[i].items()} for i in self.layers}
        slab = self._new_slab([((self._numel[i],), self.compute_dtype) for i in self.layers]
                              + [((self._numel[i],), torch.float32) for i in self.layers],
                              "upload copies and gradients")
        self._upload_flat = {i: slab.take((self._numel[i],), self.compute_dtype) for i in self.layers}
        self._grad_flat = {i: slab.take((self._numel[i],), torch.float32) for i in self.layers}
        self._upload_version = {i: 0 for i in self.layers}
        for i in self.layers:
            grads = self._views(i, self._grad_flat[i])
            for n, t in self._master[i].items():
                t.grad = grads[n]
            self._opt[i] = self.optim.make(list(self._master[i].values()), list(self._master[i]))
            self._refresh_upload(i)

    def _refresh_upload(self, layer: int) -> None:
        up = self._views(layer, self._upload_flat[layer])
        with torch.no_grad():
            for n, t in self._master[layer].items():
                up[n].copy_(t)
        self._upload_version[layer] = self._steps[layer]

    def _load_locked(self, layer: int, want: int, device: torch.device, non_blocking: bool, *, writing: bool,
                     aside: bool = False) -> dict[str, torch.Tensor]:
        have = self._steps[layer]
        if self._upload_version[layer] != want:
            if have != want or writing:
                raise self._bad_version(layer, want, f"versions {self._upload_version[layer]} (upload copy) "
                                                     f"and {have} (master)")
            if aside:  # the upload copy keeps the older version training still uploads: cast the master instead
                return {n: _to(t.detach().to(self.compute_dtype), device, non_blocking)
                        for n, t in self._master[layer].items()}
            self._wait_reads(layer)  # uploads of the older version still reading the copy
            self._refresh_upload(layer)
        return {n: _to(v, device, non_blocking) for n, v in self._views(layer, self._upload_flat[layer]).items()}

    def _land_grads(self, layer: int) -> torch.Tensor:
        return self._grad_flat[layer]

    def _grads_of(self, layer: int) -> torch.Tensor:
        return self._grad_flat[layer]

    def _update(self, layer: int, grads: torch.Tensor, *, keep_previous: bool, ready: threading.Event) -> None:
        if keep_previous and self._upload_version[layer] != self._steps[layer]:
            self._refresh_upload(layer)
        ready.set()  # the upload copy holds the version before this step
        self._opt[layer].step()  # the masters' .grad are views of the gradient buffer
        with self._locks[layer]:
            self._steps[layer] += 1
            if not keep_previous:
                self._refresh_upload(layer)

    def master(self, layer: int) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in self._master[layer].items()}

    def _layout_state(self) -> dict[str, Any]:
        return {"master": {i: {n: t.detach() for n, t in m.items()} for i, m in self._master.items()},
                "upload": dict(self._upload_flat), "upload_version": dict(self._upload_version)}

    def _load_layout_state(self, state: dict[str, Any]) -> None:
        for i in self.layers:
            for n, t in self._master[i].items():
                t.copy_(state["master"][i][n])
            self._upload_flat[i].copy_(state["upload"][i])
        self._upload_version = dict(state["upload_version"])

    def _held(self, seen: set[int], optim: int, padding: int) -> HeldBytes:
        master = storage_bytes((t for m in self._master.values() for t in m.values()), seen)
        upload = view_bytes(self._upload_flat.values())
        grads = view_bytes(self._grad_flat.values())
        return HeldBytes(self.host_memory, self.params, master, upload, grads, optim, 0, 0, padding)
