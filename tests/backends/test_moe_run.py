"""Mixture-of-experts models (Qwen3-MoE, Mixtral) through `run`: full fine-tuning equals a plain transformers loop,
load-balancing loss included; LoRA on attention and experts equals peft; what peft refuses is refused."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from conftest import plan_run  # noqa: E402

from tinypipe import traces  # noqa: E402
from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.model.hf import build_model  # noqa: E402
from tinypipe.backends.model.layers import IGNORE_INDEX  # noqa: E402
from tinypipe.backends.model.lora_adapters import initial_value, peft_config  # noqa: E402
from tinypipe.backends.options.run_flags import add_run_arguments  # noqa: E402
from tinypipe.backends.save.hf_save import to_hf_state_dict  # noqa: E402
from tinypipe.backends.save.lora_save import ADAPTER_WEIGHTS  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402
from tinypipe.estimate.lora_costs import model_adapter_params  # noqa: E402
from tinypipe.policy.lora_spec import ROLES, LoraSpec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ, MBS, MB, STEPS = 16, 2, 2, 50
# The learning rate keeps 50 steps within rounding: top-k routing is discontinuous, and once a rounding difference
# flips a token between two near-tied experts the runs part by more than rounding (at 1e-2 a tiny Qwen3-MoE run
# parts from the plain loop within ten steps, as two plain loops with transformers' two expert kernels part later).
LR, WD, COEF = 1e-3, 0.1, 0.5  # a large load-balancing coefficient: its loss and gradient are far above rounding
RANK, ALPHA = 4, 8.0
POLICY = {"name": "test", "swap": "layer", "host_memory": "compact", "microbatch_size": MBS, "resident": "none",
          "packing": [1, 2, 1, 2], "mapping": [0, 1, 0, 1]}  # two ranks, each with two packs
MODELS = ("tiny-qwen3-moe", "tiny-mixtral")


def moe_config(tmp: Path, name: str) -> str:
    """The shipped tiny MoE config `name` with the load-balancing coefficient COEF, as a file in `tmp`."""
    path = traces.path("models", name)
    assert path is not None
    out = tmp / f"{name}.json"
    out.write_text(json.dumps({**json.loads(path.read_text()), "router_aux_loss_coef": COEF}))
    return str(out)


def pipeline(tmp: Path, model: str, *extra: str, **policy: Any) -> tuple[Any, list[Any]]:
    """`run` on 2 thread ranks for STEPS steps: the plan and the ranks' results (with their final masters)."""
    pol = tmp / "policy.json"
    pol.write_text(json.dumps({**POLICY, **policy}))
    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    args = ap.parse_args(["--seq-len", str(SEQ), "--batch-tokens", str(SEQ * MBS * MB), "--lr", str(LR),
                          "--lr-schedule", "constant", "--warmup-ratio", "0", "--gpus", "2", "--model", model,
                          "--steps", str(STEPS), "--policy", str(pol), "--out", str(tmp / "out"), *extra])
    plan = plan_run(args)
    job = dataclasses.replace(plan.job, progress=False, keep_masters=True, checkpoint_s=0.0)
    return plan, run_threads(job, 2)


def hf_model(model: str) -> Any:
    """The Hugging Face model with the pipeline's initial weights (`build_model`'s seeded draw)."""
    from transformers import AutoModelForCausalLM

    stack = build_model(model, seed=0)
    hf = AutoModelForCausalLM.from_config(stack.config).float()
    hf.load_state_dict(to_hf_state_dict(stack), strict=True)
    return hf


def plain_loop(model: Any, opt: Any) -> list[float]:
    """A plain transformers loop over the pipeline's data: per microbatch, the token cross-entropy summed and divided
    by the step's loss tokens, plus `router_aux_loss_coef` x transformers' `aux_loss` of that forward call over the
    step's M microbatches (the mean of the calls' aux losses); AdamW after each step."""
    batches = make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS, microbatches=MB,
                           seed=0)
    coef = model.config.router_aux_loss_coef
    losses = []
    for step in range(STEPS):
        mbs = batches.step(step)
        denom = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in mbs)
        total = 0.0
        for ids, labels in mbs:
            out = model(input_ids=ids, output_router_logits=True)
            logits = out.logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                     ignore_index=IGNORE_INDEX, reduction="sum") / denom
            loss = loss + coef * out.aux_loss / len(mbs)
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


@pytest.mark.parametrize(("name", "recompute"), [("tiny-qwen3-moe", True), ("tiny-mixtral", False)])
def test_full_finetuning_equals_a_plain_transformers_loop(tmp_path: Path, name: str, recompute: bool) -> None:
    """50 steps of `run` (2 ranks, two packs each; recomputed or kept graphs) give the losses of a plain transformers
    loop with torch's AdamW (weight decay 0.1 where `optim_rules.decays` says), load-balancing loss included, to
    float32 rounding; the final weights agree to half a step of AdamW (a weight whose gradient is at rounding level
    moves by up to lr a step in either run). The experts are one 3-D weight per layer in both: an expert no token
    routes to gets a zero gradient, and AdamW still decays it and moves it by its moments."""
    model = moe_config(tmp_path, name)
    plan, ranks = pipeline(tmp_path, model, "--weight-decay", str(WD), recompute=recompute)
    assert plan.schedule.recomputes(1) is recompute
    got = [v for r in ranks for _, v in sorted(r.losses.items())]
    hf = hf_model(model)
    decay = [p for n, p in hf.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in hf.named_parameters() if not (p.dim() >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}], lr=LR,
                            betas=plan.job.optim.betas, eps=plan.job.optim.eps)
    want = plain_loop(hf, opt)
    assert len(got) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    names = build_model(model, seed=0, only=set()).names
    trained = dict(hf.named_parameters())
    for r in ranks:
        for i, tensors in (r.masters or {}).items():
            for n, value in tensors.items():
                torch.testing.assert_close(value, trained[names[i][n]].detach(), rtol=0, atol=LR / 2)


