"""The serving token budget: how many prompt tokens one step may carry so that it takes about
`target_step_ms`, learned from the steps the engine actually ran.

Model: a step that carries `p` prompt (prefill) tokens and `d` decode tokens takes

    ms = a + bp * p + bd * d

`a` is the weight read, the launches and the host work of a step; `bp` the marginal cost of a
prompt token (GEMM FLOPs); `bd` that of a decode token (GEMM FLOPs plus reading its context's KV,
so it grows with the context length). The three are fitted by exponentially weighted least squares
over the measured steps, each step weighing `decay` times the one after it (half-life ~350
steps), so the fit follows the workload (contexts grow, the batch mix changes). The prompt-token
budget of a step that already carries `d` decodes is

    prefill_budget(d) = clamp(floor((target_step_ms - a - bd * d) / bp), min_tokens, max_tokens)

What is fitted, and what is left out:
- Only steps that carry prompt tokens. Decode-only steps replay CUDA graphs and cost less per
  token than the eager (or mixed-graph) steps that carry prompts; they say nothing about the steps
  the budget bounds, and in steady decoding they would swamp the fit.
- Not the first `warmup_steps` such steps: lazy initialisation, allocator growth and kernel
  autotuning make them slow once.
- A step far slower than the fit predicts (a GC pause, a recompile, a stalled host) enters as at
  most `_OUTLIER_FACTOR` x the prediction: one stall cannot throttle the next few hundred steps,
  while a real, lasting slow-down still moves the fit within a few steps.
- While the decode count has not varied enough to separate `bd` from `a` (or is almost collinear
  with the prompt count), a decode token is priced like a prompt token: ms = a + b * (p + d).
- Until the fit has seen steps of different sizes with a positive slope, the budget is
  max_tokens: nothing is throttled on guesses.
The scheduler hands running decodes their tokens first whatever this says (up to
max_num_batched_tokens); the budget bounds what prompt chunks add on top (see
`Scheduler.schedule`), with at least `min_tokens` prompt tokens per step so that prompts progress.
"""

from __future__ import annotations

import math
from typing import NamedTuple

# Weight of a step relative to the next one (half-life ln 2 / (1 - decay) ~ 350 steps).
_DECAY = 0.998
# The fit needs this much weighted spread in step sizes (tokens^2) before it is trusted: steps
# that all carry the same number of tokens say nothing about the slope.
_MIN_SIZE_VARIANCE = 64.0
# Above this squared correlation between prompt and decode counts the two slopes cannot be told
# apart: fall back to one slope for both.
_MAX_COLLINEARITY = 0.95
# A step enters the fit as at most this many times its predicted time.
_OUTLIER_FACTOR = 3.0
# Steps carrying prompt tokens that are not fitted at start-up.
_WARMUP_STEPS = 3


class StepCost(NamedTuple):
    """A fitted step cost: ms = a + bp * prompt tokens + bd * decode tokens."""

    a: float
    bp: float
    bd: float


