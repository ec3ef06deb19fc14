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
    "test_crash_safety.py::test_sigkill_during_calibrate_write",
    "test_crash_safety.py::test_sigkill_during_convert_write",
    "test_default_margin.py::test_a_default_calibration_passes_verify_on_held_out_text[bundled-outliers]",
    "test_default_margin.py::test_a_default_calibration_passes_verify_on_held_out_text[bundled]",
    "test_default_margin.py::test_a_default_calibration_passes_verify_on_held_out_text[mixtral]",
    "test_distributed.py::test_two_ranks_give_the_scales_of_one_process",
    "test_evaluation.py::test_bundled_model_scores_above_chance_through_lm_eval",
    "test_evaluation.py::test_fp8kv_eval_command_writes_the_comparison",
    "test_evaluation.py::test_quarter_scales_score_lower_under_the_raw_cast_than_clamped",
    "test_first_run.py::test_readme_quickstart_runs_offline_from_another_folder",
    "test_runtime.py::test_models_with_their_own_attention_code_attend_over_the_pages[git]",
    "test_runtime.py::test_runner_through_torch_xla_reference_attention",
    "test_runtime.py::test_xla_cpu_matches_cpu_and_compiles_per_bucket_only",
    "test_secrets.py::test_every_command_ran",
    "test_secrets.py::test_token_never_printed",
    "test_secrets.py::test_token_never_written",
    "test_secrets.py::test_writes_stay_in_the_output_folder_and_temp",
    "test_transformers_load.py::test_calibrated_output_loads_in_transformers_with_the_sources_logits[llava]",
    "test_verify.py::test_mixture_of_experts_checkpoints_pass[mixtral]",
    "test_verify.py::test_the_bundled_model_calibrated_by_fp8kv_verifies_on_its_held_out_split",
    "test_verify.py::test_verify_runs_on_xla_cpu",
    "test_xla_cost.py::test_fp8_costs_what_bf16_costs_through_torch_xlas_function",
    "test_xla_cost.py::test_fp8_decode_on_xla_has_no_cpu_fallbacks",
    "test_zoo.py::test_architecture[llava]",
    "test_zoo.py::test_layerwise_scales_are_the_whole_models[idefics3]",
    "test_zoo.py::test_layerwise_scales_are_the_whole_models[llava]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[gemma3_text]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[gemma4_text]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[inkling_text]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[llava]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[mixtral]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[nemotron_h]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[olmoe]",
    "test_zoo.py::test_verify_runs_on_every_architecture_that_calibrates[zamba2]",
})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.removeprefix("tests/") in SLOW:
            item.add_marker(pytest.mark.slow)


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
