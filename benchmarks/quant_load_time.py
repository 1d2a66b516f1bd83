"""Wall time of quantizing SmolLM2-135M at load (what ``weir engine serve --quantization int4`` pays).

The float model is loaded once; each run quantizes a fresh copy of it. ``--baseline REV`` also times
``engine/quant.py`` as of git revision REV, interleaved with the working tree's (same load conditions),
and prints how far its int4 weights' error differs from the current one's.

    .venv/bin/python benchmarks/quant_load_time.py [--scheme int4] [--repeats 3] [--baseline REV] [--layers N]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from engine import quant
from engine.llm_engine import LLMEngine

ROOT = Path(__file__).resolve().parent.parent


def quant_module_at(rev: str) -> ModuleType:
    """``engine/quant.py`` as of git ``rev``, imported under another name (its imports resolve here)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:engine/quant.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / f"quant_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"quant_{rev}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def time_quantize(
    impl: ModuleType, model: torch.nn.Module, scheme: str, layers: int | None
) -> tuple[float, float, torch.nn.Module]:
    """(seconds for the activation importance, seconds for everything, the quantized model)."""
    fresh = copy.deepcopy(model)
    # only the first ``layers`` decoder layers (and no head): a shorter run for interleaved comparisons
    skip = [] if layers is None else [rf"^layers\.(?!({'|'.join(map(str, range(layers)))})\.)", "^lm_head$"]
    importance_s = 0.0
    calibrate = impl._random_token_importance

    def timed(*args: object, **kwargs: object) -> object:  # what quantize_model's "auto" calls
        nonlocal importance_s
        begin = time.perf_counter()
        try:
            return calibrate(*args, **kwargs)
        finally:
            importance_s += time.perf_counter() - begin

    impl._random_token_importance = timed
    start = time.perf_counter()
    try:
        impl.quantize_model(fresh, scheme, skip=skip)
    finally:
        impl._random_token_importance = calibrate
    return importance_s, time.perf_counter() - start, fresh


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--scheme", default="int4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, help="quantize only the first N decoder layers (no head)")
    parser.add_argument("--baseline", help="git revision of engine/quant.py to time against")
    args = parser.parse_args()

    model = LLMEngine(args.model, num_kv_blocks=64, packing="off", progress=False).model
    impls = {"current": quant}
    if args.baseline:
        impls = {f"baseline {args.baseline}": quant_module_at(args.baseline), **impls}
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()}", flush=True)
    last: dict[str, torch.nn.Module] = {}
    for r in range(args.repeats):
        for name, impl in impls.items():
            imp_s, total_s, last[name] = time_quantize(impl, model, args.scheme, args.layers)
            print(
                f"run {r}  {name:>20}: {total_s:6.2f} s  (importance {imp_s:.2f} s)"
                f"  load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    if len(last) == 2:
        a, b = last.values()
        sa, sb = a.state_dict(), b.state_dict()
        same = sum(torch.equal(sa[k], sb[k]) for k in sa)
        print(f"{same}/{len(sa)} tensors identical between the two implementations", file=sys.stderr)


if __name__ == "__main__":
    main()
