"""Models split into layers: same function as Hugging Face's model, rank-independent init, saving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402
from torch import dtype as TorchDtype  # noqa: E402
from torch.nn import Module  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import tinypipe.describe.model  # noqa: E402
from tinypipe.backends.model.hf import UnsupportedModelError, WeightReader, build_model  # noqa: E402
from tinypipe.backends.model.layers import IGNORE_INDEX, Block, Embed, Head, LayerStack, attention_mask  # noqa: E402
from tinypipe.backends.save.hf_save import save_pretrained, shard_name, to_hf_state_dict  # noqa: E402
from tinypipe.describe.model import head_chunk_tokens  # noqa: E402

TINY = {  # small configs of each family; Mistral's window (8) is shorter than the test sequences (16)
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
              "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "num_hidden_layers": 2, "vocab_size": 300, "max_position_embeddings": 128,
              "rope_theta": 10000.0, "tie_word_embeddings": False},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 64,
                "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 1,
                "num_hidden_layers": 2, "vocab_size": 260, "max_position_embeddings": 128,
                "sliding_window": 8, "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 48,
              "intermediate_size": 80, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 3, "vocab_size": 270, "max_position_embeddings": 128,
              "tie_word_embeddings": False},
}


def model_dir(tmp_path: Path, family: str) -> str:
    """A local model directory holding only a config.json (so: random initialisation)."""
    d = tmp_path / family
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY[family]))
    return str(d)


def name_for(family: str, tmp_path: Path) -> str:
    return "tiny-llama" if family == "llama" else model_dir(tmp_path, family)


def scramble(stack: LayerStack, seed: int = 1) -> None:
    """Give every parameter (norms and biases too) large random values, so that a test compares
    more than a near-zero model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in stack.layers:
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def shifted(input_ids: Tensor) -> Tensor:
    labels = torch.roll(input_ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    return labels


def hf_model(stack: LayerStack) -> Module:
    model = AutoModelForCausalLM.from_config(stack.config)
    model.load_state_dict(to_hf_state_dict(stack), strict=True)
    return model.eval()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "qwen2"])
def test_composed_layers_equal_hf_model(tmp_path: Path, family: str, impl: str) -> None:
    """Embed, every block and the head, called one after another, give Hugging Face's logits and
    loss (labels shifted by the caller, loss divided by the token count) to fp32 tolerance."""
    stack = build_model(name_for(family, tmp_path), seed=0, attn_implementation=impl)
    scramble(stack)
    vocab = stack.config.vocab_size
    input_ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = shifted(input_ids)
    labels[0, :5] = IGNORE_INDEX  # a prompt without loss
    denom = int((labels != IGNORE_INDEX).sum())
    model = hf_model(stack)
    with torch.no_grad():
        ours = stack.loss(input_ids, labels, denom)
        theirs = model(input_ids=input_ids, labels=input_ids, shift_labels=labels)
        torch.testing.assert_close(stack.logits(input_ids), theirs.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, theirs.loss, rtol=1e-6, atol=1e-6)


def test_layers_are_aligned_with_the_model_spec() -> None:
    """Layer i is spec.layers[i]: embed, blocks, head, each with the spec's parameter count."""
    stack = build_model("tiny-llama", seed=0)
    kinds = [type(layer) for layer in stack.layers]
    assert kinds == [Embed] + [Block] * stack.spec.num_blocks + [Head]
    counts = [sum(p.numel() for p in layer.parameters()) for layer in stack.layers]
    assert counts == [spec.params for spec in stack.spec.layers]
    assert stack.hf_names(0) == {"embed_tokens.weight": "model.embed_tokens.weight"}
    assert stack.hf_names(2)["layer.mlp.up_proj.weight"] == "model.layers.1.mlp.up_proj.weight"
    assert stack.hf_names(len(stack.layers) - 1) == {"norm.weight": "model.norm.weight",
                                                     "lm_head.weight": "lm_head.weight"}


