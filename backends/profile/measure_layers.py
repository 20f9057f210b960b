"""Measure one layer of each kind through the interpreter's own FWD / BWD handlers -> a ProfileTrace.

The model is built as `tinypipe run` builds it (`hf.build_model`, only the embedding, the first
block and the head: a model's blocks are identical), its weights go into a `HostState` and reach
the device through the interpreter's LOAD, exactly as in a run. Two interpreters share them: one
whose schedule keeps activations (FWD keeps the graph, BWD back-propagates through it) and one
that recomputes (FWD runs without a graph, BWD re-runs the forward from the saved input, then
back-propagates). Each action is dispatched as a run dispatches it, so what is timed is the run's
code, Python overhead included, which is most of a small layer's time on a CPU.

Per layer kind and microbatch (microbatch_size x seq_len tokens), after `warmup` unmeasured runs,
the median of `repeat`:
- fwd_s: FWD with the graph kept; bwd_s: BWD from kept activations; recompute_bwd_s: a recomputing
  BWD. The head is never recomputed by a schedule (`schedule.recomputes`), so its recompute_bwd_s
  is fwd_s + bwd_s, as in the shipped traces. Clock: CUDA events on the current stream, else
  `time.perf_counter` around the handler.
- saved_act_bytes: the distinct storages autograd saves during a graph-keeping FWD
  (`torch.autograd.graph.saved_tensors_hooks`), parameters excluded (the layer input, labels and
  token ids count: autograd holds them). saved_act_bytes_recompute: the layer input (0 for the
  embedding, whose input is the token ids).
- workspace_bytes, CUDA: the largest transient above what the ledger counts by name -- a FWD's
  peak above its start less its output and saved bytes; a BWD's peak above its start less the
  gradients it returns (weights and input); a recomputing BWD's peak less those and the re-created
  saved bytes and output. accumulate_workspace_bytes: the same for a BWD that adds into the
  layer's existing gradient accumulator (a microbatch after the first), less only the input
  gradient: the weights' fresh gradients before they are added are its transient. On a CPU there
  is no allocator peak to read: both are None here and the trace takes tinypipe.describe.trace's analytic
  formulas (see `kind_profile`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count

import torch

from tinypipe.describe.layershape import model_shapes
from tinypipe.describe.model import LayerKind, ModelSpec, head_workspace_bytes, head_workspace_fixed_bytes
from tinypipe.describe.optimprofile import OptimizerProfile
from tinypipe.describe.trace import WORKSPACE_FRACTION, KindProfile, ProfileTrace
from tinypipe.ir.schedule import Action, Kind, Schedule, gpu_resource
from tinypipe.policy.lora_spec import LoraSpec, lora_text
from tinypipe.policy.modes import HostMemory

from ..host.frozen import frozen_host_state
from ..host.layouts import make_host_state
from ..host.state import DTYPES, AdamWConfig, HostState
from ..model.compiled import LayerCaller
from ..model.hf import build_model
from ..rank.interpreter import Interpreter, StepData
from ..rank.worker import strip_parameters

STEP, MB = 0, 0  # every measured action belongs to step 0, microbatch 0


@dataclass(frozen=True)
class KindMeasurement:
    """One layer kind at one microbatch size, as measured (times are medians, in seconds)."""

    kind: str  # "embed" | "block" | "head"
    layer: int  # the layer index it was measured on
    tokens: int
    fwd_s: float  # FWD with the graph kept
    fwd_nograd_s: float  # FWD without a graph (what a recomputing schedule's FWD runs)
    bwd_s: float
    recompute_bwd_s: float
    saved_bytes: int
    input_bytes: int  # 0 for the embedding (its input is token ids)
    workspace_bytes: int | None  # None where the device has no allocator peak to read (CPU)
    accumulate_workspace_bytes: int | None = None  # a later BWD's (into the accumulator); None as above


def kind_profile(m: KindMeasurement, spec: ModelSpec, optimizer: OptimizerProfile | None = None) -> KindProfile:
    """The trace's entry for one measured kind (and its host optimizer step, when measured: optim.py); on a
    CPU the workspace is tinypipe.describe.trace's analytic one (WORKSPACE_FRACTION x the measured saved bytes; the
    head's chunked-loss formula)."""
    head = m.kind == LayerKind.HEAD.value
    fixed = head_workspace_fixed_bytes(spec, m.tokens) if head else 0
    if m.workspace_bytes is None:
        ws = head_workspace_bytes(spec, m.tokens) if head else math.ceil(WORKSPACE_FRACTION * m.saved_bytes)
    else:
        ws, fixed = m.workspace_bytes, min(fixed, m.workspace_bytes)
    return KindProfile(fwd_s=m.fwd_s, bwd_s=m.bwd_s, recompute_bwd_s=m.recompute_bwd_s,
                       saved_act_bytes=m.saved_bytes, saved_act_bytes_recompute=m.input_bytes,
                       workspace_bytes=ws, workspace_fixed_bytes=fixed, optimizer=optimizer,
                       accumulate_workspace_bytes=m.accumulate_workspace_bytes)


