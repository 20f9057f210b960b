"""`tinypipe run`'s settings: defaults, the record a resumed run continues, checks that need no torch.

A run's options default to None on the command line, so this module can tell what was given. A new
run takes `DEFAULTS` for the rest. `--resume` takes the rest from the checkpoint's record of the
run (`checkpoint/meta.json`, key `run`): `--resume --out DIR` alone continues the run exactly as it
was started, to its recorded number of steps. A setting given again must equal the record, except
`--steps` (a longer run; fewer steps than are done is an error), the checkpoint cadence, `--backend`
and `--hardware`. Everything a user can get wrong without loading a model is checked here, before
any heavy import or worker: numbers, the optimizer's settings, and every output path.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.common.outputs import check_dir, check_file

from ..host.optim_rules import schedule_params
from .record import RunOptions

# The embedded job (plain `tinypipe run`): tiny-llama learns zero-padded 2-digit addition
# (`data/addition.py`) on 2 CPU workers. 500 steps of 512 tokens, peak lr 3e-3 (`optim_rules.default_lr`
# for its 181k parameters), cosine after 5% warmup: see tests/backends/test_default_job.py for what
# "learns" means and bench/results/default_run.json for the measured run. The 2-worker pipeline runs
# ~6,000 tokens/s with 4 sequences per microbatch (~60% more than with the preset's 1).
DEFAULT_BETAS = (0.9, 0.98)
DEFAULT_POLICY, DEFAULT_MICROBATCH_SIZE = "tinypipe", 4  # the embedded job's, where --policy is not given
DEFAULTS: dict[str, Any] = {
    "model": "tiny-llama", "policy": DEFAULT_POLICY, "microbatch_size": DEFAULT_MICROBATCH_SIZE, "gpus": 2,
    "steps": 500, "seq_len": 64, "batch_tokens": 512, "lr": None, "lr_schedule": "cosine", "warmup_steps": None,
    "warmup_ratio": 0.05, "decay_all": False, "betas": DEFAULT_BETAS, "eps": 1e-8, "weight_decay": 0.0, "seed": 0,
    "backend": "cpu", "checkpoint_every": 0, "checkpoint_minutes": 10.0, "byte_tokens": False, "packing": True,
    "epochs": None, "save_every": 0, "save_dtype": None, "keep_checkpoints": 1, "lr_schedule_kwargs": None,
    "load_in_4bit": False,
}
# Options recorded in a checkpoint and restored by --resume (argparse dest names).
RECORDED = ("model", "data", "policy", "microbatch_size", "gpus", "steps", "seq_len", "batch_tokens", "dtype",
            "lr", "lr_schedule", "warmup_steps", "warmup_ratio", "decay_all", "betas", "eps", "weight_decay", "seed",
            "backend", "checkpoint_every", "checkpoint_minutes", "byte_tokens", "packing", "epochs", "save_every",
            "save_dtype", "optimizer_state", "keep_checkpoints", "lora", "lora_alpha", "lora_dropout",
            "lora_targets", "load_in_4bit", "max_grad_norm", "eval_data", "eval_fraction", "eval_every",
            "lr_schedule_kwargs", "data_split", "data_config")
# may differ from the record
FREE_ON_RESUME = ("steps", "backend", "checkpoint_every", "checkpoint_minutes", "save_every", "save_dtype",
                  "keep_checkpoints")
# None stays None: make_run_plan chooses (the embedded job's or the policy's; the lr by the model's size)
PLANNED = ("policy", "microbatch_size", "lr", "optimizer_state")
SEED_LIMIT = 2**63
# directories a run saves a model in under --out: `--merge`'s, and `--save-every`'s or a stop's OUT/step-N
SAVED_DIR = re.compile(r"merged|step-\d+")
# bounds that keep a mistyped number from planning for ever (no model has more positions; no run more steps)
MAX_SEQ_LEN, MAX_BATCH_TOKENS, MAX_STEPS, MAX_EPOCHS = 1 << 24, 1 << 34, 10**9, 10**6


def rank_threads(backend: str, ranks: int, cores: int) -> int:
    """torch intra-op threads each of `ranks` ranks of `tinypipe run` gets on `cores` cores: an even share,
    less the core that issues GPU work on CUDA. `tinypipe profile` times the host optimizer at this count."""
    share = max(1, cores // max(1, ranks))
    return share if backend == "cpu" else max(1, share - 1)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _show(v: Any) -> str:
    return " ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def settle(given: Mapping[str, Any] | RunOptions) -> RunOptions:
    """`given` (the options as the command line gave them, by argparse dest, None where not given) with every
    recorded option filled in and checked, as a `RunOptions`; InputError on a mistake. Settled options are
    returned as they are."""
    if isinstance(given, RunOptions):
        return given
    asked = dict(given)
    model = asked.get("model")
    if model is not None and not model.strip():
        raise InputError("--model: empty; give a shipped model name, a config.json or a model directory")
    if model is not None and Path(model).exists():  # a path: recorded absolute, so any directory resumes it
        asked["model"] = str(Path(model).resolve())
    if isinstance(asked.get("lr_schedule_kwargs"), str):  # JSON on the command line; a dict when recorded
        asked["lr_schedule_kwargs"] = _json_object(asked["lr_schedule_kwargs"], "--lr-schedule-kwargs")
    out = dict(asked, record=None)  # record: the checkpoint's meta.json when resuming
    if asked.get("resume"):
        _resumed(asked, out)
    else:
        for dest in RECORDED:
            if asked.get(dest) is None:
                out[dest] = _default(dest, DEFAULTS)
        if asked.get("gpus") is None and asked.get("backend") == "cuda":
            out["gpus"] = _visible_cuda_devices() or DEFAULTS["gpus"]  # none visible: cuda_hardware says so
        if out["epochs"] is not None:
            if out["data"] is None:
                raise InputError("--epochs: give --data (the embedded addition task has no end); or use --steps")
            out["steps"] = 0  # counted by the planner from the data
    if not out.get("out"):
        out["out"] = str(Path("runs") / time.strftime("run-%Y%m%d-%H%M%S"))
    opts = RunOptions.from_values(out)  # a record holds JSON lists: from_values makes them tuples
    _check_numbers(opts)
    if opts.hardware is not None and opts.backend != "cuda":
        raise InputError(f"--hardware {opts.hardware}: only for --backend cuda (the cpu backend measures this "
                         "host's CPU as its hardware)")
    check_dir(Path(opts.out), "--out")
    if not opts.resume:
        _refuse_earlier_run(Path(opts.out))
    if opts.report_to == "wandb" and not _importable("wandb"):
        raise InputError("--report-to wandb: the wandb package is not installed here; pip install wandb, or leave "
                         "--report-to out (metrics.jsonl and TensorBoard do not need it)")
    if opts.trace:
        check_file(Path(opts.trace), "--trace")
    return opts


def _resumed(asked: dict[str, Any], out: dict[str, Any]) -> None:
    """--resume: fill `out` from the checkpoint's record of the run in --out; an option given again must match it."""
    where = asked.get("out")
    if not where:
        raise InputError("--resume: give --out DIR, the directory of the run to continue")
    out["record"] = _read_record(Path(where))
    ran = out["record"].get("run", {})
    for dest in RECORDED:
        given, recorded = asked.get(dest), ran.get(dest)
        if given is None:
            out[dest] = recorded if dest in ran else _default(dest, DEFAULTS)
        elif dest in ran and dest not in FREE_ON_RESUME and _norm(given) != _norm(recorded):
            raise InputError(f"--resume: the run in {where} was started with {_flag(dest)} "
                             f"{_show(recorded) if recorded is not None else '(default)'}, this command gives "
                             f"{_flag(dest)} {_show(given)}; leave it out to continue the run as it was, or "
                             "start a new run in another --out")
    done = int(out["record"]["step"])
    if not isinstance(out["steps"], int) or out["steps"] < done:
        raise InputError(f"--steps {out['steps']}: the checkpoint in {where} is already at step {done}; give "
                         f"--steps {done} to save its model, or more to train further")
    # out["steps"] == done: nothing to train; the workers load the checkpoint and save the model