class StepCostModel:
    """Fits step time = a + bp * prompt tokens + bd * decode tokens online and turns a target
    step time into a prompt-token budget.

    Parameters
    ----------
    target_step_ms: the step time to aim for.
    max_num_batched_tokens: the budget never exceeds it (and is this until the fit is trusted).
    min_tokens: the budget never goes below it.
    decay: weight of each past step relative to the next.
    warmup_steps: steps carrying prompt tokens that are measured but not fitted at start-up.
    """

    def __init__(self, target_step_ms: float, max_num_batched_tokens: int, min_tokens: int,
                 decay: float = _DECAY, warmup_steps: int = _WARMUP_STEPS) -> None:
        if not target_step_ms > 0 or math.isinf(target_step_ms):
            raise ValueError(f"target_step_ms must be a positive number, got {target_step_ms}")
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.target_step_ms = float(target_step_ms)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_tokens = max(1, min(min_tokens, max_num_batched_tokens))
        self.decay = decay
        self.warmup_steps = max(0, warmup_steps)
        # Weighted sums over the fitted steps: weight; p, d, ms; p*p, d*d, p*d; p*ms, d*ms.
        self._s = [0.0] * 9
        self.num_steps = 0  # measured steps (empty and unmeasurable ones excluded)
        self.num_fitted = 0  # of them, entered into the fit
        self.num_clamped = 0  # of those, entered as _OUTLIER_FACTOR x the prediction
        self._warmup_seen = 0  # steps with prompt tokens skipped at start-up
        self._fit: StepCost | None = None

    def record(self, num_tokens: int, step_ms: float, num_decode_tokens: int = 0) -> None:
        """Adds one measured step: `num_tokens` scheduled tokens, `num_decode_tokens` of them
        decodes, took `step_ms` milliseconds."""
        if num_tokens <= 0 or not step_ms > 0 or math.isinf(step_ms):
            return  # an empty or unmeasurable step says nothing about the cost
        self.num_steps += 1
        p = float(num_tokens - num_decode_tokens)
        if p <= 0:
            return  # decode only: a CUDA graph replay, not the kind of step the budget bounds
        if self.num_steps_with_prompts < self.warmup_steps:
            self._warmup_seen += 1
            return
        d, y = float(num_decode_tokens), float(step_ms)
        if self._fit is not None:
            ceiling = _OUTLIER_FACTOR * max(self.predict_ms(int(p), int(d)) or 0.0, 1e-3)
            if y > ceiling:
                y = ceiling
                self.num_clamped += 1
        s, k = self._s, self.decay
        for i, v in enumerate((1.0, p, d, y, p * p, d * d, p * d, p * y, d * y)):
            s[i] = s[i] * k + v
        self.num_fitted += 1
        self._fit = self._solve()

    @property
    def num_steps_with_prompts(self) -> int:
        """Steps carrying prompt tokens seen so far (warm-up and fitted)."""
        return self._warmup_seen + self.num_fitted

    def _solve(self) -> StepCost | None:
        w, sp, sd, sy, spp, sdd, spd, spy, sdy = self._s
        if w <= 0:
            return None
        mp, md, my = sp / w, sd / w, sy / w
        vpp, vdd, vpd = spp / w - mp * mp, sdd / w - md * md, spd / w - mp * md
        cpy, cdy = spy / w - mp * my, sdy / w - md * my
        det = vpp * vdd - vpd * vpd
        if (vpp >= _MIN_SIZE_VARIANCE and vdd >= _MIN_SIZE_VARIANCE
                and det > (1.0 - _MAX_COLLINEARITY) * vpp * vdd):
            bp = (vdd * cpy - vpd * cdy) / det
            bd = (vpp * cdy - vpd * cpy) / det
            if bp > 0 and bd >= 0:
                return StepCost(my - bp * mp - bd * md, bp, bd)
        # One slope for every token: ms = a + b * (p + d).
        vtt = vpp + vdd + 2 * vpd
        if vtt < _MIN_SIZE_VARIANCE:
            return None
        b = (cpy + cdy) / vtt
        if not b > 0:
            return None
        return StepCost(my - b * (mp + md), b, b)

    def coefficients(self) -> StepCost | None:
        """The current fit (a ms, bp and bd ms per token), or None while it cannot be trusted."""
        return self._fit

    def prefill_budget(self, num_decode_tokens: int = 0) -> int:
        """Prompt tokens a step that carries `num_decode_tokens` decodes may add to take about
        target_step_ms."""
        fit = self._fit
        if fit is None:
            return self.max_num_batched_tokens
        room = self.target_step_ms - max(fit.a, 0.0) - fit.bd * num_decode_tokens
        tokens = math.floor(room / fit.bp + 1e-9)
        return max(self.min_tokens, min(tokens, self.max_num_batched_tokens))

    @property
    def budget(self) -> int:
        """Tokens a step without decodes may carry to take about target_step_ms."""
        return self.prefill_budget(0)

    def predict_ms(self, num_prompt_tokens: int, num_decode_tokens: int = 0) -> float | None:
        """The fitted time of a step (None while untrusted)."""
        fit = self._fit
        if fit is None:
            return None
        return fit.a + fit.bp * num_prompt_tokens + fit.bd * num_decode_tokens