def profile_trace(measured: list[KindMeasurement], spec: ModelSpec, *, gpu_model: str, dtype: str,
                  microbatch_size: int, seq_len: int, repeat: int, warmup: int, on: str, when: str,
                  compiled: bool = False, optimizer: Mapping[str, OptimizerProfile] | None = None,
                  optimizer_source: str = "", lora: LoraSpec | None = None) -> ProfileTrace:
    """The ProfileTrace of one microbatch size, with a `source` saying what was measured, how, when, on what;
    `optimizer`: the host optimizer step per kind (optim.py), described by `optimizer_source`."""
    by_kind = {m.kind: m for m in measured}
    cuda = all(m.workspace_bytes is not None for m in measured)
    ms = "; ".join(f"{m.kind} (layer {m.layer}): fwd {m.fwd_s * 1e3:.4g}, no-grad fwd {m.fwd_nograd_s * 1e3:.4g}, "
                   f"bwd {m.bwd_s * 1e3:.4g}, recompute+bwd {m.recompute_bwd_s * 1e3:.4g} ms, saved "
                   f"{m.saved_bytes:,} B" for m in measured)
    workspace = ("workspace_bytes: the allocator's peaks above what the schedule's ledger names (FWD: less its "
                 "output and saved bytes; BWD: less the gradients it returns; recomputing BWD: less those, the "
                 "re-created saved bytes and output), the largest; accumulate_workspace_bytes: the same for a BWD into "
                 "an existing gradient accumulator, less only the input gradient; the head's workspace_fixed_bytes: "
                 "tinypipe.describe.model.head_workspace_fixed_bytes, at most the measured workspace" if cuda else
                 f"workspace_bytes NOT measured (a CPU has no allocator peak): analytic, {WORKSPACE_FRACTION} x the "
                 "measured saved bytes; head: tinypipe.describe.model.head_workspace_bytes "
                 "(fixed part: one chunk of logits)")
    source = (f"measured by `tinypipe profile` on {on}, {when}: {spec.name}, {dtype}, {microbatch_size} x {seq_len} "
              f"tokens per microbatch; one layer of each kind run through the backend interpreter's FWD / BWD "
              f"handlers (weights LOADed from a HostState as in a run"
              f"{'; the block torch.compiled as `run --compile` runs it' if compiled else ''}"
              f"{f'; a frozen base with LoRA {lora.text()}: BWD makes the input and adapter gradients' if lora else ''}"
              f"); times: median of "
              f"{repeat} after {warmup} warm-up runs, {'CUDA events' if cuda else 'time.perf_counter'}; fwd_s: FWD "
              f"keeping the graph; bwd_s: "
              f"BWD from kept activations; recompute_bwd_s: BWD that re-runs the forward from the saved input (head: "
              f"fwd + bwd, no schedule recomputes it); saved_act_bytes: distinct storages autograd saved in the "
              f"forward (saved_tensors_hooks), parameters excluded; saved_act_bytes_recompute: the layer input (0 for "
              f"the embedding); {workspace}. Measured: {ms}"
              + (f". Host optimizer: {optimizer_source}" if optimizer else ""))
    return ProfileTrace(gpu_model=gpu_model, dtype=dtype, microbatch_size=microbatch_size, seq_len=seq_len,
                        kinds={k: kind_profile(by_kind[k], spec, (optimizer or {}).get(k))
                               for k in (x.value for x in LayerKind)},
                        analytic=False, source=source, model=spec.name, compiled=compiled, layers=model_shapes(spec),
                        lora=lora_text(lora))


