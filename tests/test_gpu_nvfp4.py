"""probes/gpu_nvfp4.py's CPU side: its inputs, and its comparison of a recorded NVFP4 write with fp8kv's.

No recording from a GPU exists yet (probes/README.md says how to make one). The recordings here are made on the CPU
by fp8kv's own write, so they test the comparer alone and are no evidence of what any GPU writes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8kv.runtime.nvfp4_cache import Nvfp4PagedKVCache


def _probe() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_nvfp4", Path(__file__).parents[1] / "probes" / "gpu_nvfp4.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


PROBE = _probe()
K, V = PROBE.inputs()


def _fp8kv_recording(*, swizzle_v: bool = False, swizzled_v: bool = False) -> dict:
    """A recording whose pages fp8kv wrote (laid out with `swizzle_v`), labelled with the layout `swizzled_v`."""
    pages = [PROBE.fp8kv_pages(K, V, ks, vs, swizzle_v=swizzle_v) for ks, vs in PROBE.SCALES]
    return PROBE.recording(K, V, pages, swizzled_v=swizzled_v, how="fp8kv's own write, on a CPU (not a GPU)")


def _counts(difference: Any) -> dict[str, tuple[int, int]]:
    return {r.region: (r.bytes_differ, r.nibbles_differ) for r in difference.regions}


def test_comparer_self_consistency_on_fp8kvs_own_cpu_recording_is_no_gpu_evidence():
    """fp8kv's write read back through the recording's hex and the fa2 page views matches itself in every byte of
    every region: the comparer's plumbing, nothing about a GPU."""
    differences = PROBE.compare(_fp8kv_recording())
    assert [(d.k_scale, d.v_scale) for d in differences] == list(PROBE.SCALES)
    page_bytes = (PROBE.NUM_PAGES - 1) * PROBE.KV_HEADS * PROBE.PAGE_SIZE
    for difference in differences:
        assert difference.differ == 0
        assert {r.region: r.total for r in difference.regions} == {
            "k_codes": page_bytes * 64, "k_scales": page_bytes * 8, "v_codes": page_bytes * 64, "v_scales": page_bytes * 8}


def test_comparer_counts_each_planted_difference_in_its_region():
    """A V code with one nibble changed, a K block scale changed, at known offsets of one run: counted there alone."""
    recorded = _fp8kv_recording()
    pages = bytearray.fromhex(recorded["runs"][1]["pages"])
    side = PROBE.KV_HEADS * PROBE.PAGE_SIZE * (64 + 8)
    v_code, k_scale = side + 5, PROBE.KV_HEADS * PROBE.PAGE_SIZE * 64 + 3  # page 1's bytes, fa2's HND page
    pages[v_code] ^= 0x10
    pages[k_scale] ^= 0x01
    recorded["runs"][1]["pages"] = pages.hex()
    first, planted, last = PROBE.compare(recorded)
    assert first.differ == last.differ == 0
    assert _counts(planted) == {"k_codes": (0, 0), "k_scales": (1, 1), "v_codes": (1, 1), "v_scales": (0, 0)}


def test_comparer_lays_fp8kvs_pages_out_as_the_recording_says():
    """Pages recorded with sm100's swizzled V scales but labelled linear differ in V's block scales only; labelled
    swizzled they match: the comparer follows the recording's layout."""
    assert all(d.differ == 0 for d in PROBE.compare(_fp8kv_recording(swizzle_v=True, swizzled_v=True)))
    for difference in PROBE.compare(_fp8kv_recording(swizzle_v=True)):
        counts = _counts(difference)
        assert counts["v_scales"][0] > 0
        assert counts["k_codes"] == counts["k_scales"] == counts["v_codes"] == (0, 0)


@pytest.mark.parametrize("scales", PROBE.SCALES, ids=lambda s: f"k_scale={s[0]:g},v_scale={s[1]:g}")
def test_the_inputs_reach_the_hard_cases_at_every_scale(scales):
    """fp8kv's own counters on the probe's inputs: saturated, subnormal and zeroed block scales and clipped values on
    both sides at each global scale, so a GPU run exercises each."""
    cache = Nvfp4PagedKVCache([0], num_pages=PROBE.NUM_PAGES, page_size=PROBE.PAGE_SIZE, num_kv_heads=PROBE.KV_HEADS,
                              head_dim=PROBE.HEAD_DIM, device=torch.device("cpu"), k_scales={0: scales[0]},
                              v_scales={0: scales[1]})
    cache.write(0, K, V, PROBE.slots(), torch.ones(PROBE.TOKENS, dtype=torch.bool))
    counts = cache.nvfp4_counts()
    for counter in ("saturated_scales", "subnormal_scales", "zeroed_blocks", "clipped_values"):
        assert min(getattr(counts, counter)[0]) > 0, counter


def test_the_unit_scale_inputs_hold_e2m1_and_e4m3_ties():
    """At k_scale 1 the constructed blocks put values exactly on e2m1 rounding midpoints (block scale 2**e exact)
    and block maxima / 6 exactly on e4m3 midpoints, where an approximate reciprocal can tip the rounding."""
    blocks = K.float().reshape(-1, 16)
    e2m1_ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    bmax = blocks.abs().amax(dim=1, keepdim=True)
    exact_scale = (bmax / 6).log2().frac() == 0
    on_tie = torch.isin(blocks.abs() / (bmax / 6), e2m1_ties) & exact_scale
    assert int(on_tie.sum()) >= 7 * 2 * 10
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    midpoints = (e4m3[1:] + e4m3[:-1]) / 2
    assert int(torch.isin(bmax.flatten() / 6, midpoints).sum()) >= 20


def test_the_fa2_views_read_fp8kvs_vllm_page_as_stored():
    """The views FlashInfer writes through are the page vLLM's split views read (`vllm_page`, which
    tests/test_nvfp4_cache.py holds to vLLM 0.32.0's `nvfp4_split_data_scale`): each reads back the codes and block
    scales fp8kv stored, per side, head and token."""
    cache = Nvfp4PagedKVCache([0], num_pages=PROBE.NUM_PAGES, page_size=PROBE.PAGE_SIZE, num_kv_heads=PROBE.KV_HEADS,
                              head_dim=PROBE.HEAD_DIM, device=torch.device("cpu"), k_scales={0: 0.0123},
                              v_scales={0: 0.04321})
    cache.write(0, K, V, PROBE.slots(), torch.ones(PROBE.TOKENS, dtype=torch.bool))
    pages = torch.stack([cache.vllm_page(0, page, swizzle_v=False) for page in range(PROBE.NUM_PAGES)])
    codes, scales = PROBE.fa2_views(pages)
    for side in (0, 1):
        assert torch.equal(codes[side], cache.codes[0][:, :, side::2].transpose(1, 2))
        assert torch.equal(scales[side].view(torch.uint8), cache.block_scales[0][:, :, side::2].transpose(1, 2))
