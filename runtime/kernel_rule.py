"""The TPU cache layout's limits, stated once: head_dim padding, and which KV-head counts torch_xla 2.9's
Pallas kernel (ragged_paged_attention_v2) can tile.

No torch here: the runtime decides with it, and inspect, verify and the model card say it.
"""

from __future__ import annotations

TPU_HEAD_DIM_MULTIPLE = 128  # vLLM's TPU backend pads head_dim to a multiple of 128
# Values per 32-bit word the kernel packs along the combined K/V head axis, per cache dtype width.
PACKING_BY_BITS = {8: 4, 16: 2, 32: 1}

FP8_HEAD_RULE = ("torch_xla 2.9's Pallas kernel (vLLM's torch_xla TPU backend) needs the combined K/V heads "
                 "2*num_kv_heads divisible by 4 for an fp8 cache, with 2*kv/4 in {1, 2, 4, 8} or a multiple of 8: "
                 "2, 4, 8, 16 or 32 KV heads work, 1, 3, 5, 6, 10, 12 or 24 fail (per chip under tensor parallelism)")


def fp8_kernel_note(num_kv_heads: int) -> str | None:
    """One line when the kernel cannot run an fp8 cache with this many KV heads, else None."""
    if heads_tile(num_kv_heads, 8):
        return None
    return (f"num_key_value_heads={num_kv_heads}: {FP8_HEAD_RULE}, so vLLM's torch_xla TPU backend will not run "
            "this checkpoint with an fp8 cache")


def heads_tile(num_kv_heads: int, dtype_bits: int) -> bool:
    """Whether 2 * num_kv_heads combined heads of a `dtype_bits`-wide cache tile in the kernel."""
    packing = PACKING_BY_BITS[dtype_bits]
    combined = 2 * num_kv_heads
    return combined % packing == 0 and (combined // packing in (1, 2, 4, 8) or combined // packing % 8 == 0)
