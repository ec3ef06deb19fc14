"""Fixtures shared by the whole suite."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from fp8kv.tools.factory import make_checkpoint


# Tests that ran over 20 s in `pytest --durations=60` (2 cores shared, load average 10-13, the whole
# suite in 44 min); `pytest -m "not slow"` leaves them out of a quick run, `make test` runs them.
# The four tests of test_secrets.py share one fixture that runs every command.
SLOW = frozenset({
    "test_engine_runs.py::test_the_amx_path_is_its_flushing_attention_not_the_exact_one",
    "test_engine_runs.py::test_the_vec_path_is_reproduced_token_by_token",
    "test_crash_safety.py::test_sigkill_during_calibrate_write",
    "test_crash_safety.py::test_sigkill_during_convert_write",
    "test_default_margin.py::test_a_default_calibration_passes_verify_on_held_out_text[bundled-outliers]",
    "test_default_margin.py::test_a_default_calibration_passes_verify_on_held_out_text[bundled]",
    "test_default_margin.py::test_a_default_calibration_passes_verify_on_held_out_text[mixtral]",
    "test_distributed.py::test_two_ranks_give_the_scales_of_one_process",
    "test_evaluation.py::test_bundled_model_scores_above_chance_through_lm_eval",
    "test_evaluation.py::test_fp8kv_eval_command_writes_the_comparison",
    "test_evaluation.py::test_quarter_scales_score_lower_without_the_clamp_than_with_it",
    "test_first_run.py::test_readme_quickstart_runs_offline_from_another_folder",
    "test_runtime.py::test_runner_through_torch_xla_reference_attention",
    "test_runtime.py::test_xla_cpu_matches_cpu_and_compiles_per_bucket_only",
    "test_runtime_bf16.py::test_a_bf16_checkpoint_stays_bf16_on_xla",
    "test_runtime_report.py::test_models_attending_outside_the_paged_function_report_what_ran[bloom-the model's own attention over fp8kv.cache_view]",
    "test_runtime_report.py::test_models_attending_outside_the_paged_function_report_what_ran[deepseek_v3-fp8kv.latent_attention]",
    "test_runtime_report.py::test_models_attending_outside_the_paged_function_report_what_ran[falcon-the model's own attention over fp8kv.cache_view]",
    "test_runtime_report.py::test_the_paged_function_reports_torch_or_torch_xla_by_calls",
    "test_runtime_report.py::test_verify_on_a_tpu_fails_vllm_tpu_for_heads_that_do_not_tile",
    "test_secrets.py::test_every_command_ran",
    "test_secrets.py::test_token_never_printed",
    "test_secrets.py::test_token_never_written",
    "test_secrets.py::test_writes_stay_in_the_output_folder_and_temp",
    "test_verify.py::test_mixture_of_experts_checkpoints_pass[mixtral]",
    "test_verify.py::test_the_bundled_model_calibrated_by_fp8kv_verifies_on_its_held_out_split",
    "test_verify.py::test_verify_runs_on_xla_cpu",
    "test_xla_cost.py::test_fp8_costs_what_bf16_costs_through_torch_xlas_function",
    "test_xla_cost.py::test_fp8_decode_on_xla_has_no_cpu_fallbacks",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[gemma3_text]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[gemma4_text]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[inkling_text]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[mixtral]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[nemotron_h]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[olmoe]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[zamba2]",
})


# Tests that need what only .venv has, each with all its parameters: the tpu extra (torch_xla on XLA:CPU, jax), or
# torch 2.9's c10 headers (the cast of the SGLang releases on torch 2.11 or older, compiled). .venv runs them;
# .venv-newest leaves them out (`-m "not oldest_only"`), and there a test missing here fails.
OLDEST_ONLY = frozenset({
    "test_attention.py::test_torch_attention_matches_torch_xla_reference",
    "test_attention.py::test_xla_reference_numerics_reproduce_torch_xla_far_closer_than_float32",
    "test_attention_features.py::test_torch_xla_attention_refuses_the_feature",
    "test_engine_writes_vendor.py::test_a_bf16_division_writes_what_tpu_inferences_jax_expression_writes_on_the_cpu",
    "test_engine_writes_vendor.py::test_cuda_engines_write_what_nvidias_and_torchs_conversions_write",
    "test_runtime.py::test_mixture_of_experts_runs_on_xla_cpu",
    "test_runtime.py::test_runner_through_torch_xla_reference_attention",
    "test_runtime.py::test_xla_cpu_matches_cpu_and_compiles_per_bucket_only",
    "test_runtime_bf16.py::test_a_bf16_checkpoint_stays_bf16_on_xla",
    "test_runtime_report.py::test_models_attending_outside_the_paged_function_report_what_ran",
    "test_runtime_report.py::test_on_a_tpu_heads_that_do_not_tile_fail_vllm_tpu_naming_the_rule",
    "test_runtime_report.py::test_the_paged_function_reports_torch_or_torch_xla_by_calls",
    "test_runtime_report.py::test_verify_on_a_tpu_fails_vllm_tpu_for_heads_that_do_not_tile",
    "test_tpu_numerics.py::test_xla_backend_refuses_numerics_it_does_not_run",
    "test_tpu_path.py::test_device_tpu_says_what_is_missing",
    "test_tpu_path.py::test_faked_tpu_calls_the_kernel_as_vllm_does",
    "test_tpu_path.py::test_kernel_is_not_used_where_its_heads_do_not_tile",
    "test_tpu_path.py::test_tpu_version_comes_from_torch_xla_tpu",
    "test_verify.py::test_verify_runs_on_xla_cpu",
    "test_verify_nvfp4.py::test_an_xla_device_is_refused_in_one_line_before_any_model_runs",
    "test_xla_cost.py::test_fp8_costs_what_bf16_costs_through_torch_xlas_function",
    "test_xla_cost.py::test_fp8_decode_on_xla_has_no_cpu_fallbacks",
})


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The arithmetic this run's bf16 results came from (`make test` runs its second pass as a CPU without AVX-512)."""
    import torch

    from fp8kv.runtime.linear import cpu_kernels

    kernels = cpu_kernels()
    terminalreporter.write_line(f"torch {torch.__version__}, CPU kernels {kernels['torch_cpu_capability']}, "
                                f"oneDNN bf16 GEMMs: {'yes' if kernels['onednn_bf16_gemm'] else 'no'}")


