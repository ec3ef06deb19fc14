"""The Hub workflow end to end, offline: calibrate `org/name` from the Hub cache, card it, plan the push."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from huggingface_hub import ModelCard

from fp8kv.console import fmt_number
from fp8kv.data import DataRequest
from fp8kv.calibrate.pipeline import CalibrationRequest, calibrate
from fp8kv.hub.card import write_card
from fp8kv.hub.push import plan_push, push

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def test_calibrate_a_cached_hub_id_then_card_and_push(tmp_path: Path, source_model: Path, monkeypatch) -> None:
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    shutil.copytree(source_model, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = tmp_path / "calib.jsonl"
    text.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + 1\n"}) + "\n" for i in range(8)))

    out = tmp_path / "out"
    data = DataRequest(dataset=str(text), num_samples=4, seq_len=32)
    result = calibrate(CalibrationRequest(model="org/tiny", out=out, data=data, device="cpu", command="fp8kv calibrate org/tiny"))
    assert result.source == snapshot

    card_text = write_card(out).read_text()
    card = ModelCard(card_text)
    assert card.data.base_model == "org/tiny"
    assert card.data.license == "llama3.1"
    for row in json.loads((out / "fp8kv.json").read_text())["layers"]:
        assert f"| {row['layer']} | {fmt_number(row['k_amax'])} | {fmt_number(row['k_scale'])} |" in card_text
    assert "Not verified." in card_text

    class Api:
        def create_repo(self, repo_id, **kwargs):
            self.repo = (repo_id, kwargs)

        def create_commit(self, repo_id, operations, **kwargs):
            self.operations = list(operations)
            return "https://huggingface.co/me/tiny-fp8kv/commit/1"

    api = Api()
    plan = plan_push(out, "me/tiny-fp8kv", force=True)
    url = push(plan, api=api)
    assert url == "https://huggingface.co/me/tiny-fp8kv/commit/1"
    sent = {op.path_in_repo: op.upload_info.size for op in api.operations}
    assert sent == {f.path_in_repo: f.size for f in plan.files}
    assert {"config.json", "fp8kv.json", "README.md", "tokenizer.json"} <= set(sent)
    assert sum(name.endswith(".safetensors") for name in sent) >= 2  # weights plus the scales