class _Clock:
    """Seconds of one call: CUDA events on the current stream, else the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3


class _Peak:
    """CUDA: the allocator's peak above the bytes allocated when `measure` was entered; CPU: None."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes: int | None = None

    @contextmanager
    def measure(self) -> Iterator[None]:
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        torch.cuda.synchronize(self.device)
        self.bytes = torch.cuda.max_memory_allocated(self.device) - base


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class LayerBench:
    """A model's embedding, first block and head on one device, driven action by action."""

    def __init__(self, model: str, *, device: torch.device, dtype: str, seed: int = 0,
                 compile_blocks: bool = False, lora: LoraSpec | None = None) -> None:
        probe = build_model(model, seed=seed, only=set())
        last = len(probe.spec.layers) - 1
        self.layers = {LayerKind.EMBED.value: 0, LayerKind.BLOCK.value: 1, LayerKind.HEAD.value: last}
        stack = build_model(model, seed=seed, only=set(self.layers.values()))
        self.spec, self.device, self.last, self.tied = stack.spec, device, last, stack.tied
        self.lora = lora
        # the layers' masters, which the optimizer's profile (optim.py) also reads; a frozen base with its
        # adapters on the device for `profile --lora` (as a LoRA run holds them)
        host: HostState = (
            frozen_host_state(stack, lora, sorted(stack.owned()), device=device, compute_dtype=DTYPES[dtype],
                              optim=AdamWConfig(), seed=seed) if lora is not None else
            make_host_state(stack.state(), host_memory=HostMemory.REPLICATED, compute_dtype=DTYPES[dtype],
                            optim=AdamWConfig()))
        self.host = host
        for i in stack.owned():
            strip_parameters(stack.layers[i])  # type: ignore[arg-type]
        caller = LayerCaller(compile_blocks=compile_blocks)  # one, so both interpreters share its graphs
        self.interp = {recompute: Interpreter(rank=0, schedule=_schedule(len(stack.layers), recompute, dtype, lora),
                                              layers=stack.layers, host=host, comm=None, device=device,
                                              hidden_size=stack.spec.hidden_size, tied=stack.tied, caller=caller)
                       for recompute in (False, True)}
        self.dtype = DTYPES[dtype]
        self.clock = _Clock(device)
        self._ids = count()

    def _act(self, kind: Kind, layer: int) -> Action:
        return Action(next(self._ids), kind, gpu_resource(0, "compute"), layer=layer, microbatch=MB)

    def measure(self, kind: str, *, microbatch_size: int, seq_len: int, repeat: int, warmup: int,
                seed: int = 0) -> KindMeasurement:
        """Time and size layer `kind` on one microbatch of `microbatch_size` x `seq_len` tokens."""
        L = self.layers[kind]
        gen = torch.Generator().manual_seed(seed)
        shape = (microbatch_size, seq_len)
        ids = torch.randint(self.spec.vocab_size, shape, generator=gen)
        labels = torch.randint(self.spec.vocab_size, shape, generator=gen)
        data = {STEP: StepData(microbatches=[(ids, labels)], denom=float(ids.numel()))}
        hidden = (*shape, self.spec.hidden_size)
        x = None if L == 0 else torch.randn(hidden, generator=gen).to(self.device, self.dtype)
        dy = None if L == self.last else torch.randn(hidden, generator=gen).to(self.device, self.dtype)
        times: dict[str, list[float]] = {"fwd": [], "fwd_nograd": [], "bwd": [], "recompute_bwd": []}
        saved, peaks, later = 0, [], []
        modes = (False,) if L == self.last else (False, True)
        for recompute in modes:
            it = self.interp[recompute]
            it.data = data
            it.dispatch(self._act(Kind.LOAD, L), STEP)
            fwd, bwd = ("fwd_nograd", "recompute_bwd") if recompute else ("fwd", "bwd")
            for r in range(warmup + repeat):
                keep = r >= warmup
                tf = self._fwd(it, L, x)
                tb = self._bwd(it, L, x, dy)
                if keep:
                    times[fwd].append(tf)
                    times[bwd].append(tb)
            if not recompute:
                saved = self._saved_bytes(it, L, x, dy)
            ws = self._workspace(it, L, x, dy, saved, recompute)
            peaks += ws[0]
            later += ws[1]
            it.dispatch(self._act(Kind.EVICT, L), STEP)
            it.data = {}
        med = {k: statistics.median(v) if v else 0.0 for k, v in times.items()}
        if L == self.last:  # a schedule never recomputes the head: a recomputing BWD of it would be both
            med["fwd_nograd"], med["recompute_bwd"] = med["fwd"], med["fwd"] + med["bwd"]
        cuda = self.device.type == "cuda"
        return KindMeasurement(kind=kind, layer=L, tokens=ids.numel(), fwd_s=med["fwd"],
                               fwd_nograd_s=med["fwd_nograd"], bwd_s=med["bwd"],
                               recompute_bwd_s=med["recompute_bwd"], saved_bytes=saved, input_bytes=_nbytes(x),
                               workspace_bytes=max(0, *peaks) if cuda else None,
                               accumulate_workspace_bytes=max(0, *later) if cuda else None)

    # ---- one action each, as the executor issues it -----------------------------------------------
    def _fwd(self, it: Interpreter, L: int, x: torch.Tensor | None) -> float:
        if x is not None:
            it.x[(STEP, L, MB)] = x
        t = self.clock.time(lambda: it.dispatch(self._act(Kind.FWD, L), STEP))
        it.x.pop((STEP, L + 1, MB), None)  # the output, handed on in a run
        it.losses.clear()
        return t

    def _bwd(self, it: Interpreter, L: int, x: torch.Tensor | None, dy: torch.Tensor | None, *,
             keep_grads: bool = False) -> float:
        """A BWD, timed; `keep_grads`: leave the layer's gradient accumulator (the next BWD adds into it)."""
        if dy is not None:
            it.dx[(STEP, L + 1, MB)] = dy
        if x is not None:
            it.x[(STEP, L, MB)] = x  # a recomputing BWD reads its input (FWD left it; BWD consumes it)
        t = self.clock.time(lambda: it.dispatch(self._act(Kind.BWD, L), STEP))
        it.dx.pop((STEP, L, MB), None)
        if not keep_grads:
            it.grads.pop((STEP, L), None)
        return t

    def _saved_bytes(self, it: Interpreter, L: int, x: torch.Tensor | None, dy: torch.Tensor | None) -> int:
        """Bytes of the distinct non-parameter storages autograd saves in one graph-keeping FWD."""
        params = {t.untyped_storage().data_ptr() for t in it.weights[L][1].values()}
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() not in params and s.nbytes() > 0:
                kept[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self._fwd(it, L, x)
        self._bwd(it, L, x, dy)
        return sum(kept.values())

    def _workspace(self, it: Interpreter, L: int, x: torch.Tensor | None, dy: torch.Tensor | None, saved: int,
                   recompute: bool) -> tuple[list[int], list[int]]:
        """CUDA: transient peaks above what the ledger names (module docstring), of FWD and the first BWD,
        and of a BWD that adds into an existing gradient accumulator; CPU: [], []."""
        if self.device.type != "cuda":
            return [], []
        out = 4 if L == self.last else _nbytes(dy)  # the head's output is one fp32 loss
        weight_grads = 0 if self.lora is not None else sum(_nbytes(t) for t in it.weights[L][1].values())
        f, b, acc = _Peak(self.device), _Peak(self.device), _Peak(self.device)
        with f.measure():
            self._fwd_keep_output(it, L, x)
        with b.measure():
            self._bwd(it, L, x, dy, keep_grads=True)
        it.x.pop((STEP, L + 1, MB), None)
        self._fwd(it, L, x)
        with acc.measure():  # the accumulator is there: only the input gradient is new
            self._bwd(it, L, x, dy)
        assert f.bytes is not None and b.bytes is not None and acc.bytes is not None
        redo = saved + out if recompute else 0
        first, later = b.bytes - weight_grads - _nbytes(x) - redo, acc.bytes - _nbytes(x) - redo
        return ([first] if recompute else [f.bytes - out - saved, first]), [later]

    def _fwd_keep_output(self, it: Interpreter, L: int, x: torch.Tensor | None) -> None:
        """A FWD whose output stays allocated until the peak is read (as in a run, until handed on)."""
        if x is not None:
            it.x[(STEP, L, MB)] = x
        it.dispatch(self._act(Kind.FWD, L), STEP)
        it.losses.clear()


def _schedule(num_layers: int, recompute: bool, dtype: str, lora: LoraSpec | None) -> Schedule:
    """An action-less one-GPU schedule: what the interpreter reads (which layers recompute, dtype, LoRA)."""
    return Schedule(actions=(), num_gpus=1, num_layers=num_layers, iterations=1, microbatches=1,
                    tokens_per_microbatch=1, recompute=recompute, pack_layers=(tuple(range(num_layers)),),
                    pack_gpu=(0,), compute_dtype=dtype, lora=lora)
