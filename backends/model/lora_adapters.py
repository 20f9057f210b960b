"""LoRA adapters on a frozen, streamed base: LoRA linears with peft's names in each block, tensors on the device.

`inject` wraps the targeted linears of the decoder blocks a rank owns in `lora_linear.LoraLinear`s, which
have peft's structure and names and compute W x + (alpha / r) B A dropout(x) as peft does under bf16
autocast: the adapters' fp32 masters cast to the compute dtype. The modules stay structure only
(`rank_state.strip_parameters`): the base arrives with each LOAD under its wrapped name
(`...q_proj.base_layer.weight`), the adapters are `Adapters`' fp32 parameters, which live on the device
for the whole run and are handed to the block beside the base. A's initial values are peft's draw
(Kaiming uniform, a = sqrt(5)), each from a generator seeded by the run's seed and the adapter's
peft name, so every process draws the same; B starts at zero.

A frozen block's BWD (`frozen_bwd`) asks autograd for its input's gradient and the adapters' only
(no base weight requires a gradient, so neither a weight-gradient GEMM nor an accumulator exists);
the adapters' gradients accumulate in their `.grad` across microbatches, and ADAPT_STEP runs their
AdamW (fused, on the device) and clears them. Files: `peft_state` names tensors as peft's
`get_peft_model_state_dict` does, so `PeftModel.from_pretrained` loads what `hf_save`-style code
writes (`backends/save/lora_save.py`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tinypipe.common.errors import InputError
from tinypipe.describe.families import LORA_FAMILIES
from tinypipe.describe.model import LayerKind
from tinypipe.ir.schedule import Action
from tinypipe.policy.lora_spec import LoraSpec

from .hf import param_seed
from .layers import LayerStack
from .lora_experts import inject_expert_lora
from .lora_linear import ADAPTER, inject_lora

# the module each role names in the families `run --lora` trains (`families.LORA_FAMILIES`)
PEFT_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
                "down": "down_proj"}
PEFT_PREFIX = "base_model.model."  # what a PeftModel puts before the Hugging Face model's own names
# A MoE model's experts (Qwen3-MoE, Mixtral) are two 3-D weights in transformers 5, gate and up fused. peft takes
# their transformers-4 names in `target_modules` (Qwen3-MoE's experts were gate_proj / up_proj / down_proj,
# Mixtral's w1 / w3 / w2) and converts them (peft.utils.transformers_weight_conversion): to `target_parameters`
# gate_up_proj at rank 2 r and alpha 2 alpha (both gate and up targeted, or neither) and down_proj at r, dropping
# the names from `target_modules`, so a Qwen3-MoE layer with a dense MLP (`mlp_only_layers`) gets no MLP adapter.
# `inject` does the same (`lora_experts.py`).
MIXTRAL_EXPERTS = {"gate": "w1", "up": "w3", "down": "w2"}
EXPERT_WEIGHTS = {"gate": "gate_up_proj", "up": "gate_up_proj", "down": "down_proj"}


class LoraError(ValueError):
    """A LoRA run this backend cannot do (the family, an adapter file that does not match)."""


def peft_config(lora: LoraSpec, family: str | None = None) -> Any:
    """peft's LoraConfig for `lora` (causal LM, no bias, plain scaling) on a model of `family` (its expert names)."""
    from .nf4 import hub_kernels_hidden

    with hub_kernels_hidden():  # peft imports bitsandbytes where it is installed
        from peft import LoraConfig

    # peft annotates lora_alpha as int but scales by alpha / r, so a fractional alpha works as it does in peft
    kw: dict[str, Any] = {"r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
                          "target_modules": [{**PEFT_MODULES, **(MIXTRAL_EXPERTS if family == "mixtral" else {})}[t]
                                             for t in lora.targets], "bias": "none", "task_type": "CAUSAL_LM"}
    return LoraConfig(**kw)


def inject(stack: LayerStack, lora: LoraSpec, layers: list[int], *, seed: int, device: torch.device | None = None
           ) -> tuple[dict[int, dict[str, str]], dict[int, dict[str, torch.Tensor]]]:
    """LoRA linears (peft's structure and names) into the owned blocks of `stack` (in place, before their
    parameters are stripped).

    Returns, per owned layer: {base parameter name -> its name in the injected module} (the LOAD names
    for `functional_call`) and the adapters' initial fp32 tensors by name in the layer, on `device` (default the
    CPU): each layer's go there as they are drawn, so the host never holds all of them (a MoE model's expert
    adapters are large: Qwen3-30B-A3B at r 16 on every linear, 0.98 G parameters, 3.9 GB in fp32)."""
    family = stack.spec.family
    if family not in LORA_FAMILIES:
        raise LoraError(f"`run --lora` trains {', '.join(LORA_FAMILIES)} models; {stack.spec.name} is {family!r}")
    modules = {PEFT_MODULES[t] for t in lora.targets}
    if stack.spec.is_moe:  # peft moves the MLP names to the experts (above)
        modules -= {PEFT_MODULES[t] for t in EXPERT_WEIGHTS}
    renames: dict[int, dict[str, str]] = {}
    adapters: dict[int, dict[str, torch.Tensor]] = {}
    for i in layers:
        module = stack.layers[i]
        assert module is not None
        before = {id(p): n for n, p in module.named_parameters()}
        if stack.spec.layers[i].kind is LayerKind.BLOCK:
            inject_lora(module, modules, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout)
            _inject_experts(stack, i, module, lora)
        renames[i] = {before[id(p)]: n for n, p in module.named_parameters() if id(p) in before}
        adapters[i] = {n: initial_value(peft_name(stack, i, n), tuple(p.shape), seed).to(device or "cpu")
                       for n, p in module.named_parameters() if "lora_" in n}
    return renames, adapters


