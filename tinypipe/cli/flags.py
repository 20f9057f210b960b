"""The flags several commands share, each declared here once: its name, type and form; a command gives its default
and help. `edge.py` reads them into typed records; `run` and `profile` register theirs through these too."""

from __future__ import annotations

import argparse

from tinypipe.policy.lora_spec import DEFAULT_ALPHA, DEFAULT_TARGETS, ROLES
from tinypipe.policy.modes import OptimizerState

Parser = argparse.ArgumentParser
MODEL_HELP = "shipped model name, config.json path, or Hugging Face Hub id (org/name, through its cache)"
HARDWARE_HELP = "shipped hardware name or JSON path"


def add_model(p: Parser, help: str = MODEL_HELP, *, default: str | None = None, required: bool = False) -> None:
    p.add_argument("--model", default=default, required=required, help=help)


def add_hardware(p: Parser, help: str = HARDWARE_HELP, *, default: str | None = None, many: bool = False,
                 metavar: str | None = None) -> None:
    """`--hardware`, once, or repeatable (`many`: a list)."""
    p.add_argument("--hardware", default=default, action="append" if many else "store", metavar=metavar, help=help)


def add_seq_len(p: Parser, help: str | None = None, *, default: int | None = 2048) -> None:
    p.add_argument("--seq-len", type=int, default=default, help=help)


def add_batch_tokens(p: Parser, help: str, *, default: int | None = None) -> None:
    p.add_argument("--batch-tokens", type=int, default=default, help=help)


def add_microbatches(p: Parser, help: str) -> None:
    p.add_argument("--microbatches", type=int, default=None, help=help)


def add_microbatch_size(p: Parser, help: str | None = None, *, default: int | list[int] | None = None,
                        many: bool = False, metavar: str | None = None) -> None:
    """`--microbatch-size N`, or several sizes (`many`: a list)."""
    p.add_argument("--microbatch-size", type=int, nargs="+" if many else None, default=default, metavar=metavar,
                   help=help)


def add_iterations(p: Parser, help: str, *, default: int | None = None) -> None:
    p.add_argument("--iterations", type=int, default=default, help=help)


def add_gpu_mem(p: Parser, help: str, *, metavar: str | None = None) -> None:
    """`--gpu-mem BYTES`: a size as people type it (`common.units.parse_bytes`), read where the command's
    record is built."""
    p.add_argument("--gpu-mem", default=None, metavar=metavar, help=help)


def add_host_mem(p: Parser, help: str, *, metavar: str | None = None) -> None:
    """`--host-mem BYTES` (or `here` where a command says so), read where the command's record is built."""
    p.add_argument("--host-mem", default=None, metavar=metavar, help=help)


def add_dtype(p: Parser, help: str, *, choices: tuple[str, ...] = ("bf16", "fp16", "fp32"),
              default: str | None = "bf16") -> None:
    p.add_argument("--dtype", choices=choices, default=default, help=help)


def add_profile(p: Parser, help: str = "measured traces (`tinypipe profile --out DIR`): a directory or a trace JSON, "
                "repeatable; a matching one is used before the shipped ones") -> None:
    p.add_argument("--profile", action="append", default=None, metavar="DIR_OR_FILE", help=help)


def add_optimizer_state(p: Parser, help: str, *, auto: bool = False, default: str | None = None) -> None:
    """`--optimizer-state` among `OptimizerState`'s values (and `auto` where the command chooses one)."""
    p.add_argument("--optimizer-state", choices=(*OptimizerState.choices(), *(("auto",) if auto else ())),
                   default=default, help=help)


def add_policy(p: Parser, help: str, *, default: str | None = None, many: bool = False) -> None:
    """`--policy NAME|FILE`, once, or repeatable (`many`: a list)."""
    p.add_argument("--policy", default=default, action="append" if many else "store", help=help)


def add_workers(p: Parser, help: str) -> None:
    p.add_argument("--workers", type=int, default=None, help=help)


def add_json(p: Parser, help: str | None = None) -> None:
    p.add_argument("--json", action="store_true", help=help)


def add_backend(p: Parser, help: str, *, default: str | None = None) -> None:
    p.add_argument("--backend", choices=("cpu", "cuda"), default=default, help=help)


def add_compile(p: Parser, help: str) -> None:
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help=help)


def add_seed(p: Parser, help: str, *, default: int | None = None) -> None:
    p.add_argument("--seed", type=int, default=default, help=help)


def add_lora(p: Parser, what: str = "train LoRA adapters of rank R on a frozen base (default: every parameter)"
             ) -> None:
    """`--lora R [--lora-alpha A] [--lora-dropout P] [--lora-targets q,k,v,o,gate,up,down]` (peft's defaults);
    `edge.lora_of` reads them into a `LoraSpec`."""
    p.add_argument("--lora", type=int, default=None, metavar="R", help=what)
    p.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                   help=f"LoRA scaling numerator: updates scale by A / R (default {DEFAULT_ALPHA:g}, peft's)")
    p.add_argument("--lora-dropout", type=float, default=None, metavar="P", help="dropout on the adapters' input "
                   "(default 0)")
    p.add_argument("--lora-targets", default=None, metavar="LIST",
                   help=f"linears to adapt among {','.join(ROLES)}, or all (default {','.join(DEFAULT_TARGETS)}, "
                        "peft's)")
    p.add_argument("--load-in-4bit", action="store_true", default=None,
                   help="with --lora: hold the frozen base's block linears on the host as NF4 (QLoRA's 4-bit "
                        "NormalFloat, 4.5 bits a parameter) and dequantise them on the GPU at each upload; needs "
                        "bitsandbytes (pip install 'tinypipe[qlora]')")


def add_calibration(p: Parser) -> None:
    p.add_argument("--calibration", metavar="here|FILE",
                   help="plan with a host's measured optimizer and copy rates: `here`, this machine's as `tinypipe "
                        "run` cached them (younger than 6 h), or a `tinypipe profile` rates.json (or its directory); "
                        "the traces' host optimizer steps are scaled to them, as `run` does")


# every flag declared here, for tests/test_layering.py: none is declared anywhere else
SHARED = ("--model", "--hardware", "--seq-len", "--batch-tokens", "--microbatches", "--microbatch-size",
          "--iterations", "--gpu-mem", "--host-mem", "--dtype", "--profile", "--optimizer-state", "--policy",
          "--workers", "--json", "--backend", "--compile", "--seed", "--lora", "--lora-alpha", "--lora-dropout",
          "--lora-targets", "--load-in-4bit", "--calibration")
