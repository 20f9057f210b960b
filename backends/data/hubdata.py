"""Training records from a Hugging Face Hub dataset (`org/name`: one split, one configuration) through the
optional `datasets` package: the Hugging Face cache's copy when HF_HUB_OFFLINE is set, else `load_dataset`'s.

Offline, the dataset's snapshot in the hub cache (`datasets--org--name/snapshots/<commit>/`, where `datasets`
downloads a Hub dataset's files) is loaded as a local folder; its README's configurations and its files' split
names apply as on the Hub. Each row is a record (`records.py`); what `datasets` writes (its Arrow cache) goes
to HF_DATASETS_CACHE, else HF_HOME/datasets.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.describe.hubcache import hub_cache, hub_module, offline

from .records import DataFile, collect, record

INSTALL = "pip install datasets (tinypipe's [data] extra)"


def datasets_cache() -> Path:
    """Where `datasets` keeps what it builds, from the environment as it reads it."""
    given = os.environ.get("HF_DATASETS_CACHE")
    if given:
        return Path(given).expanduser()
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
    return Path(home).expanduser() / "datasets"


def read_hub_dataset(repo_id: str, *, split: str, config: str | None) -> DataFile:
    """Split `split` of Hub dataset `repo_id` (configuration `config`, or its default) as records; InputError
    naming the id (and the cache when offline) when it cannot be loaded."""
    try:
        import datasets
    except ImportError:
        raise InputError(f"{repo_id}: no such data file; as a Hugging Face dataset id it needs the datasets "
                         f"package: {INSTALL}") from None
    which = f"split {split}" + (f" of configuration {config}" if config else "")
    source = _cached_snapshot(repo_id) if offline() else repo_id
    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its failures come back as the one line below
    try:
        rows: Any = datasets.load_dataset(source, name=config, split=split, cache_dir=str(datasets_cache()))
    except Exception as exc:  # missing split or configuration, unreadable files, network: many error kinds
        why = " ".join(str(exc).split())[:300]
        raise InputError(f"{repo_id}: cannot load {which} of the Hugging Face dataset ({type(exc).__name__}: "
                         f"{why})") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if not isinstance(rows, datasets.Dataset):
        raise InputError(f"{repo_id}: {which} is not one table of rows ({type(rows).__name__})")
    if len(rows) == 0:
        raise InputError(f"{repo_id}: {which} has no rows: no training examples")
    container = "Hugging Face dataset, " + (f"configuration {config}, " if config else "") + f"split {split}"
    return collect(container, (record(r, f"{repo_id} ({which}): row {k}") for k, r in enumerate(rows, 1)))


def _cached_snapshot(repo_id: str) -> str:
    """The dataset's snapshot folder in the Hugging Face cache; InputError naming the id and the cache."""
    hub, cache = hub_module(repo_id), hub_cache()
    try:
        return str(hub.snapshot_download(repo_id, repo_type="dataset", cache_dir=cache, local_files_only=True))
    except Exception:  # huggingface_hub's "not in the cache" (LocalEntryNotFoundError and kin)
        raise InputError(f"{repo_id}: no such data file, nor a dataset in the Hugging Face cache ({cache}), and "
                         f"HF_HUB_OFFLINE is set; download it first (hf download {repo_id} --repo-type dataset) or "
                         "unset HF_HUB_OFFLINE") from None
