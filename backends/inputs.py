"""A model directory's weights checked before any worker starts: the index, every shard's header and size.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the data. `check_weights` reads only the headers: a shard that is
missing, not safetensors, truncated (a tensor's range runs past the end of the file), or an index
that is not JSON or names no tensor the model needs, is an InputError naming the file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError

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
