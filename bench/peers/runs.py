"""The runs the runner knows (one system in one optimizer mode), and the configurations it makes of them:
each run on each GPU count under each GPU memory cap, in the order given.

Warm-up: `--warmup` steps are left out of every run's tokens/s, plus one more for the runs whose second
step is still warming up, so that each run is timed over the same number of steady steps:
- RoundPipe plans its stages from measured layer times; its `ModelTimer` drops the first iteration's
  timings and plans from the second's (roundpipe/timer.py), so its third step is the first planned so.
- tinypipe steps each layer's optimizer on a host thread beside the next iteration: the second iteration
  waits for every layer's first AdamW step, which allocates and first touches the moments (8 bytes per
  parameter; bench/cuda_bench.py's WARMUP measured ~3.5 s on the 8B).
- FSDP2 and DeepSpeed step synchronously at the end of a step: the first step holds all of that.

LoRA (`--lora R`): tinypipe trains its own adapters (`tinypipe run --lora`), RoundPipe peft's; the FSDP2
and DeepSpeed scripts train every parameter, so with `--lora` their runs are skipped and say why.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunSpec:
    """One system in one mode; `module` is its peer script (`python -m`), `launcher` how it is started:
    `process` (one process driving every GPU), `torchrun` (one process per GPU), `tinypipe` (one process
    that starts its own workers). `site`: a private install directory put first on its PYTHONPATH.
    `no_lora`: why its script cannot train LoRA adapters (None: it honours `--lora`)."""

    name: str
    system: str
    mode: str
    module: str
    launcher: str
    extra_warmup: int = 0
    site: str | None = None
    variant: str | None = None
    no_lora: str | None = None


FULL_ONLY = "its script trains every parameter; peft LoRA is not set up for it here"
RUNS: dict[str, RunSpec] = {r.name: r for r in (
    RunSpec("tinypipe", "tinypipe", "sync", "peers.peer_tinypipe", "tinypipe", 1, variant="searched"),
    RunSpec("roundpipe", "roundpipe", "async", "peers.peer_roundpipe", "process", 1, site="roundpipe"),
    RunSpec("tinypipe-async", "tinypipe", "async", "peers.peer_tinypipe", "tinypipe", 1, variant="searched"),
    RunSpec("roundpipe-sync", "roundpipe", "sync", "peers.peer_roundpipe", "process", 1, site="roundpipe"),
    RunSpec("fsdp2", "fsdp2", "sync", "peers.peer_fsdp2", "torchrun", no_lora=FULL_ONLY),
    RunSpec("deepspeed", "deepspeed", "sync", "peers.peer_deepspeed", "torchrun", site="deepspeed", no_lora=FULL_ONLY),
    RunSpec("mobius", "tinypipe", "sync", "peers.peer_tinypipe", "tinypipe", 1, variant="mobius"),
    RunSpec("mobius-async", "tinypipe", "async", "peers.peer_tinypipe", "tinypipe", 1, variant="mobius"),
)}
DEFAULT_RUNS = tuple(RUNS)  # most telling first: a deadline cuts the tail


@dataclass(frozen=True)
class Config:
    """One configuration: a run on `gpus` GPUs under a cap of `cap_gib` GiB per GPU (None: uncapped)."""

    run: RunSpec
    gpus: int
    cap_gib: float | None

    @property
    def key(self) -> str:
        """A file-name-safe identifier: `roundpipe-sync-1gpu-24gib`."""
        cap = "uncapped" if self.cap_gib is None else f"{self.cap_gib:g}gib"
        return f"{self.run.name}-{self.gpus}gpu-{cap}"


def configurations(runs: tuple[str, ...], gpus: tuple[int, ...], caps: tuple[float | None, ...]) -> list[Config]:
    """Every run on every GPU count under every cap: caps outermost, then GPU counts, then runs in order."""
    return [Config(RUNS[r], g, c) for c in caps for g in gpus for r in runs]


def parse_caps(text: str) -> tuple[float | None, ...]:
    """`24,none` -> (24.0, None); ValueError naming the bad item."""
    out: list[float | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        if item in ("none", "uncapped"):
            out.append(None)
            continue
        try:
            value = float(item.removesuffix("gib"))
        except ValueError:
            raise ValueError(f"--caps: {item!r} is neither a number of GiB nor 'none'") from None
        if not value > 0:
            raise ValueError(f"--caps: {item!r} must be > 0")
        out.append(value)
    if not out or len(set(out)) != len(out):
        raise ValueError(f"--caps {text!r}: give distinct caps, e.g. 24,none")
    return tuple(out)


def parse_gpus(text: str) -> tuple[int, ...]:
    """`1,2` -> (1, 2); ValueError naming the bad item."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--gpus {text!r}: give GPU counts, e.g. 1 or 1,2") from None
    if not out or min(out) < 1 or len(set(out)) != len(out):
        raise ValueError(f"--gpus {text!r}: give distinct GPU counts >= 1, e.g. 1,2")
    return out