def test_only_builds_give_identical_weights() -> None:
    """A layer's initial weights depend on the seed and the layer, not on which layers a rank owns."""
    full = build_model("tiny-llama", seed=7)
    last = len(full.layers) - 1
    for only in ({0}, {2, last}, {1, 3, 4}):
        part = build_model("tiny-llama", seed=7, only=only)
        assert part.owned() == sorted(only)
        for i, tensors in part.state().items():
            assert tensors.keys() == full.state()[i].keys()
            for name, value in tensors.items():
                assert torch.equal(value, full.state()[i][name]), (i, name)
    other = build_model("tiny-llama", seed=8, only={1})
    assert not torch.equal(other.state()[1]["layer.mlp.up_proj.weight"], full.state()[1]["layer.mlp.up_proj.weight"])


def test_init_follows_hf_rules() -> None:
    """Norm weights are one, matrices ~ N(0, initializer_range), in the requested dtype."""
    stack = build_model("tiny-llama", seed=0, dtype=torch.bfloat16)
    block = stack.state()[1]
    assert torch.equal(block["layer.input_layernorm.weight"], torch.ones(64, dtype=torch.bfloat16))
    w = block["layer.mlp.down_proj.weight"].float()
    assert w.dtype == torch.float32 and abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002


def test_save_pretrained_loads_in_transformers_and_streams_back(tmp_path: Path) -> None:
    """Two ranks save their layers; `from_pretrained` loads exactly those weights, and building the
    saved directory streams them back into only the layers asked for."""
    src = model_dir(tmp_path, "qwen3")
    stack = build_model(src, seed=3)
    scramble(stack)
    state = stack.state()
    out = tmp_path / "out"
    save_pretrained({i: state[i] for i in (1, 2)}, stack.config, out, rank=1, world=2)
    save_pretrained({i: state[i] for i in (0, 3)}, stack.config, out, rank=0, world=2)
    assert sorted(p.name for p in out.glob("*.safetensors")) == [shard_name(i, 4) for i in range(4)]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    expected = to_hf_state_dict(stack)
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    again = build_model(str(out), seed=99, only={2})
    assert again.owned() == [2]
    for name, value in again.state()[2].items():
        assert torch.equal(value, state[2][name])
    assert WeightReader(out).weight_map["lm_head.weight"] == shard_name(3, 4)


def test_tied_embeddings_share_one_matrix_listed_under_the_embedding(tmp_path: Path, tied_config: str) -> None:
    """A tied model (as Qwen3-1.7B): the head's LM head weight is the embedding's parameter, listed
    once (layer 0) in `state()` and the name maps; a head built alone gets the same values; the
    composed loss equals Hugging Face's; `save_pretrained` writes a checkpoint that
    `from_pretrained` loads tied, with the same weights."""
    from transformers import AutoModelForCausalLM

    stack = build_model(tied_config, seed=0)
    head = len(stack.layers) - 1
    assert stack.tied == ("lm_head.weight", "embed_tokens.weight")
    assert stack.layers[head].lm_head.weight is stack.layers[0].embed_tokens.weight
    assert stack.hf_names(head) == {"norm.weight": "model.norm.weight"}
    assert stack.hf_names(0) == {"embed_tokens.weight": "model.embed_tokens.weight"}
    assert sorted(stack.state()[head]) == ["norm.weight"]
    alone = build_model(tied_config, seed=0, only={head})
    assert torch.equal(alone.layers[head].lm_head.weight, stack.layers[0].embed_tokens.weight)
    out = tmp_path / "saved"
    save_pretrained(stack.state(), stack.config, out, rank=0, world=1)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, stack.layers[0].embed_tokens.weight)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids).logits, stack.logits(ids), rtol=1e-5, atol=1e-5)


def test_shipped_tied_model_builds_its_structure() -> None:
    """Qwen3-1.7B (tied) is no longer refused; building no layer costs nothing."""
    stack = build_model("qwen3-1.7b", seed=0, only=set())
    assert stack.tied is not None and stack.owned() == []


def test_unsupported_family_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        build_model("gpt2-xl", seed=0, only=set())


