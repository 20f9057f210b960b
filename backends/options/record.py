"""`tinypipe run`'s options after `settings.settle`: one frozen, typed record that the planner reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from tinypipe.policy.lora_spec import LoraSpec, lora_from_flags


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """Every `tinypipe run` option, settled: defaults filled in (or, with --resume, the checkpoint's
    record of the run), numbers and output paths checked (`settings.settle` builds it, once).

    `None` keeps its meaning from the command line where the planner decides: `policy` and
    `microbatch_size` (the embedded job's or the policy's), `lr` (by the model's size), `dtype` and
    `compile` (by backend), `gpu_mem` (the whole GPU), `hardware` (the local GPU's preset), `data`
    (the embedded addition task).
    """

    model: str
    data: str | None
    byte_tokens: bool
    packing: bool
    epochs: float | None
    policy: str | None
    microbatch_size: int | None
    gpus: int
    steps: int  # with --epochs in a new run, 0 until the planner counts the data's sequences
    seq_len: int
    batch_tokens: int
    dtype: str | None
    lr: float | None
    lr_schedule: str
    lr_schedule_kwargs: dict[str, Any] | None
    warmup_steps: int | None
    warmup_ratio: float | None
    decay_all: bool
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    seed: int
    backend: str
    checkpoint_every: int
    checkpoint_minutes: float
    out: str
    save_every: int
    save_dtype: str | None
    resume: bool = False
    gpu_mem: str | None = None
    hardware: str | None = None
    compile: bool | None = None
    trace: str | None = None
    trace_memory: bool = False
    grad_norm: bool = True
    max_grad_norm: float | None = None
    data_split: str | None = None  # a Hugging Face dataset's split (None: train) and configuration
    data_config: str | None = None
    eval_data: str | None = None
    eval_fraction: float | None = None
    eval_every: int | None = None
    profile: tuple[str, ...] = ()
    optimizer_state: str | None = None  # the moments' precision (None: the policy's)
    keep_checkpoints: int = 1  # complete checkpoints kept in --out (0: none written)
    save: bool = True  # write the fine-tuned model at the end (`--no-save`: not)
    host_mem: str | None = None  # host memory the run may take (None: this machine's, `hostfit.run_host_limit`)
    calibrate: str | None = None  # auto | now | off (None: auto)
    lora: int | None = None  # LoRA's rank (None: every parameter trains); its other options as given
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    lora_targets: str | None = None
    load_in_4bit: bool = False  # --lora's base held as NF4 on the host (`LoraSpec.nf4`)
    merge: bool = False
    report_to: str | None = None  # `wandb`: metrics.jsonl's numbers to Weights & Biases too
    record: dict[str, Any] | None = None  # the checkpoint's meta.json when resuming

    @classmethod
    def from_values(cls, given: Mapping[str, Any]) -> RunOptions:
        """The fields of `given` (settled options by name); lists become tuples."""
        values: dict[str, Any] = {f.name: given[f.name] for f in fields(cls) if f.name in given}
        values["betas"] = (float(values["betas"][0]), float(values["betas"][1]))
        values["profile"] = tuple(values.get("profile") or ())
        return cls(**values)

    def lora_spec(self) -> LoraSpec | None:
        """The adapters `--lora` and its flags ask for (None: every parameter trains)."""
        return lora_from_flags(self.lora, self.lora_alpha, self.lora_dropout, self.lora_targets,
                               bool(self.load_in_4bit))
