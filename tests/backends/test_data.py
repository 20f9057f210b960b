"""Training data: reading, tokenising, packing and masking; the synthetic task and its accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tinypipe.backends.data.addition import AdditionSequences, AdditionTask, task_accuracy  # noqa: E402
from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.examples import Example, pack, read_examples  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402

X = -100  # no loss


def ids(text: str) -> list[int]:
    return list(text.encode())


def test_prompt_completion_packs_with_loss_on_the_completion() -> None:
    """Tokens: prompt, completion, end-of-text; labels shifted by one, -100 on the prompt and padding."""
    inputs, labels = pack([Example("ab", "c"), Example("", "de")], ByteTokenizer(258), seq_len=4)
    # stream: a b c <eos> d e <eos>  (loss on c, <eos>, d, e, <eos>)
    assert inputs.tolist() == [[97, 98, 99, 256], [100, 101, 257, 257]]
    assert labels.tolist() == [[X, 99, 256, 100], [101, 256, X, X]]


def test_windows_overlap_by_one_token_and_pad_the_last() -> None:
    """Each token but the first is a label exactly once; the last window is padded without loss."""
    inputs, labels = pack([Example("", "abcdefg")], ByteTokenizer(256), seq_len=3)
    assert inputs.tolist() == [ids("abc"), ids("def")]
    assert labels.tolist() == [ids("bcd"), ids("efg")]
    inputs, labels = pack([Example("", "abcde")], ByteTokenizer(256), seq_len=3)
    assert inputs.tolist() == [ids("abc"), [100, 0, 0]]
    assert labels.tolist() == [ids("bcd"), [101, X, X]]


def test_jsonl_and_plain_text_are_read(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "hello"}\n\n{"prompt": "2+2=", "completion": "4"}\n')
    assert read_examples(f) == [Example("", "hello"), Example("2+2=", "4")]
    t = tmp_path / "d.txt"
    t.write_text("line one\nline two\n")
    assert read_examples(t) == [Example("", "line one\nline two\n")]


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\nnot json\n', r"d\.jsonl:2: not a JSON object"),
    ('{"text": "ok"}\n{"prompt": "a"}\n', r"d\.jsonl:2: needs a \"text\" field, \"prompt\" and \"completion\" "
                                          r"fields, or \"messages\" \(found: prompt\)"),
    ('{"text": 3}\n', r"d\.jsonl:1: \"text\" must be a string, got int"),
    ('[1, 2]\n', r"d\.jsonl: record 1: expected a JSON object, got int"),
    ('{"text": "a"}\n[1]\n', r"d\.jsonl:2: expected a JSON object, got list"),
    ('{"text": "a", "prompt": "b", "completion": "c"}\n', r"d\.jsonl:1: give one of"),
    ("", r"d\.jsonl: empty file"),
    ("\n  \n", r"d\.jsonl: empty file"),
])
def test_bad_data_names_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text(content)
    with pytest.raises(InputError, match=message):
        read_examples(f)


def test_missing_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"nope\.jsonl: no such data file"):
        read_examples(tmp_path / "nope.jsonl")
    f = tmp_path / "b.txt"
    f.write_bytes(b"fine\nstill fine\n\xff\xfe")
    with pytest.raises(InputError, match=r"b\.txt:3: not UTF-8"):
        read_examples(f)


def test_batches_from_a_file_cover_every_window_each_epoch(tmp_path: Path) -> None:
    """Shapes per step; one epoch serves every packed window once, in a seeded order."""
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": f"example number {i}"}) + "\n" for i in range(20)))
    batches = make_batches(f, tokenizer=ByteTokenizer(258), seq_len=16, microbatch_size=2, microbatches=3, seed=0)
    step = batches.step(0)
    assert len(step) == 3 and all(x.shape == y.shape == (2, 16) for x, y in step)
    n = len(batches.source)
    seen = {tuple(batches.source[j][0].tolist()) for j in range(n)}
    packed, _ = pack(read_examples(f), ByteTokenizer(258), 16)
    assert seen == {tuple(row) for row in packed.tolist()}
    again = make_batches(f, tokenizer=ByteTokenizer(258), seq_len=16, microbatch_size=2, microbatches=3, seed=0)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again.step(5), batches.step(5)))


def test_synthetic_task_is_deterministic_per_seed() -> None:
    """Same seed: same batches, served in any order; other seed or replica: other batches."""
    def make(seed: int, replica: int = 0) -> list:
        return make_batches(None, tokenizer=ByteTokenizer(256), seq_len=32, microbatch_size=2, microbatches=2,
                            seed=seed, replica=replica, replicas=2)

    a, b = make(0), make(0)
    first = [b.step(k) for k in (3, 0)]
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a.step(0), first[1]))
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a.step(3), first[0]))
    assert not torch.equal(make(1).step(0)[0][0], a.step(0)[0][0])
    assert not torch.equal(make(0, replica=1).step(0)[0][0], a.step(0)[0][0])


def test_synthetic_lines_and_answer_masks() -> None:
    """Sequences start with a problem; only the answer digits and newline carry loss."""
    tok = ByteTokenizer(256)
    batches = make_batches(None, tokenizer=tok, seq_len=48, microbatch_size=1, microbatches=1, seed=0)
    x, y = batches.step(0)[0]
    text = tok.decode(x[0].tolist())
    first = text.split("\n")[0]
    a, rest = first.split("+")
    b, c = rest.split("=")
    assert int(a) + int(b) == int(c)
    n = len(first)
    labelled = tok.decode([t for t in y[0, : n + 1].tolist() if t != X])
    assert labelled == c + "\n"
    everything = make_batches(None, tokenizer=tok, seq_len=48, microbatch_size=1, microbatches=1, seed=0,
                              task=AdditionTask(seed=0, loss_on="all"))
    assert (everything.step(0)[0][1] != X).all()


@pytest.mark.parametrize("digits, loss_on, vocab, seq_len", [(2, "answer", 151_936, 2048), (3, "all", 256, 64),
                                                          (1, "answer", 258, 17), (5, "answer", 300, 300)])
def test_byte_level_fast_path_serves_the_general_paths_sequences(digits: int, loss_on: str, vocab: int,
                                                                 seq_len: int) -> None:
    """With byte-level ids, `AdditionSequences` joins memoised problems: the same inputs and labels as
    tokenizing each problem (`slow_item`), from a cold and from a warm memo."""
    src = AdditionSequences(AdditionTask(seed=3, digits=digits, loss_on=loss_on), ByteTokenizer(vocab), seq_len)
    for j in [*range(12), *range(12)]:
        fast, slow = src[j], src.slow_item(j)
        for f, s in zip(fast, slow):
            assert f.dtype == s.dtype and torch.equal(f, s), j


def test_held_out_problems_are_never_trained_on() -> None:
    task = AdditionTask(seed=0, digits=2)
    held = set(task.held_out(50))
    batches = make_batches(None, tokenizer=ByteTokenizer(256), seq_len=128, microbatch_size=8, microbatches=1,
                           seed=0, task=task)
    trained = set()
    for k in range(20):
        for line in ByteTokenizer().decode(batches.step(k)[0][0].flatten().tolist()).split("\n"):
            if line.count("+") == 1 and line.count("=") == 1 and line.split("=")[1].isdigit():
                a, b = line.split("=")[0].split("+")
                if a.isdigit() and b.isdigit():
                    trained.add((int(a), int(b)))
    assert len(trained) > 100 and not held & trained


def oracle(correct: bool):
    """A logits function that greedy-decodes the right answer (or always '0')."""
    tok = ByteTokenizer()

    def logits_fn(input_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*input_ids.shape, 256)
        for row, seq in enumerate(input_ids.tolist()):
            text = tok.decode(seq)
            prompt, done = text.split("=")
            a, b = prompt.split("+")
            target = AdditionTask().answer(int(a), int(b)) + "\n" if correct else "0\n"
            out[row, -1, ord(target[min(len(done), len(target) - 1)])] = 1.0
        return out

    return logits_fn


def test_task_accuracy_scores_exact_answers() -> None:
    assert task_accuracy(oracle(True), n=40) == 1.0
    assert task_accuracy(oracle(False), n=40) == 0.0


def test_model_directory_tokenizer_is_used(tmp_path: Path) -> None:
    """Tokenizer files in the model directory win over bytes; loaded locally, BOS only where the
    tokenizer adds one itself."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{c: 3 + i for i, c in enumerate("abc=+ ")}}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    core.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path, vocab_size=9)
    assert isinstance(tok, HFTokenizer) and (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 1)
    inputs, labels = pack([Example("ab=", "c")], tok, seq_len=5)
    assert inputs.tolist() == [[0, 3, 4, 6, 5]]
    assert labels.tolist() == [[X, X, X, 5, 1]]
    assert isinstance(load_tokenizer(tmp_path / "none", vocab_size=300), ByteTokenizer)
    with pytest.raises(InputError, match="no tokenizer files .* or --byte-tokens"):
        load_tokenizer(tmp_path / "none", vocab_size=300, byte_tokens=False)
    with pytest.raises(InputError, match="the tokenizer has 9 tokens, more than the model's vocabulary of 8"):
        load_tokenizer(tmp_path, vocab_size=8)
