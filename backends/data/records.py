"""One training record, whatever its spelling, as an `Example`: text, prompt/completion, messages, ShareGPT, Alpaca.

A record is a JSON object (a line of JSON Lines, an element of a JSON array) or a table's row (CSV, Parquet, a
Hugging Face dataset); a field whose value is null (a table's empty column) counts as absent. Its kind is told
from its fields:

| kind | fields | becomes |
| --- | --- | --- |
| text | `text` | a completion without a prompt: loss on all of it |
| prompt/completion | `prompt`, `completion` | loss on the completion |
| messages | `messages`: [{`role`, `content`}, ...] | a conversation: loss on the assistant turns |
| ShareGPT | `conversations`: [{`from`: human, gpt or system, `value`}, ...] | the same conversation |
| Alpaca | `instruction`, `output`, optional `input` | Stanford Alpaca's prompt, loss on the output |

A record of Alpaca fields that also carries `text` (tatsu-lab/alpaca does: the prompt and output in one
string) is read as Alpaca; any other two kinds in one record are an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tinypipe.common.errors import InputError

ROLES = ("system", "user", "assistant", "tool")
FIELDS = ("text", "prompt", "completion", "messages", "conversations", "instruction", "output")  # that tell a kind
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool"}
RECORD_HELP = ('each record is one {"text": ...}, {"prompt": ..., "completion": ...}, {"messages": [{"role": ..., '
               '"content": ...}, ...]}, ShareGPT {"conversations": [{"from": ..., "value": ...}, ...]} or Alpaca '
               '{"instruction": ..., "input": ..., "output": ...}')
# Stanford Alpaca's prompts (github.com/tatsu-lab/stanford_alpaca, train.py's PROMPT_DICT), with and without input
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


@dataclass(frozen=True)
class Example:
    """One training example: loss on `completion` only (a plain text has no prompt); or, with
    `messages` ((role, content) pairs), a conversation with loss on the assistant turns."""

    prompt: str
    completion: str
    messages: tuple[tuple[str, str], ...] | None = None


@dataclass(frozen=True)
class DataFile:
    """Data read: its format in words (`JSON Lines (prompt/completion)`, `Parquet (ShareGPT)`) and its examples."""

    format: str
    examples: list[Example]


def collect(container: str, records: Iterable[tuple[str, Example]]) -> DataFile:
    """The examples of (kind, example) records, and the format: `JSON Lines (text)`, or with a count of each kind
    where they are mixed: `JSON Lines (390 prompt/completion, 10 text)`."""
    counts: dict[str, int] = {}
    examples = []
    for kind, example in records:
        counts[kind] = counts.get(kind, 0) + 1
        examples.append(example)
    kinds = next(iter(counts)) if len(counts) == 1 else ", ".join(f"{n:,} {k}" for k, n in counts.items())
    return DataFile(f"{container} ({kinds})", examples)


def record(value: Any, where: str) -> tuple[str, Example]:
    """A record's kind (`text`, `prompt/completion`, `messages`, `ShareGPT`, `Alpaca`) and its example."""
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(value).__name__}")
    rec = {k: v for k, v in value.items() if v is not None}
    alpaca = "instruction" in rec or "output" in rec
    kinds = ([k for k in ("text", "messages") if k in rec and not (k == "text" and alpaca)]
             + (["ShareGPT"] if "conversations" in rec else [])
             + (["prompt/completion"] if "prompt" in rec or "completion" in rec else [])
             + (["Alpaca"] if alpaca else []))
    if len(kinds) > 1:
        raise InputError(f"{where}: give one of the kinds of record, not {' and '.join(kinds)}; {RECORD_HELP}")
    if "messages" in rec:
        return "messages", Example("", "", _messages(rec["messages"], where))
    if "conversations" in rec:
        return "ShareGPT", Example("", "", _sharegpt(rec["conversations"], where))
    if alpaca:
        return "Alpaca", _alpaca(rec, where)
    if "text" in rec:
        return "text", Example("", _string(rec, "text", where))
    if "prompt" in rec and "completion" in rec:
        return "prompt/completion", Example(_string(rec, "prompt", where), _string(rec, "completion", where))
    found = ", ".join(sorted(map(str, rec))) or "none"
    raise InputError(f"{where}: needs a \"text\" field, \"prompt\" and \"completion\" fields, or \"messages\" "
                     f"(found: {found}); {RECORD_HELP}")


def _messages(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., \"content\": ...}}")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"{where}: message {k + 1} must be an object with string \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise InputError(f"{where}: message {k + 1} has role {m['role']!r}; roles are {', '.join(ROLES)}")
        out.append((m["role"], m["content"]))
    return _with_assistant(out, where)


def _sharegpt(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    """ShareGPT's turns as messages: human -> user, gpt -> assistant, system stays."""
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: \"conversations\" must be a non-empty list of {{\"from\": ..., \"value\": ...}}")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("from"), str) or not isinstance(m.get("value"), str):
            raise InputError(f"{where}: turn {k + 1} of \"conversations\" must be an object with string \"from\" "
                             "and \"value\"")
        role = SHAREGPT_ROLES.get(m["from"])
        if role is None:
            raise InputError(f"{where}: turn {k + 1} of \"conversations\" is from {m['from']!r}; ShareGPT turns are "
                             f"from {', '.join(SHAREGPT_ROLES)}")
        out.append((role, m["value"]))
    return _with_assistant(out, where)


def _with_assistant(messages: list[tuple[str, str]], where: str) -> tuple[tuple[str, str], ...]:
    if not any(role == "assistant" for role, _ in messages):
        raise InputError(f"{where}: no \"assistant\" message: the loss falls on assistant turns only")
    return tuple(messages)


def _alpaca(rec: dict[str, Any], where: str) -> Example:
    """Stanford Alpaca's prompt around `instruction` (and `input`, when not empty); `output` the completion."""
    if "instruction" not in rec or "output" not in rec:
        raise InputError(f"{where}: an Alpaca record needs \"instruction\" and \"output\" (\"input\" may be left "
                         "out)")
    instruction, output = _string(rec, "instruction", where), _string(rec, "output", where)
    given = _string(rec, "input", where) if "input" in rec else ""
    prompt = (ALPACA_PROMPT.format(instruction=instruction, input=given) if given.strip()
              else ALPACA_PROMPT_NO_INPUT.format(instruction=instruction))
    return Example(prompt, output)


def _string(rec: dict[str, Any], key: str, where: str) -> str:
    value = rec[key]
    if not isinstance(value, str):
        raise InputError(f"{where}: \"{key}\" must be a string, got {type(value).__name__}")
    return value