def _without_group(node_id: str) -> str:
    """`node_id` less the "@group" pytest-xdist's loadgroup appends (an "@" after the last "]": engine names in
    parameter ids have one too)."""
    return node_id[: node_id.rfind("@")] if node_id.rfind("@") > node_id.rfind("]") else node_id


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        node_id = _without_group(item.nodeid).removeprefix("tests/")
        if node_id in SLOW:
            item.add_marker(pytest.mark.slow)
        if node_id.partition("[")[0] in OLDEST_ONLY:
            item.add_marker(pytest.mark.oldest_only)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under `--dist loadgroup` a test marked `xdist_group` must carry its group: tests that share a costly cached
    result (a recorded engine path's runs) otherwise compute it on every worker, silently."""
    if (item.config.getoption("loadgroup", default=False) and item.get_closest_marker("xdist_group")
            and _without_group(item.nodeid) == item.nodeid):
        pytest.fail("pytest-xdist's loadgroup did not group this test marked xdist_group: this pytest and "
                    "pytest-xdist do not work together (see the dev extra in pyproject.toml)", pytrace=False)


@pytest.fixture(scope="session")
def factory_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`factory_checkpoint(arch)`: the default factory checkpoint of `arch`, built once per session.

    Tests must treat these folders as read-only (copy one first to modify it); for other sizes
    or options call `make_checkpoint` into `tmp_path` directly.
    """
    root = tmp_path_factory.mktemp("factory")
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_checkpoint(arch, root / arch)
        return built[arch]

    return build


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A jsonl of six records of 10 to 60 tokens: several longer than the factory's sliding window (16)."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("data") / "corpus.jsonl"
    texts = [topics[key][: 40 + 37 * i] for i, key in enumerate(sorted(topics)[:6])]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _emulate_fp8_cast(monkeypatch: pytest.MonkeyPatch, saturating: bool) -> None:
    """Make torch's cast to e4m3 behave as one torch release line does, whichever torch is installed.

    saturating: values past the range store ±448, as torch >= 2.12 does (e5m2 too here; NaN stays NaN).
    Otherwise: c10's conversion of torch < 2.12, where every e4m3 value past 464 (inf included) is NaN.
    """
    import torch

    real = torch.Tensor.to
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)

    def to(self, *args, **kwargs):
        dtype = next((a for a in args if isinstance(a, torch.dtype)), kwargs.get("dtype"))
        if dtype not in fp8 or self.dtype in fp8:
            return real(self, *args, **kwargs)
        if saturating:
            limit = torch.finfo(dtype).max
            return real(torch.where(self.isnan(), self, self.clamp(-limit, limit)), *args, **kwargs)
        stored = real(self, *args, **kwargs)
        if dtype is not torch.float8_e4m3fn:
            return stored
        past = real(self.abs() > 464, stored.device)
        nan = torch.where(real(self.signbit(), stored.device), 0xFF, 0x7F).to(torch.uint8)
        return torch.where(past, nan, stored.view(torch.uint8)).view(dtype)

    monkeypatch.setattr(torch.Tensor, "to", to)


@pytest.fixture(params=["NaN past the range", "saturating"])
def cast(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with torch's e4m3 cast as torch < 2.12 has it (NaN past 464), then as torch >= 2.12 has
    it (±448), emulated where the installed torch differs, so both run on any torch."""
    _emulate_fp8_cast(monkeypatch, saturating=request.param == "saturating")
    return request.param
