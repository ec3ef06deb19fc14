"""`fp8kv push`: one commit with exactly DIR's files, a verify gate, a dry run, and no token in any output."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import CommitOperationAdd
from typer.testing import CliRunner

from fp8kv.checks import FAIL, Finding
from fp8kv.cli import app
from fp8kv.errors import Fp8kvError
from fp8kv.hub.card import is_fp8kv_card, public_text, write_card
from fp8kv.hub.push import collect_files, format_plan, plan_push, push
from fp8kv.verify.verdict import EXIT_CODES

runner = CliRunner()


class FakeHfApi:
    """Records the calls push makes; `fail` is raised from create_commit."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def create_repo(self, repo_id: str, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id: str, **kwargs) -> None:
        self.calls.append(("create_branch", repo_id, kwargs))

    def create_commit(self, repo_id: str, operations, **kwargs):
        operations = list(operations)
        self.calls.append(("create_commit", repo_id, operations, kwargs))
        if self.fail:
            raise self.fail
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0123abcd")


def _expected_files(out: Path) -> dict[str, int]:
    """Every file under DIR with its size, read through links, independently of push's walk; fp8kv's records
    (fp8kv.json, verify/*.json|md) as sent, with local paths shortened."""
    files = {}
    for root, _, names in os.walk(out):
        for name in names:
            path = Path(root) / name
            relative = path.relative_to(out).as_posix()
            record = relative == "fp8kv.json" or (relative.startswith("verify/") and name.endswith((".json", ".md")))
            files[relative] = len(public_text(path.read_text()).encode()) if record else path.stat().st_size
    return files


def _output(result) -> str:
    return result.output + (str(result.exception) if result.exception else "")


def test_push_sends_one_commit_with_every_file(verified_dir: Path) -> None:
    write_card(verified_dir, repo_id="me/llama-fp8kv")
    api = FakeHfApi()
    plan = plan_push(verified_dir, "me/llama-fp8kv")
    url = push(plan, api=api)
    assert url == "https://huggingface.co/me/llama-fp8kv/commit/0123abcd"
    assert [c[0] for c in api.calls] == ["create_repo", "create_commit"]
    assert api.calls[0] == ("create_repo", "me/llama-fp8kv", {"repo_type": "model", "private": None, "exist_ok": True})
    _, repo_id, operations, kwargs = api.calls[1]
    assert repo_id == "me/llama-fp8kv"
    assert kwargs == {"commit_message": "Add static FP8 KV-cache scales (fp8kv 0.1.0)", "repo_type": "model",
                      "revision": None}
    assert all(isinstance(op, CommitOperationAdd) for op in operations)
    sent = {op.path_in_repo: op.upload_info.size for op in operations}
    assert sent == _expected_files(verified_dir)
    assert {"model.safetensors", "kv_scales.safetensors", "model.safetensors.index.json", "config.json",
            "fp8kv.json", "README.md", "tokenizer.json", "verify/report.json", "verify/scales.png"} <= set(sent)
    assert plan.total_bytes == sum(sent.values())


def test_push_reads_links_and_leaves_hidden_files_out(verified_dir: Path, tmp_path: Path) -> None:
    # A link out of the folder is refused when the digest reads the checkpoint (verify refuses it too).
    (verified_dir / "docs").mkdir()
    elsewhere = verified_dir / "docs" / "elsewhere.json"
    elsewhere.write_text('{"linked": true}')
    (verified_dir / "extra.json").symlink_to(elsewhere)
    (verified_dir / ".cache").mkdir()
    (verified_dir / ".cache" / "lock").write_text("x")
    (verified_dir / ".README.md.tmp").write_text("partial")
    files = {f.path_in_repo: f for f in collect_files(verified_dir)}
    assert files["extra.json"].local_path == elsewhere.resolve()
    assert files["extra.json"].size == elsewhere.stat().st_size
    assert not any(name.startswith(".") for name in files)
    api = FakeHfApi()
    push(plan_push(verified_dir, "me/x"), api=api)
    operations = {op.path_in_repo: op for op in api.calls[-1][2]}
    assert operations["extra.json"].path_or_fileobj == str(elsewhere.resolve())


def test_push_refuses_a_broken_link(verified_dir: Path, tmp_path: Path) -> None:
    (verified_dir / "gone.safetensors").symlink_to(tmp_path / "missing.safetensors")
    with pytest.raises(Fp8kvError, match=r"gone\.safetensors: a link to .*missing\.safetensors, which is not a file"):
        plan_push(verified_dir, "me/x")


def test_push_private_branch_and_message(verified_dir: Path) -> None:
    api = FakeHfApi()
    push(plan_push(verified_dir, "org/x", private=True, revision="fp8-scales", commit_message="Scales v2"), api=api)
    assert api.calls[0] == ("create_repo", "org/x", {"repo_type": "model", "private": True, "exist_ok": True})
    assert api.calls[1] == ("create_branch", "org/x", {"repo_type": "model", "branch": "fp8-scales", "exist_ok": True})
    assert api.calls[2][3] == {"commit_message": "Scales v2", "repo_type": "model", "revision": "fp8-scales"}


