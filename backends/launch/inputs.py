"""`tinypipe run`'s inputs checked before any worker starts: weights, checkpoint files, evaluation, LoRA's libraries.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the data. `check_weights` reads only the headers: a shard that is
missing, not safetensors, truncated (a tensor's range runs past the end of the file), or an index
that is not JSON or names no tensor the model needs, is an InputError naming the file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.policy import Policy
from tinypipe.policy.lora_spec import LoraSpec
from tinypipe.policy.modes import OptimizerState

from ..data.batches import Batches
from ..data.tokenizers import Tokenizer
from ..options.record import RunOptions

INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


def shard_tensors(path: Path) -> set[str]:
    """The tensor names in the safetensors file `path`, after checking that its data is all there."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            header = json.loads(f.read(n)) if 0 < n <= min(MAX_HEADER_BYTES, size - 8) else None
    except FileNotFoundError:
        raise InputError(f"{path}: missing (the model's index names it)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a safetensors file ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: not a safetensors file (no readable header)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)):
            raise InputError(f"{path}: not a safetensors file (tensor {name!r} has no byte range)")
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise InputError(f"{path}: truncated: its header describes {8 + n + end:,} bytes, the file has {size:,}")
    return {k for k in header if k != "__metadata__"}


def check_weights(directory: Path, needed: Iterable[str]) -> None:
    """InputError unless `directory`'s safetensors (one file, or an index and its shards) hold every
    tensor in `needed` (Hugging Face names), each shard complete."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            raw: Any = json.loads(index.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise InputError(f"{index}: not a safetensors index (no \"weight_map\" of tensor names to files)")
        held: dict[str, str] = {}
        for file in sorted(set(weight_map.values())):
            if Path(file).name != file:
                raise InputError(f"{index}: names a shard outside the directory ({file!r})")
            for name in shard_tensors(directory / file):
                held[name] = file
        for name, file in weight_map.items():
            if held.get(name) != file:
                raise InputError(f"{index}: says {name!r} is in {file}, which does not hold it")
    else:
        held = dict.fromkeys(shard_tensors(directory / SINGLE_FILE), SINGLE_FILE)
    missing = [n for n in needed if n not in held]
    if missing:
        raise InputError(f"{directory}: the weights lack {len(missing)} tensor(s) the model needs, e.g. "
                         f"{', '.join(map(repr, missing[:3]))}")


def check_eval(opts: RunOptions, train: Batches, tokenizer: Tokenizer) -> None:
    """The held-out data: read, and at least one step of it."""
    from tinypipe.describe.hubcache import is_hub_id

    from ..data.batches import make_batches
    from ..rank.evaluation import eval_steps

    if opts.eval_data is not None and is_hub_id(opts.eval_data):
        raise InputError(f"--eval-data {opts.eval_data}: a Hugging Face dataset is read as --data only (its "
                         "--data-split); hold out a share of it with --eval-fraction, or give a held-out file")
    held = make_batches(opts.eval_data or opts.data, tokenizer=tokenizer, seq_len=opts.seq_len,
                        microbatch_size=train.microbatch_size, microbatches=train.microbatches, seed=opts.seed,
                        packing=opts.packing, hold_out=0.0 if opts.eval_data else (opts.eval_fraction or 0.0),
                        part="eval", split=None if opts.eval_data else opts.data_split,
                        config=None if opts.eval_data else opts.data_config)
    need = train.microbatches * train.microbatch_size
    if eval_steps(held) < 1:
        raise InputError(f"{opts.eval_data or '--eval-fraction'}: {len(held.source)} held-out sequence(s) of "  # type: ignore[arg-type]
                         f"{opts.seq_len} tokens, fewer than one step's {need}; give more held-out data")


def check_lora_libraries(lora: LoraSpec | None) -> None:
    """A LoRA run writes peft's adapter directory, and a 4-bit base is quantised by bitsandbytes: either missing
    is refused here, in one line with its install command, before a step is trained."""
    if lora is None:
        return
    from ..model import nf4

    try:
        with nf4.hub_kernels_hidden():  # peft imports bitsandbytes where it is installed
            import peft  # noqa: F401
    except ImportError:
        raise InputError("--lora: the adapters are saved as a peft adapter directory, and peft is not installed; "
                         "pip install 'tinypipe[lora]'") from None
    if lora.nf4:
        try:
            nf4.functional()
        except ImportError:
            raise InputError("--load-in-4bit: the 4-bit base is quantised by bitsandbytes, which is not installed "
                             f"or does not load here; {nf4.INSTALL}") from None


def check_lora_policy(policy: Policy, given: str | None) -> None:
    """A LoRA run's host holds one frozen copy of the base, in no host optimizer's layout: a policy file (`given`)
    that asks for the replicated layout is refused (a preset's layout is its own, and unused under LoRA)."""
    from tinypipe.policy import PRESETS
    from tinypipe.policy.modes import HostMemory

    if policy.lora is None or given is None or given in PRESETS or policy.host_memory == HostMemory.COMPACT:
        return
    raise InputError(f"--policy {given}: host_memory {policy.host_memory} with LoRA: the host holds one frozen copy of "
                     "the base, no optimizer state to lay out; leave host_memory out of the policy")


def check_rank_files(directory: Path, ranks: int) -> None:
    """InputError unless the checkpoint holds complete files for each of `ranks` ranks (`ckpt_format`: the
    JSON beside a safetensors file whose header's tensors all lie within it; a truncated file does not)."""
    from ..save import ckpt_format

    files = sorted(directory.glob(f"rank*{ckpt_format.TENSORS}"))
    for r in range(ranks):
        f = directory / f"rank{r}{ckpt_format.TENSORS}"
        if not f.is_file() or not (directory / f"rank{r}{ckpt_format.SKELETON}").is_file():
            raise InputError(f"{f}: missing; the checkpoint holds {len(files)} rank file(s), this run has "
                             f"{ranks} ranks")
        try:
            ckpt_format.read_tensors(f)
        except (OSError, ckpt_format.FormatError, KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{f}: truncated or corrupt ({exc})") from None


def check_checkpoint(out: str, meta: dict[str, Any], ranks: int) -> None:
    """The newest checkpoint under `out` (whose meta.json `settings.settle` read as `meta`): complete files for
    each of `ranks` ranks, holding what meta.json says (`check_rank_files`, `check_rank_state`)."""
    from ..save.checkpoint import find

    held = find(out)
    assert held is not None  # settle read its record
    check_rank_files(held, ranks)
    check_rank_state(held, meta, ranks)


def check_rank_state(directory: Path, meta: dict[str, Any], ranks: int) -> None:
    """InputError unless each rank's files hold the state the checkpoint's meta.json says: its `step`, LoRA
    adapters of `policy.lora` (or, without it, every parameter's host state), and moments of
    `policy.optimizer_state`. The message names the meta.json field the files contradict."""
    from ..host.moments import state_shapes
    from ..save import ckpt_format
    from ..save.checkpoint import EDITED

    where = f"{directory}/meta.json"
    policy = meta.get("policy")
    policy = policy if isinstance(policy, dict) else {}
    lora = policy.get("lora")
    said_lora = LoraSpec.from_json(lora, f"{where}: policy.lora").text() if lora is not None else None
    said_state = OptimizerState.parse(policy.get("optimizer_state", "fp32"), f"{where}: policy.optimizer_state")
    by_dtype = {state_shapes(1, s)["exp_avg"][1]: s for s in OptimizerState}
    for r in range(ranks):
        stem = directory / f"rank{r}"
        try:
            state = ckpt_format.read(stem)
        except (OSError, ckpt_format.FormatError, KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{stem}: cannot read the checkpoint ({exc})") from None
        held = f"{stem.name}{ckpt_format.SKELETON} beside it holds"
        if state.get("step") != meta["step"]:
            raise InputError(f"{where}: step {meta['step']}, but {held} step {state.get('step')}; {EDITED}")
        host = state.get("host", {})
        held_lora = host.get("lora") if host.get("host_memory") == "frozen" else None
        if held_lora != said_lora:
            raise InputError(f"{where}: policy.lora {_trains(said_lora)}, but {held} {_trains(held_lora)}; {EDITED}")
        moments = next(_moments(host), None)
        held_state = by_dtype.get(moments["exp_avg"].dtype) if moments is not None else said_state
        if held_state != said_state:
            raise InputError(f"{where}: policy.optimizer_state {said_state}, but {held} {held_state} moments; {EDITED}")


def _trains(lora: str | None) -> str:
    return f"LoRA adapters {lora}" if lora is not None else "a full fine-tune's host state (no LoRA)"


def _moments(node: Any) -> Iterator[dict[str, Any]]:
    """Every AdamW state (a dict holding `exp_avg`) in a rank's checkpointed state, depth first."""
    if isinstance(node, dict):
        if "exp_avg" in node:
            yield node
        for v in node.values():
            yield from _moments(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            yield from _moments(v)
