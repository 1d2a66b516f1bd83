"""Decode steps as one native call (`kernels/cpu_decode.c`), on the CPU.

With one sequence running, a decode step is ~15 small ops per layer. Eager PyTorch spends 5-30 us on
each (dispatch, allocation, waking threads), which for a small model is as long as reading the weights:
SmolLM2-135M in bf16 decoded at 0.26 of its memory-bandwidth roofline. The fused step runs the whole
forward in one OpenMP region over copies of the weights in panels (a GEMM micro-kernel's layout), so a
lone stream costs the weight reads and a few barriers per layer, and a batch reuses each weight vector
for up to 12 sequences (twice oneDNN's fp32 throughput at 32 sequences, 1.6x in bf16).

It serves decode steps of 1 to `FUSED_MAX_BATCH` sequences, each computing one new token and sampling
it (no prompt log-probs, no speculative verification). Prefill chunks stay on the eager forward, whose
oneDNN kernels are at the CPU's peak there. The copies cost memory (the weights again, in their own
dtype, a tied head included), which is why `fused_decode="auto"` is on only for models up to
`AUTO_MAX_PARAMS`.

Supported: float32 and bfloat16 models, unquantized, int8 (per-row scales) or int4 (groups, scales and
zero points); a model with other linears (fp8), another dtype, or layers this file does not know is
left to the eager path.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from engine.model import Transformer
from engine.packed import DualLinear, PackedLinear
from engine.quant import Int4Linear, Int8Linear
from weir.kernels import cpu_decode

log = logging.getLogger(__name__)

AUTO_MAX_PARAMS = 2_000_000_000  # "auto" doubles weight memory only for models up to this size
FUSED_MAX_BATCH = cpu_decode.MAX_BATCH  # decode steps of up to this many sequences take the fused step
_TYPES = {torch.float32: cpu_decode.F32, torch.bfloat16: cpu_decode.BF16, torch.int8: cpu_decode.I8}


class Unsupported(Exception):
    """The model has something the fused step does not implement (the message says what)."""


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().contiguous()


def _dense(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(weight [out, in], fp32 per-output scales or None, fp32 bias or None) of a linear layer in any
    of the engine's layouts but int4."""
    if isinstance(module, Int8Linear):
        weight, scales = module.portable_weight()
        return weight, _f32(scales), _f32(module.bias)
    if isinstance(module, PackedLinear):
        weight = module.weight if module.weight is not None else module.packed.to_dense()
        return weight.detach(), None, _f32(module.bias)
    if isinstance(module, (nn.Linear, DualLinear)):
        return module.weight.detach(), None, _f32(module.bias)
    raise Unsupported(f"{type(module).__name__} layers are not supported")


def _panels(t: torch.Tensor, width: int, halves: int) -> torch.Tensor:
    """[out, ...] -> [panels, ..., width]: each half of the outputs (gate and up are two) zero-padded to
    whole panels of `width` outputs, the output index moved last. The C kernels' layout
    (kernels/cpu_decode.c), for weights [out, in] and int4 scales [out, groups] alike."""
    parts = []
    for part in t.chunk(halves):
        part = nn.functional.pad(part, (0, 0, 0, -part.shape[0] % width))
        parts.append(part.reshape(-1, width, part.shape[1]).transpose(1, 2))
    return torch.cat(parts).contiguous()


def _weight_panels(weight: torch.Tensor, width: int, halves: int) -> torch.Tensor:
    """A dense weight's panels; bf16 ones hold pairs of inputs side by side ([panels, in / 2, width, 2],
    `in` padded to even), as vdpbf16ps reads them."""
    if weight.dtype != torch.bfloat16:
        return _panels(weight, width, halves)
    flat = _panels(nn.functional.pad(weight, (0, weight.shape[1] % 2)), width, halves)  # [panels, in, width]
    return flat.view(flat.shape[0], -1, 2, width).transpose(2, 3).contiguous()


def _vector(v: torch.Tensor | None, width: int, halves: int) -> torch.Tensor | None:
    """A per-output vector (bias, scales) padded like the weight's panels."""
    return None if v is None else _panels(v.view(-1, 1), width, halves).flatten()


