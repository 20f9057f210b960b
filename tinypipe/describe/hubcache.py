"""Hugging Face Hub ids (`org/name`) through the local Hugging Face cache: read offline when cached, downloaded
into it when the network is allowed (HF_HUB_OFFLINE unset); huggingface_hub is imported only when an id is read.

The cache is where huggingface_hub and transformers put it: HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub (read when an id is resolved, so the environment of the moment counts). A model's
snapshot folder (`models--org--name/snapshots/<commit>/`, the commit named by `refs/main`) is its model
directory: config.json for `inspect`, `simulate` and `search`; safetensors weights and tokenizer files for `run`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError

CONFIG = "config.json"
# A repository id as the Hub spells one: owner and name of letters, digits, `-`, `_`, `.` (not `--` or `..`)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", flags=re.ASCII)
TRUE = ("1", "on", "yes", "true")  # huggingface_hub's spellings of a set flag
# What `run` reads of a model repository: the config, safetensors weights (one file, or an index and its
# shards; not a repository's other copies such as Mistral's `consolidated.safetensors`), the tokenizer
RUN_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
             "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
             "chat_template.json")


def is_hub_id(name: str) -> bool:
    """`name` spells a Hub repository id (`org/name`) and no local path of that name exists."""
    return (HUB_ID.fullmatch(name) is not None and "--" not in name and ".." not in name
            and not name.endswith((".json", ".jsonl")) and not Path(name).exists())


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, from the environment as huggingface_hub reads it."""
    given = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if given:
        return Path(given).expanduser()
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    """HF_HUB_OFFLINE is set: nothing is downloaded, only the cache is read."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE


def hub_module(repo_id: str) -> Any:
    """huggingface_hub, or an InputError naming the id and the package to install."""
    try:
        import huggingface_hub
    except ImportError:
        raise InputError(f"{repo_id}: a Hugging Face Hub id needs the huggingface_hub package (pip install "
                         "huggingface_hub; transformers brings it)") from None
    return huggingface_hub


def model_dir(repo_id: str, *, weights: bool = False) -> Path:
    """The cached snapshot folder of Hub model `repo_id` holding its config.json and, with `weights`, its
    safetensors and tokenizer files: the cache's when it has them, else downloaded into the cache when the
    network is allowed. InputError (naming the id and the cache) when offline and not cached, or the
    download fails."""
    hub, cache = hub_module(repo_id), hub_cache()
    found = hub.try_to_load_from_cache(repo_id, CONFIG, cache_dir=cache)
    folder = Path(found).parent if isinstance(found, str) else None
    if folder is not None and (not weights or has_weights(folder)):
        return folder
    if offline():
        held = (f"the Hugging Face cache holds its config ({folder}) but no safetensors weights" if folder
                else f"not in the Hugging Face cache ({cache})")
        raise InputError(f"{repo_id}: {held}, and HF_HUB_OFFLINE is set; download it first (hf download "
                         f"{repo_id}) or unset HF_HUB_OFFLINE")
    try:
        if weights:
            folder = Path(hub.snapshot_download(repo_id, cache_dir=cache, allow_patterns=list(RUN_FILES)))
        else:
            folder = Path(hub.hf_hub_download(repo_id, CONFIG, cache_dir=cache)).parent
    except Exception as exc:  # network, authentication, missing repository: each library raises its own
        why = " ".join(str(exc).split())[:300]
        raise InputError(f"{repo_id}: cannot download it from the Hugging Face Hub into {cache} "
                         f"({type(exc).__name__}: {why})") from None
    if not (folder / CONFIG).is_file():
        raise InputError(f"{repo_id}: the Hub repository has no config.json ({folder})")
    if weights and not has_weights(folder):
        raise InputError(f"{repo_id}: the Hub repository has no safetensors weights (model.safetensors or "
                         f"model.safetensors.index.json and its shards) in {folder}; `run` reads safetensors only")
    return folder


def has_weights(folder: Path) -> bool:
    """`folder` holds model.safetensors, or an index and every shard it names (an unreadable index counts as
    present: `run` checks it and names the fault)."""
    if (folder / "model.safetensors").is_file():
        return True
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return False
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return True
    return all((folder / str(s)).is_file() for s in shards)
