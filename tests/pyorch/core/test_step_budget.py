"""StepCostModel: the online fit of step time against tokens, and the budget it gives."""

import pytest

from pyorch.core.step_budget import StepCostModel


def test_fit_recovers_the_cost_and_sets_the_budget():
    model = StepCostModel(target_step_ms=40.0, max_num_batched_tokens=16384, min_tokens=256,
                          warmup_steps=0)
    for tokens in (64, 512, 2048, 4096, 300, 8000):  # 5 ms + 0.01 ms per token
        model.record(tokens, 5.0 + 0.01 * tokens)
    a, bp, bd = model.coefficients()
    # No decodes seen: a decode token is priced like a prompt token.
    assert a == pytest.approx(5.0) and bp == pytest.approx(0.01) and bd == pytest.approx(0.01)
    assert model.budget == 3500  # (40 - 5) / 0.01
    assert model.prefill_budget(500) == 3000
    assert model.predict_ms(1000) == pytest.approx(15.0)


def test_fit_separates_prompt_and_decode_costs():
    """Mixed steps whose decode count varies: the fit recovers a, bp and bd, and the prompt
    budget of a step shrinks by bd / bp prompt tokens per decode it already carries."""
    model = StepCostModel(target_step_ms=40.0, max_num_batched_tokens=16384, min_tokens=64,
                          warmup_steps=0)
    for i in range(60):  # 6 ms + 0.02 ms per prompt token + 0.05 ms per decode token
        p, d = 100 + 97 * (i % 13), 7 * (i % 11)
        model.record(p + d, 6.0 + 0.02 * p + 0.05 * d, num_decode_tokens=d)
    a, bp, bd = model.coefficients()
    assert (a, bp, bd) == pytest.approx((6.0, 0.02, 0.05))
    assert model.prefill_budget(0) == 1700  # (40 - 6) / 0.02
    assert model.prefill_budget(400) == 700  # (40 - 6 - 20) / 0.02
    assert model.prefill_budget(1000) == 64  # no room left: the floor


def test_decode_only_steps_and_warmup_are_not_fitted():
    """Decode-only steps (CUDA graph replays) and the first warm-up steps that carry prompt
    tokens are measured but not fitted: they would skew the cost of the steps the budget
    bounds."""
    model = StepCostModel(target_step_ms=40.0, max_num_batched_tokens=8192, min_tokens=16,
                          warmup_steps=2)
    model.record(3000, 900.0)  # first steps: lazy init, autotuning
    model.record(100, 700.0)
    for _ in range(50):
        model.record(256, 3.0, num_decode_tokens=256)  # decodes only: cheap graph replays
    assert model.num_steps == 52 and model.num_fitted == 0 and model.coefficients() is None
    for tokens in (200, 1200, 600, 2200):  # 4 ms + 0.01 ms per token
        model.record(tokens, 4.0 + 0.01 * tokens)
    assert model.coefficients() == pytest.approx((4.0, 0.01, 0.01))
    assert model.budget == 3600


def test_a_stall_cannot_throttle_the_budget():
    """One step 100x slower than the fit (a GC pause) enters as at most 3x its prediction, so
    the budget barely moves; a lasting slow-down still moves it."""
    model = StepCostModel(target_step_ms=40.0, max_num_batched_tokens=16384, min_tokens=16,
                          decay=0.98, warmup_steps=0)
    for i in range(200):
        tokens = 200 + 100 * (i % 20)
        model.record(tokens, 5.0 + 0.01 * tokens)
    assert model.budget == 3500
    model.record(1000, 1500.0)
    assert model.num_clamped == 1 and model.budget > 3300
    for i in range(400):
        tokens = 200 + 100 * (i % 20)
        model.record(tokens, 5.0 + 0.02 * tokens)
    assert model.budget == pytest.approx(1750, rel=0.02)


def test_budget_is_clamped_and_untrusted_fits_do_not_throttle():
    model = StepCostModel(target_step_ms=10.0, max_num_batched_tokens=4096, min_tokens=128,
                          warmup_steps=0)
    for _ in range(50):
        model.record(256, 12.0)  # one size only: no slope
    assert model.coefficients() is None and model.budget == 4096
    model.record(512, 100.0)
    model.record(1024, 200.0)  # now far slower than the target: the floor
    assert model.budget == 128
    fast = StepCostModel(target_step_ms=1e6, max_num_batched_tokens=4096, min_tokens=128,
                         warmup_steps=0)
    fast.record(100, 1.0)
    fast.record(1000, 2.0)
    assert fast.budget == 4096  # the ceiling
    fast.record(0, 5.0)  # empty or unmeasurable steps are ignored
    fast.record(10, float("inf"))
    assert fast.num_steps == 2


def test_fit_follows_a_change_in_cost():
    model = StepCostModel(target_step_ms=50.0, max_num_batched_tokens=16384, min_tokens=1,
                          decay=0.9, warmup_steps=0)
    for i in range(100):
        tokens = 100 + 37 * (i % 20)
        model.record(tokens, 0.01 * tokens)
    assert model.budget == pytest.approx(5000, rel=0.01)
    for i in range(200):  # steps became 4x as expensive per token
        tokens = 100 + 37 * (i % 20)
        model.record(tokens, 0.04 * tokens)
    assert model.budget == pytest.approx(1250, rel=0.02)


@pytest.mark.parametrize("target", [0.0, -1.0, float("inf")])
def test_bad_target(target):
    with pytest.raises(ValueError, match="target_step_ms"):
        StepCostModel(target, 1024, 16)


@pytest.mark.parametrize("fields, message", [
    ({"max_num_partial_prefills": 2, "enable_chunked_prefill": False,
      "max_num_batched_tokens": 4096}, "requires chunked prefill"),
    ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3}, "must be <="),
    ({"long_prefill_token_threshold": 5000}, "long_prefill_token_threshold"),
    ({"target_step_ms": -1.0}, "target_step_ms"),
])
def test_scheduler_config_checks(fields, message):
    from pyorch.config import SchedulerConfig

    with pytest.raises(ValueError, match=message):
        SchedulerConfig(max_model_len=2048, **fields).validate()