def test_attention_masks() -> None:
    """sdpa: no mask (the kernel is causal) unless a window is shorter than the sequence; eager:
    an additive mask; both allow key k for query q iff q - window < k <= q."""
    kw = {"device": torch.device("cpu"), "dtype": torch.float32}
    assert attention_mask(4, attn_implementation="sdpa", sliding_window=None, **kw) is None
    assert attention_mask(4, attn_implementation="sdpa", sliding_window=4, **kw) is None
    windowed = attention_mask(4, attn_implementation="sdpa", sliding_window=2, **kw)
    assert windowed.int().tolist() == [[[[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]]]
    eager = attention_mask(3, attn_implementation="eager", sliding_window=None, **kw)
    assert (eager == 0).int().tolist() == [[[[1, 0, 0], [1, 1, 0], [1, 1, 1]]]]


def test_blocks_follow_their_inputs_device_and_dtype() -> None:
    """A block cast to bf16 keeps its rotary frequencies fp32 (outside the module) and still
    matches the fp32 block to bf16 tolerance."""
    stack = build_model("tiny-llama", seed=0, only={1})
    block = stack.layers[1]
    assert [n for n, _ in block.named_buffers()] == []
    hidden = torch.randn(2, 8, 64)
    reference = block(hidden)
    low = block.to(torch.bfloat16)
    torch.testing.assert_close(low(hidden.bfloat16()).float(), reference, rtol=0.05, atol=0.05)
    assert low.rotary_on(torch.device("cpu")).inv_freq.dtype == torch.float32


# --- the chunked LM head and loss ---------------------------------------------------------------------

def head_case(dtype: TorchDtype, *, bias: bool = False) -> tuple[Head, Tensor, Tensor, int]:
    """tiny-llama's head (hidden 64, vocab 256) with scrambled weights, a [2, 16] microbatch whose
    labels include -100 (a prompt, the last position), and its denominator."""
    stack = build_model("tiny-llama", seed=0)
    scramble(stack)
    head = stack.layers[-1]
    if bias:
        lm_head = torch.nn.Linear(64, 256, bias=True)
        with torch.no_grad():
            lm_head.weight.copy_(head.lm_head.weight)
            lm_head.bias.copy_(torch.randn(256, generator=torch.Generator().manual_seed(2)))
        head = Head(head.norm, lm_head)
    head = head.to(dtype)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 16, 64, generator=g).to(dtype)
    labels = torch.randint(0, 256, (2, 16), generator=g)
    labels[0, :5] = IGNORE_INDEX
    labels[:, -1] = IGNORE_INDEX
    return head, hidden, labels, 40  # the step's loss tokens: more than this microbatch's 25


def plain_head_loss(head: Head, hidden: Tensor, labels: Tensor, denom: int) -> Tensor:
    """The unchunked loss: the whole microbatch's logits, upcast, cross-entropy summed / denom."""
    logits = head.lm_head(head.norm(hidden)).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum") / denom


def loss_and_grads(head: Head, hidden: Tensor, labels: Tensor, denom: int,
                   loss: Any = None) -> list[Tensor]:
    """[loss, d hidden, d every head parameter] by backward from the loss."""
    head.zero_grad(set_to_none=True)
    x = hidden.detach().requires_grad_()
    out = (loss or Head.__call__)(head, x, labels, denom)
    out.backward()
    return [out.detach(), x.grad, *(p.grad for p in head.parameters())]


def set_chunk(monkeypatch: pytest.MonkeyPatch, tokens: int, vocab: int = 256) -> None:
    """Make the head's chunks `tokens` tokens long (through the one budget constant)."""
    monkeypatch.setattr(tinypipe.describe.model, "HEAD_CHUNK_BYTES", tokens * vocab * 4)
    assert head_chunk_tokens(vocab) == tokens


@pytest.mark.parametrize("chunk", [1, 5, 7, 16, 32, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_head_equals_unchunked_loss(monkeypatch: pytest.MonkeyPatch, dtype: TorchDtype,
                                            chunk: int) -> None:
    """Head.forward in chunks (ones that divide the 32 tokens or not, one token, more than all) gives
    the unchunked loss and the gradients of the hidden state, the norm weight and the LM head
    weight, in their own dtypes: to fp32 rounding in fp32, to bf16 rounding in bf16."""
    set_chunk(monkeypatch, chunk)
    head, hidden, labels, denom = head_case(dtype)
    got = loss_and_grads(head, hidden, labels, denom)
    want = loss_and_grads(head, hidden, labels, denom, plain_head_loss)
    assert [g.dtype for g in got] == [torch.float32] + [dtype] * 3
    assert len(got) == 4 and got[1].shape == hidden.shape
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol * float(w.abs().max()))


def test_chunked_head_with_a_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    """An LM head with a bias (no supported family has one) gets its gradient too."""
    set_chunk(monkeypatch, 7)
    head, hidden, labels, denom = head_case(torch.float32, bias=True)
    got = loss_and_grads(head, hidden, labels, denom)
    want = loss_and_grads(head, hidden, labels, denom, plain_head_loss)
    assert len(got) == 5
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-6, atol=2e-6 * float(w.abs().max()))


