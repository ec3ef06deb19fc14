"""fp8kv.api on live models: the CLI's scales bit for bit, observation during generate, the written folder.

Each model is a real architecture with random weights and a real tokenizer, loaded the way a user's own code
loads it (transformers' `from_pretrained`), never through fp8kv's loader.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fp8kv import api
from fp8kv.calibrate.pipeline import calibrate
from fp8kv.calibrate.request import CalibrationRequest
from fp8kv.checkpoint.provenance import read_provenance
from fp8kv.checkpoint.reader import read_kv_scales
from fp8kv.data import DataRequest, load_calibration_data, make_batches, pad_id
from fp8kv.errors import Fp8kvError
from fp8kv.tools.factory import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("api") / "llama", num_layers=3)


def _live(folder: Path) -> tuple[torch.nn.Module, object]:
    return AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval(), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("strategy", ["amax", "percentile:99.9"])
def test_scales_of_a_live_model_equal_the_clis_bit_for_bit(llama: Path, corpus: str, tmp_path: Path,
                                                            strategy: str) -> None:
    data = DataRequest(corpus, num_samples=6, seq_len=48)
    cli = calibrate(CalibrationRequest(model=str(llama), out=tmp_path / "cli", data=data, batch_size=2,
                                       strategy=strategy))
    model, tokenizer = _live(llama)
    samples = load_calibration_data(data, tokenizer).samples  # the very tokens calibrate saw
    statistics = api.observe_model(model, make_batches(samples, 2, pad_id(tokenizer)))
    scales = api.scales_from(statistics, strategy=strategy)
    for kind in ("k", "v"):
        ours, theirs = getattr(scales.scales, kind), getattr(cli.scales, kind)
        assert ours.keys() == theirs.keys()
        for layer in ours:
            assert ours[layer] == theirs[layer], (kind, layer)  # float32 values held as Python floats
    assert scales.num_tokens == sum(len(s) for s in samples)
    assert all(p.requires_grad for p in model.parameters()) and not model.training  # the model is as it was


def test_texts_with_the_tokenizer_give_the_same_statistics_as_their_token_batches(llama: Path) -> None:
    model, tokenizer = _live(llama)
    texts = ["The quick brown fox jumps over the lazy dog.", "A second, longer text " * 6]
    from_texts = api.observe_model(model, texts, tokenizer=tokenizer, batch_size=2, seq_len=32)
    encoded = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=32)
    from_tokens = api.observe_model(model, [(encoded["input_ids"], encoded["attention_mask"])])
    assert torch.equal(from_texts.tokens, from_tokens.tokens)
    assert torch.allclose(from_texts.amax, from_tokens.amax, rtol=1e-2)


def test_left_padding_is_never_observed(llama: Path) -> None:
    model, _ = _live(llama)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    alone = api.observe_model(model, [(ids[1:, 1:], torch.ones(1, 3, dtype=torch.long))])
    # row 1 left-padded with a token that, observed, would change the statistics
    padded = api.observe_model(model, [(ids, torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]))])
    row0 = api.observe_model(model, [(ids[:1], torch.ones(1, 4, dtype=torch.long))])
    assert int(padded.tokens[0]) == 7
    assert torch.equal(padded.hist, alone.hist + row0.hist)


def test_observing_generate_folds_prompt_and_decode_tokens_and_resets(llama: Path) -> None:
    model, tokenizer = _live(llama)
    tokenizer.padding_side = "left"
    prompts = tokenizer(["Once upon a time", "A longer prompt about the sea and ships"], return_tensors="pt",
                        padding=True)
    new_tokens = 5
    with api.observing(model) as observation:
        out = model.generate(**prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=pad_id(tokenizer))
        live = observation.statistics()
        # every real prompt token, and each generated token but the last (it is never fed back)
        assert observation.num_tokens == int(prompts["attention_mask"].sum()) + 2 * (new_tokens - 1)
        observation.reset()
        assert observation.num_tokens == 0 and int(observation.statistics().hist.sum()) == 0
    # the same tokens in one forward: the same K/V up to the order bf16 sums them in
    fed = out[:, :-1]
    mask = torch.cat([prompts["attention_mask"], torch.ones(2, new_tokens - 1, dtype=torch.long)], dim=1)
    whole = api.observe_model(model, [(fed, mask)])
    assert torch.equal(live.tokens, whole.tokens)
    assert torch.allclose(live.amax, whole.amax, rtol=2e-2)
    assert type(model.generate(**prompts, max_new_tokens=1, pad_token_id=pad_id(tokenizer))) is torch.Tensor
    assert all("update" not in vars(m) for m in model.modules())  # nothing left patched


@pytest.mark.parametrize("buffer_elements", [0, 700])  # every update folded alone; the buffer folded mid-forward
def test_buffered_updates_fold_to_the_statistics_of_folding_each_alone(llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       buffer_elements: int) -> None:
    model, tokenizer = _live(llama)
    tokenizer.padding_side = "left"
    prompts = tokenizer(["Once upon a time", "A longer prompt about the sea and ships"], return_tensors="pt",
                        padding=True)

    def observed() -> api.KVStatistics:
        with api.observing(model) as observation:
            model.generate(**prompts, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                           pad_token_id=pad_id(tokenizer))
        return observation.statistics()

    buffered = observed()
    monkeypatch.setattr(api, "_BUFFER_ELEMENTS", buffer_elements)
    other = observed()
    for name in ("amax", "hist", "tokens"):
        assert torch.equal(getattr(buffered, name), getattr(other, name)), name


def test_save_scales_writes_a_folder_verify_reads_with_its_provenance(llama: Path, tmp_path: Path) -> None:
    model, tokenizer = _live(llama)
    scales = api.scales_from(api.observe_model(model, ["Some text to calibrate on."] * 3, tokenizer=tokenizer))
    linked = api.save_scales(scales, llama, tmp_path / "linked")
    saved = api.save_scales(scales, model, tmp_path / "saved", tokenizer=tokenizer)
    for folder, weights_saved in ((linked, False), (saved, True)):
        record = read_provenance(folder)
        assert record is not None and record.memory is not None and record.memory.weights_saved is weights_saved
        assert (record.source is None) is weights_saved
        held = read_kv_scales(folder).scales
        assert held is not None
        for layer, k in scales.scales.k.items():
            assert held.k[layer] == k and held.v[layer] == scales.scales.v[layer]
    assert json.loads((saved / "config.json").read_text())["compression_config"]["kv_cache_scheme"]
    with pytest.raises(Fp8kvError, match="exists"):
        api.save_scales(scales, llama, tmp_path / "linked")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["linked", "saved"]  # no staging folder left behind


def test_bad_input_is_one_clear_error(llama: Path) -> None:
    model, tokenizer = _live(llama)
    ids = torch.tensor([[5, 6, 7]])
    for batches, match in ((ids, "bare tensor"), (["text"], "pass tokenizer="), ([], "empty"),
                           ([(ids, torch.tensor([[1, 0, 1]]))], "padding between real tokens"),
                           ([(ids.float(), torch.ones(1, 3))], "token ids are integers")):
        with pytest.raises(Fp8kvError, match=match):
            api.observe_model(model, batches)
    with pytest.raises(Fp8kvError, match="expected a transformers model"):
        api.observe_model(torch.nn.Linear(2, 2), ["x"], tokenizer=tokenizer)
    with pytest.raises(Fp8kvError, match="statistics: expected KVStatistics"):
        api.scales_from({"amax": 1})  # type: ignore[arg-type]


def test_the_documented_example_runs(llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    (example,) = re.findall(r"```python\n(.*?)```", text, re.S)[:1]
    assert 'model_id = "HuggingFaceTB/SmolLM2-135M-Instruct"' in example
    monkeypatch.chdir(tmp_path)
    exec(compile(example.replace("HuggingFaceTB/SmolLM2-135M-Instruct", str(llama)), "docs/api.md", "exec"), {})
    record = read_provenance(tmp_path / "smollm2-fp8kv")
    assert record is not None and record.memory is not None