def _int4_panels(
    module: Int4Linear, width: int, halves: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nibbles uint8 [panels, k padded to groups, width / 2], scales and zero - 8 * scale fp32 [panels,
    groups, width]) from either of the module's layouts: w = q * scale + (zero - 8 * scale). Byte m of
    a row holds output m in its low nibble and output width / 2 + m in its high one."""
    packed = module.portable_qweight()  # [out, k // 2]: weights 2b (low nibble) and 2b + 1 (high)
    q = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(1)
    q = _panels(q, width, halves)
    half = width // 2
    nibbles = (q[..., :half] | (q[..., half:] << 4)).contiguous()
    sz = module.scales_and_zeros.float()  # [groups, out, 2]
    scale, zero = sz[..., 0].t(), sz[..., 1].t()
    return nibbles, _panels(scale, width, halves), _panels(zero - 8 * scale, width, halves)


def _tied(model: Transformer) -> bool:
    """Whether the head reads the embedding's own weight (a quantized head is its own copy)."""
    return getattr(model.lm_head, "weight", None) is model.embed_tokens.weight


class FusedDecoder:
    """Holds the tables the C step reads; call it with each sequence's new token and position."""

    def __init__(self, model: Transformer, lib: ctypes.CDLL, max_len: int) -> None:
        config = model.config
        dtype = model.embed_tokens.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise Unsupported(f"{dtype} models are not supported")
        if model.embed_tokens.weight.device.type != "cpu":
            raise Unsupported("it runs on the CPU only")
        first = model.decoder_layers[0].self_attn
        if first.k_cache.dtype != dtype or first.k_cache.dim() != 4:
            raise Unsupported("the KV cache is not allocated in the model's dtype")
        self._lib = lib
        self._keep: list[torch.Tensor] = []  # every tensor a table points into
        self._width = int(lib.weir_panel_width())  # outputs per weight panel
        self.max_len = max_len
        self.eps = float(config.rms_norm_eps)
        layers = (cpu_decode.Layer * config.num_layers)()
        for i, layer in enumerate(model.decoder_layers):
            attn, mlp = layer.self_attn, layer.mlp
            layers[i] = cpu_decode.Layer(
                self._ptr(_f32(layer.input_layernorm.weight)),
                self._linear(attn.qkv_proj),
                self._linear(attn.o_proj),
                self._ptr(_f32(layer.post_attention_layernorm.weight)),
                self._linear(mlp.gate_up_proj, halves=2),
                self._linear(mlp.down_proj),
                self._ptr(attn.k_cache),
                self._ptr(attn.v_cache),
            )
        embed = model.embed_tokens.weight.detach()  # rows looked up in place, in whatever layout it has
        self.globals = cpu_decode.Globals(
            self._ptr(embed),
            (ctypes.c_int64 * 2)(*embed.stride()),
            self._ptr(_f32(model.norm.weight)),
            self._linear(model.lm_head, tied=embed if _tied(model) else None),
            self._ptr(model.rotary.cos),
            self._ptr(model.rotary.sin),
        )
        self.layers = layers
        shape = {
            "hidden": config.hidden_size,
            "heads": config.num_heads,
            "kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim or 0,
            "intermediate": config.intermediate_size,
            "vocab": config.vocab_size,
            "layers": config.num_layers,
            "block_size": first.k_cache.shape[1],
            "kv_type": _TYPES[dtype],
            "embed_type": _TYPES[dtype],
            "max_len": max_len,
        }
        self._shape = shape
        self.shape = torch.tensor([shape[f] for f in cpu_decode.SHAPE_FIELDS], dtype=torch.int64)
        self._scratch = torch.empty(0)

    def _ptr(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        self._keep.append(t)
        return t.data_ptr()

    def _linear(
        self, module: nn.Module, tied: torch.Tensor | None = None, halves: int = 1
    ) -> cpu_decode.Linear:
        """The C table entry of a linear layer, over a copy of its weights in panels (`halves`: 2 for the
        fused [gate; up] projection, whose halves the kernel reads side by side)."""
        width = self._width
        if isinstance(module, Int4Linear):
            if module.group_size % 2:
                raise Unsupported(f"int4 groups of {module.group_size} are not supported")
            nibbles, scale, zero = _int4_panels(module, width, halves)
            bias = _vector(_f32(module.bias), width, halves)
            return cpu_decode.Linear(
                self._ptr(nibbles),
                cpu_decode.I4,
                self._ptr(scale),
                self._ptr(bias),
                self._ptr(zero),
                module.group_size,
            )
        weight, row_scales, bias = _dense(module) if tied is None else (tied, None, None)
        if weight.dtype not in _TYPES:
            raise Unsupported(f"{weight.dtype} weights are not supported")
        return cpu_decode.Linear(
            self._ptr(_weight_panels(weight, width, halves)),
            _TYPES[weight.dtype],
            self._ptr(_vector(row_scales, width, halves)),
            self._ptr(_vector(bias, width, halves)),
            None,
            0,
        )

    def copied_bytes(self, model: Transformer) -> int:
        """Bytes this decoder holds beyond `model`'s own tensors (its weight panels)."""
        tensors = [t for t in [*model.parameters(), *model.buffers()] if t.layout == torch.strided]
        own = {t.untyped_storage().data_ptr() for t in tensors}  # (oneDNN's packed weights have none)
        own.update(
            t.untyped_storage().data_ptr()
            for layer in model.decoder_layers
            for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)
        )
        copies = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self._keep}
        return sum(n for ptr, n in copies.items() if ptr not in own)

    def __call__(self, tokens: list[int], positions: list[int], block_tables: torch.Tensor) -> torch.Tensor:
        """Logits [batch, vocab] (fp32) for one new token per sequence (`tokens[b]` at `positions[b]`);
        writes their K/V into the cache slots the block tables (int32 [batch, >= blocks], CPU) give."""
        batch = len(tokens)
        if not 1 <= batch <= cpu_decode.MAX_BATCH:
            raise ValueError(f"the fused step takes 1 to {cpu_decode.MAX_BATCH} sequences, not {batch}")
        if max(positions) >= self.max_len:
            raise ValueError(f"position {max(positions)} beyond the fused step's {self.max_len}")
        threads = torch.get_num_threads()
        need = cpu_decode.scratch_floats(self._shape, batch, threads)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        logits = torch.empty(batch, self._shape["vocab"], dtype=torch.float32)
        ids = torch.tensor([tokens, positions], dtype=torch.int64)
        tables = block_tables.to(torch.int32).contiguous()
        status = self._lib.weir_decode_step(
            self.shape.data_ptr(),
            ctypes.byref(self.globals),
            self.layers,
            batch,
            ids[0].data_ptr(),
            ids[1].data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            self.eps,
            threads,
            self._scratch.data_ptr(),
            logits.data_ptr(),
        )
        if status != 0:
            raise RuntimeError(f"fused decode step failed ({status})")
        return logits


