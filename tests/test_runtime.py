"""The paged model runner against transformers' eager forward, prefix sharing, fp8 overflow, XLA:CPU."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")

from fp8kv.errors import Fp8kvError  # noqa: E402
from fp8kv.tools.factory import ARCHITECTURES, make_checkpoint  # noqa: E402
from fp8kv.runtime.device import resolve_device  # noqa: E402
from fp8kv.runtime.runner import PagedModelRunner, load_model  # noqa: E402

# 23 tokens: more than one page (4) and more than the factory's sliding window (16)
PROMPTS = [[(7 * i + 11) % 500 + 4 for i in range(23)], [(13 * i + 5) % 500 + 4 for i in range(19)]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: make_checkpoint(arch, root / arch) for arch in ARCHITECTURES}


def _eager(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()


@torch.no_grad()
def _eager_logits(model, ids):
    return model(torch.tensor([ids])).logits[0]


@torch.no_grad()
def _eager_greedy(model, ids, steps):
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(_eager_logits(model, ids)[-1].argmax()))
    return ids[-steps:]


def _runner(model_dir, **kwargs):
    defaults = dict(device="cpu", cache_dtype="fp32", page_size=4, max_model_len=64, max_num_seqs=4)
    return PagedModelRunner(model_dir, **{**defaults, **kwargs})


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_runner_reproduces_eager_prefill_mixed_step_and_greedy(arch, checkpoints):
    eager, runner = _eager(checkpoints[arch]), _runner(checkpoints[arch])
    full = [_eager_logits(eager, p) for p in PROMPTS]
    a, _ = runner.start()
    b, _ = runner.start()
    prefill = runner.step([(a, PROMPTS[0][:20]), (b, PROMPTS[1][:15])])  # ragged batched prefill
    torch.testing.assert_close(prefill[0], full[0][:20], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prefill[1], full[1][:15], rtol=1e-4, atol=1e-4)
    mixed = runner.step([(b, PROMPTS[1][15:]), (a, PROMPTS[0][20:21])])  # a chunk and a decode step together
    torch.testing.assert_close(mixed[0], full[1][15:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mixed[1], full[0][20:21], rtol=1e-4, atol=1e-4)
    assert runner.generate(PROMPTS, max_new_tokens=4) == [_eager_greedy(eager, p, 4) for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_bf16_cache_stays_close_to_eager(arch, checkpoints):
    eager, runner = _eager(checkpoints[arch]), _runner(checkpoints[arch], cache_dtype="bf16")
    seq, _ = runner.start()
    logits = runner.step([(seq, PROMPTS[0])])[0]
    torch.testing.assert_close(logits, _eager_logits(eager, PROMPTS[0]), rtol=0, atol=2e-2)
    assert runner.generate(PROMPTS, max_new_tokens=3) == [_eager_greedy(eager, p, 3) for p in PROMPTS]


def test_shared_prefix_reads_the_first_sequences_pages(checkpoints):
    eager, runner = _eager(checkpoints["qwen3"]), _runner(checkpoints["qwen3"])
    first, _ = runner.start()
    runner.step([(first, PROMPTS[0][:18])])
    second_ids = PROMPTS[0][:14] + PROMPTS[1][:6]
    second, reused = runner.start(share_from=first, shared_tokens=14)
    assert reused == 12  # three whole pages of 4
    assert runner.allocator.tables[second][:3] == runner.allocator.tables[first][:3]
    logits = runner.step([(second, second_ids[reused:])])[0]
    torch.testing.assert_close(logits, _eager_logits(eager, second_ids)[reused:], rtol=1e-4, atol=1e-4)
    written = runner.counts().written[0]
    assert written == (18 + 8) * 2 * 16  # the shared 12 tokens were not written again (2 kv heads x 16)


def test_fp8_cache_clamps_and_raw_cast_turns_to_nan(checkpoints):
    model = checkpoints["llama"]
    tiny = {0: 1e-4, 1: 1e-4}  # far below the amax: most values overflow
    ones = {0: 1.0, 1: 1.0}
    clamped = _runner(model, cache_dtype="fp8_e4m3", k_scales=tiny, v_scales=ones)
    seq, _ = clamped.start()
    logits = clamped.step([(seq, PROMPTS[0])])[0]
    counts = clamped.counts()
    assert logits.isfinite().all()
    assert all(k > 0 and v == 0 for k, v in counts.clamped.values())
    assert all(pair == (0, 0) for pair in counts.nonfinite.values())
    raw = _runner(model, cache_dtype="fp8_e4m3", k_scales=tiny, v_scales=ones, engine="no-clamp")
    seq, _ = raw.start()
    logits = raw.step([(seq, PROMPTS[0])])[0]
    assert logits.isnan().all()
    nan_k, nan_v = raw.counts().nonfinite[0]  # layer 0 sees the same K as before: compare to its clamps
    assert 0.9 * counts.clamped[0][0] < nan_k <= counts.clamped[0][0] and nan_v == 0  # 448 < x < 465: no NaN


def test_runners_sharing_weights_keep_their_own_caches(checkpoints):
    model_dir = checkpoints["gemma2"]
    own = _runner(model_dir)
    shared = load_model(model_dir, torch.device("cpu"))
    first, second = _runner(model_dir, model=shared), _runner(model_dir, model=shared, cache_dtype="bf16")
    expected = own.step([(own.start()[0], PROMPTS[0])])[0]
    # Interleave the two sharing runners: neither may see the other's cache.
    a, b = first.start()[0], second.start()[0]
    first.step([(a, PROMPTS[0][:10])])
    second.step([(b, PROMPTS[1])])
    rest = first.step([(a, PROMPTS[0][10:])])[0]
    assert first.model is second.model
    assert torch.allclose(rest, expected[10:], atol=1e-5)


def test_fp8_cache_with_sane_scales_tracks_eager(checkpoints):
    eager = _eager(checkpoints["qwen3"])
    runner = _runner(checkpoints["qwen3"], cache_dtype="fp8_e4m3", k_scales={0: 0.02, 1: 0.02}, v_scales={0: 0.01, 1: 0.01})
    seq, _ = runner.start()
    logits = runner.step([(seq, PROMPTS[1])])[0]
    reference = _eager_logits(eager, PROMPTS[1])
    assert (logits - reference).abs().max() < 0.1 * reference.abs().max()


def test_runner_errors_name_the_problem(checkpoints):
    runner = _runner(checkpoints["llama"], max_model_len=16)
    seq, _ = runner.start()
    with pytest.raises(Fp8kvError, match="sequence 0: 23 tokens exceed max_model_len=16"):
        runner.step([(seq, PROMPTS[0])])
    with pytest.raises(Fp8kvError, match="sequence 7 was not started"):
        runner.step([(7, [1])])
    with pytest.raises(Fp8kvError, match="unknown device 'gpu'; choose one of auto, tpu, xla-cpu, cuda, cpu"):
        resolve_device("gpu")
    with pytest.raises(Fp8kvError, match="attention backend 'xla' needs an XLA device"):
        _runner(checkpoints["llama"], attention_backend="xla")


def _compiles() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def test_xla_cpu_matches_cpu_and_compiles_per_bucket_only(checkpoints):
    """The torch attention on XLA keeps shapes static: one compile per token bucket, fp8 like bf16."""
    model = checkpoints["gemma3"]
    cpu = _runner(model, cache_dtype="fp8_e4m3", k_scales={0: 0.05, 1: 0.05}, v_scales={0: 0.05, 1: 0.05})
    xla = _runner(model, device="xla-cpu", cache_dtype="fp8_e4m3", k_scales={0: 0.05, 1: 0.05},
                  v_scales={0: 0.05, 1: 0.05}, attention_backend="torch")
    assert xla.cache.pages[0].shape[-1] == 128  # head_dim 16 padded as on TPU
    lengths = [5, 7, 11, 13, 9]  # token buckets 8, 8, 16, 16, 16
    after = []
    for n in lengths:
        outs = [r.step([(r.start()[0], PROMPTS[0][:n])])[0] for r in (cpu, xla)]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
        after.append(_compiles())
    for runner in (cpu, xla):
        runner.free(0)
    decode_start = _compiles()
    for _ in range(4):  # 4 sequences decode together: bucket 8, already compiled
        outs = {name: r.step([(s, [3]) for s in r.allocator.tables]) for name, r in (("cpu", cpu), ("xla", xla))}
    torch.testing.assert_close(outs["xla"], outs["cpu"], rtol=1e-4, atol=1e-4)
    assert after[1] == after[0] and after[3] == after[4] == after[2]  # a new length in a seen bucket: no compile
    assert _compiles() == decode_start  # N decode steps: no compile
    on_xla, on_cpu = xla.counts(), cpu.counts()
    assert (on_xla.clamped, on_xla.nonfinite, on_xla.written) == (on_cpu.clamped, on_cpu.nonfinite, on_cpu.written)
    for layer, pair in on_cpu.amax.items():  # K/V computed by XLA and by the CPU agree to float32 rounding
        torch.testing.assert_close(torch.tensor(on_xla.amax[layer]), torch.tensor(pair), rtol=1e-5, atol=0)


def test_mixture_of_experts_runs_on_xla_cpu(checkpoints):
    """transformers' default MoE path cannot run on XLA (an integer histc); the runner picks batched_mm there."""
    scales = {0: 0.05, 1: 0.05}
    cpu = _runner(checkpoints["qwen3_moe"], cache_dtype="fp8_e4m3", k_scales=scales, v_scales=scales)
    xla = _runner(checkpoints["qwen3_moe"], device="xla-cpu", cache_dtype="fp8_e4m3", k_scales=scales,
                  v_scales=scales, attention_backend="torch")
    assert xla.model.config._experts_implementation == "batched_mm"
    outs = [r.step([(r.start()[0], PROMPTS[0][:11]), (r.start()[0], PROMPTS[1][:5])]) for r in (cpu, xla)]
    for reference, ours in zip(*outs):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