@pytest.mark.parametrize("name", MODELS)
def test_lora_on_attention_and_experts_equals_peft(tmp_path: Path, name: str) -> None:
    """LoRA r 4 on all seven roles (attention's linears; the experts' gate/up weight at 2 r and down at r, as peft
    converts the targets for transformers 5; the router frozen): 50 steps through the pipeline give peft's losses
    (load-balancing loss included) and adapters; the saved directory holds peft's keys, which
    `PeftModel.from_pretrained` loads with the trained values, and the estimate counts peft's parameters."""
    model = moe_config(tmp_path, name)
    _, ranks = pipeline(tmp_path, model, "--lora", str(RANK), "--lora-alpha", str(ALPHA), "--lora-targets", "all")
    got = [v for r in ranks for _, v in sorted(r.losses.items())]
    hf = hf_model(model)
    lora = LoraSpec(rank=RANK, alpha=ALPHA, targets=ROLES)
    stack = build_model(model, seed=0, only=set())
    pm = peft.get_peft_model(hf, peft_config(lora, stack.spec.family))
    named = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in named) and any(".experts." in n for n in named)
    assert sum(p.numel() for p in named.values()) == model_adapter_params(stack.spec, lora)
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(initial_value(n.replace(".default", ""), tuple(p.shape), 0))
    opt = torch.optim.AdamW(list(named.values()), lr=LR, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    want = plain_loop(pm, opt)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "out" / ADAPTER_WEIGHTS))
    trained = {n.replace(".default", ""): p.detach() for n, p in named.items()}
    assert set(saved) == set(trained)
    for k, v in trained.items():
        torch.testing.assert_close(saved[k], v, rtol=1e-4, atol=2e-5)
    loaded = peft.PeftModel.from_pretrained(hf_model(model), str(tmp_path / "out"))
    back = {n.replace(".default", ""): p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)


@pytest.mark.parametrize(("argv", "words"), [
    (("--lora-targets", "q,gate"), "fuse gate and up into one weight"),
    (("--lora-targets", "all", "--lora-dropout", "0.1"), "without dropout"),
])
def test_lora_on_experts_refuses_what_peft_refuses(tmp_path: Path, argv: tuple[str, ...], words: str) -> None:
    """One of gate and up alone, or dropout, on a MoE model's experts: a one-line InputError before any worker
    starts (peft raises for both)."""
    with pytest.raises(InputError, match=words):
        pipeline(tmp_path, "tiny-mixtral", "--lora", str(RANK), *argv, recompute=False)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_lora_computes_what_the_adapted_weight_computes(family: str) -> None:
    """The outermost expert wrapper's grouped low-rank forward (no adapted weight made) gives peft's adapted-weight
    output and gradients, to fp32 rounding, on a MoE block of each family."""
    from tinypipe.backends.model import lora_experts

    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Moe

        config: Any = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Moe

        config = MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = Moe(config)
    lora_experts.inject_expert_lora(block, {"gate_up_proj": 2, "down_proj": 1}, rank=RANK, alpha=ALPHA)
    wrapper = block.experts
    for name, p in block.named_parameters():
        torch.nn.init.normal_(p, std=0.1)
        p.requires_grad_("lora_" in name)
    assert lora_experts.lowrank_ok(wrapper._target()[0], wrapper.chain())
    x = torch.randn(2, 7, 32, requires_grad=True)
    trained = [x, *(p for p in block.parameters() if p.requires_grad)]

    def output_and_grads() -> list[Any]:
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        return [out, *torch.autograd.grad(out.square().sum(), trained)]

    grouped = output_and_grads()
    _, path = wrapper._target()
    wrapper.forward = lambda *a, **k: torch.func.functional_call(  # type: ignore[method-assign]
        wrapper.base_layer, {path: wrapper.weight()}, a, k, strict=False)
    adapted = output_and_grads()
    for a, b in zip(grouped, adapted, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_expert_lora_takes_the_grouped_path_where_transformers_leaves_out_the_optional_flags() -> None:
    """transformers 5.17's experts carry no `has_post_expert_norm` (nor, earlier, `is_concatenated`): missing flags
    read as transformers' defaults, so the grouped low-rank path is taken; a flag that changes the computation
    (a norm after the experts, transposed weights) sends the experts to peft's path."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from tinypipe.backends.model import lora_experts

    block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8,
                                                  num_experts_per_tok=2))
    lora_experts.inject_expert_lora(block, {"gate_up_proj": 2, "down_proj": 1}, rank=RANK, alpha=ALPHA)
    experts, chain = block.experts._target()[0], block.experts.chain()
    for flag in ("has_post_expert_norm", "is_concatenated"):
        if flag in vars(experts):
            delattr(experts, flag)
    assert lora_experts.lowrank_ok(experts, chain)
    experts.has_post_expert_norm = True
    assert not lora_experts.lowrank_ok(experts, chain)
    experts.has_post_expert_norm, experts.is_transposed = False, True
    assert not lora_experts.lowrank_ok(experts, chain)
