"""Action kinds and what each one means, in one table: stream, direction, buffer carried, cost, label, colour.

Every part that needs a fact about a kind reads it here (`KINDS`, or `kind.info`): the compiler (the
stream a kind runs on), the validator (which kinds need a microbatch or a peer), the simulator (how
a kind's cost is computed: `Cost`), the backend (whether a transfer carries an activation or a
gradient), the floor, timelines and plots (which kinds are compute, labels, colours). Adding a kind
is one row here, the pass that emits it, one simulator cost (only for a new `Cost`) and one backend
handler. docs/schedule-contract.md says what each kind does to memory.

As in PyTorch pipelining (`SEND_F`, `RECV_B`, ...), the direction of a GPU -> GPU transfer is part of
its kind: `SEND_F` / `RECV_F` move a boundary activation `x.L{l}` forward, `SEND_B` / `RECV_B` its
gradient `dx.L{l}` backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Kind(str, Enum):
    """Action kinds; the value is the printed name."""

    LOAD = "LOAD"
    EVICT = "EVICT"
    FWD = "FWD"
    BWD = "BWD"
    SEND_F = "SEND_F"
    SEND_B = "SEND_B"
    RECV_F = "RECV_F"
    RECV_B = "RECV_B"
    OFFLOAD_ACT = "OFFLOAD_ACT"
    FETCH_ACT = "FETCH_ACT"
    GRAD_OUT = "GRAD_OUT"
    OPT_STEP = "OPT_STEP"
    ADAPT_STEP = "ADAPT_STEP"  # a LoRA layer's adapters' AdamW step, on its GPU's compute stream

    info: KindInfo  # this kind's row of `KINDS` (set below: a plain attribute, read in hot loops)


class Direction(str, Enum):
    """The pass of the pipeline an action belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"
    NONE = "none"


class Carries(str, Enum):
    """The buffer an action moves or drops."""

    WEIGHTS = "weights"  # w.L{l}
    ACTIVATION = "activation"  # a layer's input x.L{l}.m{m} (host: act.L{l}.m{m})
    GRADIENT = "gradient"  # dx.L{l}.m{m} between GPUs; a layer's weight gradients gr.L{l} to the host
    NONE = "none"


class Cost(str, Enum):
    """How the simulator times a kind (docs/schedule-contract.md, "Kinds ... and their cost")."""

    COMPUTE = "compute"  # the trace's time for the layer: forward, or backward (with recompute or not)
    UPLOAD = "upload"  # a copy of `nbytes` host -> GPU
    DOWNLOAD = "download"  # a copy of `nbytes` GPU -> host
    PEER = "peer"  # one half of a GPU -> GPU copy; the pair moves the SEND's `nbytes` once both are ready
    OPTIMIZER = "optimizer"  # the layer's parameters at the host optimizer's rate
    # a fused AdamW over `nbytes` / 4 parameters on the GPU (estimate/lora_costs.py)
    DEVICE_OPTIMIZER = "device_optimizer"
    FREE = "free"  # takes no time


@dataclass(frozen=True, slots=True)
class KindInfo:
    """What one kind means. `stream`: its resource on a GPU (`g{i}.{stream}`), or `optim` for `host.optim`."""

    stream: str
    direction: Direction
    carries: Carries
    cost: Cost
    label: str  # cell label prefix: `F3.2` is FWD L3 m2 (`Action.label`)
    colour: str  # in timeline pictures (matplotlib's tab10 / tab20 palette)
    per_microbatch: bool  # acts on one microbatch (names `m`)
    # from `cost`, as fields (read per action in hot loops): a SEND or RECV half of a GPU -> GPU copy (it
    # names its `peer`); a FWD or BWD, the GPU work that marks an iteration's end and that the executor keeps
    # in flight
    is_half: bool = field(init=False, repr=False, compare=False)
    is_compute: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_half", self.cost is Cost.PEER)
        object.__setattr__(self, "is_compute", self.cost is Cost.COMPUTE)


_F, _B, _N = Direction.FORWARD, Direction.BACKWARD, Direction.NONE
_W, _A, _G, _X = Carries.WEIGHTS, Carries.ACTIVATION, Carries.GRADIENT, Carries.NONE

KINDS: dict[Kind, KindInfo] = {
    # kind: stream, direction, carries, cost, label, colour, per microbatch
    Kind.LOAD: KindInfo("h2d", _N, _W, Cost.UPLOAD, "LD", "#2ca02c", False),
    Kind.EVICT: KindInfo("compute", _N, _W, Cost.FREE, "EV", "#7f7f7f", False),
    Kind.FWD: KindInfo("compute", _F, _X, Cost.COMPUTE, "F", "#1f77b4", True),
    Kind.BWD: KindInfo("compute", _B, _X, Cost.COMPUTE, "B", "#ff7f0e", True),
    Kind.SEND_F: KindInfo("send", _F, _A, Cost.PEER, "S", "#9467bd", True),
    Kind.SEND_B: KindInfo("send", _B, _G, Cost.PEER, "S", "#bcbd22", True),
    Kind.RECV_F: KindInfo("recv", _F, _A, Cost.PEER, "R", "#c5b0d5", True),
    Kind.RECV_B: KindInfo("recv", _B, _G, Cost.PEER, "R", "#dbdb8d", True),
    Kind.OFFLOAD_ACT: KindInfo("d2h", _F, _A, Cost.DOWNLOAD, "OA", "#8c564b", True),
    Kind.FETCH_ACT: KindInfo("h2d", _B, _A, Cost.UPLOAD, "FA", "#c49c94", True),
    Kind.GRAD_OUT: KindInfo("d2h", _B, _G, Cost.DOWNLOAD, "GO", "#d62728", False),
    Kind.OPT_STEP: KindInfo("optim", _N, _X, Cost.OPTIMIZER, "OPT", "#e377c2", False),
    Kind.ADAPT_STEP: KindInfo("compute", _N, _X, Cost.DEVICE_OPTIMIZER, "AS", "#17becf", False),
}

GPU_STREAMS = ("compute", "h2d", "d2h", "send", "recv")  # the streams of each GPU, in display order
HOST_OPTIM = "host.optim"  # the host optimizer's resource (stream `optim`)
KIND_STREAM: dict[Kind, str] = {k: i.stream for k, i in KINDS.items()}
for _kind, _info in KINDS.items():
    _kind.info = _info
COMPUTE_KINDS = frozenset(k.value for k, i in KINDS.items() if i.is_compute)  # printed names: FWD, BWD


def recorded_as(name: str, kind: Kind) -> bool:
    """Whether a record that names its kind `name` (a trace's, a timeline's) is an action of `kind`."""
    return bool(name == kind.value)