def test_runner_through_torch_xla_reference_attention(checkpoints):
    """`auto` on XLA:CPU is torch_xla's function (its reference): same logits, compiles bounded per step."""
    scales = {0: 0.05, 1: 0.05}
    outs = []
    for backend in ("auto", "torch"):
        runner = _runner(checkpoints["mistral"], device="xla-cpu", cache_dtype="fp8_e4m3", k_scales=scales,
                         v_scales=scales, attention_backend=backend)
        assert not runner.use_kernel  # no TPU here
        outs.append(runner.step([(runner.start()[0], PROMPTS[0][:6]), (runner.start()[0], PROMPTS[1][:3])]))
        assert runner.attention == ("torch_xla.ragged_paged_attention (reference)" if backend == "auto"
                                    else "fp8kv.torch")
    for reference, ours in zip(*outs):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    reference = _runner(checkpoints["mistral"], device="xla-cpu", cache_dtype="fp8_e4m3", k_scales=scales,
                        v_scales=scales)
    seqs = [reference.start()[0] for _ in range(2)]
    reference.step([(seqs[0], PROMPTS[0][:6]), (seqs[1], PROMPTS[1][:3])])
    # the first decode step also compiles what every decode step shares (one graph more when no earlier test in this
    # process compiled it for the same model)
    reference.step([(s, [5]) for s in seqs])
    start = _compiles()
    for _ in range(3):  # the reference slices by the real lengths: each new kv length is one new graph
        reference.step([(s, [5]) for s in seqs])
    assert _compiles() - start <= 3
    again = _runner(checkpoints["mistral"], device="xla-cpu", cache_dtype="fp8_e4m3", k_scales=scales,
                    v_scales=scales, model=reference.model)
    seqs = [again.start()[0] for _ in range(2)]
    start = _compiles()
    again.step([(seqs[0], PROMPTS[0][:6]), (seqs[1], PROMPTS[1][:3])])
    for _ in range(3):  # the same lengths again: every graph is cached
        again.step([(s, [5]) for s in seqs])
    assert _compiles() == start


