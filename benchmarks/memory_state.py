"""The in-process state's (`MemoryState`) CPU per admission, against another version of it in one process.

    git show 96bbc37:gateway/state/memory.py > /tmp/memory_base.py
    .venv/bin/python benchmarks/memory_state.py --baseline /tmp/memory_base.py

Three cases, each admission being `admit_now` with Admission's four limits and two budgets followed by
`settle_attempt`: one caller on the real clock (the hot path), interleaved base / new for `--rounds`
rounds (min and median); a new API key every request at 100 a second for 300 s of a fake clock (what
an ever-growing key population costs, min of 3, and how many windows are held at the end); and, for the new
code, a round of sweeps with 1,000 to 100,000 keys held: its longest call (what one request pays) and
its total.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.state import memory  # noqa: E402
from gateway.state.base import Budget, Limit  # noqa: E402


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("memory_base", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clocked(module: ModuleType, clock: list[float]) -> Any:
    return type("Clocked", (module.MemoryState,), {"_now": staticmethod(lambda: clock[0])})()


def hot_path_us(module: ModuleType, calls: int) -> float:
    state = module.MemoryState()
    limits = [
        Limit("rpm:tenant:t", 10**12),
        Limit("rpm:key:k", 10**12),
        Limit("tpm:tenant:t", 10**12, 30),
        Limit("tpm:key:k", 10**12, 30),
    ]
    budgets = [Budget("budget:tenant:t:2026-12", 10**15), Budget("budget:key:k:2026-12", 10**15)]
    tpm_keys, budget_keys = ["tpm:tenant:t", "tpm:key:k"], [b.key for b in budgets]
    admit, settle = state.admit_now, state.settle_attempt
    gc.collect()
    start = time.process_time()
    for _ in range(calls):
        decision = admit(limits, budgets, 10, 600.0)
        settle(tpm_keys, -5, budget_keys, decision.reservation_id, 7, report=False)
    return (time.process_time() - start) / calls * 1e6


def churn(module: ModuleType, seconds: int = 300, rate: int = 100) -> tuple[float, float, int]:
    """(us per admission, of which in sweeps, windows held at the end) with a new API key on every
    request."""
    clock = [1_000_000.0]
    state = clocked(module, clock)
    swept = [0.0]
    sweep = getattr(state, "_sweep", None)
    if sweep is not None:

        def timed(now: float) -> None:
            start = time.process_time()
            sweep(now)
            swept[0] += time.process_time() - start

        state._sweep = timed
    budgets = [Budget("budget:tenant:t:2026-12", 10**15)]
    start = time.process_time()
    for i in range(seconds * rate):
        limits = [
            Limit("rpm:tenant:t", 10**12),
            Limit(f"rpm:key:k{i}", 60),
            Limit(f"tpm:key:k{i}", 10**9, 30),
        ]
        decision = state.admit_now(limits, budgets, 10, 600.0)
        state.settle_attempt(
            [f"tpm:key:k{i}"], -5, [budgets[0].key], decision.reservation_id, 7, report=False
        )
        clock[0] += 1 / rate
    calls = seconds * rate
    return (time.process_time() - start) / calls * 1e6, swept[0] / calls * 1e6, len(state._windows)


def sweep_ms(keys: int) -> tuple[float, float, float, float, int]:
    """A round of sweeps with `keys` keys held (two windows and a kv value each), all live, then all
    lapsed: (the longest call's ms, the round's total ms) of each, and the calls a round takes. A
    round is spread over calls (at most SWEEP_CHUNK entries each) where it used to be one call."""
    clock = [1_000_000.0]
    state = clocked(memory, clock)

    async def hold() -> None:
        for k in range(keys):
            state.admit_now([Limit(f"rpm:key:k{k}", 10), Limit(f"tpm:key:k{k}", 10**6, 30)])
            await state.kv_set(f"session:{k}", b"", ttl_s=60)

    asyncio.run(hold())
    timings: list[float] = []
    calls = 0
    for step in (30, 120):
        clock[0] += step
        state._next_sweep = 0.0  # due now (it may not be after 30 s)
        longest = total = 0.0
        calls = 0
        while state._next_sweep <= clock[0]:  # until the round is over
            start = time.process_time()
            state._sweep(clock[0])
            took = time.process_time() - start
            longest, total, calls = max(longest, took), total + took, calls + 1
        timings += [longest * 1e3, total * 1e3]
    assert not state._windows and not state._kv
    return timings[0], timings[1], timings[2], timings[3], calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", required=True, help="another version's gateway/state/memory.py")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100_000)
    args = parser.parse_args()
    base = load(args.baseline)
    times: dict[str, list[float]] = {"base": [], "new": []}
    for _ in range(args.rounds):
        for name, module in (("base", base), ("new", memory)):
            times[name].append(hot_path_us(module, args.calls))
    b, n = times["base"], times["new"]
    print(
        f"hot path, us per admit + settle: base min {min(b):.2f} median {statistics.median(b):.2f}; "
        f"new min {min(n):.2f} median {statistics.median(n):.2f}; new/base min {min(n) / min(b):.3f} "
        f"median {statistics.median(n) / statistics.median(b):.3f}"
    )
    for name, module in (("base", base), ("new", memory)):
        runs = [churn(module) for _ in range(3)]
        us, in_sweeps, held = min(runs)
        print(
            f"a new key every request, 100/s for 300 s: {name} {us:.2f} us per admit + settle "
            f"({in_sweeps:.2f} of it in sweeps), {held} windows held"
        )
    for keys in (1_000, 10_000, 100_000):
        live, live_total, lapsed, lapsed_total, calls = min(sweep_ms(keys) for _ in range(3))
        print(
            f"a round of sweeps, {keys} keys ({2 * keys} windows, {keys} kv values), {calls} calls: "
            f"all live {live:.2f} ms the longest call ({live_total:.1f} ms in all), "
            f"lapsed {lapsed:.2f} ms ({lapsed_total:.1f} ms)"
        )


if __name__ == "__main__":
    main()
