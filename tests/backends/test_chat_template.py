"""Assistant-only loss under a chat template that renders an earlier turn otherwise once later messages follow
(Qwen3's: an earlier turn's thinking block dropped, the last turn given one): each assistant turn's tokens carry
loss as the template renders them in the whole conversation, and nothing else does."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

from tinypipe.backends.data.chatspans import assistant_spans  # noqa: E402
from tinypipe.backends.data.examples import Example, pack, tokenize  # noqa: E402
from tinypipe.backends.data.tokenizers import load_tokenizer  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402

# Qwen3's chat template (Qwen/Qwen3-8B's tokenizer_config.json) without its tool-call parts, long lines broken:
# the thinking of an assistant turn before the last user query is dropped; the last turn always shows a thinking
# block.
QWEN3 = r"""
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
            and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1]
                                                   .lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n')
                    + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
""".strip()

THINK = (("system", "be brief"), ("user", "2+2?"), ("assistant", "<think>\nadd them\n</think>\n\n4."),
         ("user", "and 3+3?"), ("assistant", "<think>\nagain\n</think>\n\n6."))
PLAIN = (("user", "2+2?"), ("assistant", "4."), ("user", "and 3+3?"), ("assistant", "6.\n"))
TOOLS = (("user", "what is 6*7?"), ("assistant", "<think>\nask the tool\n</think>\n\ncall mul(6, 7)"),
         ("tool", "42"), ("assistant", "<think>\nit said 42\n</think>\n\nit is 42"), ("user", "thanks"),
         ("assistant", "bye"))
END = "<|im_end|>\n"


def byte_level_tokenizer(directory: Path, template: str) -> Path:
    """A byte-level BPE tokenizer (256 byte tokens, no merges) with Qwen's special and added tokens and
    `template` as its chat template, saved locally: what a Qwen3 model directory holds, in small."""
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    core = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = tokenizers.decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<think>", "</think>"])  # added, not special, as in Qwen3
    tok.chat_template = template
    tok.save_pretrained(directory)
    return directory


@pytest.mark.parametrize(("talk", "trained"), [
    (THINK, ["4." + END, "<think>\nagain\n</think>\n\n6." + END]),
    (PLAIN, ["4." + END, "<think>\n\n</think>\n\n6.\n" + END]),
    (TOOLS, ["call mul(6, 7)" + END, "it is 42" + END, "<think>\n\n</think>\n\nbye" + END]),
], ids=["thinking", "no-thinking", "tool-turns"])
def test_each_turn_carries_loss_as_the_whole_conversation_renders_it(tmp_path: Path, talk: tuple[tuple[str, str]],
                                                                    trained: list[str]) -> None:
    """The tokens are the whole rendering's (earlier thinking dropped); the tokens with loss are exactly each
    assistant turn's after `<|im_start|>assistant\\n`, in order, including its `<|im_end|>\\n`."""
    from transformers import AutoTokenizer

    d = byte_level_tokenizer(tmp_path / "tok", QWEN3)
    tok = load_tokenizer(d, vocab_size=300, byte_tokens=False)
    ids, loss = tokenize(Example("", "", talk), tok)
    hf = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    rendered = hf.apply_chat_template([{"role": r, "content": c} for r, c in talk], tokenize=False)
    assert ids == hf(rendered, add_special_tokens=False)["input_ids"]
    assert "add them" not in rendered and "ask the tool" not in rendered and "it said 42" not in rendered
    pieces = [hf.decode([i]) for i in ids]
    assert "".join(pieces) == rendered
    runs: list[str] = []  # the runs of consecutive tokens with loss, as text
    for k, (piece, keep) in enumerate(zip(pieces, loss)):
        if keep and k and loss[k - 1]:
            runs[-1] += piece
        elif keep:
            runs.append(piece)
    assert runs == trained
    _, labels = pack([Example("", "", talk)], tok, len(ids) - 1)
    assert labels[0].tolist() == [t if keep else -100 for t, keep in zip(ids[1:], loss[1:])]


def test_a_template_that_changes_an_earlier_turns_end_is_one_line(tmp_path: Path) -> None:
    """A template that cuts an earlier turn's end leaves no way to tell its tokens: one line, naming the tokenizer."""
    cut = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] if loop.last or m['role'] != "
           "'assistant' else m['content'][:1] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = load_tokenizer(byte_level_tokenizer(tmp_path / "tok", cut), vocab_size=300, byte_tokens=False)
    with pytest.raises(InputError, match=r"tok: the chat template renders a turn differently once later messages "
                                         r"follow, and not only at its start") as info:
        tokenize(Example("", "", PLAIN), tok)
    assert "\n" not in str(info.value)


def test_prefix_by_prefix_templates_take_the_plain_path() -> None:
    """A template whose prefixes extend each other: each turn is the text it adds, no marks rendered."""
    seen: list[str] = []

    def chatml(msgs: list[dict[str, str]], prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in msgs) + ("<assistant>" if prompt else "")
        seen.append(text)
        return text

    full, spans = assistant_spans(chatml, [("user", "hi"), ("assistant", "yo"), ("user", "ok"),
                                           ("assistant", "bye")], "t")
    assert [full[a:b] for a, b in spans] == ["yo</>", "bye</>"]
    assert not any("\ue000" in s for s in seen)
