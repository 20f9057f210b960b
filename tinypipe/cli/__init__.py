"""The `tinypipe` command: inspect, simulate, search, run, replay, profile.

The parser and the dispatch; the commands are `inspect.py`, `simulate.py` (simulate and search) and,
for run, replay and profile, thin calls into backends/ and `tinypipe.replay.runner`. A flag that several
commands share is declared once, in `flags.py`; `edge.py` reads the parsed command line into the typed
records the commands pass down (no function below this package takes the Namespace). The modules of
this package are the only core ones that may import sim/ and backends/, inside functions.

User mistakes end in one line `error: ...` and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from tinypipe.common.errors import InputError, TinypipeError
from tinypipe.common.progress import CLEAR

from . import flags
from .edge import profile_options, replay_options, run_options
from .inspect import cmd_inspect
from .simulate import cmd_search, cmd_simulate

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InputError(f"{self.prog}: {message}")


def _common_workload(p: argparse.ArgumentParser) -> None:
    flags.add_model(p, default="llama-3.1-8b")
    flags.add_hardware(p, default="rtx4090x8-pcie4")
    flags.add_seq_len(p, "tokens per sequence (default 2048)")
    flags.add_microbatches(p, "override the policy's microbatch count")
    flags.add_microbatch_size(p, "override sequences per microbatch")
    flags.add_iterations(p, "iterations compiled and simulated (default 3)", default=3)
    flags.add_dtype(p, DTYPE_HELP)
    flags.add_profile(p)
    flags.add_lora(p)
    flags.add_calibration(p)
    flags.add_json(p, "print JSON for programs instead of tables")


DTYPE_HELP = "compute dtype of the workload, which a --profile trace must match (default bf16)"
HERE = ("`here`: this machine's MemAvailable or cgroup limit (default: `here` when the hardware's GPUs are this "
        "machine's, else the hardware's)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="tinypipe", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", parser_class=_Parser)
    _add_inspect(sub.add_parser("inspect", help="models, hardware, schedules: sizes, routes, what fits where"))
    _add_simulate(sub.add_parser("simulate", help="simulate policies side by side (one workload with --batch-tokens)"))
    _add_search(sub.add_parser("search", help="find the fastest policy that fits (simulated), and the Pareto front"))
    _add_replay(sub.add_parser("replay", help="re-run a real run's trace in the simulator with its measured "
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


def _add_inspect(ins: argparse.ArgumentParser) -> None:
    isub = ins.add_subparsers(dest="what", parser_class=_Parser)
    im = isub.add_parser("model", help="per-layer sizes, pack footprints, host bytes, fit")
    im.add_argument("name", nargs="?", help="shipped model name, config.json path or Hugging Face Hub id "
                    "(none: list them)")
    flags.add_seq_len(im)
    flags.add_microbatch_size(im, default=1)
    flags.add_hardware(im, "check fit on this hardware (default: every preset)", many=True)
    flags.add_lora(im)
    flags.add_host_mem(im, "size each server's host DRAM at this instead, e.g. 256GiB (a machine like the preset "
                           "with another amount of memory)", metavar="BYTES")
    flags.add_json(im)
    icov = isub.add_parser("coverage", help="the largest model each server can fine-tune, by host memory, "
                           "per optimizer-state precision and with LoRA, beside RoundPipe and ZeRO-Offload")
    flags.add_hardware(icov, "server preset or JSON (default: every shipped preset)", many=True)
    flags.add_seq_len(icov)
    flags.add_json(icov)
    ih = isub.add_parser("hardware", help="nodes, links, routes (no name: list the shipped presets)")
    ih.add_argument("name", nargs="?")
    flags.add_json(ih)
    isch = isub.add_parser("schedule", help="compile and validate a policy; action counts and the grid")
    _common_workload(isch)
    flags.add_policy(isch, "preset name or policy JSON file", default="tinypipe")
    isch.add_argument("--out", help="write the schedule's text form here")
    isch.add_argument("--steps", type=int, default=24, help="grid rows to print")


def _add_simulate(sim: argparse.ArgumentParser) -> None:
    _common_workload(sim)
    flags.add_policy(sim, "preset name or policy JSON (repeatable; default: resident, mobius, tinypipe)", many=True)
    flags.add_batch_tokens(sim, "tokens per optimizer step for every policy (each policy's microbatch count is set "
                                "to match; default: each policy's own, shown in the tokens/step column)")
    flags.add_gpu_mem(sim, "limit per GPU, e.g. 24GiB (default: the hardware's)")
    flags.add_host_mem(sim, f"host DRAM limit, e.g. 256GiB, or {HERE}")
    flags.add_optimizer_state(sim, "hold AdamW's moments as fp32, bf16 or 8-bit blocks in every policy (default: "
                                   "each policy's own, fp32)")
    flags.add_workers(sim, "processes simulating the policies side by side (default: all cores)")
    sim.add_argument("--trace", help="write a Chrome trace (Perfetto) of the first policy")
    sim.add_argument("--plot", help="write a PNG timeline of the first policy")


def _add_search(se: argparse.ArgumentParser) -> None:
    flags.add_model(se, default="llama-3.1-8b")
    flags.add_hardware(se, default="rtx4090x8-pcie4")
    flags.add_seq_len(se)
    flags.add_batch_tokens(se, "tokens per optimizer step (default 65536)", default=65536)
    flags.add_gpu_mem(se, "tighter limit per GPU, e.g. 20GiB")
    flags.add_host_mem(se, f"tighter host DRAM limit, e.g. 128GiB, or {HERE}")
    flags.add_workers(se, "processes evaluating candidates (default: all cores)")
    se.add_argument("--top", type=int, default=10, help="candidates listed (default 10)")
    se.add_argument("--out", help="write the winning policy JSON here (simulate and run accept it)")
    se.add_argument("--plot", help="write the Pareto front as a PNG")
    se.add_argument("--prefer", choices=("footprint", "speed"), default="footprint",
                    help="footprint (default): among candidates within the simulator's 2%% error band of the fastest, "
                         "the least GPU memory, then the least host memory; speed: the fastest predicted")
    se.add_argument("--allow-async", action="store_true",
                    help="also consider the async optimizer (staleness 1: changes the training semantics)")
    flags.add_optimizer_state(se, "how the host holds AdamW's moments: fp32 (default, exact), bf16, 8bit (block-wise "
                                  "quantised), or auto: the most precise of these for which a policy fits (it changes "
                                  "the numerics, so only when asked)", auto=True, default="fp32")
    flags.add_dtype(se, DTYPE_HELP)
    flags.add_profile(se)
    flags.add_lora(se)
    flags.add_calibration(se)
    flags.add_json(se)


def _add_replay(p: argparse.ArgumentParser) -> None:
    from tinypipe.compiler import WINDOW_ITERATIONS

    p.add_argument("trace", metavar="RUN_TRACE", help="Chrome trace (`tinypipe run --trace`) or timeline JSON of a run")
    flags.add_model(p, "model name or config.json (default: the trace's)")
    flags.add_hardware(p, "hardware preset or JSON the run compiled for (default: the trace's)")
    flags.add_policy(p, "policy JSON or preset the run used (default: the trace's record of it)")
    flags.add_seq_len(p, "tokens per sequence (default: the trace's)", default=None)
    flags.add_batch_tokens(p, "tokens per optimizer step (sets the microbatch count)")
    flags.add_microbatches(p, "microbatches per step (instead of --batch-tokens)")
    flags.add_gpu_mem(p, "GPU memory the run was planned for, e.g. 24GiB (the prediction's capacity)")
    flags.add_iterations(p, f"iterations the run compiled (default: the trace's, else min({WINDOW_ITERATIONS}, "
                            "steps), `tinypipe run`'s longest window)")
    p.add_argument("--schedule", help="the schedule's text form the run executed (`tinypipe inspect schedule "
                   "--out`) (default: recompiled from the settings)")
    p.add_argument("--warmup", type=int, default=1, help="iterations left out of the steady state (default 1)")
    p.add_argument("--window", type=int, default=0, help="which of the run's whole windows to replay: 0 the first "
                   "(default), 1 the next, -1 the last")
    p.add_argument("--top", type=int, default=8, help="rows of the kind and gap tables (default 8)")
    flags.add_json(p, "print JSON for programs instead of tables")


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
    status: int = profile_main(profile_options(args))
    return status


def _cmd_run(args: argparse.Namespace) -> int:
    if getattr(args, "_run_missing", None):
        raise InputError(f"`tinypipe run` needs the torch extra: pip install 'tinypipe[torch]' ({args._run_missing})")
    from tinypipe.backends.launch.run import run_main

    status: int = run_main(run_options(args))
    return status


def _cmd_replay(args: argparse.Namespace) -> int:
    from tinypipe.replay.runner import replay_main
    from tinypipe.sim import simulate

    return replay_main(replay_options(args), simulate=simulate)


_HANDLERS: dict[str | None, Callable[[argparse.Namespace], int]] = {
    "inspect": cmd_inspect, "simulate": cmd_simulate, "run": _cmd_run, "search": cmd_search,
    "profile": _cmd_profile, "replay": _cmd_replay,
}
