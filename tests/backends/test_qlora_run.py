"""LoRA on a 4-bit (NF4) base equals peft's QLoRA on bitsandbytes' Linear4bit; its adapter is peft's for the
original base; its host holds what the formula says. LoRA clips by the adapters' global norm as a plain peft loop
with torch.nn.utils.clip_grad_norm_ does. A LoRA run without peft, or a 4-bit one without bitsandbytes, is refused
before any worker starts."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tinypipe.backends.model import nf4  # noqa: E402

try:
    F = nf4.functional()
    with nf4.hub_kernels_hidden():
        import peft
except ImportError:
    pytest.skip("needs peft and bitsandbytes (pip install 'tinypipe[lora,qlora]')", allow_module_level=True)

from conftest import plan_run  # noqa: E402
from test_lora_run import ALPHA, LR, MB, MBS, RANK, SEED, SEQ, config, hf_model, parse, pipeline, saved  # noqa: E402

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.model.layers import IGNORE_INDEX  # noqa: E402
from tinypipe.backends.model.lora_adapters import initial_value, peft_config  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402
from tinypipe.estimate.lora_costs import frozen_host_bytes  # noqa: E402
from tinypipe.policy.lora_spec import ROLES, LoraSpec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 20
LORA = LoraSpec(rank=RANK, alpha=ALPHA, targets=ROLES)
# the pipeline and peft compute the same mathematics in another order (test_lora_run.py); over 20 steps the
# losses stay within float32 rounding of each other
LOSS_RTOL, ADAPTER_ATOL, ADAPTER_RTOL = 1e-5, 1e-4, 1e-3


def quantized_hf_model(model: str) -> Any:
    """The Hugging Face model with the pipeline's initial weights in 4 bits, as QLoRA holds it: each decoder
    layer's nn.Linear replaced by bitsandbytes' Linear4bit (NF4, block 64, fp32 absmax; computing in fp32 on the
    CPU), what `from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True))` builds (here without
    its CPU path, which would fetch a kernel from the Hub)."""
    with nf4.hub_kernels_hidden():
        import bitsandbytes as bnb

    hf = hf_model(model)
    for block in hf.model.layers:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.float32, compress_statistics=False, quant_type="nf4")
                    q.weight = bnb.nn.Params4bit(child.weight.detach().clone(), requires_grad=False,
                                                 compress_statistics=False, quant_type="nf4", blocksize=64)
                    setattr(parent, name, q.to("cpu"))  # quantised as it moves to its device
    return hf


def peft_loop(base: Any, steps: int, max_grad_norm: float | None = None
              ) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """peft's LoRA (`LORA`) on `base`, trained as test_lora_run.peft_reference does (the pipeline's data, initial
    adapters and loss), with the adapters' gradients clipped by `torch.nn.utils.clip_grad_norm_` when
    `max_grad_norm` is given. Returns the losses, the final adapters by peft's keys, and each step's norm."""
    pm = peft.get_peft_model(base, peft_config(LORA))
    pm.train()  # bitsandbytes' CPU inference path repacks the weights; training computes as a GPU does
    named = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(initial_value(n.replace(".default", ""), tuple(p.shape), SEED))
    opt = torch.optim.AdamW(list(named.values()), lr=LR, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    data = make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS, microbatches=MB,
                        seed=SEED)
    losses, norms = [], []
    for step in range(steps):
        mbs = data.step(step)
        denom = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in mbs)
        total = 0.0
        for ids, labels in mbs:
            logits = pm(input_ids=ids).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                     ignore_index=IGNORE_INDEX, reduction="sum") / denom
            loss.backward()
            total += float(loss.detach())
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(named.values()), max_grad_norm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {n.replace(".default", ""): p.detach().clone() for n, p in named.items()}, norms


def test_4bit_lora_equals_peft_on_bitsandbytes_and_saves_an_adapter_for_the_original_base(tmp_path: Path) -> None:
    """`run --lora --load-in-4bit` over 20 steps on 2 workers: the losses and adapters equal peft's LoRA on the
    model Hugging Face loads in 4 bits (bitsandbytes' Linear4bit, the same NF4 codes); the host holds each block
    linear as NF4, exactly the bytes `frozen_host_bytes` counts (under a third of the fp32 copy's); the adapter
    directory loads with peft on the original, unquantised base; `--merge` writes the dequantised base with the
    adapters folded in, which computes what peft computes on the dequantised base."""
    model = config(tmp_path)
    plan, ranks = pipeline(tmp_path, model, 2, "--steps", str(STEPS), "--load-in-4bit", "--merge")
    assert plan.schedule.lora == dataclasses.replace(LORA, nf4=True)
    losses = {k: v for r in ranks for k, v in r.losses.items()}
    want_losses, want_adapters, _ = peft_loop(quantized_hf_model(model), STEPS)
    assert [losses[k] for k in range(STEPS)] == pytest.approx(want_losses, rel=LOSS_RTOL)
    got = saved(tmp_path / "out")
    assert sorted(got) == sorted(want_adapters)
    for key, want in want_adapters.items():
        torch.testing.assert_close(got[key], want, atol=ADAPTER_ATOL, rtol=ADAPTER_RTOL)
    # the host: NF4 for the blocks' linears, fp32 for the rest, as the formula counts them, rank by rank
    spec = plan.spec
    for r in ranks:
        formula = frozen_host_bytes(spec, compute_dtype="fp32", layers=tuple(r.layers), nf4=True)
        assert r.held["upload_copy_bytes"] == formula.upload_copy_bytes
    # each block: its linears' 9,216 weights as NF4 (0.5625 B each: 5,184 B) and its 80 norm weights in fp32
    # (320 B), against 37,184 B in fp32; the embedding and the head (16,416 weights) stay fp32
    assert frozen_host_bytes(spec, compute_dtype="fp32", nf4=True).total_bytes == 3 * (5184 + 320) + 16416 * 4
    assert frozen_host_bytes(spec, compute_dtype="fp32").total_bytes == 3 * 37184 + 16416 * 4
    # the adapter is peft's for the original base: it loads there with the trained values, and generates
    original = hf_model(model)
    loaded = peft.PeftModel.from_pretrained(original, str(tmp_path / "out"))
    params = {n.replace(".default", ""): p for n, p in loaded.named_parameters() if "lora_" in n}
    assert all(torch.equal(params[k].detach(), t) for k, t in got.items())
    assert loaded.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False).shape == (1, 7)
    # --merge: the dequantised base plus the adapters, as peft on a base holding the dequantised weights computes
    from transformers import AutoModelForCausalLM

    dequantised = hf_model(model)
    with torch.no_grad():
        for name, module in dequantised.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                codes, absmax = nf4.quantize(module.weight.detach())
                module.weight.copy_(nf4.dequantize(codes, absmax, tuple(module.weight.shape), torch.float32))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out" / "merged"))
    on_dequantised = peft.PeftModel.from_pretrained(dequantised, str(tmp_path / "out"))
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(merged(input_ids=ids).logits, on_dequantised(input_ids=ids).logits, atol=1e-4,
                               rtol=1e-4)


def test_lora_clips_the_adapters_by_their_global_norm_like_clip_grad_norm(tmp_path: Path) -> None:
    """`--max-grad-norm` with `--lora` on 3 workers, the embedding alone on one and the head alone on another (no
    adapters there: each rank still joins the norm's all-reduce): the losses and adapters equal a plain peft loop
    that clips the adapters' gradients with torch.nn.utils.clip_grad_norm_, which clips every step; and they differ
    from the unclipped run's."""
    model = config(tmp_path)
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"name": "t", "swap": "layer", "microbatch_size": MBS, "resident": "none",
                                  "packing": [1, 3, 1], "mapping": [0, 1, 2]}))
    max_norm = 0.05
    steps = 6
    _, ranks = pipeline(tmp_path, model, 3, "--steps", str(steps), "--policy", str(policy),
                        "--max-grad-norm", str(max_norm))
    losses = {k: v for r in ranks for k, v in r.losses.items()}
    want, want_adapters, norms = peft_loop(hf_model(model), steps, max_grad_norm=max_norm)
    assert min(norms) > max_norm  # every step clipped: the test could tell clipping from none
    assert [losses[k] for k in range(steps)] == pytest.approx(want, rel=LOSS_RTOL)
    got = saved(tmp_path / "out")
    for key, t in want_adapters.items():
        torch.testing.assert_close(got[key], t, atol=ADAPTER_ATOL, rtol=ADAPTER_RTOL)
    unclipped, _, _ = peft_loop(hf_model(model), steps)
    assert unclipped[-1] != pytest.approx(want[-1], rel=1e-3)


