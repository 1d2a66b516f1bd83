"""How many CPU threads each engine step runs on, chosen from measured step times.

On an idle machine two threads decode faster than one (SmolLM2-135M, this project's 2-CPU VM: 27.4 vs
21.0 tok/s in float32, 23.2 vs 21.7 in bfloat16). On a busy one the second OpenMP thread is often
descheduled while the first waits for it at every matmul, and two threads decode 5-10x slower than one
(1.1 vs 13.5 tok/s bf16 at load 4). Which count wins depends on the machine's load right now, so the
engine measures instead of guessing: a moving average of the time per token of a step, per step size
(power-of-two buckets of the step's token count) and thread count. Each step runs on the faster count;
now and then a step tries the other, so a change of load is noticed, and each try that confirms the
choice doubles the wait before the next one.

A try is cheap on a decode step and expensive on a prefill: one 1,024-token prompt on one thread costs
1.8x its two-thread time on an idle machine, and a fresh engine used to pay that once per prefill size
(the second prompt of each power of two). Steps of 64+ tokens are compute-bound matmuls, so which count
wins is mostly a property of the machine's load, not of the size: a large bucket not yet measured on
both counts follows the verdict of the nearest large bucket that has been, and tries the other count
only after the usual wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_BUCKET = 12  # steps of 4,096+ tokens share one bucket


def bucket(num_tokens: int) -> int:
    return min(max(num_tokens, 1).bit_length(), MAX_BUCKET)


LARGE_BUCKET = bucket(64)  # from here up, buckets lend each other their verdict


@dataclass
class ThreadTuner:
    max_threads: int
    explore_every: int = 16  # steps of a bucket before the other count is tried again (then 32, 64, ...)
    max_explore_every: int = 1024
    ema: float = 0.3  # weight of the newest step
    _cost: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, threads) -> s/token
    _countdown: dict[int, int] = field(default_factory=dict)
    _interval: dict[int, int] = field(default_factory=dict)
    _trying: dict[int, int] = field(default_factory=dict)  # bucket -> the count being tried this step

    @property
    def candidates(self) -> tuple[int, ...]:
        return (self.max_threads, 1) if self.max_threads > 1 else (self.max_threads,)

    def best(self, num_tokens: int) -> int | None:
        """The faster count for steps of this size, None until both have been measured."""
        return self._best(bucket(num_tokens))

    def _best(self, b: int) -> int | None:
        costs = [(self._cost[b, t], t) for t in self.candidates if (b, t) in self._cost]
        return min(costs)[1] if len(costs) == len(self.candidates) else None

    def _borrowed(self, b: int) -> int | None:
        """The verdict of the nearest large bucket measured on both counts (the larger on a tie)."""
        if b < LARGE_BUCKET:
            return None
        judged = [o for o in range(LARGE_BUCKET, MAX_BUCKET + 1) if self._best(o) is not None]
        if not judged:
            return None
        return self._best(min(judged, key=lambda o: (abs(o - b), -o)))

    def choose(self, num_tokens: int) -> int:
        if len(self.candidates) == 1:
            return self.max_threads
        b = bucket(num_tokens)
        best = self._best(b)
        if best is None:
            best = self._borrowed(b)
            missing = [t for t in self.candidates if (b, t) not in self._cost]
            if best is None:  # nothing to go on: measure each count once
                return missing[0]
            if best in missing:  # the borrowed verdict has not run at this size yet: not a try
                return best
        self._countdown[b] = self._countdown.get(b, self.explore_every) - 1
        if self._countdown[b] > 0:
            return best
        self._countdown[b] = self._interval.get(b, self.explore_every)
        other = next(t for t in self.candidates if t != best)
        self._trying[b] = other
        return other

    def exploring(self, num_tokens: int) -> bool:
        """Whether the step `choose` just picked for this size runs on the other count as a try."""
        return bucket(num_tokens) in self._trying

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        b = bucket(num_tokens)
        per_token = seconds / max(num_tokens, 1)
        tried = self._trying.pop(b, None)
        old = self._cost.get((b, threads))
        if old is None or tried is not None:
            # a try replaces the count's stale average: it was last measured under other load
            self._cost[b, threads] = per_token
        else:
            self._cost[b, threads] = (1 - self.ema) * old + self.ema * per_token
        if tried is not None:
            interval = self._interval.get(b, self.explore_every)
            if self._best(b) == tried:  # the other count is faster now: follow it, look again soon
                self._interval[b] = self.explore_every
            else:
                self._interval[b] = min(2 * interval, self.max_explore_every)
            self._countdown[b] = self._interval[b]