def test_push_writes_the_card_when_dir_has_only_the_source_readme(verified_dir: Path, source_model: Path) -> None:
    source_readme = (source_model / "README.md").read_text()
    plan = plan_push(verified_dir, "me/llama-fp8kv")
    push(plan, api=FakeHfApi())
    assert plan.card_text is not None
    assert is_fp8kv_card(verified_dir / "README.md")
    assert "vllm serve me/llama-fp8kv --kv-cache-dtype fp8" in (verified_dir / "README.md").read_text()
    assert (source_model / "README.md").read_text() == source_readme


def test_push_keeps_an_existing_fp8kv_card_for_the_same_repo(verified_dir: Path) -> None:
    card = write_card(verified_dir, repo_id="me/x")
    card.write_text(card.read_text() + "\nHand-written note.\n")
    plan = plan_push(verified_dir, "me/x")
    push(plan, api=FakeHfApi())
    assert plan.card_text is None
    assert card.read_text().endswith("Hand-written note.\n")


@pytest.mark.parametrize("written_for", [None, "me/other"])
def test_push_rewrites_a_card_written_for_another_target(verified_dir: Path, written_for) -> None:
    """`fp8kv card DIR` then `fp8kv push DIR --repo-id me/x`, the README's order, publishes a card for me/x."""
    write_card(verified_dir, repo_id=written_for)
    plan = plan_push(verified_dir, "me/x")
    push(plan, api=FakeHfApi())
    text = (verified_dir / "README.md").read_text()
    assert plan.card_text == text
    assert text.startswith("---") and "\n# me/x\n" in text and "vllm serve me/x --kv-cache-dtype" in text
    assert f"vllm serve {verified_dir}" not in text and str(verified_dir.parent) not in text.split("## How to serve")[1]


@pytest.mark.parametrize("verdict", ["FAIL", None])
def test_failed_or_missing_verify_blocks_the_push(calibrated_dir: Path, write_report, verdict) -> None:
    if verdict:
        write_report(calibrated_dir, verdict=verdict, exit_code=EXIT_CODES[verdict],
                     reasons=(Finding(FAIL, "layer 1: 3 NaN without clamp"),))
        expected = r"the last verify says FAIL \(layer 1: 3 NaN without clamp\); .* or pass --force"
    else:
        expected = r"no verify/report\.json; run `fp8kv verify .*` first, or pass --force"
    api = FakeHfApi()
    with pytest.raises(Fp8kvError, match=expected):
        push(plan_push(calibrated_dir, "me/x"), api=api)
    assert api.calls == []
    assert not (calibrated_dir / "README.md").exists() or not is_fp8kv_card(calibrated_dir / "README.md")
    plan = plan_push(calibrated_dir, "me/x", force=True)
    push(plan, api=api)
    assert plan.verdict == verdict
    assert [c[0] for c in api.calls] == ["create_repo", "create_commit"]


def test_dry_run_lists_every_file_and_uploads_nothing(verified_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: pytest.fail("dry run built an HfApi"))
    readme_before = (verified_dir / "README.md").read_text()
    result = CliRunner().invoke(app, ["push", str(verified_dir), "--repo-id", "me/x", "--dry-run"])
    assert result.exit_code == 0, _output(result)
    assert (verified_dir / "README.md").read_text() == readme_before  # the card is only planned
    plan = plan_push(verified_dir, "me/x")
    listing = result.stdout.splitlines()
    assert result.stderr == ("fp8kv: warning: the card names no base_model (the source is not a Hub id); "
                             "pass --base-model org/name\n")
    assert listing == format_plan(plan).splitlines()
    expected = _expected_files(verified_dir)
    expected["README.md"] = len(plan.card_text.encode())
    assert listing[0] == ("Dry run: nothing uploaded. One commit to model repo me/x, created if missing: "
                          "'Add static FP8 KV-cache scales (fp8kv 0.1.0)'")
    assert listing[1] == "Last verify: WARN"
    files = listing[2:-1]
    assert [line.split()[-1] if "new card" not in line else "README.md" for line in files] == sorted(expected)
    for line in files:
        name = "README.md" if "new card" in line else line.split()[-1]
        assert f" {expected[name]:,} B  {name}" in line
    assert listing[-1].startswith(f"{len(expected)} files, ")
    assert listing[-1].endswith(f"({sum(expected.values()):,} B)")


