"""A causal LM as the pipeline's layer sequence: embed, decoder blocks, norm + head + loss.

The modules here wrap Hugging Face's own modules (`embed_tokens`, one decoder layer, `norm` and
`lm_head`) so that each pipeline layer is called on its own: a block builds its positions (0..s-1),
rotary embeddings and causal mask itself (a packed window's per-document attention: `doc_attention`).
`hf.build_model` makes a `LayerStack` of them; the few lines that differ between transformers versions
are in `_call_decoder_layer` and `hf.make_rotary`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinypipe.describe.model import ModelSpec, head_chunk_tokens

from . import doc_attention

IGNORE_INDEX = -100  # labels with this value carry no loss (torch's and Hugging Face's convention)

# attention implementations whose kernels apply causality themselves when given no mask
_CAUSAL_KERNELS = ("sdpa", "flash_attention_2", "flash_attention_3")
_FLASH = ("flash_attention_2", "flash_attention_3")  # these also apply the sliding window themselves


class Embed(nn.Module):
    """Layer 0: token ids [b, s] -> hidden states [b, s, h]."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        return hidden


class Block(nn.Module):
    """One decoder layer: hidden [b, s, h] -> hidden, at positions 0..s-1 under a causal mask.

    The rotary module is kept outside the module tree (one copy per device, made on first use), so
    `.to(device)`, `.to(dtype)` and `state_dict()` see only the decoder layer's parameters and the
    inverse frequencies stay fp32 whatever the compute dtype.
    """

    def __init__(self, layer: nn.Module, rotary: nn.Module | None, *, attn_implementation: str,
                 sliding_window: int | None) -> None:
        super().__init__()
        self.layer = layer
        self.attn_implementation = attn_implementation
        self.sliding_window = sliding_window
        # packed windows attend per document without an [s, s] mask where the layer's attention takes one
        self.routed = doc_attention.route(layer, attn_implementation)
        # None: packed windows take `attention_path`'s choice; "mask", "segments" or "flex" forces one (the
        # benchmark and the tests compare them; the last two need `routed`)
        self.packed_attention: str | None = None
        self._rotary: dict[torch.device, nn.Module | None] = {torch.device("cpu"): rotary}

    def rotary_on(self, device: torch.device) -> nn.Module | None:
        """The rotary-embedding module on `device` (a copy of the CPU one; None if the layer has its own)."""
        if device not in self._rotary:
            cpu = self._rotary[torch.device("cpu")]
            self._rotary[device] = None if cpu is None else copy.deepcopy(cpu).to(device)
        return self._rotary[device]

    def attention_path(self, device: torch.device) -> str:
        """How a packed window attends on `device`: `flex` or `segments` (`doc_attention`), or `mask` (a
        [b, 1, s, s] mask, where the layer's attention cannot be routed), unless `packed_attention` says."""
        forced = self.packed_attention
        if forced is None:
            return doc_attention.packed_path(device) if self.routed else "mask"
        if forced not in doc_attention.PATHS or (forced != "mask" and not self.routed):
            raise ValueError(f"packed_attention {forced!r}: this block takes one of "
                             f"{', '.join(doc_attention.PATHS if self.routed else ('mask',))}")
        return forced

    def forward(self, hidden: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents` [b, s]: the document each position belongs to (packed windows); a position then
        attends only to earlier positions of its own document, and positions count from each document's
        start, as if each document were a sequence of its own."""
        seq_len = hidden.shape[1]
        mask: torch.Tensor | doc_attention.DocumentAttention | None
        if documents is None:
            position_ids = torch.arange(seq_len, device=hidden.device).unsqueeze(0)
            mask = attention_mask(seq_len, device=hidden.device, dtype=hidden.dtype,
                                  attn_implementation=self.attn_implementation,
                                  sliding_window=self.sliding_window)
        else:
            documents = documents.to(hidden.device)
            position_ids = document_positions(documents)
            path = self.attention_path(hidden.device)
            mask = (document_mask(documents, position_ids, dtype=hidden.dtype,
                                  attn_implementation=self.attn_implementation, sliding_window=self.sliding_window)
                    if path == "mask" else
                    doc_attention.document_attention(documents, sliding_window=self.sliding_window, path=path))
        rotary = self.rotary_on(hidden.device)
        position_embeddings = None if rotary is None else rotary(hidden, position_ids)
        return _call_decoder_layer(self.layer, hidden, mask, position_ids, position_embeddings)


class Head(nn.Module):
    """The last layer: final norm, LM head and the summed token cross-entropy divided by `denom`."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits [b, s, vocab] in the compute dtype."""
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, denom: float) -> torch.Tensor:
        """Sum of cross-entropies (fp32) over labels != -100, divided by `denom`.

        `labels` are already shifted (position t predicts labels[t]); `denom` is the number of loss
        tokens in the whole optimizer step, so the heads' outputs summed over microbatches are the
        step's mean loss, as in Hugging Face's loss with `num_items_in_batch`. The logits exist one
        chunk of `head_chunk_tokens(vocab)` tokens at a time (`chunked_lm_loss`), never for the
        whole microbatch.
        """
        normed = self.norm(hidden)
        weight, bias = self.lm_head.weight, getattr(self.lm_head, "bias", None)
        assert isinstance(weight, torch.Tensor)
        return chunked_lm_loss(normed.reshape(-1, normed.shape[-1]), weight, bias,
                               labels.reshape(-1).to(normed.device), denom,
                               chunk_tokens=head_chunk_tokens(weight.shape[0]))


def chunked_lm_loss(normed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                    denom: float, *, chunk_tokens: int) -> torch.Tensor:
    """sum over labels != -100 of cross_entropy(normed @ weight.T + bias, labels), in fp32, / `denom`.

    `normed` [T, h], `weight` [vocab, h], `labels` [T]. Equal, to fp32 rounding, to
    `F.cross_entropy(F.linear(normed, weight, bias).float(), labels, reduction="sum") / denom`,
    computed `chunk_tokens` tokens at a time (`_ChunkedLMLoss`).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    apply: Callable[..., Any] = _ChunkedLMLoss.apply  # torch's Function.apply is unannotated
    out = apply(normed, weight, bias, labels, float(denom), chunk_tokens)
    assert isinstance(out, torch.Tensor)
    return out


class _ChunkedLMLoss(torch.autograd.Function):
    """LM head + fp32 cross-entropy over chunks of tokens; the backward recomputes each chunk's logits.

    The forward keeps its inputs (the normed hidden states, the weights, the labels) and one fp32
    log-sum-exp per token: per chunk it computes the logits and their log-sum-exp, adds the chunk's
    loss and drops the logits. The backward recomputes each chunk's logits, makes them the fp32
    softmax with that log-sum-exp, subtracts the one-hot labels, scales by grad / denom (0 where the
    label is -100) and adds the chunk's share to the gradients of the normed hidden states, the
    weight and the bias. A microbatch so costs one more head GEMM (the recompute) but holds one
    chunk of logits at a time, as Liger-Kernel's fused linear cross-entropy does
    (linkedin/Liger-Kernel, ops/fused_linear_cross_entropy.py), which also accumulates the weight's
    gradient chunk by chunk in the weight's dtype.

    Transient bytes of a chunk of c tokens and a vocabulary of v, in a 2-byte compute dtype: 6 c v,
    forward and backward alike -- the logits (2 c v) while their fp32 shifted copy (4 c v) is
    written, then the fp32 softmax while the logits' gradient (2 c v) is written from it; the rest
    works in place. `tinypipe.describe.model.head_workspace_bytes` counts this.
    """

    @staticmethod
    def forward(ctx: Any, normed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, denom: float, chunk_tokens: int) -> torch.Tensor:
        valid = labels != IGNORE_INDEX
        target = torch.where(valid, labels, 0)
        lse = torch.empty(labels.shape, dtype=torch.float32, device=normed.device)
        total = torch.zeros((), dtype=torch.float32, device=normed.device)
        for a, b in _chunks(normed.shape[0], chunk_tokens):
            logits = F.linear(normed[a:b], weight, bias)
            top = logits.amax(dim=1, keepdim=True).float()
            picked = logits.gather(1, target[a:b, None]).squeeze(1).float()
            shifted = torch.sub(logits, top, out=_fp32_like(logits))
            del logits
            lse[a:b] = shifted.exp_().sum(dim=1).log_().add_(top.squeeze(1))
            del shifted
            total += torch.where(valid[a:b], lse[a:b] - picked, 0.0).sum()
        ctx.save_for_backward(normed, weight, bias, labels, lse)
        ctx.denom, ctx.chunk_tokens = denom, chunk_tokens
        return total / denom

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        normed, weight, bias, labels, lse = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        valid = labels != IGNORE_INDEX
        target = torch.where(valid, labels, 0)
        row_scale = torch.where(valid, grad_loss.float() / ctx.denom, 0.0)  # d loss / d logits = this x (p - onehot)
        grad_x = torch.empty(normed.shape, dtype=normed.dtype, device=normed.device) if need_x else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        for a, b in _chunks(normed.shape[0], ctx.chunk_tokens):
            x = normed[a:b]
            logits = F.linear(x, weight, bias)
            probs = torch.sub(logits, lse[a:b, None], out=_fp32_like(logits))
            del logits
            probs.exp_()
            probs[torch.arange(b - a, device=probs.device), target[a:b]] -= 1.0
            grad_logits = torch.mul(probs, row_scale[a:b, None], out=torch.empty_like(probs, dtype=normed.dtype))
            del probs
            if grad_x is not None:
                torch.mm(grad_logits, weight, out=grad_x[a:b])
            if grad_w is not None:
                grad_w.addmm_(grad_logits.t(), x)
            if grad_b is not None:
                grad_b.add_(grad_logits.sum(dim=0))
            del grad_logits  # before the next chunk's logits exist
        return grad_x, grad_w, grad_b, None, None, None


def _fp32_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=torch.float32, device=t.device)


def _chunks(tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of `chunk_tokens` tokens (the last one shorter where it does not divide)."""
    return [(a, min(a + chunk_tokens, tokens)) for a in range(0, tokens, chunk_tokens)]


def attention_mask(seq_len: int, *, device: torch.device, dtype: torch.dtype, attn_implementation: str,
                   sliding_window: int | None) -> torch.Tensor | None:
    """The mask a decoder layer gets for positions 0..seq_len-1 with no padding.

    None where the kernel is causal by itself (sdpa, flash: this keeps SDPA on its flash kernel);
    otherwise [1, 1, s, s]: boolean (True = attend) for sdpa with a sliding window, additive
    (0 or the dtype's minimum) for eager attention, as transformers' own mask builders make them.
    """
    windowed = sliding_window is not None and sliding_window < seq_len
    if attn_implementation in _FLASH or (attn_implementation in _CAUSAL_KERNELS and not windowed):
        return None
    q = torch.arange(seq_len, device=device)[:, None]
    k = torch.arange(seq_len, device=device)[None, :]
    allowed = k <= q
    if sliding_window is not None and windowed:
        allowed &= k > q - sliding_window
    allowed = allowed[None, None]
    if attn_implementation == "sdpa":
        return allowed
    additive = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return additive.masked_fill(~allowed, torch.finfo(dtype).min)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Per position of `documents` [b, s] (document ids, equal along each document's run), its offset from
    the start of its document's run in the row: [b, s] long."""
    b, s = documents.shape
    index = torch.arange(s, device=documents.device).expand(b, s)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def document_mask(documents: torch.Tensor, positions: torch.Tensor, *, dtype: torch.dtype, attn_implementation: str,
                  sliding_window: int | None) -> torch.Tensor:
    """[b, 1, s, s]: position q attends to k <= q of its own document (within the sliding window, counted
    in the document's positions); boolean for sdpa and flash-free kernels that take one, additive (0 or
    the dtype's minimum) for eager attention."""
    s = documents.shape[1]
    q = torch.arange(s, device=documents.device)
    allowed = (q[None, :] <= q[:, None])[None] & (documents[:, :, None] == documents[:, None, :])
    if sliding_window is not None:
        allowed &= (positions[:, :, None] - positions[:, None, :]) < sliding_window
    allowed = allowed[:, None]
    if attn_implementation != "eager":
        return allowed
    additive = torch.zeros(allowed.shape, dtype=dtype, device=documents.device)
    return additive.masked_fill(~allowed, torch.finfo(dtype).min)


def _call_decoder_layer(layer: nn.Module, hidden: torch.Tensor,
                        mask: torch.Tensor | doc_attention.DocumentAttention | None, position_ids: torch.Tensor,
                        position_embeddings: Any) -> torch.Tensor:
    """Call a Hugging Face decoder layer the way its model's forward does, in any transformers >= 4.45.

    transformers 5.x takes `position_embeddings` and returns a tensor; 4.4x returns a tuple whose
    first item is the hidden state, and its Mistral/Qwen2 layers compute rotary from `position_ids`
    (which is why both are passed: each version ignores what it does not use).
    """
    kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": position_ids}
    if position_embeddings is not None:
        kwargs["position_embeddings"] = position_embeddings
    out = layer(hidden, **kwargs)
    hidden_out: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return hidden_out


@dataclass
class LayerStack:
    """A model split into its layer sequence, index-aligned with `spec.layers`.

    `layers[0]` is an `Embed`, `layers[1..L]` are `Block`s, `layers[L+1]` the `Head`; a layer this
    process does not own is None. `config` is the Hugging Face config; `source_dir` the local model
    directory the weights (and tokenizer files) came from, if any.
    """

    layers: list[nn.Module | None]
    config: Any
    spec: ModelSpec
    names: list[dict[str, str]]  # per layer: parameter name in the layer -> Hugging Face state-dict name
    source_dir: Path | None = None
    # tied embeddings: (the shared matrix's name in the head, its name in the embedding); the head's
    # parameter is the embedding's own one where both are materialised, and is listed under layer 0 only
    tied: tuple[str, str] | None = None
    # `build_model(lazy=True)`: layer i's own weights, read or drawn when called (its module's stay on meta)
    tensors_of: Callable[[int], dict[str, torch.Tensor]] | None = None

    def hf_names(self, i: int) -> dict[str, str]:
        """Layer i's own parameter names (as in `layers[i].named_parameters()`, less a tied head's
        shared matrix, which is layer 0's) -> Hugging Face names."""
        return dict(self.names[i])

    def own_parameters(self, i: int) -> list[tuple[str, nn.Parameter]]:
        """Layer i's parameters that it owns (a tied head's embedding matrix is layer 0's)."""
        return [(n, p) for n, p in self._layer(i).named_parameters() if n in self.names[i]]

    def owned(self) -> list[int]:
        """Indices of the layers materialised in this process."""
        return [i for i, layer in enumerate(self.layers) if layer is not None]

    def state(self) -> dict[int, dict[str, torch.Tensor]]:
        """The owned layers' parameters, {layer index: {name in layer: tensor}} (detached, not copied)."""
        return {i: {n: p.detach() for n, p in self.own_parameters(i)}
                for i, layer in enumerate(self.layers) if layer is not None}

    def load_state(self, state: dict[int, dict[str, torch.Tensor]]) -> None:
        """Copy `state` (as `state()` returns it) into the owned layers."""
        for i, tensors in state.items():
            layer = self._layer(i)
            params = dict(layer.named_parameters())
            with torch.no_grad():
                for name, value in tensors.items():
                    params[name].copy_(value)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits of the whole model (every layer must be owned): [b, s] -> [b, s, vocab]."""
        hidden = self._layer(0)(input_ids)
        for i in range(1, len(self.layers) - 1):
            hidden = self._layer(i)(hidden)
        head = self._layer(len(self.layers) - 1)
        assert isinstance(head, Head)
        return head.logits(hidden)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, denom: float) -> torch.Tensor:
        """The composed forward: embed, every block, head (every layer must be owned)."""
        hidden = self._layer(0)(input_ids)
        for i in range(1, len(self.layers) - 1):
            hidden = self._layer(i)(hidden)
        loss: torch.Tensor = self._layer(len(self.layers) - 1)(hidden, labels, denom)
        return loss

    def _layer(self, i: int) -> nn.Module:
        layer = self.layers[i]
        if layer is None:
            raise ValueError(f"layer {i} ({self.spec.layers[i].name}) is not materialised in this process")
        return layer

