"""The per-rank interpreter: one rank's part of a Schedule, run through a dispatch table keyed by Kind.

See docs/architecture.md. Each handler does what docs/schedule-contract.md says its kind means: LOAD / EVICT move
a layer's weights between the host state and the device; FWD runs a layer without keeping the
graph and keeps its input (or, without recompute, keeps the graph); BWD recomputes from that input
and back-propagates, accumulating the weight gradients on the device; GRAD_OUT hands them to the
host; OPT_STEP runs AdamW there; SEND_F / RECV_F move activations, SEND_B / RECV_B their gradients
between ranks;
OFFLOAD_ACT / FETCH_ACT park a kept input in host memory. `executor.py` decides when each runs.

Values are keyed by (step, layer, microbatch): `x` is the input of a layer, `dx` the gradient with
respect to it. A layer's parameters are handed to its module with `torch.func.functional_call`, so
the modules are structure only and the tensors on the device are exactly what LOAD put there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from tinypipe.ir.kinds import Carries, Kind
from tinypipe.ir.schedule import Action, Schedule, owned_layers

from ..host.adapters import Adapters
from ..host.state import HostState
from ..model.compiled import LayerCaller
from ..model.lora_adapters import frozen_bwd, with_adapters
from .comm import Comm, Handle
from .gradclip import GradClip
from .moe_aux import AuxLoss
from .parking import ParkingLot

Key = tuple[int, int, int]  # (step, layer, microbatch)
Done = tuple[Handle, Callable[[], None]] | None  # an asynchronous handler returns what to wait for


class UnknownKindError(ValueError):
    """An action kind the dispatch table has no handler for."""


class ExecutionError(RuntimeError):
    """The schedule asked for something the rank's state cannot do (names the action)."""


@dataclass
class StepData:
    """One optimizer step's input: (input_ids, labels) per microbatch and the step's loss-token count;
    `documents`: per microbatch, each position's document id, for the decoder blocks' per-document mask."""

    microbatches: list[tuple[torch.Tensor, torch.Tensor]]
    denom: float
    documents: list[torch.Tensor] | None = None


