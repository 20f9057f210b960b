"""A checkpoint file without pickle: nested state as JSON, its tensors as one safetensors file beside it.

`write(stem, state)` writes `stem.safetensors` (every tensor of `state`, byte for byte, streamed from
the live tensors: no copy of the state in memory) and `stem.json` (the state with each tensor replaced
by a reference to its name; tuples, dicts with non-string keys and string enums kept). `read(stem)`
gives the state back with its tensors mapped from the file (copy-on-write pages: reading a checkpoint
costs no memory until the host state copies them in). The tensor file is standard safetensors
(https://huggingface.co/docs/safetensors, "Format"): an 8-byte little-endian header length, a JSON
header (dtype, shape, data_offsets of each tensor) padded to 8 bytes, then the bytes without holes;
`safetensors.safe_open` reads it. Tensors are laid out by falling element size, so each one's offset is
a multiple of its element size.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

# safetensors dtype names (the format's spec)
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
TENSORS, SKELETON = ".safetensors", ".json"
_WRITE_CHUNK_BYTES = 64 << 20  # a tensor is written in slices of this size (no temporary of its size)


class FormatError(ValueError):
    """A checkpoint file that is not what `write` writes."""


def flatten(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-ready skeleton, tensors by name) of nested dicts / lists / tuples / scalars / tensors."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = x
            return {"__tensor__": name}
        if isinstance(x, dict):
            return {"__dict__": [[enc(k), enc(v)] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"__tuple__": [enc(v) for v in x]}
        if isinstance(x, list):
            return [enc(v) for v in x]
        if isinstance(x, str):
            return str(x)  # a str enum (a host layout) as its value
        if x is None or isinstance(x, (bool, int, float)):
            return x
        raise TypeError(f"a checkpoint holds tensors, numbers, strings, lists, tuples and dicts; got {type(x)}")

    return enc(state), tensors


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of `flatten`."""
    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if isinstance(x, dict):
            if "__tensor__" in x:
                return tensors[x["__tensor__"]]
            if "__tuple__" in x:
                return tuple(dec(v) for v in x["__tuple__"])
            if "__dict__" in x:
                return {_key(dec(k)): dec(v) for k, v in x["__dict__"]}
            raise FormatError(f"unknown node {sorted(x)[:3]}")
        return x

    return dec(skeleton)


def _key(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def tensor_file_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Size of the safetensors file `write` makes of `tensors`."""
    header, _ = _header(tensors)
    return 8 + len(header) + sum(t.numel() * t.element_size() for t in tensors.values())


def _header(tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[str]]:
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), int(n[1:]) if n[1:].isdigit() else 0, n))
    meta: dict[str, Any] = {"__metadata__": {"format": "tinypipe.checkpoint"}}
    off = 0
    for n in order:
        t = tensors[n]
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {n}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        meta[n] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + size]}
        off += size
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, order


def write_tensors(f: BinaryIO, tensors: dict[str, torch.Tensor]) -> None:
    """Stream `tensors` into `f` in the safetensors format (each from its own memory, sliced)."""
    header, order = _header(tensors)
    f.write(struct.pack("<Q", len(header)))
    f.write(header)
    for n in order:
        t = tensors[n].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        for s in range(0, raw.numel(), _WRITE_CHUNK_BYTES):
            f.write(raw[s:s + _WRITE_CHUNK_BYTES].numpy().data)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, mapped copy-on-write (writable; the file is not changed)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise FormatError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if n > size - 8:
            raise FormatError(f"{path}: header length {n} beyond the file's {size} bytes")
        try:
            meta = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"{path}: unreadable header ({exc})") from None
        base = 8 + n
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 0 else b""
    out: dict[str, torch.Tensor] = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        dtype = _BY_NAME.get(info.get("dtype"))
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if dtype is None or base + end > size:
            raise FormatError(f"{path}: tensor {name}: bad dtype or offsets")
        count = (end - begin) // dtype.itemsize
        t = (torch.frombuffer(buf, dtype=dtype, count=count, offset=base + begin) if count
             else torch.empty(0, dtype=dtype))
        out[name] = t.view(shape)
    return out


def write(stem: Path, state: Any, synced: Callable[[Path, Callable[[BinaryIO], None]], None]) -> None:
    """Write `state` as `stem.safetensors` and `stem.json`, each through `synced(path, write)` (the caller's
    all-or-nothing file writer)."""
    skeleton, tensors = flatten(state)
    synced(stem.with_name(stem.name + TENSORS), lambda f: write_tensors(f, tensors))
    text = (json.dumps(skeleton) + "\n").encode()

    def write_skeleton(f: BinaryIO) -> None:
        f.write(text)

    synced(stem.with_name(stem.name + SKELETON), write_skeleton)


def read(stem: Path) -> Any:
    """The state `write` wrote at `stem`."""
    try:
        skeleton = json.loads(stem.with_name(stem.name + SKELETON).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{stem}{SKELETON}: unreadable ({exc})") from None
    return unflatten(skeleton, read_tensors(stem.with_name(stem.name + TENSORS)))


def state_bytes(state: Any) -> int:
    """Bytes `write` puts on disk for `state` (the tensor file; the JSON skeleton is small)."""
    return tensor_file_bytes(flatten(state)[1])
