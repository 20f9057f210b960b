"""`tinypipe profile`'s options: registered by the CLI on every start (so this module imports no torch), and the
typed record `command.profile_main` takes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import tinypipe.cli.flags as flags
from tinypipe.policy.lora_spec import LoraSpec


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """`tinypipe profile`'s options as the command line gave them (`cli.edge` builds it; `command` checks it)."""

    model: str
    out: str
    seq_len: int = 2048
    microbatch_size: tuple[int, ...] = (1,)  # one trace each
    backend: str = "cpu"
    dtype: str | None = None  # None: fp32 on cpu, bf16 on cuda
    repeat: int = 10
    warmup: int = 2
    threads: int | None = None
    hardware: str | None = None
    compile: bool | None = None
    no_rates: bool = False
    no_optimizer: bool = False
    optimizer_rounds: int | None = None
    optimizer_phases: bool = False
    no_loop: bool = False
    lora: LoraSpec | None = None
    seed: int = 0
    json: bool = False


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    """Register `tinypipe profile`'s options on `p` (the CLI's subparser); `command.profile_main` runs it."""
    flags.add_model(p, "shipped model name, config.json, or a local model directory", required=True)
    flags.add_seq_len(p, "tokens per sequence (default 2048)")
    flags.add_microbatch_size(p, "sequences per microbatch, one trace each (default 1)", default=[1], many=True,
                              metavar="N")
    flags.add_backend(p, "cpu: this host's CPU, as `run --backend cpu` uses it; cuda: the current GPU (default cpu)",
                      default="cpu")
    flags.add_dtype(p, "compute dtype (default: fp32 on cpu, bf16 on cuda, as `run`)", choices=("fp32", "bf16"),
                    default=None)
    p.add_argument("--repeat", type=int, default=10, help="measured runs per time, the median kept (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured runs first (default 2)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: all cores, and for the optimizer step of each layer kind "
                        "those one rank of `run` gets: all cores on cpu, one less on cuda; `run` gives each of its N "
                        "ranks cores/N, one less on cuda)")
    flags.add_hardware(p, "base preset for hardware.json (the measured rates put into it) and, on CUDA, the GPU "
                       "model name the traces carry (default on CUDA: the shipped preset of this GPU model)",
                       metavar="NAME|FILE")
    flags.add_compile(p, "torch.compile the decoder block, as `run --compile` runs it; the traces say so and a run "
                         "takes only traces that match it (default: on for cuda, off for cpu, as `run`)")
    p.add_argument("--no-rates", action="store_true", help="measure the layers only (no rates.json, hardware.json)")
    p.add_argument("--no-optimizer", action="store_true",
                   help="skip the host optimizer step of each layer kind (alone and beside the device's work, at the "
                        "thread count of one rank of `run`, or --threads); without it the simulator costs the "
                        "optimizer at the host's rate")
    p.add_argument("--optimizer-rounds", type=int, default=None, metavar="N",
                   help="time every kind's host optimizer step in N rounds, one after another, and take the medians "
                        "over all of them (default 3 on cuda, 1 on cpu): on virtual machines the host's steps can "
                        "run 2x slow for tens of seconds at a time, with the hypervisor taking CPU time (the profile "
                        "prints the share it took in each round); a round in which it took more than 1%% is taken "
                        "again, up to N more, and left out of the medians")
    p.add_argument("--optimizer-phases", action="store_true",
                   help="also time the host optimizer step beside a loop of FWDs only and one of BWDs only, and the "
                        "async step alone (the simulator then runs the step at the rate of what the compute stream "
                        "runs); off by default: on an H200 these did not reproduce a run's steps beside "
                        "the forward (40-47 ms against ~80 ms for a Qwen3-1.7B block) and made the compiled async "
                        "prediction worse (-27%% against -18%%)")
    p.add_argument("--no-loop", action="store_true",
                   help="skip timing the block's FWD and BWD inside the executor's loop (alone and beside a stepping "
                        "host optimizer, what the simulator charges a recomputed block); without it the simulator "
                        "takes the isolated times")
    flags.add_lora(p, what="measure the block on a frozen base with these LoRA adapters (its FWD and BWD as a LoRA "
                           "run's; the traces say so and a LoRA run with the same adapters takes them; no host "
                           "optimizer or loop timing: a frozen base has no host step)")
    flags.add_seed(p, "random weights and inputs (default 0)", default=0)
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the JSON files (made if missing)")
    flags.add_json(p, "print what was written and measured as JSON")
