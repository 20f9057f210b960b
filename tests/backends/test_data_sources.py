"""Training data beyond JSON Lines and text: JSON arrays, CSV/TSV and Parquet files, Hugging Face dataset ids
through the local cache (a split, a configuration), and ShareGPT and Alpaca records mapped to chat and
prompt/completion examples; the run's data line names the format it found."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.formats import read_data, read_source  # noqa: E402
from tinypipe.backends.data.records import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, Example  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402

ROWS = [{"prompt": "2+2=", "completion": "4"}, {"prompt": "3+3=", "completion": "6"}]
EXAMPLES = [Example("2+2=", "4"), Example("3+3=", "6")]
SHAREGPT = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "2+2?"},
                              {"from": "gpt", "value": "4."}]}
TALK = (("system", "be brief"), ("user", "2+2?"), ("assistant", "4."))
ALPACA = [{"instruction": "Add.", "input": "2 and 2", "output": "4"}, {"instruction": "Say hi.", "input": "",
                                                                        "output": "hi"}]


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize(("name", "content", "fmt"), [
    ("d.json", json.dumps(ROWS), "a JSON array (prompt/completion)"),
    ("d.csv", "prompt,completion\n2+2=,4\n3+3=,6\n", "CSV (prompt/completion)"),
    ("d.tsv", "prompt\tcompletion\n2+2=\t4\n3+3=\t6\n", "TSV (prompt/completion)"),
    ("rows", "prompt,completion\n2+2=,4\n3+3=,6\n", "CSV (prompt/completion)"),  # a table told from its content
    ("excel.csv", "\ufeffprompt,completion\r\n2+2=,4\r\n3+3=,6\r\n", "CSV (prompt/completion)"),
    ("d.parquet", None, "Parquet (prompt/completion)"),
    ("d.bin", None, "Parquet (prompt/completion)"),  # Parquet told from its first bytes, not its name
])
def test_arrays_tables_and_parquet_read_as_records(tmp_path: Path, name: str, content: str | None, fmt: str) -> None:
    f = tmp_path / name
    if content is None:
        write_parquet(f, ROWS)
    else:
        f.write_text(content)
    got = read_data(f)
    assert (got.format, got.examples) == (fmt, EXAMPLES)


def test_sharegpt_and_alpaca_records_map_to_chat_and_prompt_completion(tmp_path: Path) -> None:
    """ShareGPT's human/gpt/system turns become user/assistant/system messages; an Alpaca record becomes
    Stanford Alpaca's prompt (its no-input form when `input` is empty or absent) with the output as completion.
    A `text` beside Alpaca's fields (tatsu-lab/alpaca's rendering of them) is not read."""
    f = tmp_path / "d.jsonl"
    rows = [SHAREGPT, *ALPACA, {"instruction": "Go.", "output": "ok", "text": "### Instruction: Go. ok"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = read_data(f)
    assert got.format == "JSON Lines (1 ShareGPT, 3 Alpaca)"
    assert got.examples == [
        Example("", "", TALK),
        Example(ALPACA_PROMPT.format(instruction="Add.", input="2 and 2"), "4"),
        Example(ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi."), "hi"),
        Example(ALPACA_PROMPT_NO_INPUT.format(instruction="Go."), "ok")]
    assert got.examples[1].prompt.endswith("### Instruction:\nAdd.\n\n### Input:\n2 and 2\n\n### Response:\n")


@pytest.mark.parametrize(("record", "match"), [
    ({"conversations": [{"from": "bing", "value": "hi"}]}, r"d\.jsonl:1: turn 1 of \"conversations\" is from "
                                                          r"'bing'; ShareGPT turns are from system, human"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, r"d\.jsonl:1: no \"assistant\" message"),
    ({"conversations": [{"role": "user", "content": "hi"}]}, r"turn 1 of \"conversations\" must be an object with "
                                                            r"string \"from\" and \"value\""),
    ({"instruction": "Add."}, r"d\.jsonl:1: an Alpaca record needs \"instruction\" and \"output\""),
    ({"instruction": "Add.", "output": 4}, r"d\.jsonl:1: \"output\" must be a string, got int"),
    ({"messages": [{"role": "user", "content": "a"}], **SHAREGPT}, r"give one of the kinds of record, not messages "
                                                                   r"and ShareGPT"),
])
def test_bad_sharegpt_and_alpaca_records_are_one_line(tmp_path: Path, record: dict[str, Any], match: str) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(record) + "\n")
    with pytest.raises(InputError, match=match) as info:
        read_data(f)
    assert "\n" not in str(info.value)


def test_a_parquet_row_names_its_place_and_empty_cells_are_absent(tmp_path: Path) -> None:
    """A table's columns are every row's: a row's null cell is no field of its record."""
    f = write_parquet(tmp_path / "d.parquet", [{"text": "plain", "prompt": None, "completion": None},
                                               {"text": None, "prompt": "a", "completion": "b"},
                                               {"text": None, "prompt": "a", "completion": None}])
    with pytest.raises(InputError, match=r"d\.parquet: row 3: needs a \"text\" field, .* \(found: prompt\)"):
        read_data(f)