@pytest.mark.parametrize("model_type", ["falcon", "bloom", "git"])  # rotary multi-query; ALiBi; own table of attention names
def test_models_with_their_own_attention_code_attend_over_the_pages(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    from fp8kv.checkpoint.load import takes_attention_function
    from fp8kv.tools.zoo import make_zoo_checkpoint

    path = make_zoo_checkpoint(model_type, tmp_path / model_type)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = _runner(path, dtype=torch.float32)
    # falcon attends in its own code up to transformers 5.24 and through the attention interface from 5.25
    assert runner.cache_view is not takes_attention_function(model.config)
    full = [_eager_logits(model, p) for p in PROMPTS]
    a, _ = runner.start()
    b, _ = runner.start()
    prefill = runner.step([(a, PROMPTS[0][:20]), (b, PROMPTS[1][:15])])
    torch.testing.assert_close(prefill[0], full[0][:20], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prefill[1], full[1][:15], rtol=1e-4, atol=1e-4)
    mixed = runner.step([(b, PROMPTS[1][15:]), (a, PROMPTS[0][20:21])])  # a chunk and a decode step over the pages
    torch.testing.assert_close(mixed[0], full[1][15:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mixed[1], full[0][20:21], rtol=1e-4, atol=1e-4)
    assert runner.generate(PROMPTS, max_new_tokens=4) == [_eager_greedy(model, p, 4) for p in PROMPTS]
    # what the model attends over is what the fp8 pages hold: K and V clamped at a tiny scale change its logits
    tiny = {0: 1e-4, 1: 1e-4}
    fp8 = _runner(path, cache_dtype="fp8_e4m3", k_scales=tiny, v_scales=tiny, model=runner.model)
    seq, _ = fp8.start()
    clamped = fp8.step([(seq, PROMPTS[0])])[0]
    assert min(fp8.counts().clamped[0]) > 0 and not torch.allclose(clamped, full[0], atol=1e-2)


@pytest.mark.parametrize("model_type", ["jamba", "minimax", "qwen4_exp", "lara_mini"])  # Mamba; linear attention, own cache; an indexer; sliding-window layers
def test_hybrids_keep_each_sequences_recurrent_state_apart(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    from fp8kv.tools.zoo import make_zoo_checkpoint

    path = make_zoo_checkpoint(model_type, tmp_path / model_type)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = _runner(path, dtype=torch.float32)
    assert runner.cache_view and runner.recurrent
    full = [_eager_logits(model, p) for p in PROMPTS]
    a, _ = runner.start()
    b, _ = runner.start()
    prefill = runner.step([(a, PROMPTS[0][:20]), (b, PROMPTS[1])])
    torch.testing.assert_close(prefill[0], full[0][:20], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prefill[1], full[1], rtol=1e-4, atol=1e-4)  # nothing of sequence a leaked in
    decode = runner.step([(a, PROMPTS[0][20:21])])  # the recurrent state carried from a's prefill
    torch.testing.assert_close(decode[0], full[0][20:21], rtol=1e-4, atol=1e-4)
    with pytest.raises(Fp8kvError, match=r"a hybrid continues a started sequence one token per step .* got 2$"):
        runner.step([(a, PROMPTS[0][21:23])])
    assert runner.start(share_from=a, shared_tokens=16)[1] == 0  # no recurrent state kept at a prefix's end
    assert runner.generate(PROMPTS, max_new_tokens=4) == [_eager_greedy(model, p, 4) for p in PROMPTS]
    layer = runner.geometry.kv_layers[0]  # its attention reads the fp8 pages: K and V clamped change its logits
    fp8 = _runner(path, cache_dtype="fp8_e4m3", k_scales={layer: 1e-4}, v_scales={layer: 1e-4}, model=runner.model)
    seq, _ = fp8.start()
    clamped = fp8.step([(seq, PROMPTS[0])])[0]
    assert min(fp8.counts().clamped[layer]) > 0 and not torch.allclose(clamped, full[0], atol=1e-2)


# V narrower than K; K/V tiled per expert; positions numbered from past the padding index
@pytest.mark.parametrize("model_type", ["mimo_v2_flash", "jetmoe", "roberta"])
def test_models_the_runtime_adapts_to_reproduce_transformers(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    from fp8kv.tools.zoo import make_zoo_checkpoint

    path = make_zoo_checkpoint(model_type, tmp_path / model_type)
    decoder = {"is_decoder": True} if model_type == "roberta" else {}  # the paged attention is causal
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **decoder).eval()
    runner = _runner(path, dtype=torch.float32)
    a, _ = runner.start()
    prefill = runner.step([(a, PROMPTS[0][:20])])[0]
    decode = runner.step([(a, PROMPTS[0][20:21])])[0]
    full = _eager_logits(model, PROMPTS[0])
    torch.testing.assert_close(prefill, full[:20], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode, full[20:21], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", ["cpmant", "xlm"])  # prepends its prompt tokens; re-reads the whole sequence
def test_models_caching_other_tokens_than_the_new_ones_are_refused_in_one_line(model_type, tmp_path):
    from fp8kv.tools.zoo import make_zoo_checkpoint

    runner = _runner(make_zoo_checkpoint(model_type, tmp_path / model_type), dtype=torch.float32)
    seq, _ = runner.start()
    with pytest.raises(Fp8kvError, match=r"^layer 0: the model cached K/V of \d+ tokens for \d+ new ones"):
        runner.step([(seq, PROMPTS[0][:20])])
        runner.step([(seq, PROMPTS[0][20:21])])


def test_a_model_keeping_its_recurrent_state_in_its_modules_is_refused_in_one_line(tmp_path):
    from fp8kv.tools.zoo import make_zoo_checkpoint

    path = make_zoo_checkpoint("recurrent_gemma", tmp_path / "recurrent_gemma")
    with pytest.raises(Fp8kvError, match=r"^recurrent_gemma keeps its recurrent state inside its modules"):
        _runner(path, dtype=torch.float32)
