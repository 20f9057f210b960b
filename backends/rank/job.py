"""What a rank is given (`Job`: picklable, it travels to spawned processes) and what it reports (`RankResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tinypipe.ir.schedule import Schedule
from tinypipe.ir.timeline import Record

from ..host.state import AdamWConfig
from ..model.compiled import COMPILE_BACKEND
from ..save import checkpoint
from ..save.lora_save import LoraFiles
from .rss_guard import GuardSettings, LowMemory
from .stepfeed import LocalFeed, ProcessFeed


@dataclass(frozen=True)
class Job:
    """Everything a rank needs to train (picklable: it travels to spawned processes)."""

    model: str
    schedule: Schedule
    steps: int
    seq_len: int
    microbatch_size: int
    data: str | None = None
    data_split: str | None = None  # a Hugging Face dataset id's split and configuration (`--data-split`)
    data_config: str | None = None
    byte_tokens: bool = True  # a model without tokenizer files trains on byte ids (the planner checked)
    packing: bool = True  # examples packed end to end (else one per sequence, data.examples.pack)
    seed: int = 0
    optim: AdamWConfig = AdamWConfig()
    backend: str = "cpu"
    out: str | None = None
    checkpoint_every: int = 0
    checkpoint_s: float = 0.0  # also checkpoint after this much training time, and at the end (0: off)
    keep_checkpoints: int = checkpoint.DEFAULT_KEEP  # complete checkpoints kept (`--keep-checkpoints`)
    resume: bool = False
    threads: int = 0  # torch intra-op threads per rank (0: torch's default)
    gpu_mem_bytes: int | None = None  # CUDA: the caching allocator's cap per rank (None: the whole GPU)
    progress: bool = True
    write_metrics: bool = True  # OUT/metrics.jsonl (and TensorBoard), by rank 0
    grad_norm: bool = True  # each step's global gradient norm for the metrics (`--no-grad-norm`)
    max_grad_norm: float | None = None  # clip by the global gradient norm (the schedule must have grad_clip)
    eval_data: str | None = None  # held-out data file (`--eval-data`), else
    eval_fraction: float = 0.0  # the share of `data`'s sequences held out (`--eval-fraction`)
    eval_every: int = 0  # evaluate every N steps (0: at the end only), when there is held-out data
    save_every: int = 0  # also save the model to OUT/step-N every N steps (0: off)
    save_dtype: str | None = None  # the saved weights' dtype (DTYPES key; None: fp32, the masters')
    save_model: bool = True
    keep_masters: bool = False  # return the final fp32 masters in the result (tests)
    compile_blocks: bool = False  # torch.compile the decoder blocks (`--compile`, backends/model/compiled.py)
    compile_backend: str = COMPILE_BACKEND
    stop_after: int | None = None  # behave as if interrupted after this many steps (tests)
    trace_memory: bool = False  # CUDA: sample the allocator at each action (`--trace-memory`; run_actions(memory=))
    identity: dict[str, Any] = field(default_factory=dict)  # what a checkpoint must match on --resume
    record: dict[str, Any] = field(default_factory=dict)  # the run's options, recorded for --resume
    timeout_s: float = 600.0
    lora_files: LoraFiles = LoraFiles()  # LoRA: an adapter directory to continue from; --merge
    rss_guard: GuardSettings = GuardSettings()  # when host memory runs low the rank stops as Ctrl-C stops it
    report_to: str | None = None  # `wandb`: rank 0 logs the metrics to Weights & Biases too (`--report-to`)
    feed: LocalFeed | ProcessFeed | None = None  # the Python API's callback: rank 0's metrics rows, a stop request

    @property
    def tokens_per_step(self) -> int:
        return self.schedule.microbatches * self.microbatch_size * self.seq_len


@dataclass
class RankResult:
    """What one rank reports at the end (gathered to rank 0)."""

    rank: int
    layers: list[int]
    losses: dict[int, float]
    records: list[Record]
    order: dict[str, list[int]]
    memory: list[tuple[float, int]]
    ledger_peak: dict[str, int]
    ledger_problems: list[str]
    held: dict[str, Any]  # HeldBytes.to_json()
    peak_device_bytes: int
    peak_rss_bytes: int
    start_step: int
    steps_run: int
    wall_s: float
    interrupted: bool = False
    peak_reserved_bytes: int = 0  # the caching allocator's peak reserved memory (CUDA)
    alloc_retries: int = 0  # allocations that found no cached block within the cap and freed cache (CUDA)
    masters: dict[int, dict[str, torch.Tensor]] | None = None
    issued: list[int] = field(default_factory=list)  # action ids in the order the host issued them
    peaks: list[tuple[float, int, int]] = field(default_factory=list)  # RunLog.peaks (CUDA with Job.trace_memory)
    issue: list[tuple[int, float, float]] = field(default_factory=list)  # RunLog.issue: the main thread's issue spans
    # (name, start, end) on the host clock: the rank's work between windows and garbage collections of 1 ms
    # or more (hostwork.gc_pauses), drawn on the trace's `gN.host`
    host: list[tuple[str, float, float]] = field(default_factory=list)
    # host RSS at points of the rank's life: phase -> (resident now, peak so far), bytes
    rss_phases: dict[str, tuple[int, int]] = field(default_factory=dict)
    # most pinned host bytes held at once: the slabs this rank registered with CUDA, and PyTorch's pinned
    # caching allocator (None where torch has no statistics for it); two peaks, so their sum is an upper bound
    pinned_peak_bytes: dict[str, int | None] = field(default_factory=dict)
    # the host's CPU time a hypervisor took (cpustat.Steal) over the training loop; None where unknown
    host_steal_share: float | None = None
    checkpoint_failures: list[str] = field(default_factory=list)  # checkpoint.Failed.line() of each not written
    eval_losses: dict[int, float] = field(default_factory=dict)  # step (0-based) -> held-out loss after it (rank 0)
    low_memory: LowMemory | None = None  # what this rank's host-memory guard saw when it stopped the run
