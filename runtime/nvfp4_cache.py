"""The paged KV cache stored as NVFP4 (vLLM's `--kv-cache-dtype nvfp4` and `nvfp4_4over6` writes, and ModelOpt's
fp8_k_nvfp4_v: K in fp8 e4m3, V in NVFP4), and what the attention reads back from it. FlashInfer's slot-mapping
writer, vLLM's nvfp4 on sm80, sm90 and sm120, stores what the nvfp4 write does (`fp8kv.nvfp4`).

Per KV layer the cache stores what vLLM's does, K and V interleaved on the head axis as in the fp8 cache (vLLM
orders a page's bytes [K codes | K scales | V codes | V scales]; the values are the same): packed e2m1 codes
`codes` uint8 `[num_pages, page_size, 2 * kv_heads, head_dim / 2]`, e4m3 block scales `block_scales` (their bytes,
uint8) `[num_pages, page_size, 2 * kv_heads, head_dim / 16]`, and the layer's global K and V scales in `scales`.
With `fp8_keys` (fp8_k_nvfp4_v) `codes` and `block_scales` hold V alone (`kv_heads` on the head axis) and `keys` K's e4m3
bytes `[num_pages, page_size, kv_heads, head_dim]`, written as the fp8 cache writes them (the cache's `engine`).
`pages` holds what attention reads, made from the stored bytes at each write (by the write's own pass where
`fp8kv.nvfp4`'s kernel runs), so every attention function reads it
as it reads any cache (an fp8 K reads as the fp8 cache's: its e4m3 value, times k_scale in the float32 read):

- read "float32": e2m1 * (SF * s) in float32, the plain dequantized read (vLLM's `dequantize_to_dtype`). FlashInfer's
  fa2 attention (sm80, sm90, sm120) reads so: e2m1 * SF in the model's 16-bit dtype, which holds every such product
  exactly (6 x 448 at most), with s folded into the softmax scale for K and multiplied into the output for V;
- read "fp8": e2m1 * SF rounded to e4m3, with s left to the attention as its k_scale / v_scale: the sm100 path,
  where the attention kernel dequantizes K and V to fp8 (with the runner's `q_scales`, Q is fp8 too, as vLLM's
  `scaled_fp8_quant` of the query makes it) and writes its output in fp8 e4m3 (`fp8_attention_output`). The kernel's
  own roundings are not read (trtllm-gen ships compiled); these round to nearest and saturate, like every fp8 write
  here. A product past 448 (a block scale above 448 / 6, which a global scale below amax / 448 gives) cannot be
  held: `fp8_read_over` counts those.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from fp8kv.engine_models import DEFAULT_ENGINE, EngineModel
from fp8kv.errors import Fp8kvError
from fp8kv.fp8 import to_float32, to_fp8
from fp8kv.kvdtypes import NVFP4_BLOCK_SIZE
from fp8kv.nvfp4 import E4M3, Decoded, WriteCounts, quantize_read_back
from fp8kv.runtime.cache import PagedKVCache, Scale, store_rows

NVFP4_READS = {"float32": torch.float32, "fp8": E4M3}


@dataclass(frozen=True)
class Nvfp4Counts:
    """An NVFP4 cache's write counters per KV layer, `(K, V)` each: blocks whose scale saturated at 448, fell in
    e4m3's subnormals, or rounded to 0 with a nonzero value in the block; values clipped at ±6 block scales; values
    whose e2m1 * block scale is past e4m3's 448, which the fp8 read cannot hold (`nvfp4_cache`'s docstring)."""

    saturated_scales: dict[int, tuple[int, int]]
    subnormal_scales: dict[int, tuple[int, int]]
    zeroed_blocks: dict[int, tuple[int, int]]
    clipped_values: dict[int, tuple[int, int]]
    fp8_read_over: dict[int, tuple[int, int]]


_WRITE_COUNTERS = tuple(f.name for f in fields(WriteCounts))
_COUNTERS = tuple(f.name for f in fields(Nvfp4Counts))
assert _COUNTERS[: len(_WRITE_COUNTERS)] == _WRITE_COUNTERS, "Nvfp4Counts starts with WriteCounts' counters"


class Nvfp4PagedKVCache(PagedKVCache):
    """`PagedKVCache`'s pages, allocator and counters over NVFP4 storage (the module's docstring). `four_over_six`
    picks vLLM's 4over6 write, `fp8_keys` an fp8 e4m3 K (its values clamped at ±448 counted in `clamped`, its NVFP4
    counters 0), `read` what the attention reads ("float32" or "fp8"). Every head_dim must be a multiple of 16;
    shadow engines do not apply (their writes are fp8)."""

    def __init__(
        self,
        kv_layers: Sequence[int],
        *,
        num_pages: int,
        page_size: int,
        num_kv_heads: int | Sequence[int],
        head_dim: int | Sequence[int],
        device: torch.device,
        four_over_six: bool = False,
        fp8_keys: bool = False,
        read: str = "float32",
        head_dim_multiple: int = 1,
        k_scales: Mapping[int, Scale] | None = None,
        v_scales: Mapping[int, Scale] | None = None,
        engine: str | EngineModel = DEFAULT_ENGINE,
        shared_layers: Mapping[int, int] | None = None,
    ) -> None:
        if read not in NVFP4_READS:
            raise Fp8kvError(f"unknown NVFP4 read {read!r}; choose one of {', '.join(NVFP4_READS)}")
        super().__init__(kv_layers, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=NVFP4_READS[read], device=device,
                         head_dim_multiple=head_dim_multiple, k_scales=k_scales, v_scales=v_scales, engine=engine,
                         shared_layers=shared_layers)
        odd = sorted({d for d in self._head_dims if d % NVFP4_BLOCK_SIZE})
        if odd:
            raise Fp8kvError(f"an NVFP4 cache stores blocks of {NVFP4_BLOCK_SIZE} head_dim values: head_dim {odd} is not "
                             "a multiple; serve this model with an fp8 cache")
        self.four_over_six, self.fp8_keys, self.read = four_over_six, fp8_keys, read
        # vLLM 0.32.0's FlashInfer backend (v1/attention/backends/flashinfer.py) gives sm100's NVFP4 attention an fp8
        # output buffer and copies it into the model's dtype: the output is rounded to e4m3 at scale 1
        self.fp8_attention_output = read == "fp8"
        sides = 1 if fp8_keys else 2  # the sides stored as NVFP4
        shapes = [(num_pages, page_size, sides * heads, d) for heads, d in zip(self._kv_heads, self._head_dims)]
        self.codes = [torch.zeros(*s[:3], s[3] // 2, dtype=torch.uint8, device=device) for s in shapes]
        self.block_scales = [torch.zeros(*s[:3], s[3] // NVFP4_BLOCK_SIZE, dtype=torch.uint8, device=device) for s in shapes]
        self.keys = [torch.zeros(num_pages, page_size, heads, d, dtype=torch.uint8, device=device)
                     for heads, d in zip(self._kv_heads, self._head_dims)] if fp8_keys else []
        self.nvfp4_counters = torch.zeros(len(self.kv_layers), 2, len(_COUNTERS), dtype=torch.int64, device=device)

    @property
    def clamps(self) -> bool:
        return False

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> None:
        """Quantize K/V `[tokens, kv_heads, head_dim]` to NVFP4 (K to fp8 e4m3 with `fp8_keys`) and store them at flat
        `slots` `[tokens]`; padding tokens (`valid` False) go to the scratch page as zeros, so they count nothing."""
        row = self._row[layer]
        heads = self._kv_heads[row]
        real = valid[:, None, None]
        k, v = torch.where(real, k, 0.0), torch.where(real, v, 0.0)
        scale = self.scales[row, :, :heads, None]  # [2 (K, V), kv_heads, 1]
        # the fp8 read starts from e2m1 * SF, the float32 read is the dequantized value
        read_back = "dequantize" if self.read == "float32" else "block_values"
        nvfp4 = [(side, *quantize_read_back(x, scale[side], four_over_six=self.four_over_six, read_back=read_back))
                 for side, x in enumerate((k, v)) if side or not self.fp8_keys]

        def interleaved(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack(parts, dim=2).flatten(1, 2)  # [T, sides * kv_heads, ...]: K0, V0, K1, V1, ...

        store_rows(self.codes[row].flatten(0, 1), slots, interleaved([s.codes for _, s, _, _ in nvfp4]))
        store_rows(self.block_scales[row].flatten(0, 1), slots,
                   interleaved([s.block_scales.view(torch.uint8) for _, s, _, _ in nvfp4]))
        reads = []
        counts = torch.zeros(2, len(_COUNTERS), dtype=torch.int64, device=k.device)
        for side, _, c, decoded in nvfp4:
            read, over = self._read_back(decoded)
            reads.append(read)
            counts[side] = torch.stack([*(getattr(c, name) for name in _WRITE_COUNTERS), over])
        if self.fp8_keys:
            reads.insert(0, self._fp8_key(row, k, scale[0], slots))
        self.nvfp4_counters[row] += counts
        read = torch.nn.functional.pad(interleaved(reads), (0, self._padded[row] - self._head_dims[row]))
        self._count(row, interleaved([k, v]), read, valid)
        self._store(row, slots, read)

    def _fp8_key(self, row: int, k: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """K `[T, kv_heads, head_dim]` written as the fp8 cache writes it at `scale` `[kv_heads, 1]`, stored in
        `keys` at `slots`, its clamped values counted; what the attention reads of it."""
        stored = self.engine.write(k, scale, E4M3)
        store_rows(self.keys[row].flatten(0, 1), slots, stored.view(torch.uint8))
        self.clamped[row, 0] += (to_float32(k).abs() / scale > torch.finfo(E4M3).max).sum()
        return stored if self.read == "fp8" else to_float32(stored) * scale

    def _read_back(self, decoded: Decoded) -> tuple[torch.Tensor, torch.Tensor]:
        """What the attention reads of what the write `decoded` (`dequantize`'s values for the float32 read,
        `block_values`' for the fp8 read), and how many of its e2m1 x block scale pass e4m3's 448, which the fp8 read
        cannot hold."""
        if self.read == "float32":
            return decoded.values, decoded.past_e4m3
        return to_fp8(decoded.values, E4M3, saturate=True), decoded.past_e4m3

    def vllm_page(self, layer: int, page: int, *, swizzle_v: bool) -> torch.Tensor:
        """Page `page` of `layer` laid out as vLLM's kernel writes an HND page, uint8: [K codes | K block scales |
        V codes | V block scales], codes `[kv_heads, page_size, head_dim/2]` and block scales `[kv_heads, page_size,
        head_dim/16]` per side (vLLM 0.32.0 `nvfp4_kv_cache_kernels.cu`). `swizzle_v`: V's block scales in the
        4-token swizzle sm100's attention reads (vLLM's kernel swizzles below compute capability 12; K's stay
        linear). On 8.x, 9.x and 12.x vLLM 0.32.0 writes the same page with FlashInfer's writer instead, every block
        scale linear, as fa2 reads them: `swizzle_v=False`."""
        if self.fp8_keys:
            raise Fp8kvError("vllm_page lays out vLLM's nvfp4 page, NVFP4 K and V; this cache holds an fp8 K")
        row = self._row[layer]
        parts = []
        for side in (0, 1):
            codes = self.codes[row][page, :, side::2].transpose(0, 1)  # [kv_heads, page_size, head_dim/2]
            scales = self.block_scales[row][page, :, side::2].transpose(0, 1)  # [kv_heads, page_size, head_dim/16]
            parts += [codes.flatten(), (_swizzled(scales) if side and swizzle_v else scales).flatten()]
        return torch.cat(parts)

    def bytes_per_token(self) -> float:
        """Bytes the stored codes, block scales and fp8 keys take per token across all layers (the read-back pages
        are fp8kv's model of the attention's input, not storage)."""
        return float(sum(stored[0, 0].numel() for stored in (*self.codes, *self.block_scales, *self.keys)))

    def nvfp4_counts(self) -> Nvfp4Counts:
        """The NVFP4 write counters, read from the device once."""
        counters = self.nvfp4_counters.cpu().tolist()  # [layer][K, V][counter]
        return Nvfp4Counts(**{name: {layer: (counters[i][0][j], counters[i][1][j])
                                     for i, layer in enumerate(self.kv_layers)}
                              for j, name in enumerate(_COUNTERS)})


def _swizzled(scales: torch.Tensor) -> torch.Tensor:
    """Block scales `[kv_heads, T, S]` (T tokens of a page, S = head_dim / 16) in sm100's swizzle: per head,
    `[T/4, 4, 4, S/4]` permuted to `[T/4, 4, S/4, 4]`, so the scale of token t, block s sits at row
    (t // 4) * 4 + s // (S/4), column (s % (S/4)) * 4 + t % 4. T and S must be multiples of 4."""
    heads, tokens, blocks = scales.shape
    if tokens % 4 or blocks % 4:
        raise Fp8kvError(f"sm100's V-scale swizzle needs a page size and head_dim / 16 that are multiples of 4, not "
                         f"{tokens} and {blocks}: a page size that is a multiple of 4 and a head_dim that is a multiple of 64")
    return scales.reshape(heads, tokens // 4, 4, 4, blocks // 4).permute(0, 1, 3, 4, 2).reshape(heads, tokens, blocks)