def _visible_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _default(dest: str, defaults: dict[str, Any]) -> Any:
    return None if dest in PLANNED else defaults.get(dest)


def _norm(v: Any) -> Any:
    """Values as JSON gives them back (tuples become lists, ints stay ints, floats compare as floats)."""
    return json.loads(json.dumps(v))


def _read_record(out: Path) -> dict[str, Any]:
    from ..save.checkpoint import check_record, find, read_record

    found = find(out)
    if found is None:
        raise InputError(f"--resume: no checkpoint under {out}")
    meta = read_record(found)
    check_record(found, meta)
    return meta


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{flag} {text}: not JSON ({exc.msg}); give an object, e.g. "
                         "'{\"min_lr_rate\": 0.1}'") from None
    if not isinstance(value, dict):
        raise InputError(f"{flag} {text}: a JSON object, e.g. '{{\"min_lr_rate\": 0.1}}'")
    return value


def _check_numbers(a: RunOptions) -> None:
    for dest in ("gpus", "seq_len", "batch_tokens") + (("steps",) if a.epochs is None else ()):
        if getattr(a, dest) < 1:
            raise InputError(f"{_flag(dest)}: must be >= 1, got {getattr(a, dest)}")
    if a.seq_len > MAX_SEQ_LEN or a.batch_tokens > MAX_BATCH_TOKENS or a.steps > MAX_STEPS:
        raise InputError(f"--seq-len {a.seq_len}, --batch-tokens {a.batch_tokens}, --steps {a.steps}: at most "
                         f"{MAX_SEQ_LEN:,}, {MAX_BATCH_TOKENS:,} and {MAX_STEPS:,}")
    if a.epochs is not None and not (math.isfinite(a.epochs) and 0 < a.epochs <= MAX_EPOCHS):
        raise InputError(f"--epochs: must be a number in (0, {MAX_EPOCHS}], got {a.epochs}")
    if a.max_grad_norm is not None and not (math.isfinite(a.max_grad_norm) and a.max_grad_norm > 0):
        raise InputError(f"--max-grad-norm: must be a positive number, got {a.max_grad_norm}")
    if a.eval_fraction is not None and not (math.isfinite(a.eval_fraction) and 0 < a.eval_fraction < 1):
        raise InputError(f"--eval-fraction: must be in (0, 1), got {a.eval_fraction}")
    if a.eval_fraction is not None and a.data is None:
        raise InputError("--eval-fraction: give --data to hold a share of it out (or --eval-data FILE)")
    if (a.data_split is not None or a.data_config is not None) and a.data is None:
        flag = "--data-split" if a.data_split is not None else "--data-config"
        raise InputError(f"{flag}: give --data ORG/NAME, the Hugging Face dataset to read it of")
    if a.eval_every is not None and a.eval_every < 1:
        raise InputError(f"--eval-every: must be >= 1, got {a.eval_every}")
    if a.eval_every is not None and a.eval_data is None and a.eval_fraction is None:
        raise InputError("--eval-every: give --eval-data FILE or --eval-fraction F to evaluate on")
    if a.save_every < 0:
        raise InputError(f"--save-every: must be >= 0, got {a.save_every}")
    if a.microbatch_size is not None and a.microbatch_size < 1:
        raise InputError(f"--microbatch-size: must be >= 1, got {a.microbatch_size}")
    if a.keep_checkpoints < 0:
        raise InputError(f"--keep-checkpoints: must be >= 0, got {a.keep_checkpoints}")
    if a.checkpoint_every < 0:
        raise InputError(f"--checkpoint-every: must be >= 0, got {a.checkpoint_every}")
    if not (math.isfinite(a.checkpoint_minutes) and a.checkpoint_minutes >= 0):
        raise InputError(f"--checkpoint-minutes: must be a number >= 0, got {a.checkpoint_minutes}")
    if a.lr is not None and not (math.isfinite(a.lr) and a.lr > 0):
        raise InputError(f"--lr: must be a positive number, got {a.lr}")
    if a.warmup_steps is not None and a.warmup_steps < 0:
        raise InputError(f"--warmup-steps: must be >= 0, got {a.warmup_steps}")
    if a.warmup_ratio is not None and not (math.isfinite(a.warmup_ratio) and 0 <= a.warmup_ratio < 1):
        raise InputError(f"--warmup-ratio: must be in [0, 1), got {a.warmup_ratio}")
    schedule_params(a.lr_schedule, a.lr_schedule_kwargs)  # transformers' names and lr_scheduler_kwargs
    b1, b2 = a.betas
    for i, b in enumerate((b1, b2)):
        if not (math.isfinite(b) and 0.0 <= b < 1.0):
            raise InputError(f"--betas: each must be in [0, 1), got {b1} {b2} (B{i + 1} = {b})")
    if not (math.isfinite(a.eps) and a.eps > 0):
        raise InputError(f"--eps: must be a positive number, got {a.eps}")
    if not (math.isfinite(a.weight_decay) and a.weight_decay >= 0):
        raise InputError(f"--weight-decay: must be a number >= 0, got {a.weight_decay}")
    if not 0 <= a.seed < SEED_LIMIT:
        raise InputError(f"--seed: must be in 0..{SEED_LIMIT - 1}, got {a.seed}")


