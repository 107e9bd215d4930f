"""StepCostModel: the online fit of step time against tokens, and the budget it gives."""

import pytest

from pyorch.core.step_budget import StepCostModel


def test_fit_recovers_the_cost_and_sets_the_budget():
    model = StepCostModel(target_step_ms=40.0, max_num_batched_tokens=16384, min_tokens=256)
    for tokens in (64, 512, 2048, 4096, 300, 8000):  # 5 ms + 0.01 ms per token
        model.record(tokens, 5.0 + 0.01 * tokens)
    a, b = model.coefficients()
    assert a == pytest.approx(5.0) and b == pytest.approx(0.01)
    assert model.budget == 3500  # (40 - 5) / 0.01
    assert model.predict_ms(1000) == pytest.approx(15.0)


def test_budget_is_clamped_and_untrusted_fits_do_not_throttle():
    model = StepCostModel(target_step_ms=10.0, max_num_batched_tokens=4096, min_tokens=128)
    for _ in range(50):
        model.record(256, 12.0)  # one size only: no slope
    assert model.coefficients() is None and model.budget == 4096
    model.record(512, 100.0)
    model.record(1024, 200.0)  # now far slower than the target: the floor
    assert model.budget == 128
    fast = StepCostModel(target_step_ms=1e6, max_num_batched_tokens=4096, min_tokens=128)
    fast.record(100, 1.0)
    fast.record(1000, 2.0)
    assert fast.budget == 4096  # the ceiling
    fast.record(0, 5.0)  # empty or unmeasurable steps are ignored
    fast.record(10, float("inf"))
    assert fast.num_steps == 2


def test_fit_follows_a_change_in_cost():
    model = StepCostModel(target_step_ms=50.0, max_num_batched_tokens=16384, min_tokens=1,
                          decay=0.9)
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
