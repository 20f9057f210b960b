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
writes (`backends/lora_save.py`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tinypipe.describe.model import LayerKind
from tinypipe.policy.lora import LoraSpec

from .hf import param_seed
from .layers import LayerStack
from .lora_linear import ADAPTER, inject_lora

if TYPE_CHECKING:
    from .adamw import AdamWConfig

from tinypipe.ir.schedule import Action

# the module each role names in the families `run --lora` trains (Llama, Mistral, Qwen2, Qwen3)
PEFT_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
                "down": "down_proj"}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
PEFT_PREFIX = "base_model.model."  # what a PeftModel puts before the Hugging Face model's own names


class LoraError(ValueError):
    """A LoRA run this backend cannot do (the family, an adapter file that does not match)."""


def peft_config(lora: LoraSpec) -> Any:
    """peft's LoraConfig for `lora` (causal LM, no bias, plain scaling)."""
    from peft import LoraConfig

    # peft annotates lora_alpha as int but scales by alpha / r, so a fractional alpha works as it does in peft
    kw: dict[str, Any] = {"r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
                          "target_modules": [PEFT_MODULES[t] for t in lora.targets], "bias": "none",
                          "task_type": "CAUSAL_LM"}
    return LoraConfig(**kw)


def inject(stack: LayerStack, lora: LoraSpec, layers: list[int], *, seed: int
           ) -> tuple[dict[int, dict[str, str]], dict[int, dict[str, torch.Tensor]]]:
    """LoRA linears (peft's structure and names) into the owned blocks of `stack` (in place, before their
    parameters are stripped).

    Returns, per owned layer: {base parameter name -> its name in the injected module} (the LOAD names
    for `functional_call`) and the adapters' initial fp32 tensors by name in the layer."""
    family = stack.spec.family
    if family not in FAMILIES:
        raise LoraError(f"`run --lora` trains {', '.join(FAMILIES)} models; {stack.spec.name} is {family!r}")
    modules = {PEFT_MODULES[t] for t in lora.targets}
    renames: dict[int, dict[str, str]] = {}
    adapters: dict[int, dict[str, torch.Tensor]] = {}
    for i in layers:
        module = stack.layers[i]
        assert module is not None
        before = {id(p): n for n, p in module.named_parameters()}
        if stack.spec.layers[i].kind is LayerKind.BLOCK:
            inject_lora(module, modules, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout)
        renames[i] = {before[id(p)]: n for n, p in module.named_parameters() if id(p) in before}
        adapters[i] = {n: initial_value(peft_name(stack, i, n), tuple(p.shape), seed)
                       for n, p in module.named_parameters() if "lora_" in n}
    return renames, adapters


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
    base = stack.names[layer][f"{module}.weight"]  # the Hugging Face name of the wrapped linear's weight
    return f"{PEFT_PREFIX}{base.removesuffix('.weight')}.lora_{kind}.{leaf.removeprefix(ADAPTER + '.')}"


class Adapters:
    """One rank's adapters: fp32 parameters on its device, one fused AdamW per layer, steps counted."""

    def __init__(self, tensors: dict[int, dict[str, torch.Tensor]], device: torch.device, optim: AdamWConfig,
                 names: dict[int, dict[str, str]]) -> None:
        self.params = {i: {n: nn.Parameter(t.to(device), requires_grad=True) for n, t in own.items()}
                       for i, own in tensors.items()}
        self.names = names  # per layer: name in layer -> peft key
        # every adapter is a matrix, which weight decay applies to (`optim_rules.decays`)
        self.opt = {i: torch.optim.AdamW(list(p.values()), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                         weight_decay=optim.weight_decay, fused=True)
                    for i, p in self.params.items() if p}
        self.optim = optim
        self.steps = {i: 0 for i in self.params}
        self._grad_sq: dict[int, tuple[int, float]] = {}  # training step -> (layers stepped, sum of squares)

    def of(self, layer: int) -> dict[str, nn.Parameter]:
        return self.params.get(layer, {})

    def step(self, layer: int, *, at_step: int) -> None:
        """AdamW over the layer's adapters with the gradients its BWDs accumulated, at the learning rate of
        training step `at_step`; then clear them."""
        opt = self.opt.get(layer)
        if opt is None:
            raise LoraError(f"layer {layer} has no adapters to step")
        grads = [p.grad for p in self.params[layer].values()]
        if any(g is None for g in grads):
            raise LoraError(f"layer {layer}: an adapter step without gradients (no BWD before it)")
        for group in opt.param_groups:
            group["lr"] = self.optim.lr_at(at_step)
        sq = float(sum(torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads if g is not None))
        n, total = self._grad_sq.get(at_step, (0, 0.0))
        self._grad_sq[at_step] = (n + 1, total + sq)
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.steps[layer] += 1

    def drop_grads(self, layer: int) -> None:
        """Clear the layer's adapter gradients without a step (an evaluation window's backward made them)."""
        for p in self.params.get(layer, {}).values():
            p.grad = None

    def note_step(self, at_step: int) -> None:
        """Training step `at_step` ran here (its gradient-norm share is complete once its adapters stepped)."""
        self._grad_sq.setdefault(at_step, (0, 0.0))

    def take_grad_sq(self) -> dict[int, float]:
        """Per training step whose every adapter layer here has stepped: the sum of their gradients' squares."""
        done = {k: t for k, (n, t) in self._grad_sq.items() if n == len(self.opt)}
        for k in done:
            del self._grad_sq[k]
        return done

    def peft_state(self) -> dict[str, torch.Tensor]:
        """The adapters as peft saves them (CPU fp32 copies keyed by peft's names)."""
        return {self.names[i][n]: p.detach().float().cpu().clone()
                for i, own in self.params.items() for n, p in own.items()}

    def load_peft_state(self, state: dict[str, torch.Tensor], where: str) -> None:
        """Take the values of `state` (peft's keys) for this rank's adapters; a missing key is an error."""
        with torch.no_grad():
            for i, own in self.params.items():
                for n, p in own.items():
                    key = self.names[i][n]
                    if key not in state:
                        raise LoraError(f"{where}: no tensor {key!r}; the adapter was made for other targets "
                                        "or another model")
                    if tuple(state[key].shape) != tuple(p.shape):
                        raise LoraError(f"{where}: {key!r} has shape {tuple(state[key].shape)}, this model's "
                                        f"rank-{p.shape[0] if '.lora_A.' in key else p.shape[1]} adapter needs "
                                        f"{tuple(p.shape)}")
                    p.copy_(state[key])

    def state_dict(self) -> dict[str, Any]:
        return {"adapters": {i: {n: p.detach() for n, p in own.items()} for i, own in self.params.items()},
                "optim": {i: o.state_dict() for i, o in self.opt.items()}, "steps": dict(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for i, own in self.params.items():
                for n, p in own.items():
                    p.copy_(state["adapters"][i][n])
        for i, o in self.opt.items():
            o.load_state_dict(state["optim"][i])
        self.steps = dict(state["steps"])

    def device_bytes(self) -> int:
        """Adapters, their gradients and AdamW moments on the device now."""
        total = 0
        for own in self.params.values():
            for p in own.values():
                total += p.numel() * p.element_size() * (2 if p.grad is not None else 1)
        for o in self.opt.values():
            for st in o.state.values():
                total += sum(v.numel() * v.element_size() for v in st.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0)
        return total


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
    with torch.enable_grad():
        torch.autograd.backward(out, grad_tensors=dy, inputs=inputs)
    assert xin.grad is not None
    interp.dx[(step, L, m)] = xin.grad
    return None