def record(opts: RunOptions) -> dict[str, Any]:
    """What a checkpoint records of the run's options (JSON-ready), for `settle` on --resume."""
    return {dest: _norm(getattr(opts, dest)) for dest in RECORDED}


def _importable(module: str) -> bool:
    """Whether `module` imports here: one in sys.modules counts as it is (a stand-in, or None: blocked)."""
    import importlib.util
    import sys

    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def _refuse_earlier_run(out: Path) -> None:
    """A new run never overwrites an earlier run's checkpoint, saved model or metrics in --out: a Hugging Face
    model, a LoRA run's adapter directory and merged model, a model saved every N steps (`worker`: OUT/step-N),
    or the lines of a metrics.jsonl (a run with --no-save and no checkpoint leaves nothing else)."""
    from ..rank.metrics import METRICS_FILE
    from ..save import checkpoint

    held = [p.name for p in (out / "config.json", out / "model.safetensors.index.json", out / "model.safetensors",
                             out / "adapter_config.json", out / "adapter_model.safetensors") if p.exists()]
    saved = sorted((p.name for p in out.iterdir() if p.is_dir() and SAVED_DIR.fullmatch(p.name)),
                   key=lambda name: (len(name), name)) if out.is_dir() else []  # merged/, then step-N/ by N
    held += [f"{name}/" for name in saved[:3]] + ([f"{len(saved) - 3} more step-N/"] if len(saved) > 3 else [])
    if checkpoint.find(str(out)) is not None:
        held.insert(0, "a checkpoint")
    metrics = out / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size:  # an empty one (a run that failed at its start) holds nothing
        if not held:  # nothing of the run to continue: say what to move away
            raise InputError(f"--out {out}: already holds an earlier run's {METRICS_FILE} (and no checkpoint to "
                             "continue with --resume); move it away or choose another directory")
        held.append(METRICS_FILE)
    if held:
        raise InputError(f"--out {out}: already holds an earlier run ({', '.join(held)}); continue it with --resume "
                         "or choose another directory")
