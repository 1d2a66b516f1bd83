"""LLMEngine: the synchronous core. `add_request`, then call `step()` until no request is unfinished.

One thread drives it (the server runs it off the HTTP event loop). Each step schedules a batch under
one token budget, runs the model once and returns what every request gained.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from engine import registry
from engine.config import ModelConfig
from engine.fused_step import check_mode as check_fused_mode
from engine.kv_cache import BlockManager
from engine.model import kv_bytes_per_token
from engine.packed import pack_linears
from engine.quant import QuantScheme, quantize_model
from engine.runner import ModelRunner, TokenLogprob
from engine.sampling import JsonFormat, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.spec_draft import DraftModelProposer
from engine.speculative import SpecStats, SpeculativeConfig, Speculator, parse_speculative, self_draft_model
from engine.threads import ThreadTuner
from engine.tokenizer import Tokenizer
from engine.weights import build_model, gguf_metadata, is_gguf, load_config, open_gguf, tqdm_progress
from weir.kernels.fp8_matmul import fp8_gpu

if TYPE_CHECKING:
    from engine.grammar import Grammars
    from engine.model import Transformer

__all__ = ["EngineStats", "LLMEngine", "RequestOutput", "SamplingParams", "TokenLogprob"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens generated in THIS step (may be empty)
    new_logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None  # only in the first output (first prompt token: None)
    finished: bool
    finish_reason: str | None  # "stop" (EOS / stop token) | "length" | "abort"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int  # total so far
    stop_token_id: int | None = None  # the request's stop token that ended it; None for EOS and the rest


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    # the target model's KV cache: what admission and preemption wait on, so what usage means
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_queries: int  # tokens, cumulative
    prefix_cache_hits: int  # tokens, cumulative
    num_preemptions: int
    speculative: SpecStats | None = None  # None when speculation is off
    # A draft model's own KV cache (0 without one): as many blocks again, from the same memory budget
    # but a pool of its own, not in lockstep with the target's: blocks are taken when a request drafts
    # and kept until it ends or the pool runs short (then the least recently drafted requests' caches
    # are dropped, and one that still does not fit decodes plainly), so it never holds a request up.
    draft_kv_blocks_total: int = 0
    draft_kv_blocks_free: int = 0


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 where the hardware multiplies it natively (CUDA with bf16, CPUs with AVX512-BF16
    or AMX: half the bytes to move per token and faster matmuls), else float32 (emulated bf16 is slower
    than fp32)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        cpu = torch.cpu
        native = (
            getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
            or getattr(cpu, "_is_amx_tile_supported", lambda: False)()
        )
        return torch.bfloat16 if native else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose auto or one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


class LLMEngine:
    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "float32",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float | None = None,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        device: str | None = None,
        seed: int = 0,
        speculative: str | None = None,
        num_speculative_tokens: int = 4,
        quantization: str = "none",
        packing: str = "auto",
        fused_decode: str = "auto",
        adaptive_threads: bool = True,
        _config: ModelConfig | None = None,
        _tokenizer: Tokenizer | None = None,
        _draft_config: ModelConfig | None = None,
        progress: bool = True,
    ) -> None:
        for name, limit in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("block_size", block_size),
        ):
            # a step would schedule nothing (every request waiting forever), or no prompt would fit
            if limit < 1:
                raise ValueError(f"{name} must be at least 1, got {limit}")
        self.device = torch.device(device or _default_device())
        if self.device.type == "cuda" and block_size & (block_size - 1):
            # the Triton decode kernel reads a block as one power-of-two tile: refused here rather than
            # by an assertion at the first decode step, which would stop the engine for every request
            raise ValueError(f"block_size must be a power of two on CUDA, got {block_size}")
        check_fused_mode(fused_decode)
        self.dtype = resolve_dtype(dtype, self.device)
        if QuantScheme.parse(quantization).method == "fp8" and not fp8_gpu(self.device):
            # the CPU fallback dequantizes every weight on every call: slower than no quantization
            raise ValueError(
                f"fp8 weights need a CUDA GPU with compute capability 8.9+ (Ada, Hopper); "
                f"on {self.device.type} use int8 or int4"
            )
        source: Path | None = None
        reader = None
        if _config is not None:  # random weights (from_config)
            config = _config
            self.model_name = config.name
            self.tokenizer = _tokenizer or Tokenizer.byte_level(
                config.vocab_size, set(config.eos_token_ids) or {0}
            )
        else:
            source = registry.resolve(model)
            reader = open_gguf(source) if is_gguf(source) else None
            config = load_config(source, reader)
            self.model_name = registry.canonical_name(str(model)) if not Path(model).exists() else source.stem
            if reader is not None:  # a GGUF file
                self.tokenizer = Tokenizer.from_gguf_metadata(gguf_metadata(reader))
            else:
                self.tokenizer = Tokenizer.from_hf_dir(source, set(config.eos_token_ids))
            if self.tokenizer.eos_token_ids:
                config = config.with_(eos_token_ids=tuple(sorted(self.tokenizer.eos_token_ids)))
        self.config = config
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, torch.get_num_threads()))
        # CPU: each step runs on 1 thread or all of them, whichever is faster under the current load
        # (engine/threads.py)
        self.thread_tuner = (
            ThreadTuner(torch.get_num_threads()) if adaptive_threads and self.device.type == "cpu" else None
        )
        self.model = build_model(
            config,
            source,
            dtype=self.dtype,
            device=self.device,
            seed=seed,
            reader=reader,
            progress=tqdm_progress(f"loading {self.model_name}") if progress and source else None,
        )
        spec_config = parse_speculative(speculative, num_speculative_tokens) if speculative else None
        # a self:int4 draft quantizes the floating-point weights, so it is copied before the target is
        # quantized
        draft_model = (
            self_draft_model(self.model, "int4")
            if spec_config is not None and spec_config.self_draft == "int4"
            else None
        )
        # Weight quantization is a module swap after loading (engine/quant.py): "int8", "int4",
        # "int4-g32|g64|g128", "fp8"; the model code never learns about it.
        quantize_model(self.model, quantization)
        # CPU: the linears quantization left as they are get weights prepacked for oneDNN (engine/packed.py)
        self.num_packed_linears = pack_linears(self.model, packing)
        if spec_config is not None and spec_config.method != "ngram" and draft_model is None:
            draft_model = self._load_draft(spec_config, quantization, packing, seed, _draft_config, progress)

        # a draft model's cache has as many blocks as the target's: the KV memory covers both
        per_block = kv_bytes_per_token(config, self.dtype) * block_size
        if draft_model is not None:
            draft_config = cast(ModelConfig, draft_model.config)
            draft_layers = len(cast("Transformer", draft_model).decoder_layers)  # self:layers=N: N
            per_block += (
                kv_bytes_per_token(draft_config.with_(num_layers=draft_layers), self.dtype) * block_size
            )
        if num_kv_blocks is None:
            gb = kv_cache_memory_gb if kv_cache_memory_gb is not None else self._default_kv_gb()
            num_kv_blocks = max(1, int(gb * (1 << 30)) // per_block)
        want_len = max_model_len or config.max_position_embeddings
        if want_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len {want_len} exceeds the model's {config.max_position_embeddings}")
        # one request must always fit alone, or preemption could not guarantee progress
        self.max_model_len = min(want_len, num_kv_blocks * block_size)
        self.block_manager = BlockManager(num_kv_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )
        self.runner = ModelRunner(
            self.model,
            num_blocks=num_kv_blocks,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
            seed=seed,
        )
        # CPU: decode steps of a few sequences as one native call (engine/fused_step.py)
        if self.device.type == "cpu":
            self.runner.use_fused_decode(fused_decode, self.max_model_len)
        elif fused_decode == "on":
            raise ValueError("fused_decode='on' is a CPU path; the GPU runs the Triton kernels")
        self._requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self.grammars: Grammars | None = None  # structured output, built on first use
        self._grammars_lock = threading.Lock()
        self.speculator: Speculator | None = None
        if spec_config is not None:
            proposer = None
            if draft_model is not None:
                proposer = DraftModelProposer(
                    draft_model,
                    num_blocks=num_kv_blocks,
                    block_size=block_size,
                    dtype=self.dtype,
                    device=self.device,
                    enable_prefix_caching=enable_prefix_caching,
                    max_num_batched_tokens=max_num_batched_tokens,
                )
            self.speculator = Speculator(spec_config, self.max_model_len, proposer)
            self.scheduler.on_preempt = self.speculator.preempted

    def _load_draft(
        self,
        spec: SpeculativeConfig,
        quantization: str,
        packing: str,
        seed: int,
        config: ModelConfig | None,
        progress: bool,
    ) -> torch.nn.Module:
        """The draft of `self:layers=N` (the target's first layers) or `draft:<model>` (a registry name
        or path, loaded like the target and quantized the same way; `config`: random weights instead,
        for tests). A separate draft must share the target's vocabulary."""
        if spec.self_draft is not None:
            return self_draft_model(self.model, spec.self_draft)
        assert spec.draft_model is not None
        source: Path | None = None
        reader = None
        if config is None:
            source = registry.resolve(spec.draft_model)
            reader = open_gguf(source) if is_gguf(source) else None
            config = load_config(source, reader)
        if config.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"draft model {spec.draft_model!r} has a vocabulary of {config.vocab_size} tokens; "
                f"the target's has {self.config.vocab_size} (they must share the tokenizer)"
            )
        draft = build_model(
            config,
            source,
            dtype=self.dtype,
            device=self.device,
            seed=seed,
            reader=reader,
            progress=tqdm_progress(f"loading draft {spec.draft_model}") if progress and source else None,
        )
        quantize_model(draft, quantization)
        pack_linears(draft, packing)
        return draft

    def _default_kv_gb(self) -> float:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return 0.5 * free / (1 << 30)
        return 1.0

    @classmethod
    def from_config(
        cls, config: ModelConfig, tokenizer: Tokenizer | None = None, **kwargs: object
    ) -> LLMEngine:
        """An engine over random weights (tests, benchmarks). Tiny configs get a byte-level tokenizer."""
        return cls(config.name, _config=config, _tokenizer=tokenizer, **kwargs)  # type: ignore[arg-type]

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is {self.max_model_len} "
                "tokens, including at least one for the completion"
            )
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError("prompt token ids must lie in [0, vocab_size)")
        params.validate(vocab)
        seq = Sequence(request_id, list(prompt_token_ids), params)
        if params.json_format is not None:
            seq.grammar = self._grammars().start(params.json_format)
        if params.seed is not None:
            seq.generator = self.runner.make_generator(params.seed)
        if params.min_tokens:
            eos = () if params.ignore_eos else self.config.eos_token_ids
            seq.min_tokens_banned = sorted({*params.stop_token_ids, *eos})
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = []
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def _grammars(self) -> Grammars:
        """Built on the first structured-output request (compiling the vocabulary takes ~0.1 s), by
        whichever thread asks first (`compile_grammar` runs outside the engine's)."""
        with self._grammars_lock:
            if self.grammars is None:
                from engine.grammar import Grammars

                self.grammars = Grammars(self.tokenizer, self.config.vocab_size)
            return self.grammars

    def compile_grammar(self, fmt: JsonFormat) -> None:
        """Compiles `fmt`'s grammar into the cache `add_request` reads it from; ValueError (naming the
        parameter) if its schema cannot be used. Thread-safe, and meant for another thread than the
        engine's: a large schema compiles for seconds (xgrammar releases the GIL meanwhile), which in
        `add_request` stalled every running request's generation."""
        self._grammars().compile(fmt)

    def abort_request(self, request_id: str) -> None:
        """Free the request's blocks now; the next step reports it finished with reason "abort"."""
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # --- stepping ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = [self._output(seq, [], None) for seq in self._aborted]
        for seq in self._aborted:
            self._requests.pop(seq.request_id, None)
            if self.speculator:
                self.speculator.forget(seq.request_id)
        self._aborted.clear()
        if self.speculator:
            self.speculator.begin_step(self.scheduler.running, self.runner.generator)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return outputs
        tuner, num_tokens = self.thread_tuner, sum(batch.num_tokens)
        threads = tuner.choose(num_tokens) if tuner else 0
        # a step on the thread count being tried is timed for the tuner only: under load such a step
        # can take 10-30x a normal one, and the speculator would price every draft by it
        exploring = tuner.exploring(num_tokens) if tuner else False
        if tuner:
            torch.set_num_threads(threads)
        started = time.perf_counter()
        try:
            results = self.runner.execute(batch)
        finally:
            if tuner:
                torch.set_num_threads(tuner.max_threads)
        elapsed = time.perf_counter() - started
        if tuner:
            tuner.record(num_tokens, threads, elapsed)
        if self.speculator and not exploring:
            self.speculator.end_step(batch.seqs, batch.num_tokens, elapsed)
        for seq, n, res in zip(batch.seqs, batch.num_tokens, results, strict=True):
            if res.spec_logits is not None:
                outputs.append(self._accept_speculative(seq, n, res.spec_logits))
                continue
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
                seq.prompt_logprobs.extend(res.prompt_logprobs)
            if res.token_id is None:
                continue
            seq.output_token_ids.append(res.token_id)
            if seq.grammar is not None:
                seq.grammar.accept(res.token_id)
            self._check_finished(seq, res.token_id)
            outputs.append(self._output(seq, [res.token_id], [res.logprob] if res.logprob else None))
            if seq.is_finished:
                self.scheduler.remove(seq)
                self._requests.pop(seq.request_id, None)
                if self.speculator:
                    self.speculator.forget(seq.request_id)
        return outputs

    def _accept_speculative(self, seq: Sequence, n: int, logits: torch.Tensor) -> RequestOutput:
        """Keep the verified tokens; the KV of rejected drafts is past num_computed_tokens (overwritten
        later) and blocks holding only rejected drafts go back to the pool."""
        assert self.speculator is not None
        computed = seq.num_computed_tokens + n - len(seq.draft_token_ids)  # the real tokens
        p = seq.params
        ends = {*p.stop_token_ids, *(() if p.ignore_eos else self.config.eos_token_ids)}
        tokens = self.speculator.verify(seq, logits, self.runner.generator, ends)
        emitted: list[int] = []
        for token in tokens:
            seq.output_token_ids.append(token)
            emitted.append(token)
            self._check_finished(seq, token)
            if seq.is_finished:
                break
        # accepted drafts' KV is valid; the last emitted token is computed next step
        seq.num_computed_tokens = min(computed + len(emitted) - 1, seq.num_tokens - 1)
        self.block_manager.trim(seq)
        self.block_manager.cache_full_blocks(seq)
        if seq.is_finished:
            self.scheduler.remove(seq)
            self._requests.pop(seq.request_id, None)
            self.speculator.forget(seq.request_id)
        return self._output(seq, emitted, None)

    def _check_finished(self, seq: Sequence, token: int) -> None:
        p = seq.params
        # In vLLM's order, which its `stop_reason` shows: EOS (none), then a stop token (its id).
        if not p.ignore_eos and token in self.config.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in p.stop_token_ids:
            seq.finish_reason, seq.stop_token_id = "stop", token
        elif seq.grammar is not None and seq.grammar.complete:
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        else:
            return
        seq.status = SequenceStatus.FINISHED

    def _output(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
        prompt_lps: list[TokenLogprob | None] | None = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent and seq.finish_reason != "abort":
            prompt_lps = [None, *seq.prompt_logprobs]
            seq.prompt_logprobs_sent = True
        if seq.params.logprobs is not None and logprobs is None and tokens:
            logprobs = []
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            new_logprobs=logprobs if seq.params.logprobs is not None else None,
            prompt_logprobs=prompt_lps,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            num_output_tokens=seq.num_output_tokens,
            stop_token_id=seq.stop_token_id,
        )

    def stats(self) -> EngineStats:
        s = self.scheduler
        draft = self.speculator.proposer if self.speculator else None
        draft_pool = draft if isinstance(draft, DraftModelProposer) else None
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_blocks_total=self.block_manager.num_blocks,
            kv_blocks_free=self.block_manager.num_free_blocks,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            speculative=self.speculator.stats() if self.speculator else None,
            draft_kv_blocks_total=draft_pool.num_blocks if draft_pool else 0,
            draft_kv_blocks_free=draft_pool.num_free_blocks if draft_pool else 0,
        )

    # --- convenience ---------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion together; returns the generated token ids per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{id(self)}-{i}-{os.urandom(4).hex()}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self._requests for rid in ids):
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]