class LargestVocabTensor(TorchDispatchMode):
    """Records the shapes of every op's outputs that have a vocabulary-sized dimension."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, Tensor) and self.vocab in t.shape:
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("recompute", [False, True])
def test_chunked_head_never_holds_the_microbatch_logits(monkeypatch: pytest.MonkeyPatch, recompute: bool) -> None:
    """With 5-token chunks, forward and backward (the interpreter's way: functional_call, and with
    recompute a no-grad forward, then the forward again and autograd.grad) create no tensor with a
    vocabulary dimension larger than one chunk's logits, except the LM head weight and its gradient;
    the unchunked loss does (so the check can fail)."""
    set_chunk(monkeypatch, 5)
    head, hidden, labels, denom = head_case(torch.bfloat16)
    weight_shape = tuple(head.lm_head.weight.shape)

    def run(loss: Any) -> list[tuple[int, ...]]:
        x = hidden.detach().requires_grad_()
        leaves = {n: p.detach().requires_grad_() for n, p in head.named_parameters()}
        with LargestVocabTensor(256) as seen:
            if recompute:
                with torch.no_grad():
                    loss(x, leaves)
            torch.autograd.grad(loss(x, leaves), [x, *leaves.values()], allow_unused=True)
        return [s for s in seen.shapes if s not in (weight_shape, weight_shape[::-1])]

    chunked = run(lambda x, w: torch.func.functional_call(head, w, (x, labels, denom)))
    assert chunked and max(torch.Size(s).numel() for s in chunked) == 5 * 256
    plain = run(lambda x, w: plain_head_loss(head, x, labels, denom))
    assert max(torch.Size(s).numel() for s in plain) == 32 * 256


def test_chunked_head_through_functional_call_and_tied(monkeypatch: pytest.MonkeyPatch, tied_config: str) -> None:
    """Through torch.func.functional_call with parameter leaves and autograd.grad (the interpreter's
    call) the head gives exactly what a direct call and backward give; a tied head (the embedding's
    matrix passed in, as the reference does) gets the unchunked loss's gradient for it."""
    set_chunk(monkeypatch, 7)
    head, hidden, labels, denom = head_case(torch.float32)
    x = hidden.detach().requires_grad_()
    leaves = {n: p.detach().requires_grad_() for n, p in head.named_parameters()}
    out = torch.func.functional_call(head, leaves, (x, labels, denom))
    got = [out.detach(), *torch.autograd.grad(out, [x, *leaves.values()])]
    direct = loss_and_grads(head, hidden, labels, denom)
    for g, d in zip(got, direct, strict=True):
        assert torch.equal(g, d)

    stack = build_model(tied_config, seed=0)
    scramble(stack)
    tied, (name, _) = stack.layers[-1], stack.tied
    v = stack.config.vocab_size
    set_chunk(monkeypatch, 7, vocab=v)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 16, stack.config.hidden_size, generator=g)
    labels = torch.randint(0, v, (2, 16), generator=g)
    matrix = stack.layers[0].get_parameter(stack.tied[1]).detach()
    alias = matrix.clone().requires_grad_()
    out = torch.func.functional_call(tied, {name: alias}, (hidden, labels, denom), strict=False)
    got = [out.detach(), torch.autograd.grad(out, [alias])[0]]
    alias = matrix.clone().requires_grad_()
    logits = F.linear(tied.norm(hidden), alias).float()
    want = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1), reduction="sum") / denom
    want_grads = [want.detach(), torch.autograd.grad(want, [alias])[0]]
    for a, b in zip(got, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6 * float(b.abs().max()))
