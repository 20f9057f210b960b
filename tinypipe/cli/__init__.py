"""The `tinypipe` command: inspect, simulate, search, run, replay, profile.

The parser and the dispatch; the commands are `inspect.py`, `simulate.py` (simulate and search) and,
for run, replay and profile, thin calls into backends/ and `tinypipe.replay.runner`. The modules of
this package are the only core ones that may import sim/ and backends/, inside functions.

User mistakes end in one line `error: ...` and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from tinypipe.common.errors import InputError, TinypipeError
from tinypipe.common.progress import CLEAR
from tinypipe.policy.lora_spec import add_lora_arguments

from .inspect import cmd_inspect
from .simulate import cmd_search, cmd_simulate

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InputError(f"{self.prog}: {message}")


def _common_workload(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.1-8b", help="shipped model name or config.json path")
    p.add_argument("--hardware", default="rtx4090x8-pcie4", help="shipped hardware name or JSON path")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--microbatches", type=int, default=None, help="override the policy's microbatch count")
    p.add_argument("--microbatch-size", type=int, default=None, help="override sequences per microbatch")
    p.add_argument("--iterations", type=int, default=3, help="iterations compiled and simulated (default 3)")
    _dtype_option(p)
    _profile_option(p)
    add_lora_arguments(p)
    _calibration_option(p)
    p.add_argument("--json", action="store_true", help="print JSON for programs instead of tables")


def _dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="compute dtype of the workload, which a --profile trace must match (default bf16)")


def _calibration_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration", metavar="here|FILE",
                   help="plan with a host's measured optimizer and copy rates: `here`, this machine's as `tinypipe "
                        "run` cached them (younger than 6 h), or a `tinypipe profile` rates.json (or its directory); "
                        "the traces' host optimizer steps are scaled to them, as `run` does")


def _profile_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", action="append", metavar="DIR_OR_FILE",
                   help="measured traces (`tinypipe profile --out DIR`): a directory or a trace JSON, repeatable; "
                        "a matching one is used before the shipped ones")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="tinypipe", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", parser_class=_Parser)

    ins = sub.add_parser("inspect", help="models, hardware, schedules: sizes, routes, what fits where")
    isub = ins.add_subparsers(dest="what", parser_class=_Parser)
    im = isub.add_parser("model", help="per-layer sizes, pack footprints, host bytes, fit")
    im.add_argument("name", nargs="?", help="shipped model name or config.json path (none: list them)")
    im.add_argument("--seq-len", type=int, default=2048)
    im.add_argument("--microbatch-size", type=int, default=1)
    im.add_argument("--hardware", action="append", help="check fit on this hardware (default: every preset)")
    add_lora_arguments(im)
    im.add_argument("--host-mem", metavar="BYTES", help="size each server's host DRAM at this instead, e.g. 256GiB "
                    "(a machine like the preset with another amount of memory)")
    im.add_argument("--json", action="store_true")
    icov = isub.add_parser("coverage", help="the largest model each server can fine-tune, by host memory, "
                           "per optimizer-state precision and with LoRA, beside RoundPipe and ZeRO-Offload")
    icov.add_argument("--hardware", action="append", help="server preset or JSON (default: every shipped preset)")
    icov.add_argument("--seq-len", type=int, default=2048)
    icov.add_argument("--json", action="store_true")
    ih = isub.add_parser("hardware", help="nodes, links, routes (no name: list the shipped presets)")
    ih.add_argument("name", nargs="?")
    ih.add_argument("--json", action="store_true")
    isch = isub.add_parser("schedule", help="compile and validate a policy; action counts and the grid")
    _common_workload(isch)
    isch.add_argument("--policy", default="tinypipe", help="preset name or policy JSON file")
    isch.add_argument("--out", help="write the schedule's text form here")
    isch.add_argument("--steps", type=int, default=24, help="grid rows to print")

    sim = sub.add_parser("simulate", help="simulate policies side by side (one workload with --batch-tokens)")
    _common_workload(sim)
    sim.add_argument("--policy", action="append", help="preset name or policy JSON (repeatable; "
                     "default: resident, mobius, tinypipe)")
    sim.add_argument("--batch-tokens", type=int, default=None,
                     help="tokens per optimizer step for every policy (each policy's microbatch count is set to "
                          "match; default: each policy's own, shown in the tokens/step column)")
    sim.add_argument("--gpu-mem", help="limit per GPU, e.g. 24GiB (default: the hardware's)")
    sim.add_argument("--host-mem", help="host DRAM limit, e.g. 256GiB, or `here`: this machine's MemAvailable or "
                     "cgroup limit (default: `here` when the hardware's GPUs are this machine's, else the hardware's)")
    sim.add_argument("--optimizer-state", choices=("fp32", "bf16", "8bit"), default=None,
                     help="hold AdamW's moments as fp32, bf16 or 8-bit blocks in every policy (default: each "
                          "policy's own, fp32)")
    sim.add_argument("--workers", type=int, default=None,
                     help="processes simulating the policies side by side (default: all cores)")
    sim.add_argument("--trace", help="write a Chrome trace (Perfetto) of the first policy")
    sim.add_argument("--plot", help="write a PNG timeline of the first policy")

    se = sub.add_parser("search", help="find the fastest policy that fits (simulated), and the Pareto front")
    se.add_argument("--model", default="llama-3.1-8b", help="shipped model name or config.json path")
    se.add_argument("--hardware", default="rtx4090x8-pcie4", help="shipped hardware name or JSON path")
    se.add_argument("--seq-len", type=int, default=2048)
    se.add_argument("--batch-tokens", type=int, default=65536, help="tokens per optimizer step (default 65536)")
    se.add_argument("--gpu-mem", help="tighter limit per GPU, e.g. 20GiB")
    se.add_argument("--host-mem", help="tighter host DRAM limit, e.g. 128GiB, or `here`: this machine's "
                    "MemAvailable or cgroup limit (default: `here` when the hardware's GPUs are this machine's, "
                    "else the hardware's)")
    se.add_argument("--workers", type=int, default=None, help="processes evaluating candidates (default: all cores)")
    se.add_argument("--top", type=int, default=10, help="candidates listed (default 10)")
    se.add_argument("--out", help="write the winning policy JSON here (simulate and run accept it)")
    se.add_argument("--plot", help="write the Pareto front as a PNG")
    se.add_argument("--prefer", choices=("footprint", "speed"), default="footprint",
                    help="footprint (default): among candidates within the simulator's 2%% error band of the fastest, "
                         "the least GPU memory, then the least host memory; speed: the fastest predicted")
    se.add_argument("--allow-async", action="store_true",
                    help="also consider the async optimizer (staleness 1: changes the training semantics)")
    se.add_argument("--optimizer-state", choices=("fp32", "bf16", "8bit", "auto"), default="fp32",
                    help="how the host holds AdamW's moments: fp32 (default, exact), bf16, 8bit (block-wise "
                         "quantised), or auto: the most precise of these for which a policy fits (it changes the "
                         "numerics, so only when asked)")
    _dtype_option(se)
    _profile_option(se)
    add_lora_arguments(se)
    _calibration_option(se)
    se.add_argument("--json", action="store_true")

    from tinypipe.replay.runner import add_replay_arguments

    add_replay_arguments(sub.add_parser("replay", help="re-run a real run's trace in the simulator with its measured "
                                        "durations; where measurement, replay and prediction diverge"))

    pr = sub.add_parser("profile", help="measure per-layer traces and host rates on this device (PyTorch)")
    from tinypipe.backends.profile.profile_flags import add_profile_arguments  # no torch import: always there

    add_profile_arguments(pr)

    run = sub.add_parser("run", help="train through the compiled schedule (PyTorch)")
    try:
        from tinypipe.backends.options.run_flags import add_run_arguments
    except ImportError as exc:  # torch missing: the subcommand explains itself when used
        run.add_argument("rest", nargs=argparse.REMAINDER)
        run.set_defaults(_run_missing=str(exc))
    else:
        add_run_arguments(run)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        handler = _HANDLERS.get(args.command)
        if handler is None:  # plain `tinypipe`: a request for help
            build_parser().print_help()
            return 0
        return handler(args)
    except TinypipeError as exc:
        if sys.stderr.isatty():
            sys.stderr.write(CLEAR)  # a progress line on the terminal gives way to the error
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    try:
        from tinypipe.backends.profile.command import profile_main
    except ImportError as exc:
        raise InputError(f"`tinypipe profile` needs the torch extra: pip install 'tinypipe[torch]' ({exc})") from None
    status: int = profile_main(args)
    return status


def _cmd_run(args: argparse.Namespace) -> int:
    if getattr(args, "_run_missing", None):
        raise InputError(f"`tinypipe run` needs the torch extra: pip install 'tinypipe[torch]' ({args._run_missing})")
    from tinypipe.backends.launch.run import run_main

    status: int = run_main(args)
    return status


_HANDLERS: dict[str | None, Callable[[argparse.Namespace], int]] = {
    "inspect": cmd_inspect, "simulate": cmd_simulate, "run": _cmd_run, "search": cmd_search,
    "profile": _cmd_profile,
}


def _cmd_replay(args: argparse.Namespace) -> int:
    from tinypipe.replay.runner import replay_main
    from tinypipe.sim import simulate

    return replay_main(args, simulate=simulate)


_HANDLERS["replay"] = _cmd_replay


