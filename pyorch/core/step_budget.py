"""The serving token budget: how many tokens one step may carry so that it takes about
`target_step_ms`, learned from the steps the engine actually ran.

Model: a step of `t` scheduled tokens takes `a + b * t` milliseconds. `a` (the weight read, the
launch and host overhead) and `b` (the marginal cost of a token) are fitted by exponentially
weighted least squares over the measured (tokens, ms) of past steps, each step weighing
`decay` times the one after it (a half-life of ~350 steps), so the fit follows the workload
(context lengths grow, the batch mix changes). The budget is

    budget = clamp(floor((target_step_ms - a) / b), min_tokens, max_num_batched_tokens)

and it stays at max_num_batched_tokens until the fit has seen steps of at least two different
sizes (`b` > 0 and the sizes spread), so nothing is throttled on guesses. The scheduler hands
running decodes their tokens first whatever this says (up to max_num_batched_tokens); the budget
bounds what prefill chunks add on top (see `Scheduler.schedule`), with at least `min_tokens`
prefill tokens per step so that prompts always progress.
"""

from __future__ import annotations

import math

# Weight of a step relative to the next one (half-life ln 2 / (1 - decay) ~ 350 steps).
_DECAY = 0.998
# The fit needs this much weighted spread in step sizes (tokens^2) before it is trusted: steps
# that all carry the same number of tokens say nothing about the slope.
_MIN_SIZE_VARIANCE = 64.0


class StepCostModel:
    """Fits step time = a + b * tokens online and turns a target step time into a budget.

    Parameters
    ----------
    target_step_ms: the step time to aim for.
    max_num_batched_tokens: the budget never exceeds it (and is this until the fit is trusted).
    min_tokens: the budget never goes below it.
    decay: weight of each past step relative to the next.
    """

    def __init__(self, target_step_ms: float, max_num_batched_tokens: int, min_tokens: int,
                 decay: float = _DECAY) -> None:
        if not target_step_ms > 0 or math.isinf(target_step_ms):
            raise ValueError(f"target_step_ms must be a positive number, got {target_step_ms}")
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.target_step_ms = float(target_step_ms)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_tokens = max(1, min(min_tokens, max_num_batched_tokens))
        self.decay = decay
        # Weighted sums: weight, tokens, ms, tokens^2, tokens * ms.
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.num_steps = 0
        self._budget = max_num_batched_tokens

    def record(self, num_tokens: int, step_ms: float) -> None:
        """Adds one measured step: `num_tokens` scheduled tokens took `step_ms` milliseconds."""
        if num_tokens <= 0 or not step_ms > 0 or math.isinf(step_ms):
            return  # an empty or unmeasurable step says nothing about the cost
        d = self.decay
        x, y = float(num_tokens), float(step_ms)
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.num_steps += 1
        self._budget = self._compute_budget()

    def coefficients(self) -> tuple[float, float] | None:
        """(a ms, b ms per token) of the current fit, or None while it cannot be trusted."""
        if self._w <= 0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < _MIN_SIZE_VARIANCE:
            return None
        slope = (self._xy / self._w - mean_x * mean_y) / var_x
        if not slope > 0:
            return None
        return mean_y - slope * mean_x, slope

    def _compute_budget(self) -> int:
        fit = self.coefficients()
        if fit is None:
            return self.max_num_batched_tokens
        a, b = fit
        tokens = math.floor((self.target_step_ms - max(a, 0.0)) / b + 1e-9)
        return max(self.min_tokens, min(tokens, self.max_num_batched_tokens))

    @property
    def budget(self) -> int:
        """Tokens one step may carry to take about target_step_ms."""
        return self._budget

    def predict_ms(self, num_tokens: int) -> float | None:
        """The fitted time of a step of `num_tokens` tokens (None while untrusted)."""
        fit = self.coefficients()
        return None if fit is None else fit[0] + fit[1] * num_tokens
