"""`kv_recompute_threshold: "auto"`: the smallest pull that is faster than recomputing.

Pulling n tokens costs one extra engine step of latency (the request waits for its KV in
WAITING_FOR_REMOTE_KVS and is scheduled on a later step) plus the read itself, modelled as
`a + b*n` (a: per-read latency, b: seconds per token, fitted by least squares over recent
reads). Recomputing costs n / prefill_speed, with prefill_speed measured from steps that
scheduled at least `MIN_PREFILL_STEP_TOKENS` tokens (scheduled tokens / step time). The
threshold is the smallest n for which

    step_s + a + b*n  <  n / prefill_speed,   i.e.   n > (step_s + a) / (1/prefill_speed - b)

and, if reading a token is no faster than computing it, no pull is worth it (threshold =
max_model_len + 1). Until `MIN_SAMPLES` reads and prefill steps were measured, the configured
default (64) applies. Measurements decay exponentially (factor `DECAY` per sample), so the
estimate follows load changes.

A step's time is its own share of the engine's time: from when it was built or the step
before it reported, whichever is later, to its own report. Steps run one after another, and
under async scheduling (vLLM's default) step N+1 is built while step N runs, so its time starts
when N's report comes; without overlap it is build to report. Each report is paired with the
step it reports (`step_built`, `step_done`: vLLM reports every step it built, in that order),
never with the step built last, which under async scheduling is the next one.

A lookup by content (a prefill node asking decode nodes whether they hold the prompt's history)
costs its wait on top, hit or miss: the request waits in the scheduler for the answers, one
step of the engine while other requests run (the step it misses), a round trip (about a
millisecond) while it is idle. `lookup_threshold(busy)` adds a step to the fixed cost when the
engine is busy: a busy prefill node looks up only prompts that could gain more than that, so it
stops paying a step for histories too short to pay it back, goes on looking up long ones, and
looks up as before once it is idle again (the step's time is measured on every step).
"""

from __future__ import annotations

import math
from collections import deque

MIN_SAMPLES = 4
MIN_PREFILL_STEP_TOKENS = 64
DECAY = 0.9


class _Ema:
    def __init__(self) -> None:
        self.weight = 0.0
        self.total = 0.0
        self.samples = 0

    def add(self, value: float) -> None:
        self.weight = DECAY * self.weight + 1.0
        self.total = DECAY * self.total + value
        self.samples += 1

    @property
    def mean(self) -> float:
        return self.total / self.weight


class RecomputeThresholdEstimator:
    def __init__(self, default_threshold: int, max_model_len: int) -> None:
        self._default = default_threshold
        self._never = max_model_len + 1
        self._step_s = _Ema()
        self._prefill_s_per_token = _Ema()
        # Decayed sums for the least-squares fit of read time against tokens.
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._reads = 0
        # (when built, tokens scheduled) of each step built and not reported yet.
        self._steps: deque[tuple[float, int]] = deque()
        self._last_done = -math.inf

    def step_built(self, now: float, scheduled_tokens: int) -> None:
        self._steps.append((now, scheduled_tokens))

    def step_done(self, now: float) -> None:
        """The oldest step built and not reported has reported (`now`)."""
        if not self._steps:
            return
        built, tokens = self._steps.popleft()
        self.observe_step(now - max(built, self._last_done), tokens)
        self._last_done = now

    def observe_step(self, seconds: float, scheduled_tokens: int) -> None:
        if seconds <= 0 or scheduled_tokens <= 0:
            return
        self._step_s.add(seconds)
        if scheduled_tokens >= MIN_PREFILL_STEP_TOKENS:
            self._prefill_s_per_token.add(seconds / scheduled_tokens)

    def observe_read(self, seconds: float, tokens: int) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        d = DECAY
        self._w = d * self._w + 1.0
        self._sx = d * self._sx + tokens
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + tokens * tokens
        self._sxy = d * self._sxy + tokens * seconds
        self._reads += 1

    def _read_model(self) -> tuple[float, float]:
        """(seconds per read, seconds per token) of the fitted read time."""
        mean_x = self._sx / self._w
        mean_y = self._sy / self._w
        var_x = self._sxx / self._w - mean_x * mean_x
        if var_x > 1e-9 * max(1.0, mean_x * mean_x):
            slope = (self._sxy / self._w - mean_x * mean_y) / var_x
            if slope > 0:
                return max(0.0, mean_y - slope * mean_x), slope
        # All reads of one size (or noise hides the slope): charge it all per token.
        return 0.0, mean_y / mean_x

    def threshold(self) -> int:
        """The fewest gained tokens worth a pull whose owner is known."""
        return self._smallest_gain(0.0)

    def lookup_threshold(self, busy: bool) -> int:
        """The fewest tokens a lookup must be able to gain to be worth its wait and the pull:
        a step more than a pull while other requests run (`busy`)."""
        return self._smallest_gain(self._step_s.mean if busy and self._step_s.samples else 0.0)

    def _smallest_gain(self, wait_s: float) -> int:
        if (
            self._reads < MIN_SAMPLES
            or self._prefill_s_per_token.samples < MIN_SAMPLES
            or self._step_s.samples < MIN_SAMPLES
        ):
            return self._default
        per_read_s, read_s_per_token = self._read_model()
        saving_per_token = self._prefill_s_per_token.mean - read_s_per_token
        if saving_per_token <= 0:
            return self._never
        fixed_s = wait_s + self._step_s.mean + per_read_s
        return min(self._never, max(1, math.floor(fixed_s / saving_per_token) + 1))
