"""Which KV-head counts torch_xla 2.9's Pallas kernel (ragged_paged_attention_v2) can tile, stated once.

No torch here: the runtime decides with it, and inspect, verify and the model card say it.
"""

from __future__ import annotations

# Values per 32-bit word the kernel packs along the combined K/V head axis, per cache dtype width.
PACKING_BY_BITS = {8: 4, 16: 2, 32: 1}

FP8_HEAD_RULE = ("torch_xla 2.9's Pallas kernel (vLLM's torch_xla TPU backend) needs the combined K/V heads "
                 "2*num_kv_heads divisible by 4 for an fp8 cache, with 2*kv/4 in {1, 2, 4, 8} or a multiple of 8: "
                 "2, 4, 8, 16 or 32 KV heads work, 1, 3, 5, 6, 10, 12 or 24 fail (per chip under tensor parallelism)")


def heads_tile(num_kv_heads: int, dtype_bits: int) -> bool:
    """Whether 2 * num_kv_heads combined heads of a `dtype_bits`-wide cache tile in the kernel."""
    packing = PACKING_BY_BITS[dtype_bits]
    combined = 2 * num_kv_heads
    return combined % packing == 0 and (combined // packing in (1, 2, 4, 8) or combined // packing % 8 == 0)
