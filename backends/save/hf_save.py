"""Saving a trained layer stack as a Hugging Face checkpoint, one safetensors shard per layer.

`save_pretrained` writes one shard per layer plus the index and config.json, so that
`AutoModelForCausalLM.from_pretrained(out_dir)` loads the result; every rank writes its own layers.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..model.hf import INDEX_FILE, set_config_dtype, split_meta
from ..model.layers import LayerStack

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")


def shard_name(i: int, n: int) -> str:
    """The safetensors file that holds layer i of n."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def save_pretrained(stack_state: dict[int, dict[str, torch.Tensor]], config: Any, out_dir: str | Path, *,
                    rank: int, world: int, source_dir: str | Path | None = None,
                    dtype: torch.dtype | None = None) -> None:
    """Write the layers in `stack_state` so that `AutoModelForCausalLM.from_pretrained(out_dir)` loads them.

    Every rank calls this with the layers it holds ({layer index: {name in layer: tensor}}); each
    layer goes to its own shard (`shard_name`), written atomically, so no rank waits for another.
    Rank 0 also writes the index (which is known from the config alone), config.json (dtype set
    to the saved tensors') and the tokenizer files of `source_dir`. `dtype`: cast the tensors to it
    (None: as they are).
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metas, names, _ = split_meta(config)
    n = len(names)
    if dtype is not None:
        stack_state = {i: {p: t.to(dtype) for p, t in tensors.items()} for i, tensors in stack_state.items()}
    dtypes = {t.dtype for tensors in stack_state.values() for t in tensors.values()} or {dtype or torch.float32}
    for i, tensors in stack_state.items():
        renamed = {names[i][p]: t.detach().to("cpu").contiguous() for p, t in tensors.items()}
        tmp = out / f".{shard_name(i, n)}.tmp{os.getpid()}"
        save_file(renamed, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / shard_name(i, n))
    if rank != 0:
        return
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    total = sum({id(p): p.numel() for m in metas for p in m.parameters()}.values()) * dtype.itemsize  # tied: once
    weight_map = {hf: shard_name(i, n) for i, layer_names in enumerate(names) for hf in layer_names.values()}
    _write_atomic(out / INDEX_FILE, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                               indent=2, sort_keys=True) + "\n")
    saved = copy.deepcopy(config)
    set_config_dtype(saved, dtype)
    saved.save_pretrained(str(out))
    if source_dir is not None:
        for fname in TOKENIZER_FILES:
            src = Path(source_dir) / fname
            if src.is_file():
                shutil.copyfile(src, out / fname)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def to_hf_state_dict(stack: LayerStack) -> dict[str, torch.Tensor]:
    """The owned layers' parameters under their Hugging Face names."""
    return {stack.names[i][p]: t for i, tensors in stack.state().items() for p, t in tensors.items()}