FUSED_MODES = ("auto", "on", "off")


def check_mode(mode: str) -> str:
    if mode not in FUSED_MODES:
        raise ValueError(f"fused_decode must be one of {', '.join(FUSED_MODES)}, not {mode!r}")
    return mode


def build_fused_decoder(model: Transformer, mode: str, max_len: int) -> FusedDecoder | None:
    """The fused step for `model` under `mode` ("auto", "on", "off"), or None (the eager forward).
    "on" raises where it cannot be built; "auto" logs why and falls back."""
    if check_mode(mode) == "off":
        return None
    params = sum(p.numel() for p in model.parameters())
    if mode == "auto" and params > AUTO_MAX_PARAMS:
        return None
    try:
        lib = cpu_decode.library()
        if lib is None:
            raise Unsupported("it could not be compiled (no C compiler?)")
        decoder = FusedDecoder(model, lib, max_len)
    except Unsupported as exc:
        if mode == "on":
            raise ValueError(f"fused decode step unavailable: {exc}") from exc
        log.info("fused decode step off: %s", exc)
        return None
    except Exception:
        if mode == "on":
            raise
        # a model this file misreads must not stop the engine from serving on the eager path
        log.warning("fused decode step off: building it failed", exc_info=True)
        return None
    log.info("fused decode step on (%.0f MiB of weight copies)", decoder.copied_bytes(model) / 2**20)
    return decoder
