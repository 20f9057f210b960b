"""ProfileTrace: measured (or analytic) per-layer-kind times and sizes for one GPU type and workload.

A measured trace comes from `tinypipe profile` (shipped ones live in `traces/profiles/`; a user's own
are given with `--profile`, see `load_profiles` and `trace_for`); where none matches,
`analytic_trace` stands in and says so. The analytic model, per layer kind, for one
microbatch of T = microbatch_size x seq_len tokens:

    fwd_s = T * fwd_flops_per_token(seq_len) / (MATMUL_FRACTION * gpu.matmul_flops)
          + bytes_moved / (MEM_FRACTION * gpu.mem_gbps * 1e9)
    bytes_moved = weight bytes read (all of them; the embedding reads only the T rows it gathers)
                + T * (2 * saved_act_bytes_per_token + 2 * boundary_bytes_per_token)
                  (every saved tensor written once and read once; the input read, the output written)
    bwd_s = 2 * fwd_s;  recompute_bwd_s = fwd_s + bwd_s
    saved_act_bytes = T * saved_act_bytes_per_token
    saved_act_bytes_recompute = T * boundary_bytes_per_token (the layer input; 0 for the embedding,
                                whose input is the token ids)
    workspace_bytes = WORKSPACE_FRACTION * saved_act_bytes, except for the head, which computes its
                      logits in chunks: tinypipe.describe.model.head_workspace_bytes (one chunk of logits
                      plus per-token gradients, so nearly constant in T)

The compute and memory terms add rather than overlap: the memory term stands for the norms, RoPE,
activations and residual adds, which run as separate bandwidth-bound kernels between the GEMMs.

A measured trace may also carry, per kind, the host optimizer step of one layer of that kind
(`tinypipe.describe.optimprofile.OptimizerProfile`, `tinypipe profile`); a trace without it leaves the
simulator to cost an OPT_STEP at the host's rate (`tinypipe.estimate.hostmem.optimizer_step_s` decides).
The block's kind may also carry `loop` (`tinypipe.describe.looptimes.LoopTimes`: its recomputing FWD /
BWD timed inside the executor's loop), also optional; `KindProfile.compute_s` is the one rule for
what a FWD or BWD costs. So is `accumulate_workspace_bytes`, a later BWD's transient
(`KindProfile.accumulate_workspace` decides where it is missing).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import tinypipe.traces as shipped
from tinypipe.common.errors import InputError
from tinypipe.common.jsonio import Fields, load_json
from tinypipe.describe.hardware import GPU
from tinypipe.describe.layershape import Shapes, same_layers, shapes_from_json
from tinypipe.describe.looptimes import LoopTimes
from tinypipe.describe.model import (
    DTYPE_BYTES,
    LayerKind,
    LayerSpec,
    ModelSpec,
    head_workspace_bytes,
    head_workspace_fixed_bytes,
    read_weight_bytes,
)
from tinypipe.describe.optimprofile import OptimizerProfile

MOE_NOTE = (" (MoE blocks, none measured: FLOPs of the active parameters, the experts a token routes to; reads of "
            "the experts expected to get tokens; whole-layer uploads)")

# Fraction of the GPU's achieved large-GEMM rate (`GPU.matmul_flops`) that a layer's mix of
# smaller GEMMs and causal flash attention reaches. Calibrated once against the measured H200
# Llama-3.1-8B block (traces/profiles/h200-llama-3.1-8b-mb1-seq2048.json: forward 1.96 ms); see tests/test_trace.py.
MATMUL_FRACTION = 0.7
# Fraction of the spec memory bandwidth that streaming elementwise kernels reach.
MEM_FRACTION = 0.8
# Transient peak on top of the saved activations while a layer computes (backward holds gradients
# of about half of the saved tensors at once, e.g. of the MLP's intermediates). An estimate; the
# measured H200 Llama-3.1-8B block shows 0.68 x at 4-8 x 2048 tokens, 2.2 x at 2048 tokens.
WORKSPACE_FRACTION = 0.5

KIND_NAMES = tuple(k.value for k in LayerKind)
# What `to_json` writes. Read: this, or none (the traces before per-kind optimizer steps; they read the same).
FORMAT = "tinypipe-trace-v2"


@dataclass(frozen=True)
class KindProfile:
    """Times and sizes of one layer kind for one microbatch (microbatch_size x seq_len tokens).

    With recompute the backward re-creates the forward's activations, so while it runs the layer
    transiently holds saved_act_bytes + workspace_bytes. `workspace_fixed_bytes` is the part of a
    workspace that does not grow with the tokens (the LM head's chunk of logits; 0 elsewhere).
    """

    fwd_s: float
    bwd_s: float  # backward with the forward's activations kept
    recompute_bwd_s: float  # forward recomputed from the saved input, then backward
    saved_act_bytes: int  # kept from forward to backward without recompute
    saved_act_bytes_recompute: int  # kept with recompute (the layer input)
    workspace_bytes: int  # transient peak while the layer computes, on top of saved_act_bytes
    workspace_fixed_bytes: int = 0  # the part of workspace_bytes that stays the same at any token count
    optimizer: OptimizerProfile | None = None  # one layer's host optimizer step, when measured
    loop: LoopTimes | None = None  # the block's recomputing FWD / BWD inside the executor's loop, when measured
    # a BWD's transient when the layer's gradient accumulator exists (every BWD of a step but its first):
    # the weights' fresh gradients before they are added; None: not measured (`accumulate_workspace`)
    accumulate_workspace_bytes: int | None = None

    def accumulate_workspace(self, gradient_bytes: int) -> int:
        """A later BWD's transient: the measured one, else `workspace_bytes` + the layer's whole gradient
        (`gradient_bytes`), as a backward that returns every gradient at once before adding them holds."""
        if self.accumulate_workspace_bytes is not None:
            return self.accumulate_workspace_bytes
        return self.workspace_bytes + gradient_bytes

    def backward_s(self, recomputed: bool) -> float:
        """The backward's time: with its forward re-run first (`schedule.recomputes`), or from kept activations."""
        return self.recompute_bwd_s if recomputed else self.bwd_s

    def compute_s(self, forward: bool, recomputed: bool, *, beside_optimizer: bool = False,
                  issue: bool = True) -> float:
        """What a FWD (`forward`) or BWD of a layer of this kind costs: in a schedule that recomputes the
        layer (`schedule.recomputes`) and with `loop` measured, the loop's time (beside a running host
        optimizer step or alone; without `issue`, its device time only: `LoopTimes.device_s`); else the
        isolated one (`fwd_s`; `backward_s`)."""
        if recomputed and self.loop is not None:
            loop = self.loop
            return loop.compute_s(forward, beside_optimizer) if issue else loop.device_s(forward, beside_optimizer)
        return self.fwd_s if forward else self.backward_s(recomputed)

    def issue_gap_s(self, forward: bool, recomputed: bool, *, beside_optimizer: bool = False) -> float:
        """How long after the previous FWD / BWD on its stream a FWD or BWD of this kind starts at the
        earliest, waiting for the main thread to issue it (`LoopTimes.gap_s`; 0 without loop times, or in
        a schedule that does not recompute the layer, as `compute_s` takes the loop's times there only)."""
        if recomputed and self.loop is not None:
            return self.loop.gap_s(forward, beside_optimizer)
        return 0.0

    def least_compute_s(self, forward: bool, recomputed: bool, *, issue: bool = True) -> float:
        """The least of `compute_s` alone and beside the optimizer (lower bounds: floor, search); without
        `issue`, the loop's device times only (`LoopTimes.device_s`: the floor leaves dispatch out)."""
        return min(self.compute_s(forward, recomputed, issue=issue),
                   self.compute_s(forward, recomputed, beside_optimizer=True, issue=issue))

    def scaled(self, factor: float) -> KindProfile:
        """Every time and size times `factor` (linear in tokens), but a workspace with a fixed part.

        Such a workspace (the head's) is the larger of a phase that holds the fixed part and one that
        grows with the tokens (`tinypipe.describe.model.head_workspace_bytes`); which phase it was is not
        recorded, so both readings are scaled -- the whole linearly, or only the part above the fixed
        one -- and the larger kept, which is never below either phase. The optimizer step does not
        depend on the tokens and is kept; the loop's times scale like the others.
        """
        ws, fixed = self.workspace_bytes, self.workspace_fixed_bytes
        new_ws = max(round(ws * factor), fixed + round((ws - fixed) * factor))
        acc = self.accumulate_workspace_bytes  # its part above workspace_bytes (fresh gradients) does not scale
        new_acc = None if acc is None else new_ws + acc - ws if acc >= ws else round(acc * factor)
        return KindProfile(fwd_s=self.fwd_s * factor, bwd_s=self.bwd_s * factor,
                           recompute_bwd_s=self.recompute_bwd_s * factor,
                           saved_act_bytes=round(self.saved_act_bytes * factor),
                           saved_act_bytes_recompute=round(self.saved_act_bytes_recompute * factor),
                           workspace_bytes=new_ws, workspace_fixed_bytes=fixed, optimizer=self.optimizer,
                           loop=None if self.loop is None else self.loop.scaled(factor),
                           accumulate_workspace_bytes=new_acc)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["optimizer"], out["loop"]
        if self.accumulate_workspace_bytes is None:
            del out["accumulate_workspace_bytes"]
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.to_json()
        if self.loop is not None:
            out["loop"] = self.loop.to_json()
        return out

    @classmethod
    def from_json(cls, f: Fields) -> KindProfile:
        return cls(fwd_s=f.float("fwd_s", minimum=0.0), bwd_s=f.float("bwd_s", minimum=0.0),
                   recompute_bwd_s=f.float("recompute_bwd_s", minimum=0.0),
                   saved_act_bytes=f.int("saved_act_bytes", minimum=0),
                   saved_act_bytes_recompute=f.int("saved_act_bytes_recompute", minimum=0),
                   workspace_bytes=f.int("workspace_bytes", minimum=0),
                   workspace_fixed_bytes=f.int("workspace_fixed_bytes", 0, minimum=0),
                   accumulate_workspace_bytes=(f.int("accumulate_workspace_bytes", minimum=0)
                                               if f.has("accumulate_workspace_bytes") else None),
                   optimizer=OptimizerProfile.from_json(f.obj_("optimizer")) if f.has("optimizer") else None,
                   loop=LoopTimes.from_json(f.obj_("loop")) if f.has("loop") else None)


@dataclass(frozen=True)
class ProfileTrace:
    gpu_model: str
    dtype: str
    microbatch_size: int  # sequences per microbatch
    seq_len: int
    kinds: dict[str, KindProfile]  # keyed by LayerKind value: "embed", "block", "head"
    analytic: bool  # True when computed from FLOPs over a rate rather than measured
    source: str
    model: str = ""  # model name the trace was profiled on ("" for analytic traces)
    compiled: bool = False  # measured with the blocks torch.compiled (`profile --compile`, as `run` on CUDA)
    layers: Shapes | None = None  # each kind's measured layer shape (`describe.layershape`); None: by `model`
    # the LoRA adapters the blocks carried on a frozen base (`LoraSpec.text()`, `profile --lora`); "": full training
    lora: str = ""

    @property
    def tokens_per_microbatch(self) -> int:
        return self.microbatch_size * self.seq_len

    def layer(self, layer: LayerSpec) -> KindProfile:
        return self.kinds[layer.kind.value]

    def scaled_to(self, microbatch_size: int) -> ProfileTrace:
        """This trace at another microbatch size, every time and size scaled linearly in tokens.

        Linear scaling ignores fixed costs: the measured H200 block's per-token forward time falls
        by ~10% from 1 to 8 sequences per microbatch, so scaling up from a small microbatch
        overestimates a little and scaling down underestimates.
        """
        if microbatch_size < 1:
            raise InputError(f"microbatch_size: must be >= 1, got {microbatch_size}")
        if microbatch_size == self.microbatch_size:
            return self
        factor = microbatch_size / self.microbatch_size
        return replace(self, microbatch_size=microbatch_size,
                       kinds={k: p.scaled(factor) for k, p in self.kinds.items()},
                       source=f"{self.source}; scaled linearly in tokens from microbatch_size "
                              f"{self.microbatch_size} to {microbatch_size}")

    def to_json(self) -> dict[str, Any]:
        out = {"format": FORMAT, "gpu_model": self.gpu_model, "model": self.model, "dtype": self.dtype,
               "microbatch_size": self.microbatch_size, "seq_len": self.seq_len, "analytic": self.analytic,
               "compiled": self.compiled, "source": self.source,
               "kinds": {k: p.to_json() for k, p in self.kinds.items()}}
        if self.lora:
            out["lora"] = self.lora
        return out if self.layers is None else out | {"layers": self.layers}

    @classmethod
    def from_json(cls, obj: Any, where: str = "trace") -> ProfileTrace:
        f = Fields(obj, where)
        fmt = f.str("format")
        if fmt != FORMAT:
            raise InputError(f"{f.where}: format {fmt!r} is not one this tinypipe reads ({FORMAT})")
        kinds_f = f.obj_("kinds")
        for key in kinds_f.obj:
            if key not in KIND_NAMES:
                raise InputError(f"{kinds_f.where}: unknown layer kind {key!r}; "
                                 f"expected {', '.join(KIND_NAMES)}")
        return cls(gpu_model=f.str("gpu_model"), model=f.str("model", ""),
                   dtype=f.str("dtype", choices=tuple(DTYPE_BYTES)),
                   microbatch_size=f.int("microbatch_size", minimum=1), seq_len=f.int("seq_len", minimum=1),
                   kinds={k: KindProfile.from_json(kinds_f.obj_(k)) for k in KIND_NAMES},
                   analytic=f.bool("analytic"), source=f.str("source"), compiled=f.bool("compiled", False),
                   layers=shapes_from_json(f.obj.get("layers"), f.where), lora=f.str("lora", ""))


def _kind_profile(layer: LayerSpec, model: ModelSpec, gpu: GPU, tokens: int, seq_len: int,
                  dtype: str) -> KindProfile:
    flops = tokens * layer.fwd_flops_per_token(seq_len)
    weight_bytes = (tokens * layer.boundary_bytes_per_token if layer.kind is LayerKind.EMBED
                    else read_weight_bytes(layer, tokens, dtype))
    act_bytes = tokens * 2 * (layer.saved_act_bytes_per_token + layer.boundary_bytes_per_token)
    fwd_s = (flops / (MATMUL_FRACTION * gpu.matmul_flops)
             + (weight_bytes + act_bytes) / (MEM_FRACTION * gpu.mem_gbps * 1e9))
    saved = tokens * layer.saved_act_bytes_per_token
    # recompute keeps the layer input; the embedding's input is the token ids, which are input data
    kept = 0 if layer.kind is LayerKind.EMBED else tokens * layer.boundary_bytes_per_token
    if layer.kind is LayerKind.HEAD:  # chunked logits: nearly constant in the tokens, not a fraction
        workspace, fixed = head_workspace_bytes(model, tokens), head_workspace_fixed_bytes(model, tokens)
    else:
        workspace, fixed = math.ceil(WORKSPACE_FRACTION * saved), 0
    return KindProfile(fwd_s=fwd_s, bwd_s=2 * fwd_s, recompute_bwd_s=3 * fwd_s, saved_act_bytes=saved,
                       saved_act_bytes_recompute=kept, workspace_bytes=workspace, workspace_fixed_bytes=fixed)


def analytic_trace(model: ModelSpec, gpu: GPU, *, microbatch_size: int, seq_len: int,
                   dtype: str = "bf16") -> ProfileTrace:
    """FLOPs over an achieved rate plus bytes over bandwidth, per layer kind (formula: module docstring).

    Each kind's profile is that of its first layer in `model` (all blocks share one shape).
    """
    if microbatch_size < 1 or seq_len < 1:
        raise InputError(f"microbatch_size and seq_len must be >= 1, got {microbatch_size} and {seq_len}")
    if dtype not in DTYPE_BYTES:
        raise InputError(f"dtype: must be one of {', '.join(DTYPE_BYTES)}; got {dtype!r}")
    tokens = microbatch_size * seq_len
    kinds: dict[str, KindProfile] = {}
    for layer in model.layers:
        if layer.kind.value not in kinds:
            kinds[layer.kind.value] = _kind_profile(layer, model, gpu, tokens, seq_len, dtype)
    return ProfileTrace(
        gpu_model=gpu.model, dtype=dtype, microbatch_size=microbatch_size, seq_len=seq_len, kinds=kinds,
        analytic=True,
        source=(f"analytic: {model.name} on {gpu.model}{MOE_NOTE if model.is_moe else ''}, FLOPs / "
                f"({MATMUL_FRACTION} x {gpu.matmul_flops:.3g} "
                f"FLOP/s) + bytes / ({MEM_FRACTION} x {gpu.mem_gbps:g} GB/s); backward 2 x forward; "
                f"workspace {WORKSPACE_FRACTION} x saved activations (head: chunked-loss formula)"))


def shipped_traces() -> list[str]:
    """Names of the measured traces in `traces/profiles/`, sorted."""
    found: list[str] = shipped.names("profiles")  # tinypipe.traces: data files, untyped here
    return found


def load_trace(path: str) -> ProfileTrace:
    """A shipped trace by name (`h200-llama-3.1-8b-mb1-seq2048`) or a path to a trace JSON file."""
    found = shipped.path("profiles", path) if "/" not in path else None
    if found is not None:
        return ProfileTrace.from_json(load_json(found), where=f"{path}.json")
    p = Path(path)
    if not p.exists() and p.suffix != ".json" and "/" not in path:
        raise InputError(f"unknown trace {path!r}: not a file, nor a shipped trace "
                         f"({', '.join(shipped_traces())})")
    return ProfileTrace.from_json(load_json(p), where=path)


def load_profiles(paths: Iterable[str]) -> tuple[ProfileTrace, ...]:
    """The measured traces of `--profile` arguments, in the order given: a trace JSON file, or a
    directory whose `*.json` traces are all read, sorted by name. In a directory, JSON files without
    `kinds` (the rates and hardware JSON that `tinypipe profile` writes beside its traces) are
    skipped. InputError for a missing path, a directory without a trace, or a file that is not a
    valid trace (named with the field at fault)."""
    out: list[ProfileTrace] = []
    for arg in paths:
        p = Path(arg)
        if p.is_dir():
            found = [ProfileTrace.from_json(obj, where=str(f)) for f in sorted(p.glob("*.json"))
                     if isinstance(obj := load_json(f), dict) and "kinds" in obj]
            if not found:
                raise InputError(f"--profile {arg}: no profile trace in this directory (no *.json with `kinds`; "
                                 "`tinypipe profile --out DIR` writes them)")
            out += found
        elif p.is_file():
            out.append(ProfileTrace.from_json(load_json(p), where=str(p)))
        else:
            raise InputError(f"--profile {arg}: no such file or directory")
    return tuple(out)


@lru_cache(maxsize=1)
def _measured() -> tuple[ProfileTrace, ...]:
    return tuple(load_trace(name) for name in shipped_traces())


def measured_traces() -> tuple[ProfileTrace, ...]:
    """The shipped measured traces (`traces/profiles/`), read once."""
    return _measured()


def find_trace(traces: Iterable[ProfileTrace], model: ModelSpec, gpu_model: str, microbatch_size: int,
               seq_len: int, dtype: str, compiled: bool | None = None, lora: str = "") -> ProfileTrace | None:
    """The first of `traces` for this GPU model (case-insensitively), microbatch size, sequence length and
    dtype that measured the layers `model` has (`layershape.same_layers`: each kind's shape, whatever the
    model's name), with compiled blocks or eager ones as `compiled` says (None: an eager one if there is
    one, else a compiled one), and with the LoRA adapters `lora` names (`LoraSpec.text()`; "": full training);
    or None."""
    found = [t for t in traces
             if (t.gpu_model.casefold() == gpu_model.casefold() and t.microbatch_size == microbatch_size
                 and t.lora == lora
                 and t.seq_len == seq_len and t.dtype == dtype and same_layers(t.model, t.layers, model))]
    for want in ((False, True) if compiled is None else (compiled,)):
        for t in found:
            if t.compiled == want:
                return t
    return None


def trace_for(model: ModelSpec, hardware_gpu: GPU, microbatch_size: int, seq_len: int,
              dtype: str = "bf16", *, profiles: Sequence[ProfileTrace] = (), compiled: bool | None = None,
              lora: str = "") -> ProfileTrace:
    """The first matching trace (`find_trace`) of `profiles` (measured by `tinypipe profile`, given
    with `--profile`), else of the shipped measured traces, else `analytic_trace`. `compiled`: a run
    that compiles its blocks (or not) takes a trace measured so, else a measured one of the other
    kind before an analytic one; None takes either (eager first). `lora` (a LoRA run's `LoraSpec.text()`):
    a trace measured with those adapters first, else a full-training one (`estimate.lora.frozen_trace`
    scales it)."""
    for want in ((None,) if compiled is None else (compiled, not compiled)):
        for adapters in ((lora, "") if lora else ("",)):
            for pool in (profiles, _measured()):
                found = find_trace(pool, model, hardware_gpu.model, microbatch_size, seq_len, dtype, want, adapters)
                if found is not None:
                    return found
    return analytic_trace(model, hardware_gpu, microbatch_size=microbatch_size, seq_len=seq_len, dtype=dtype)


def unmatched_note(profiles: Sequence[ProfileTrace], chosen: ProfileTrace, model: ModelSpec,
                   compiled: bool | None = None) -> str | None:
    """Lines for people when `chosen` is not what was asked for: `--profile` traces were given but
    none of them is `chosen` (what was looked for, what they are for, what stands in); or a run that
    compiles its blocks (or not, `compiled`) is predicted from a measured trace of the other kind."""
    lines = []
    if profiles and not any(t is chosen for t in profiles):

        def key(t: ProfileTrace, name: str) -> str:
            return (f"{t.gpu_model} / {name} / microbatch {t.microbatch_size} / seq {t.seq_len} / {t.dtype}"
                    f"{' / compiled' if t.compiled else ''}{' / LoRA ' + t.lora if t.lora else ''}")

        have = "; ".join(sorted({key(t, t.model) for t in profiles}))
        lines.append(f"note: no --profile trace matches {key(chosen, model.name)} (they are for {have}); "
                     f"using the {'analytic' if chosen.analytic else 'shipped measured'} trace")
    if compiled is not None and not chosen.analytic and chosen.compiled != compiled:
        kind = "compiled" if compiled else "eager"
        lines.append(f"note: no trace of {kind} blocks for {model.name} at microbatch {chosen.microbatch_size}; the "
                     f"prediction uses one measured {'eager' if compiled else 'compiled'} (`tinypipe profile"
                     f"{'' if compiled else ' --no-compile'}` measures {kind} ones)")
    return "\n".join(lines) or None