def test_cli_push_dry_run_and_upload_never_show_the_token(verified_dir: Path, fake_token: str, monkeypatch) -> None:
    api = FakeHfApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: api)
    dry = runner.invoke(app, ["push", str(verified_dir), "--repo-id", "me/x", "--dry-run"])
    assert dry.exit_code == 0, _output(dry)
    assert "Dry run: nothing uploaded." in dry.output and "kv_scales.safetensors" in dry.output
    assert api.calls == []
    real = runner.invoke(app, ["push", str(verified_dir), "--repo-id", "me/x", "--private"])
    assert real.exit_code == 0, _output(real)
    count = len(api.calls[-1][2])
    assert real.stdout.startswith(f"Uploaded {count} files (")
    assert real.stdout.endswith("in one commit: https://huggingface.co/me/x/commit/0123abcd\n")
    assert api.calls[0][2]["private"] is True
    for text in (dry.output, real.output, (verified_dir / "README.md").read_text()):
        assert fake_token not in text


def test_cli_push_errors_never_show_the_token(verified_dir: Path, fake_token: str, monkeypatch) -> None:
    api = FakeHfApi(fail=RuntimeError(f"400 Bad Request for header Authorization: Bearer {fake_token}"))
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: api)
    readme = (verified_dir / "README.md").read_bytes()
    result = runner.invoke(app, ["push", str(verified_dir), "--repo-id", "me/x"])
    assert result.exit_code == 4
    text = _output(result)
    assert "me/x: upload failed (RuntimeError: 400 Bad Request for header Authorization: Bearer hf_***)" in text
    assert fake_token not in text
    assert (verified_dir / "README.md").read_bytes() == readme  # nothing uploaded, nothing written


def test_cli_push_refusal_is_one_line(calibrated_dir: Path, write_report) -> None:
    write_report(calibrated_dir, verdict="FAIL", exit_code=EXIT_CODES["FAIL"], reasons=())
    result = runner.invoke(app, ["push", str(calibrated_dir), "--repo-id", "me/x", "--dry-run"])
    assert result.exit_code == 4
    assert "the last verify says FAIL; fix the checkpoint and verify again, or pass --force" in _output(result)


def test_push_rejects_a_bad_repo_id(verified_dir: Path) -> None:
    with pytest.raises(Fp8kvError, match=r"--repo-id 'not a repo': not a valid Hub repository id"):
        plan_push(verified_dir, "not a repo")


def test_nothing_push_uploads_shows_a_local_path(verified_dir: Path, source_model: Path) -> None:
    """Every uploaded file, fp8kv's records included, is free of the author's paths (folders, data files)."""
    from dataclasses import replace

    from fp8kv.checkpoint.provenance import read_provenance

    record = read_provenance(verified_dir)  # calibrated on a local file, as `--dataset my.jsonl` records it
    local_data = replace(record.dataset, name=str(source_model.parent / "calib.jsonl"))
    (verified_dir / "fp8kv.json").write_text(replace(record, dataset=local_data).to_json())
    (verified_dir / "verify" / "report.md").write_text(f"# verify of `{verified_dir}` on ({local_data.name})\n")
    api = FakeHfApi()
    push(plan_push(verified_dir, "me/x", base_model="org/base", force=True), api=api)
    operations = api.calls[1][2]
    local = [str(verified_dir.parent), str(source_model.parent), str(Path.home()), sys.prefix]
    for op in operations:
        data = op.path_or_fileobj if isinstance(op.path_or_fileobj, bytes) else Path(op.path_or_fileobj).read_bytes()
        for path in local:
            assert path.encode() not in data, (op.path_in_repo, path)
    assert {op.path_in_repo for op in operations} >= {"fp8kv.json", "verify/report.json", "verify/report.md", "README.md"}


def test_card_and_push_keep_an_edited_readme_unless_forced(verified_dir: Path) -> None:
    write_card(verified_dir, repo_id="me/x")
    edited = (verified_dir / "README.md").read_text().replace("# me/x", "# me/x\n\nMy own words.")
    (verified_dir / "README.md").write_text(edited)
    for args in (["card", str(verified_dir)], ["push", str(verified_dir), "--repo-id", "me/other", "--dry-run"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 4, _output(result)
        assert result.stderr.endswith("README.md: differs from the README.md fp8kv wrote (edited since?); keep your "
                                      "text by moving it elsewhere first, or pass --force to replace it\n")
        assert (verified_dir / "README.md").read_text() == edited
    result = runner.invoke(app, ["card", str(verified_dir), "--force"])
    assert result.exit_code == 0, _output(result)
    assert "My own words." not in (verified_dir / "README.md").read_text()
    assert runner.invoke(app, ["card", str(verified_dir)]).exit_code == 0  # fp8kv's own card, unchanged: replaced


def test_push_without_a_token_says_so(verified_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # no HF_TOKEN, no `hf auth login`
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: pytest.fail("built an HfApi without a token"))
    readme = (verified_dir / "README.md").read_bytes()
    result = runner.invoke(app, ["push", str(verified_dir), "--repo-id", "me/x"])
    assert result.exit_code == 4
    assert (verified_dir / "README.md").read_bytes() == readme  # the card was not written for a push that never ran
    assert result.stderr.endswith("fp8kv: error: me/x: no Hub token; log in with `hf auth login` or set HF_TOKEN, "
                             "then push again\n")