def test_without_pyarrow_or_datasets_the_install_command_is_named(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    f = write_parquet(tmp_path / "d.parquet", ROWS)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(InputError, match=r"d\.parquet: a Parquet file, which needs pyarrow: pip install datasets "
                                         r"\(tinypipe's \[data\] extra\)"):
        read_data(f)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=r"acme/chats: no such data file; as a Hugging Face dataset id it needs the "
                                         r"datasets package: pip install datasets \(tinypipe's \[data\] extra\)"):
        read_source("acme/chats")


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache under HF_HOME, offline; `datasets` writes under it too."""
    pytest.importorskip("datasets")
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "hf" / "hub"


def cached_dataset(cache: Path, repo_id: str, files: dict[str, list[dict[str, Any]] | str]) -> Path:
    """A dataset in the Hugging Face cache's layout (datasets--org--name/{refs/main, snapshots/<commit>/...}), as
    `datasets` leaves one it downloaded: Parquet files from rows, other files from text."""
    repo = cache / f"datasets--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123abcd"
    for name, content in files.items():
        if isinstance(content, str):
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / name).write_text(content)
        else:
            write_parquet(snapshot / name, content)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return snapshot


def test_a_cached_hub_dataset_reads_offline_by_split(hub: Path) -> None:
    other = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    cached_dataset(hub, "acme/chats", {"data/train-00000-of-00001.parquet": [SHAREGPT] * 3,
                                       "data/test-00000-of-00001.parquet": [other]})
    train = read_source("acme/chats")
    assert train.format == "Hugging Face dataset, split train (ShareGPT)"
    assert train.examples == [Example("", "", TALK)] * 3
    test = read_source("acme/chats", split="test")
    assert test.examples == [Example("", "", (("user", "hi"), ("assistant", "yo")))]
    assert len(read_source("acme/chats", split="train[:2]").examples) == 2
    with pytest.raises(InputError, match=r"acme/chats: cannot load split validation of the Hugging Face dataset"):
        read_source("acme/chats", split="validation")


def test_a_hub_datasets_configuration_is_chosen(hub: Path) -> None:
    readme = ("---\nconfigs:\n- config_name: alpaca\n  data_files:\n  - split: train\n    path: alpaca/train.parquet\n"
              "- config_name: pairs\n  data_files:\n  - split: train\n    path: pairs/train.parquet\n---\n")
    cached_dataset(hub, "acme/mixed", {"README.md": readme, "alpaca/train.parquet": ALPACA,
                                       "pairs/train.parquet": ROWS})
    got = read_source("acme/mixed", config="pairs")
    assert (got.format, got.examples) == ("Hugging Face dataset, configuration pairs, split train (prompt/completion)",
                                          EXAMPLES)
    assert read_source("acme/mixed", config="alpaca").format.endswith("(Alpaca)")


def test_an_uncached_hub_dataset_offline_is_one_line_naming_it_and_the_cache(hub: Path) -> None:
    with pytest.raises(InputError) as info:
        read_source("acme/absent")
    assert str(info.value) == (f"acme/absent: no such data file, nor a dataset in the Hugging Face cache ({hub}), and "
                               "HF_HUB_OFFLINE is set; download it first (hf download acme/absent --repo-type "
                               "dataset) or unset HF_HUB_OFFLINE")
    with pytest.raises(InputError, match=r"d\.jsonl: a split or configuration \(--data-split, --data-config\) is "
                                         r"chosen within a Hugging Face dataset id"):
        read_source(Path("d.jsonl"), split="train")


def test_the_run_data_line_names_the_format_found(tmp_path: Path) -> None:
    f = write_parquet(tmp_path / "alpaca.parquet", ALPACA * 4)
    batches = make_batches(f, tokenizer=ByteTokenizer(258), seq_len=64, microbatch_size=1, microbatches=1, seed=0)
    first = batches.lines()[0]
    assert first.startswith(f"data      {f}: Parquet (Alpaca), 8 examples -> ")
