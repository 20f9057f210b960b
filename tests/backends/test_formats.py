"""Data formats told from the content: JSON Lines under any name, what is not a training format refused in one
line, and chat data through a local tokenizer's chat template with loss on the assistant turns only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

from tinypipe.backends.data.examples import Example, pack, read_examples, tokenize  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer, load_tokenizer  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 \n=+?.,"
TALK = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6, of course."}]


def make_tokenizer(directory: Path, *, template: str | None = CHATML) -> Path:
    """A character-level fast tokenizer with ChatML's two special tokens (and a chat template), saved locally."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + list(CHARS))}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>",
                                  additional_special_tokens=specials[1:])
    if template is not None:
        tok.chat_template = template
    directory.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.txt", "data"])
def test_json_lines_are_read_as_records_whatever_the_name(tmp_path: Path, name: str) -> None:
    f = tmp_path / name
    f.write_text('{"text": "hello"}\n{"prompt": "2+2=", "completion": "4"}\n' + json.dumps({"messages": TALK}) + "\n")
    got = read_examples(f)
    assert got[:2] == [Example("", "hello"), Example("2+2=", "4")]
    assert got[2].messages == tuple((m["role"], m["content"]) for m in TALK)


@pytest.mark.parametrize(("name", "content", "match"), [
    ("d.csv", "name,label\nhello,1\n", r"d\.csv: looks like CSV \(a table\) with columns name, label, none of "
                                        r"them a record field"),
    ("d.txt", "a,b,c\n1,2,3\n4,5,6\n7,8,9\n", r"d\.txt: looks like CSV"),
    ("d.tsv", "a\tb\n", r"d\.tsv: looks like TSV"),
    ("d.json", '[{"text": "a"}, 3]', r"d\.json: record 2: expected a JSON object, got int"),
    ("d.json", "text: hello\n", r"d\.json:1: not a JSON object; a \.json data file is JSON Lines"),
    ("d.bin", "\0\1\2", r"d\.bin: a binary file"),
    ("d.jsonl", '{"messages": []}\n', r"d\.jsonl:1: \"messages\" must be a non-empty list"),
    ("d.jsonl", '{"messages": [{"role": "user", "content": "hi"}]}\n', r"d\.jsonl:1: no \"assistant\" message"),
    ("d.jsonl", '{"messages": [{"role": "robot", "content": "hi"}]}\n', r"d\.jsonl:1: message 1 has role 'robot'"),
    ("d.jsonl", '{"messages": [{"role": "user"}]}\n', r"d\.jsonl:1: message 1 must be an object"),
])
def test_what_is_not_a_training_format_is_one_line(tmp_path: Path, name: str, content: str, match: str) -> None:
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(InputError, match=match) as info:
        read_examples(f)
    assert "\n" not in str(info.value)


def test_prose_with_commas_is_plain_text(tmp_path: Path) -> None:
    f = tmp_path / "story.txt"
    f.write_text("Once, there was a model.\nIt learned, slowly, to add.\nThe end.\n")
    assert read_examples(f) == [Example("", f.read_text())]


def test_chat_loss_falls_on_assistant_turns_only_token_by_token(tmp_path: Path) -> None:
    """The tokens are the template's rendering tokenised; a token carries loss exactly when it is part of
    an assistant turn's text as the template adds it (content and `<|im_end|>` + newline)."""
    from transformers import AutoTokenizer

    d = make_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(d, vocab_size=64, byte_tokens=False)
    ids, loss = tokenize(Example("", "", tuple((m["role"], m["content"]) for m in TALK)), tok)
    hf = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    rendered = hf.apply_chat_template(TALK, tokenize=False)
    assert ids == hf(rendered, add_special_tokens=False)["input_ids"]
    pieces = [hf.convert_ids_to_tokens(i) for i in ids]
    trained = "".join(p for p, keep in zip(pieces, loss) if keep)
    assert trained == "4.<|im_end|>\n" + "6, of course.<|im_end|>\n"
    assert "".join(pieces) == rendered
    inputs, labels = pack([Example("", "", tuple((m["role"], m["content"]) for m in TALK))], tok, len(ids) - 1)
    assert labels[0].tolist() == [t if keep else -100 for t, keep in zip(ids[1:], loss[1:])]


def test_chat_without_a_template_or_with_bytes_is_one_line(tmp_path: Path) -> None:
    ex = Example("", "", (("user", "hi"), ("assistant", "yo")))
    tok = load_tokenizer(make_tokenizer(tmp_path / "plain", template=None), vocab_size=64)
    with pytest.raises(InputError, match="the tokenizer has no chat template"):
        tokenize(ex, tok)
    with pytest.raises(InputError, match="byte-level ids have no chat template"):
        tokenize(ex, ByteTokenizer(258))


def test_no_packing_gives_each_example_its_own_window() -> None:
    """Cut at seq_len + 1 tokens and padded without loss; an example with no loss token left is dropped."""
    inputs, labels = pack([Example("", "abcdefg"), Example("", "xy"), Example("abcdefgh", "z")],
                          ByteTokenizer(258), seq_len=4, packing=False)
    assert inputs.tolist() == [list(b"abcd"), [120, 121, 257, 257]]
    assert labels.tolist() == [list(b"bcde"), [121, 256, -100, -100]]
