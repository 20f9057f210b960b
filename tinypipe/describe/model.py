"""ModelSpec and LayerSpec: parameters, bytes, FLOPs and activation sizes of each layer of a model.

The formulas take a `Shape` (what they need from a config); `hfconfig.py` reads configs into one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tinypipe.common.units import MIB
from tinypipe.describe.families import FAMILIES

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}

ACT_BYTES = DTYPE_BYTES["bf16"]  # activations are kept in the compute dtype (bf16)
LSE_BYTES = DTYPE_BYTES["fp32"]  # flash/sdpa attention keeps one fp32 log-sum-exp per head per token
MASK_BYTES = 1  # a dropout mask is one bool per element
LABEL_BYTES = 8  # token labels are int64 (the loss keeps the microbatch's on the GPU)
NORM_STAT_BYTES = DTYPE_BYTES["fp32"]  # a norm's per-token statistic (reciprocal RMS, mean) is fp32

# The LM head and its loss run over chunks of tokens whose fp32 logits take at most this many bytes
# (`head_chunk_tokens`; backends/model/layers.py computes them so), and no [tokens, vocab] tensor of the
# whole microbatch exists: unchunked, 4 x 2048 tokens of Llama-3's 128,256-token vocabulary held
# 11 GiB (a 3.9 GiB fp32 copy of the logits, then log-probs and their gradients). 256 MiB makes
# 523-token chunks for that vocabulary, whose transient (HEAD_CHUNK_BYTES_PER_LOGIT per logit) is
# 384 MiB. Measured on an H200, Llama-3.1-8B's head, 8,192 tokens, forward + backward: 89, 76, 71
# and 68 ms at 128, 256, 512 and 1024 MiB (unchunked: 50 ms; the backward recomputes the logits).
# 256 MiB keeps the head's workspace below the block's measured one at every shipped microbatch
# size (400 vs 728 MiB at 1 x 2048 tokens); 512 MiB would not.
HEAD_CHUNK_BYTES = 256 * MIB
LOGIT_BYTES = DTYPE_BYTES["fp32"]  # the loss's softmax is computed over fp32 logits
# At a chunk's peak, forward or backward, its logits (bf16) coexist with their fp32 shifted copy
# (forward) or softmax (backward), then that fp32 softmax with the logits' gradient (bf16): 2 + 4
# bytes per logit.
HEAD_CHUNK_BYTES_PER_LOGIT = ACT_BYTES + LOGIT_BYTES
# The head's final norm, per token and hidden element. Hugging Face's RMSNorm (Llama, Mistral,
# Qwen) computes in fp32: autograd keeps the fp32 copy of its input (4 bytes) and the normalised
# input in the compute dtype (2), and its backward, a chain of fp32 elementwise steps, holds up to
# 16 bytes per element above what the head keeps (measured: Llama-3.1-8B's head on an H200,
# 8,192 and 16,384 tokens). torch's fused LayerNorm (GPT-2, GPT-NeoX) keeps its input (2 bytes);
# its backward needs the output's and the input's gradients (2 + 2; counted, not measured).
RMSNORM_SAVED_BYTES, RMSNORM_BWD_BYTES = DTYPE_BYTES["fp32"] + ACT_BYTES, 16
LAYERNORM_SAVED_BYTES, LAYERNORM_BWD_BYTES = ACT_BYTES, 2 * ACT_BYTES

class LayerKind(str, Enum):
    """The three kinds of layer a causal LM is split into for the pipeline."""

    EMBED = "embed"
    BLOCK = "block"
    HEAD = "head"  # final norm + LM head + loss


@dataclass(frozen=True)
class LayerSpec:
    """One layer of the pipeline's layer sequence.

    `params` counts the parameters this layer owns (summed over layers = the model's exact count);
    a tied LM head owns only its norm, but `gpu_params` (what must be on the GPU to compute it)
    includes the tied embedding matrix.
    FLOPs are per token for a forward pass: `linear_flops_per_token` (2 x matmul weights) plus
    `attn_flops_per_token_per_ctx` x average attended context (seq_len / 2 for causal attention).
    Backward costs twice the forward. Activation sizes are bytes per token in the compute dtype;
    `saved_act_bytes_per_token` follows the formula in `_block_saved_act_bytes_per_token` (blocks)
    and `_head_saved_act_bytes_per_token` (the head).
    `boundary_bytes_per_token` is the hidden state (bf16): what a layer hands on (embed, block), the
    size of its input (block, head: what recompute keeps), and of the gradient it sends back.
    """

    index: int
    kind: LayerKind
    name: str
    params: int
    gpu_params: int
    linear_flops_per_token: float
    attn_flops_per_token_per_ctx: float
    saved_act_bytes_per_token: int  # what autograd keeps for backward without recompute
    boundary_bytes_per_token: int  # the activation handed to the next layer (also what recompute keeps)
    # a block's linears a LoRA may wrap: (roles it plays, in features, out features); a fused q/k/v
    # projection (GPT-2, GPT-NeoX) plays `q+k+v` (`tinypipe.policy.lora_spec.ROLES`)
    linears: tuple[tuple[str, int, int], ...] = ()
    # a mixture-of-experts MLP (0 experts: a dense layer): `experts` routed experts, `experts_per_token` of
    # them computing each token, `expert_params` parameters each, `expert_linears` one expert's linears as
    # `linears` spells them (a fused gate/up projection plays `gate+up`). `params` and `gpu_params` count
    # every expert (the host holds them all and a whole-layer LOAD uploads them all); the FLOPs count the
    # active ones (`active_params`)
    experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    expert_linears: tuple[tuple[str, int, int], ...] = ()

    @property
    def active_params(self) -> int:
        """Parameters that compute one token: all of them but the experts the router does not pick for it."""
        return self.params - (self.experts - self.experts_per_token) * self.expert_params

    def expert_bytes(self, dtype: str = "bf16") -> int:
        """Bytes of one expert's weights in `dtype` (0 for a dense layer)."""
        return self.expert_params * DTYPE_BYTES[dtype]

    def fwd_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token at sequence length `seq_len` (causal attention)."""
        return self.linear_flops_per_token + self.attn_flops_per_token_per_ctx * seq_len / 2

    def param_bytes(self, dtype: str = "bf16") -> int:
        """Bytes of the parameters this layer needs on a GPU, in `dtype`."""
        return self.gpu_params * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelSpec:
    """An ordered layer sequence (embed, block x L, head) with the model's shape and provenance."""

    name: str
    family: str  # the config's model_type: a key of `families.FAMILIES`
    layers: tuple[LayerSpec, ...]
    hidden_size: int
    vocab_size: int
    num_blocks: int
    tied_embeddings: bool
    max_seq_len: int
    source: str  # where the config came from (file or URL of the published config)
    published_params: int | None = None  # the config's `_published_params`, when it gives one

    @property
    def params(self) -> int:
        """The model's exact parameter count (a tied embedding counted once)."""
        return sum(layer.params for layer in self.layers)

    @property
    def active_params(self) -> int:
        """Parameters that compute one token (`params` for a dense model; a mixture of experts counts
        only the experts each MoE layer routes a token to)."""
        return sum(layer.active_params for layer in self.layers)

    @property
    def is_moe(self) -> bool:
        """Whether some block's MLP is a mixture of experts."""
        return any(layer.experts for layer in self.layers)


@dataclass(frozen=True)
class Shape:
    """What the layer formulas need from a config, whatever the family spells it as."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    positions: int  # rows of a learned position embedding (GPT-2); 0 for rotary models
    max_seq_len: int
    tied: bool
    gated_mlp: bool  # SwiGLU: gate, up, down (3 matrices) vs fc, proj (2)
    layer_norm: bool  # LayerNorm with bias (2h params) vs RMSNorm (h)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm of head_dim on q and k
    parallel_residual: bool  # GPT-NeoX: both norms read the block input
    block_dropout: bool  # two residual dropouts per block keep bool masks
    embed_dropout: bool
    moe: Experts | None = None  # a mixture-of-experts MLP in the layers it says (Qwen3-MoE, Mixtral)


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP (Qwen3-MoE, Mixtral as transformers defines them): a linear router (hidden ->
    `count`, no bias) and `count` SwiGLU experts of width `intermediate` (a fused gate/up projection and a down
    projection each), `per_token` of them computing each token; `sparse[k]`: whether decoder layer k has it (a
    Qwen3-MoE layer in `mlp_only_layers`, or off its `decoder_sparse_step`, has the dense MLP instead)."""

    count: int
    per_token: int
    intermediate: int
    sparse: tuple[bool, ...]


def _block_saved_act_bytes_per_token(s: Shape, *, sparse: bool = False) -> int:
    """Bytes autograd keeps per token for one block's backward (no recompute, bf16, flash/sdpa).

    The standard accounting (Korthikanti et al., "Reducing Activation Recomputation in Large
    Transformer Models", MLSys 2023) with flash attention, so no seq x seq score matrix. With
    h = hidden, q = heads * head_dim, kv = kv_heads * head_dim, i = intermediate:

        2 bytes x ( h            input of the attention norm
                  + h            input of the q/k/v projections (the normed hidden state)
                  + q + kv       inputs of q_norm / k_norm (Qwen3 only)
                  + q + 2 kv     q, k, v as the attention kernel keeps them (after RoPE)
                  + q            attention output = input of the output projection
                  + h            input of the MLP norm (0 with GPT-NeoX's parallel residual)
                  + h            input of the MLP's first projection(s)
                  + 4 i | 2 i )  SwiGLU: gate, up, silu(gate), silu(gate) * up = down's input;
                                 plain MLP: fc output (GELU input), GELU output = proj input
        + 4 bytes x heads        fp32 log-sum-exp of the attention kernel
        + 1 byte x 2 h           bool masks of the two residual dropouts, when dropout is on

    A mixture-of-experts MLP (`sparse`; k = experts per token, m = an expert's width, E = experts) keeps,
    instead of the dense 4 i, per token and routed expert the gathered input (h), the fused gate/up output
    (2 m), silu(gate) and its product with up (2 m) and the down projection's output, which the routing
    weight multiplies (h): 2 bytes x k (2 h + 4 m); and the router's fp32 softmax, 4 bytes x E (the router's
    input is the MLP's input, counted above). Counted from transformers' expert loop, not measured.

    Not counted (each well under 1%): norm statistics (fp32, one or two per token per norm),
    RoPE cos/sin (shared by all layers), the tensors of an unfused activation function.
    """
    h, i = s.hidden, s.intermediate
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    moe = s.moe if sparse else None
    mlp = (4 * i if s.gated_mlp else 2 * i) if moe is None else moe.per_token * (2 * h + 4 * moe.intermediate)
    elements = (2 * h + (q + kv if s.qk_norm else 0) + (q + 2 * kv) + q
                + (h if not s.parallel_residual else 0) + h + mlp)
    return (ACT_BYTES * elements + LSE_BYTES * s.heads + (0 if moe is None else LOGIT_BYTES * moe.count)
            + (MASK_BYTES * 2 * h if s.block_dropout else 0))


def _head_saved_act_bytes_per_token(hidden: int, *, layer_norm: bool) -> int:
    """Bytes autograd keeps per token for the head's backward (no recompute), as backends/model/layers.py's
    chunked head computes it, with h = hidden:

          RMSNORM_SAVED_BYTES x h + 4     the final RMSNorm's: its input in fp32, the normalised input
                                          (bf16) and the fp32 reciprocal RMS (Llama, Mistral, Qwen)
        | LAYERNORM_SAVED_BYTES x h + 8   LayerNorm's: its input, an fp32 mean and rstd (GPT-2, NeoX)
        + 2 h                             the normed hidden state, the LM head's input
        + 8 + 4                           the labels (int64), the loss's fp32 log-sum-exp

    Nothing per vocabulary entry: the backward recomputes the logits chunk by chunk. (The head's
    input itself is not kept by the RMSNorm, which keeps its fp32 copy; the plan counts the input.)
    Measured on an H200 (Llama-3.1-8B's head, 2,048 to 16,384 tokens): exactly this.
    """
    norm = (LAYERNORM_SAVED_BYTES * hidden + 2 * NORM_STAT_BYTES if layer_norm
            else RMSNORM_SAVED_BYTES * hidden + NORM_STAT_BYTES)
    return norm + ACT_BYTES * hidden + LABEL_BYTES + LOGIT_BYTES


def experts_hit(layer: LayerSpec, tokens: int) -> float:
    """Experts of `layer` expected to get at least one of `tokens` tokens when the router spreads them evenly
    (each token picks k of E): E (1 - (1 - k / E)^tokens); 0 for a dense layer. At a few thousand tokens every
    expert of the shipped MoE models gets some (Qwen3-30B-A3B: 8 of 128 a token, all 128 by 300 tokens)."""
    if not layer.experts:
        return 0.0
    return layer.experts * (1.0 - (1.0 - layer.experts_per_token / layer.experts) ** max(0, tokens))


def read_weight_bytes(layer: LayerSpec, tokens: int, dtype: str = "bf16") -> int:
    """Weight bytes a forward of `layer` over `tokens` tokens reads: all of them, less, in a MoE layer, the
    experts no token is expected to route to (`experts_hit`)."""
    unused = layer.experts - experts_hit(layer, tokens)
    return layer.param_bytes(dtype) - round(unused * layer.expert_bytes(dtype))


def head_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the LM head and loss: as many as keep the chunk's fp32 logits within
    HEAD_CHUNK_BYTES (at least one)."""
    return max(1, HEAD_CHUNK_BYTES // (vocab_size * LOGIT_BYTES))


def head_workspace_bytes(model: ModelSpec, tokens: int) -> int:
    """Transient bytes of the head over a microbatch of `tokens` tokens, on top of what it saves
    (`_head_saved_act_bytes_per_token`), as backends/model/layers.py's chunked head computes it: the larger
    of its backward's two phases (the forward's peak, one chunk, is below both). With h = hidden,
    v = vocabulary, T = tokens and c = min(T, head_chunk_tokens(v)):

        logits phase:  2 h T     the gradient of the normed hidden state, filled chunk by chunk
                     + 6 c v     one chunk's logits and fp32 softmax (HEAD_CHUNK_BYTES_PER_LOGIT)
        norm phase:    16 h T    the final RMSNorm's fp32 backward (RMSNORM_BWD_BYTES; LayerNorm: 4 h T)

    The logits phase is almost constant in T, unlike every other layer's workspace. The LM head
    weight's gradient is not counted here: it is the layer's gradient, which the plan counts.
    Measured on an H200 (Llama-3.1-8B's head, 2,048 to 16,384 tokens, with and without recompute):
    exactly this; the unchunked head it replaces needed 7.0 GiB here at 8,192 tokens.
    """
    h, v = model.hidden_size, model.vocab_size
    chunk = min(tokens, head_chunk_tokens(v))
    logits_phase = ACT_BYTES * h * tokens + HEAD_CHUNK_BYTES_PER_LOGIT * chunk * v
    family = FAMILIES.get(model.family)  # LayerNorm with bias, else RMSNorm
    norm_bwd = LAYERNORM_BWD_BYTES if family is not None and family.layer_norm else RMSNORM_BWD_BYTES
    return max(logits_phase, norm_bwd * h * tokens)


def head_workspace_fixed_bytes(model: ModelSpec, tokens: int) -> int:
    """The part of `head_workspace_bytes` that does not grow with the tokens: one chunk of logits."""
    return HEAD_CHUNK_BYTES_PER_LOGIT * min(tokens, head_chunk_tokens(model.vocab_size)) * model.vocab_size


def _block(s: Shape, k: int) -> LayerSpec:
    """Decoder layer k: attention, then the dense MLP or, where `s.moe` says, the router and experts."""
    h, i = s.hidden, s.intermediate
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    norm = 2 * h if s.layer_norm else h
    moe = s.moe if s.moe is not None and s.moe.sparse[k] else None
    attn_weights = h * q + 2 * h * kv + q * h
    extras = (2 * norm + (q + 2 * kv if s.qkv_bias else 0) + (h if s.o_bias else 0)
              + (2 * s.head_dim if s.qk_norm else 0))
    attn: tuple[tuple[str, int, int], ...] = (
        (("q+k+v", h, q + 2 * kv),) if s.layer_norm else (("q", h, q), ("k", h, kv), ("v", h, kv)))
    if moe is None:
        mlp_weights = (3 if s.gated_mlp else 2) * h * i
        params = attn_weights + mlp_weights + extras + ((((2 * i) if s.gated_mlp else i) + h) if s.mlp_bias else 0)
        # peft gives a MoE model's MLP roles to its experts: the MLP of its dense layers gets no LoRA
        mlp: tuple[tuple[str, int, int], ...] = (
            () if s.moe is not None
            else (("gate", h, i), ("up", h, i), ("down", i, h)) if s.gated_mlp else (("up", h, i), ("down", i, h)))
        return LayerSpec(
            index=1 + k, kind=LayerKind.BLOCK, name=f"block.{k}", params=params, gpu_params=params,
            linear_flops_per_token=float(2 * (attn_weights + mlp_weights)),
            attn_flops_per_token_per_ctx=float(4 * q),  # QK^T and AV: 2 * q FLOPs each per position
            saved_act_bytes_per_token=_block_saved_act_bytes_per_token(s), boundary_bytes_per_token=ACT_BYTES * h,
            linears=(*attn, ("o", q, h), *mlp))
    m = moe.intermediate
    router, expert = h * moe.count, 3 * h * m
    params = attn_weights + router + moe.count * expert + extras
    return LayerSpec(
        index=1 + k, kind=LayerKind.BLOCK, name=f"block.{k}", params=params, gpu_params=params,
        linear_flops_per_token=float(2 * (attn_weights + router + moe.per_token * expert)),
        attn_flops_per_token_per_ctx=float(4 * q),
        saved_act_bytes_per_token=_block_saved_act_bytes_per_token(s, sparse=True),
        boundary_bytes_per_token=ACT_BYTES * h, linears=(*attn, ("o", q, h)),
        experts=moe.count, experts_per_token=moe.per_token, expert_params=expert,
        expert_linears=(("gate+up", h, 2 * m), ("down", m, h)))


def layer_specs(s: Shape) -> tuple[LayerSpec, ...]:
    h, v = s.hidden, s.vocab
    norm = 2 * h if s.layer_norm else h
    boundary = ACT_BYTES * h
    embed_params = v * h + s.positions * h
    head_params = norm + (0 if s.tied else v * h)

    embed = LayerSpec(
        index=0, kind=LayerKind.EMBED, name="embed", params=embed_params, gpu_params=embed_params,
        linear_flops_per_token=0.0, attn_flops_per_token_per_ctx=0.0,
        saved_act_bytes_per_token=MASK_BYTES * h if s.embed_dropout else 0,  # token ids are input data
        boundary_bytes_per_token=boundary,
    )
    blocks = [_block(s, k) for k in range(s.layers)]
    head = LayerSpec(
        index=1 + s.layers, kind=LayerKind.HEAD, name="head", params=head_params,
        gpu_params=norm + v * h, linear_flops_per_token=float(2 * v * h), attn_flops_per_token_per_ctx=0.0,
        saved_act_bytes_per_token=_head_saved_act_bytes_per_token(h, layer_norm=s.layer_norm),
        boundary_bytes_per_token=boundary,
    )
    return (embed, *blocks, head)