@pytest.mark.parametrize(("blocked", "argv", "match"), [
    ("peft", ["--lora", "4"], r"peft is not installed; pip install 'tinypipe\[lora\]'"),
    ("bitsandbytes", ["--lora", "4", "--load-in-4bit"], r"bitsandbytes.*pip install 'tinypipe\[qlora\]'"),
])
def test_a_missing_library_is_refused_before_any_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        blocked: str, argv: list[str], match: str) -> None:
    """Without peft a LoRA run would train every step and fail at the save; without bitsandbytes a 4-bit one at
    its first layer: both are one-line errors with the install command while the run is planned."""
    for name in [m for m in sys.modules if m == blocked or m.startswith(blocked + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, blocked, None)  # `import peft` / `import bitsandbytes` raise ImportError
    with pytest.raises(InputError, match=match):
        plan_run(parse("--gpus", "1", "--out", str(tmp_path / "o"), *argv))
    assert not (tmp_path / "o").exists()


def test_load_in_4bit_needs_lora(tmp_path: Path) -> None:
    """--load-in-4bit alone: a one-line error naming --lora."""
    with pytest.raises(InputError, match="--load-in-4bit needs --lora R"):
        plan_run(parse("--gpus", "1", "--out", str(tmp_path / "o"), "--load-in-4bit"))