def expert_ranks(lora: LoraSpec) -> dict[str, int]:
    """The expert weights `lora` adapts, each with its rank's multiple of `lora.rank` (and of alpha), as peft's
    conversion makes them: gate_up_proj x 2 (gate and up both targeted), down_proj x 1; InputError for one of
    gate and up alone, or dropout (peft refuses both)."""
    roles = {t for t in lora.targets if t in EXPERT_WEIGHTS}
    if roles & {"gate", "up"} and not {"gate", "up"} <= roles:
        raise InputError(f"lora: targets {','.join(lora.targets)}: a MoE layer's experts fuse gate and up into one "
                         "weight (gate_up_proj); target both or neither, as peft requires")
    if roles and lora.dropout:
        raise InputError(f"lora: dropout {lora.dropout:g}: peft adapts a MoE layer's expert weights without dropout; "
                         "give --lora-dropout 0, or leave gate, up and down out of the targets")
    ranks = {"gate_up_proj": 2} if "gate" in roles else {}
    return {**ranks, **({"down_proj": 1} if "down" in roles else {})}


def _inject_experts(stack: LayerStack, i: int, module: nn.Module, lora: LoraSpec) -> None:
    """peft's LoRA of the expert weights (`lora_experts.LoraParam`) in block i where the targets name them."""
    ranks = expert_ranks(lora)
    if stack.spec.layers[i].experts and ranks:
        inject_expert_lora(module, ranks, rank=lora.rank, alpha=lora.alpha)


def initial_value(key: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial fp32 value of the adapter tensor peft saves as `key`: peft's draw for A
    (kaiming_uniform_, a = sqrt(5)) from a generator seeded by `seed` and `key`; B zero."""
    value = torch.zeros(shape, dtype=torch.float32)
    if ".lora_A." in key:
        g = torch.Generator().manual_seed(param_seed(seed, key))
        nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=g)
    return value


def peft_name(stack: LayerStack, layer: int, name: str) -> str:
    """The key peft saves an adapter tensor of `layer` under: `block.layer.self_attn.q_proj.lora_A.default.weight`
    -> `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`."""
    module, _, rest = name.partition(".lora_")
    kind, _, leaf = rest.partition(".")  # "A" / "B", then "default.weight"
    base = stack.names[layer].get(f"{module}.weight")  # the Hugging Face name of the wrapped linear's weight
    if base is None:  # an expert weight's wrapper: `...mlp.experts[.base_layer]` in peft's nesting
        owner = module
        while owner.endswith(".base_layer"):
            owner = owner.removesuffix(".base_layer")
        hf = next(v for k, v in stack.names[layer].items() if k.startswith(owner + "."))
        base = hf.rpartition(".")[0] + module[len(owner):] + ".weight"
    return f"{PEFT_PREFIX}{base.removesuffix('.weight')}.lora_{kind}.{leaf.removeprefix(ADAPTER + '.')}"


# `interp` below is the rank's `interpreter.Interpreter` (typed Any: the interpreter imports this module)
def with_adapters(interp: Any, layer: int, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a frozen layer computes with: its loaded base (no gradient) and its adapters (leaves)."""
    adapters = interp.adapters
    assert adapters is not None
    return {**weights, **adapters.of(layer)}


def frozen_bwd(interp: Any, a: Action, step: int) -> None:
    """BWD of a layer on a frozen base: its input's gradient and its adapters' (accumulated in `.grad`).

    The embedding has nothing to train and no layer before it: nothing to do but drop what its FWD kept."""
    L, m = a.layer, a.microbatch
    assert L is not None and m is not None
    dy = interp.output_grad(a, step)
    if L == 0:
        interp.graphs.pop((step, L, m), None)
        if interp.aux is not None:  # a MoE model's routing sums of the microbatch (rank/moe_aux.py)
            interp.aux.done(step, m)
        adapters = interp.adapters
        assert adapters is not None
        if not interp.evaluating:  # a rank without adapters still reports its (empty) share of the step's norm
            adapters.note_step(step)
        return None
    if interp.schedule.recomputes(L):
        weights = interp._weights(a, step)
        x, extra = interp._inputs(a, step)
        xin = x.detach().requires_grad_()
        leaves = with_adapters(interp, L, weights)
        with torch.enable_grad():
            out = interp._call(L, leaves, xin, extra)
    else:
        if (step, L, m) not in interp.graphs:
            raise interp.fail(a, "no forward graph kept for it (FWD missing)")
        out, kept, leaves = interp.graphs.pop((step, L, m))
        assert kept is not None
        xin = kept
    interp.x.pop((step, L, m), None)
    inputs = [xin, *(t for t in leaves.values() if t.requires_grad)]
    outs, grads = ([out], [dy]) if interp.aux is None else interp.aux.backward_outputs(interp, a, step, out, dy)
    with torch.enable_grad():
        torch.autograd.backward(outs, grad_tensors=grads, inputs=inputs)
    assert xin.grad is not None
    interp.dx[(step, L, m)] = xin.grad
    return None