class Interpreter:
    """Device-side state of one rank and the handlers that change it, one per action kind."""

    HANDLERS: ClassVar[dict[Kind, str]] = {
        Kind.LOAD: "_load", Kind.EVICT: "_evict", Kind.FWD: "_fwd", Kind.BWD: "_bwd",
        Kind.SEND_F: "_send", Kind.SEND_B: "_send", Kind.RECV_F: "_recv", Kind.RECV_B: "_recv",
        Kind.OFFLOAD_ACT: "_offload", Kind.FETCH_ACT: "_fetch",
        Kind.GRAD_OUT: "_grad_out", Kind.OPT_STEP: "_opt_step", Kind.ADAPT_STEP: "_adapt_step",
    }

    def __init__(self, *, rank: int, schedule: Schedule, layers: list[nn.Module | None], host: HostState,
                 comm: Comm | None, device: torch.device, hidden_size: int,
                 tied: tuple[str, str] | None = None, caller: LayerCaller | None = None,
                 clip: GradClip | None = None) -> None:
        if schedule.grad_clip != (clip is not None):
            raise ExecutionError("the schedule's grad_clip and the run's --max-grad-norm disagree")
        self.clip = clip
        # an evaluation window (evaluation.evaluate): the schedule's actions run, but GRAD_OUT and ADAPT_STEP drop
        # the gradients and OPT_STEP does nothing, so the head's FWD gives the held-out loss and the host state
        # and the adapters are untouched
        self.evaluating = False
        self.rank = rank
        self.schedule = schedule
        self.layers = layers
        self.host = host
        self.comm = comm
        self.device = device
        self.hidden_size = hidden_size
        self.staleness = schedule.optimizer.staleness  # the schedule's optimizer mode: the one source of truth
        self.caller = caller if caller is not None else LayerCaller()  # compiles the blocks under --compile
        self.compute_dtype = host.compute_dtype
        self.owned = set(owned_layers(schedule, rank))
        self.last_layer = schedule.num_layers - 1
        # tied embeddings: (the shared matrix's name in the head, in the embedding). The head's LOAD
        # adds layer 0's matrix (same version) to its weights; its GRAD_OUT hands that matrix's
        # gradient to layer 0's host gradient, which OPT_STEP 0 then applies (host.shared_grad)
        self.tied = tied if tied is not None and self.last_layer > 0 and self.last_layer in self.owned else None
        if self.tied is not None and 0 not in self.owned:
            raise ExecutionError(f"rank {rank}: the model ties its LM head to the token embedding, so the head "
                                 f"(layer {self.last_layer}) and the embedding (layer 0) must be on one GPU; "
                                 f"this schedule puts them on GPUs {schedule.pack_gpu[-1]} and {schedule.pack_gpu[0]}")
        self.weights: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}  # layer -> (version, tensors)
        self.loads: dict[int, int] = {}  # layer -> LOADs not yet matched by an EVICT
        self.x: dict[Key, torch.Tensor] = {}
        self.dx: dict[Key, torch.Tensor] = {}
        self.graphs: dict[Key, tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]] = {}
        self.grads: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (step, layer) -> accumulator
        self.parked: dict[Key, torch.Tensor] = {}  # inputs offloaded to host memory
        self.parking = ParkingLot(pin=device.type == "cuda", device=device)  # their reusable pinned buffers
        self.losses: dict[tuple[int, int], torch.Tensor] = {}  # (step, microbatch) -> head output
        self.data: dict[int, StepData] = {}
        self.pending_loads: dict[tuple[int, int], int] = {}  # (layer, step) -> LOADs of the window not yet run
        self.use: Callable[[torch.Tensor], None] = lambda t: None  # CUDA: record_stream on the current stream
        self.streams: dict[str, Any] = {}  # CUDA: one stream per resource, kept across windows
        # LoRA (`Schedule.lora`): the adapters on this device, beside a frozen base (backends/model/lora_adapters.py)
        self.adapters: Adapters | None = getattr(host, "adapters", None) if schedule.lora is not None else None
        self.aux = AuxLoss.of(layers, device)  # a MoE model's load-balancing loss (moe_aux.py); None when dense

    # ---- dispatch ----------------------------------------------------------------------------------
    def dispatch(self, a: Action, step: int) -> Done:
        """Run action `a` (of optimizer step `step`); an unknown kind is an error."""
        name = self.HANDLERS.get(a.kind) if isinstance(a.kind, Kind) else None
        if name is None:
            raise UnknownKindError(f"rank {self.rank}: no handler for action kind {getattr(a.kind, 'value', a.kind)!r} "
                                   f"(action {a.id}); known kinds: {', '.join(k.value for k in self.HANDLERS)}")
        handler: Callable[[Action, int], Done] = getattr(self, name)
        return handler(a, step)

    def fail(self, a: Action, why: str) -> ExecutionError:
        return ExecutionError(f"rank {self.rank}: action {a.id} ({a}): {why}")

    def want_version(self, step: int) -> int:
        """Optimizer steps the weights used by `step` include: step under sync, step - 1 under async; 0 for a
        frozen base, which no step changes."""
        return 0 if self.adapters is not None else max(0, step - self.staleness)

    # ---- weights -------------------------------------------------------------------------------------
    def _load(self, a: Action, step: int) -> Done:
        want = self.want_version(step)
        nb = self.device.type == "cuda"
        aside = self.evaluating
        weights = self.host.load(a.layer, want, self.device, non_blocking=nb, aside=aside)
        if self.tied is not None and a.layer == self.last_layer:
            weights[self.tied[0]] = self.host.load(0, want, self.device, non_blocking=nb, aside=aside)[self.tied[1]]
        self.weights[a.layer] = (want, weights)
        self.loads[a.layer] = self.loads.get(a.layer, 0) + 1
        for layer in self.reads(a.layer):
            key = (layer, step)
            self.pending_loads[key] = left = self.pending_loads.get(key, 1) - 1
            if left <= 0 and self.host.version(layer) > want:
                self.host.drop_stale(layer)  # the last upload of an older version
        return None

    def reads(self, layer: int) -> tuple[int, ...]:
        """The layers whose host weights a LOAD of `layer` reads (a tied head also reads layer 0's)."""
        return (layer, 0) if self.tied is not None and layer == self.last_layer else (layer,)

    def _evict(self, a: Action, step: int) -> Done:
        """Drop the layer's weights; a layer LOADed again before this EVICT stays until the next one."""
        n = self.loads.get(a.layer, 0)
        if n == 0:
            raise self.fail(a, "the layer is not on the device")
        self.loads[a.layer] = n - 1
        if n == 1:
            del self.weights[a.layer]
        return None

    def _weights(self, a: Action, step: int) -> dict[str, torch.Tensor]:
        have = self.weights.get(a.layer)
        if have is None:
            raise self.fail(a, "the layer's weights are not on the device (no LOAD before it)")
        if have[0] != self.want_version(step):
            raise self.fail(a, f"the weights on the device are version {have[0]}, step {step} needs "
                               f"{self.want_version(step)} (no LOAD after the optimizer step)")
        for t in have[1].values():
            self.use(t)
        return have[1]

    # ---- compute ---------------------------------------------------------------------------------------
    def _inputs(self, a: Action, step: int) -> tuple[torch.Tensor, tuple[Any, ...]]:
        """The layer's input (token ids for the embedding) and the extra arguments of its forward."""
        L, m = a.layer, a.microbatch
        assert L is not None and m is not None
        sd = self.data[step]
        if L == 0:
            return sd.microbatches[m][0].to(self.device), ()
        x = self.x.get((step, L, m))
        if x is None:
            raise self.fail(a, f"no input for layer {L} microbatch {m} (missing FWD, RECV or FETCH_ACT before it)")
        self.use(x)
        if L == self.last_layer:
            return x, (sd.microbatches[m][1].to(self.device), sd.denom)
        return x, (() if sd.documents is None else (sd.documents[m].to(self.device),))

    def _call(self, L: int, weights: dict[str, torch.Tensor], x: torch.Tensor, extra: tuple[Any, ...]) -> torch.Tensor:
        module = self.layers[L]
        assert module is not None
        return self.caller(module, weights, (x, *extra))

    def _fwd(self, a: Action, step: int) -> Done:
        L, m = a.layer, a.microbatch
        assert L is not None and m is not None
        weights = self._weights(a, step)
        if self.adapters is not None:  # a frozen base: its adapters compute beside it, and only they are leaves
            weights = with_adapters(self, L, weights)
        x, extra = self._inputs(a, step)
        if self.schedule.recomputes(L):
            with torch.no_grad():
                out = self._call(L, weights, x, extra)
        else:
            xin = x.detach().requires_grad_() if L > 0 else None
            leaves = ({n: w.detach().requires_grad_() for n, w in weights.items()} if self.adapters is None
                      else weights)
            with torch.enable_grad():
                out = self._call(L, leaves, x if xin is None else xin, extra)
            self.graphs[(step, L, m)] = (out, xin, leaves)
        if L == self.last_layer:
            self.losses[(step, m)] = out.detach()
        else:
            self.x[(step, L + 1, m)] = out.detach()
        if self.aux is not None:  # a MoE block's routing statistics; at the head, the aux loss it reports
            self.aux.after_fwd(self, a, step)
        return None

    def output_grad(self, a: Action, step: int) -> torch.Tensor | None:
        """The gradient of `a.layer`'s output for `a.microbatch` (None for the last layer, whose loss starts it)."""
        L, m = a.layer, a.microbatch
        if L == self.last_layer or L is None or m is None:
            return None
        dy = self.dx.pop((step, L + 1, m), None)
        if dy is None:
            raise self.fail(a, f"no gradient for the output of layer {L} microbatch {m}")
        self.use(dy)
        return dy

    def _bwd(self, a: Action, step: int) -> Done:
        if self.adapters is not None:
            frozen_bwd(self, a, step)
            return None
        L, m = a.layer, a.microbatch
        assert L is not None and m is not None
        dy = self.output_grad(a, step)  # None for the last layer
        if self.schedule.recomputes(L):
            weights = self._weights(a, step)
            x, extra = self._inputs(a, step)
            xin = x.detach().requires_grad_() if L > 0 else None
            leaves = {n: w.detach().requires_grad_() for n, w in weights.items()}
            with torch.enable_grad():
                out = self._call(L, leaves, x if xin is None else xin, extra)
        else:
            if (step, L, m) not in self.graphs:
                raise self.fail(a, "no forward graph kept for it (FWD missing)")
            out, xin, leaves = self.graphs.pop((step, L, m))
        self.x.pop((step, L, m), None)
        inputs = ([xin] if xin is not None else []) + list(leaves.values())
        outs, grads = ([out], [dy]) if self.aux is None else self.aux.backward_outputs(self, a, step, out, dy)
        acc = self.grads.get((step, L))
        if acc is None:  # the layer's first BWD of the step: its gradients become the accumulator
            with torch.enable_grad():
                got = torch.autograd.grad(outs, inputs, grad_outputs=grads)
            self.grads[(step, L)] = dict(zip(leaves, got[1:] if xin is not None else got))
            if xin is not None:
                self.dx[(step, L, m)] = got[0]
            return None
        # later ones add into it in place as autograd makes each weight's gradient (AccumulateGrad), so
        # one weight's fresh gradient is transient at a time, not the layer's (a compiled block's
        # backward still returns them all at once: the profile measures which)
        for n, leaf in leaves.items():
            leaf.grad = acc[n]
        with torch.enable_grad():
            torch.autograd.backward(outs, grad_tensors=grads, inputs=inputs)
        for n, leaf in leaves.items():  # autograd keeps the same tensor; were it to replace it, take the new one
            assert leaf.grad is not None
            acc[n] = leaf.grad
        if xin is not None:
            assert xin.grad is not None
            self.dx[(step, L, m)] = xin.grad
        return None

    # ---- host transfers ----------------------------------------------------------------------------------
    def _grad_out(self, a: Action, step: int) -> Done:
        grads = self.grads.pop((step, a.layer), None)
        if grads is None:
            raise self.fail(a, "no accumulated gradients (no BWD of this layer in this step)")
        for g in grads.values():
            self.use(g)
        if self.evaluating:  # an evaluation window: the gradients go nowhere
            return None
        if self.tied is not None and a.layer == self.last_layer:
            share = grads.pop(self.tied[0])
            self.host.receive_grads(0, {self.tied[1]: share}, non_blocking=self.device.type == "cuda")
        self.host.receive_grads(a.layer, grads, non_blocking=self.device.type == "cuda")
        return None

    def _opt_step(self, a: Action, step: int) -> Done:
        if self.evaluating:
            return None
        if self.host.version(a.layer) != step:
            raise self.fail(a, f"the host holds version {self.host.version(a.layer)} of the layer, "
                               f"step {step}'s update needs {step}")
        # asynchronous: the next step's uploads read the weights before this update; keep them
        # when one of those uploads is still to come (outside this window, or not yet run)
        nxt = self.pending_loads.get((a.layer, step + 1))
        keep = self.staleness > 0 and (nxt is None or nxt > 0)
        scale = 1.0 if self.clip is None else self.clip.coefficient(step)
        self.host.step(a.layer, keep_previous=keep, at_step=step, grad_scale=scale)
        return None

    def _adapt_step(self, a: Action, step: int) -> Done:
        """The layer's adapters' AdamW on this device, with the gradients its BWDs of `step` accumulated; clipped
        by the global norm, whose all-reduce the rank's first adapter step of `step` meets (a rank whose layers
        have no adapters has one empty step for it: `compiler.optimizer.adapter_pass`)."""
        if self.adapters is None:
            raise self.fail(a, "an adapter step, but the schedule trains no LoRA adapters")
        if self.evaluating:  # the evaluation's backward made them; they go nowhere
            self.adapters.drop_grads(a.layer)
            return None
        scale = 1.0 if self.clip is None else self.clip.coefficient(step)
        if self.clip is None or self.adapters.of(a.layer):
            self.adapters.step(a.layer, at_step=step, grad_scale=scale)
        return None

    def _key(self, a: Action, step: int) -> tuple[int, int, int]:
        """(step, layer, microbatch) of the buffer a per-microbatch action moves."""
        if a.microbatch is None:
            raise self.fail(a, "needs a microbatch")
        return step, a.layer, a.microbatch

    def _offload(self, a: Action, step: int) -> Done:
        key = self._key(a, step)
        x = self.x.pop(key, None)
        if x is None:
            raise self.fail(a, "no kept input to offload")
        self.use(x)
        host = self.parking.take(x.shape, x.dtype)
        host.copy_(x, non_blocking=self.device.type == "cuda")
        self.parked[key] = host
        return None

    def _fetch(self, a: Action, step: int) -> Done:
        key = self._key(a, step)
        host = self.parked.pop(key, None)
        if host is None:
            raise self.fail(a, "no offloaded input to fetch")
        self.x[key] = host.to(self.device, non_blocking=True) if self.device.type == "cuda" else host.clone()
        self.parking.give_back(host)
        return None

    # ---- between ranks ---------------------------------------------------------------------------------
    def _store(self, a: Action) -> dict[Key, torch.Tensor]:
        """Where a SEND / RECV half's tensor lives: `dx` for a gradient (SEND_B / RECV_B), else `x`."""
        return self.dx if a.kind.info.carries is Carries.GRADIENT else self.x

    def _send(self, a: Action, step: int) -> Done:
        if self.comm is None or a.peer is None:
            raise self.fail(a, "a SEND needs a peer and a communicator")
        t = self._store(a).pop(self._key(a, step), None)
        if t is None:
            raise self.fail(a, "nothing to send (the FWD / BWD producing it has not run)")
        self.use(t)
        sent = self.comm.isend(t.contiguous(), a.peer)  # a MoE model's routing sums follow (moe_aux.py)
        return (sent if self.aux is None else self.aux.send(self.comm, a.peer, self._key(a, step), sent)), lambda: None

    def _recv(self, a: Action, step: int) -> Done:
        if self.comm is None or a.peer is None:
            raise self.fail(a, "a RECV needs a peer and a communicator")
        mb = self.data[step].microbatches[a.microbatch or 0][0]
        buf = torch.empty((*mb.shape, self.hidden_size), dtype=self.compute_dtype, device=self.device)
        store = self._store(a)
        key = self._key(a, step)

        def arrived() -> None:
            store[key] = buf

        got = self.comm.irecv(buf, a.peer)
        return (got, arrived) if self.aux is None else self.aux.recv(self.comm, a.peer, key, got, arrived)

    # ---- accounting -----------------------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Bytes of the tensors this rank holds on its device (weights, activations, gradients; LoRA adapters)."""
        seen: set[int] = set()
        total = 0
        pools: list[Any] = [w for _, w in self.weights.values()] + list(self.grads.values())
        tensors = [t for pool in pools for t in pool.values()] + list(self.x.values()) + list(self.dx.values())
        for t in tensors:
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total + (self.adapters.device_bytes() if self.adapters is not None else 0)

    def leftovers(self) -> list[str]:
        """What is still held at the end of a step that should not be (for checks)."""
        out = [f"x{k}" for k in self.x] + [f"dx{k}" for k in self.dx] + [f"graph{k}" for k in self.graphs]
        out += [f"grads{k}" for k in self.grads] + [f"parked{k}" for k in self.parked]
        return out
