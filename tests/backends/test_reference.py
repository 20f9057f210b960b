"""Single-process reference training: it learns, per-layer AdamW is one AdamW, staleness is exact."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.model.hf import build_model  # noqa: E402
from tinypipe.backends.model.layers import IGNORE_INDEX  # noqa: E402
from tinypipe.backends.rank.reference import reference_train  # noqa: E402

OPT = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def batches(seed: int = 0, microbatches: int = 2):
    return make_batches(None, tokenizer=ByteTokenizer(256), seq_len=32, microbatch_size=4,
                        microbatches=microbatches, seed=seed)


def test_training_the_tiny_model_lowers_the_loss() -> None:
    """50 steps on the addition task take the answer loss from ~ln(256) well down."""
    result = reference_train(build_model("tiny-llama", seed=0), batches(microbatches=1), steps=50, **OPT)
    assert len(result.losses) == 50
    assert 5.0 < result.losses[0] < 6.0
    assert sum(result.losses[-5:]) / 5 < 0.6 * result.losses[0]


def test_step_loss_is_the_mean_over_all_loss_tokens() -> None:
    """Summing the heads' outputs of a step's microbatches gives the token mean over the step."""
    stack = build_model("tiny-llama", seed=0)
    step = batches().step(0)
    expected = copy.deepcopy(stack)
    with torch.no_grad():
        x = torch.cat([x for x, _ in step])
        y = torch.cat([y for _, y in step])
        mean = expected.loss(x, y, int((y != IGNORE_INDEX).sum()))
    result = reference_train(stack, [step], steps=1, **OPT)
    assert result.losses[0] == pytest.approx(float(mean), rel=1e-5)


def test_per_layer_adamw_equals_one_adamw_over_all_parameters() -> None:
    """One AdamW per layer (what the pipeline runs) is the same update as one over the model."""
    stack = build_model("tiny-llama", seed=0)
    whole = copy.deepcopy(stack)
    data = [batches().step(k) for k in range(3)]
    result = reference_train(stack, data, steps=3, **OPT)
    params = [p for layer in whole.layers for p in layer.parameters()]
    opt = torch.optim.AdamW(params, **OPT)
    for step in data:
        denom = sum(int((y != IGNORE_INDEX).sum()) for _, y in step)
        for x, y in step:
            whole.loss(x, y, denom).backward()
        opt.step()
        opt.zero_grad()
    for i, tensors in whole.state().items():
        for name, value in tensors.items():
            torch.testing.assert_close(result.state[i][name], value, rtol=1e-5, atol=1e-6)


def test_async_staleness_one_applies_each_gradient_one_step_late() -> None:
    """Steps 0 and 1 both use the initial weights; step 2 uses the weights after step 0's update;
    the final weights hold every update."""
    data = [batches().step(k) for k in range(3)]
    stale = reference_train(build_model("tiny-llama", seed=0), data, steps=3, async_staleness=1, **OPT)
    on_initial = reference_train(build_model("tiny-llama", seed=0), [data[1]], steps=1, **OPT)
    assert stale.losses[1] == pytest.approx(on_initial.losses[0], rel=1e-6)
    stack = build_model("tiny-llama", seed=0)
    sync_first = reference_train(stack, [data[0]], steps=1, **OPT)  # stack now holds W after step 0
    probe = reference_train(stack, [data[2]], steps=1, **OPT)
    assert stale.losses[2] == pytest.approx(probe.losses[0], rel=1e-6)
    assert sync_first.losses[0] == pytest.approx(stale.losses[0], rel=1e-6)
    one = reference_train(build_model("tiny-llama", seed=0), data, steps=1, async_staleness=1, **OPT)
    sync = reference_train(build_model("tiny-llama", seed=0), data, steps=1, **OPT)
    for i, tensors in sync.state.items():
        for name, value in tensors.items():
            assert torch.equal(one.state[i][name], value)


def test_bf16_compute_tracks_fp32() -> None:
    """bf16 forward/backward with fp32 masters follows the fp32 run closely."""
    data = [batches().step(k) for k in range(5)]
    fp32 = reference_train(build_model("tiny-llama", seed=0), data, steps=5, **OPT)
    bf16 = reference_train(build_model("tiny-llama", seed=0), data, steps=5, dtype=torch.bfloat16, **OPT)
    assert all(v.dtype == torch.float32 for t in bf16.state.values() for v in t.values())
    for a, b in zip(fp32.losses, bf16.losses):
        assert a == pytest.approx(b, rel=0.02)
