"""`fp8kv push`: a calibrated folder to a Hub model repository, in one commit.

The token is huggingface_hub's business: `HfApi()` finds it in its standard places (`HF_TOKEN`,
`hf auth login`). fp8kv never reads it except to blank it out of an error message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8kv import __version__
from fp8kv.checkpoint.locate import verify_command
from fp8kv.checkpoint.artifacts import EVAL_DIR, PROVENANCE_FILE, VERIFY_DIR, write_file_atomic
from fp8kv.checkpoint.provenance import record_written
from fp8kv.errors import Fp8kvError
from fp8kv.options import Verdict
from fp8kv.hub.card import (
    CARD_FILE, REPORT_FILE, card_repo_id, check_replaceable, public_text, read_provenance, read_report, render_card,
)

PUSHABLE_VERDICTS: tuple[Verdict, ...] = ("PASS", "WARN")


@dataclass(frozen=True)
class PushPlan:
    """Everything `push` would do, decided before anything is uploaded or written."""

    out_dir: Path
    repo_id: str
    revision: str | None
    private: bool
    commit_message: str
    files: list[UploadFile]
    verdict: str | None
    card_text: str | None  # a new card, uploaded and then written to DIR; None when DIR already has one
    warnings: tuple[str, ...] = ()  # what the new card cannot name (base model, license)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class UploadFile:
    """One file of the commit: where it goes in the repo, the file it is read from, its size in bytes, and the
    bytes sent instead of the file's when they differ (fp8kv's records with local paths shortened)."""

    path_in_repo: str
    local_path: Path
    size: int
    content: bytes | None = None


def check_repo_id(repo_id: str) -> str:
    """`--repo-id`: a Hub repository id huggingface_hub accepts."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except Exception as exc:  # noqa: BLE001 - HFValidationError, one line
        raise Fp8kvError(f"--repo-id {repo_id!r}: not a valid Hub repository id ({exc})") from exc
    return repo_id


def plan_push(
    out_dir: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    force: bool = False,
    base_model: str | None = None,
    license: str | None = None,
) -> PushPlan:
    """Check the folder and the last verify, and list the files of the commit. Writes nothing.

    Refuses (`Fp8kvError`) when there is no `verify/report.json` or its verdict is not PASS/WARN,
    unless `force`. When DIR has no fp8kv card written for `repo_id` (none, a README copied from the
    source, or a card for the local folder), the plan carries a new one, listed as README.md; a README.md
    fp8kv did not write, or one edited since, is replaced only with `force`. fp8kv's own records
    (fp8kv.json, verify/, eval/) are sent with local paths shortened to their last part.
    """
    from fp8kv.hub.card import card_warnings

    out = Path(out_dir)
    check_repo_id(repo_id)
    read_provenance(out)  # DIR must be an fp8kv calibrate output
    files = collect_files(out)
    verdict = _check_verify(out, force)
    card_path = out / CARD_FILE
    # A card written for another target (`fp8kv card DIR` names the local folder) is rewritten for this repo.
    card_text = None
    if card_repo_id(card_path) != repo_id:
        card_text = render_card(out, repo_id=repo_id, base_model=base_model, license=license)
        check_replaceable(out, force)
    if card_text is not None:
        files = [f for f in files if f.path_in_repo != CARD_FILE]
        card_bytes = card_text.encode("utf-8")
        files.append(UploadFile(CARD_FILE, card_path, len(card_bytes), card_bytes))
        files.sort(key=lambda f: f.path_in_repo)
    message = commit_message or f"Add static FP8 KV-cache scales (fp8kv {__version__})"
    warnings = tuple(card_warnings(out, base_model=base_model, license=license)) if card_text is not None else ()
    return PushPlan(out, repo_id, revision, private, message, files, verdict, card_text, warnings)


def push(plan: PushPlan, api: Any = None) -> str:
    """Carry out `plan` (from `plan_push`): one commit to its repo; returns the commit URL.

    Creates the repository (and the `revision` branch) when missing, then sends one `create_commit`
    with a `CommitOperationAdd` per file; links are read through, so the Hub gets the files they point
    to. The plan's new card goes up from memory and is written to DIR only once the commit landed, so a
    push that fails changes nothing on disk. `api` is any object with HfApi's `create_repo`,
    `create_branch` and `create_commit` (default: `huggingface_hub.HfApi()`).
    """
    url = _upload(plan, api)
    if plan.card_text is not None:
        write_file_atomic(plan.out_dir / CARD_FILE, plan.card_text.encode("utf-8"))
        record_written(plan.out_dir / CARD_FILE)
    return url


def collect_files(out_dir: Path) -> list[UploadFile]:
    """Every file under DIR, links followed, hidden names (temp files, .cache) left out; sorted."""
    out = Path(out_dir)
    files = []
    for root, dirs, names in os.walk(out, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            if name.startswith("."):
                continue
            path = Path(root) / name
            target = Path(os.path.realpath(path))
            if not target.is_file():
                raise Fp8kvError(
                    f"{path}: a link to {target}, which is not a file; restore it or rerun `fp8kv calibrate`"
                )
            name = path.relative_to(out).as_posix()
            files.append(_public(name, target) if _is_record(name) else UploadFile(name, target, target.stat().st_size))
    return sorted(files, key=lambda f: f.path_in_repo)


def _is_record(name: str) -> bool:
    """fp8kv's own records, which hold local paths (the source folder, the data file) for local use."""
    return name == PROVENANCE_FILE or (name.split("/", 1)[0] in (VERIFY_DIR, EVAL_DIR) and
                                       name.endswith((".json", ".md")))


def _public(name: str, path: Path) -> UploadFile:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise Fp8kvError(f"{path}: cannot be read ({exc}); rerun the fp8kv command that wrote it") from None
    content = public_text(text).encode("utf-8")
    return UploadFile(name, path, len(content), content)


def format_plan(plan: PushPlan) -> str:
    """The dry-run listing: destination, verify verdict, and every file with its size."""
    where = f"{plan.repo_id}" + (f" (branch {plan.revision})" if plan.revision else "")
    lines = [
        f"Dry run: nothing uploaded. One commit to model repo {where}"
        + (", created private if missing" if plan.private else ", created if missing")
        + f": {plan.commit_message!r}",
        f"Last verify: {plan.verdict or 'none'}",
    ]
    width = max((len(f"{f.size:,}") for f in plan.files), default=1)
    for f in plan.files:
        note = "  (new card, written before upload)" if f.path_in_repo == CARD_FILE and plan.card_text else ""
        lines.append(f"  {human_size(f.size):>9}  {f.size:>{width},} B  {f.path_in_repo}{note}")
    lines.append(f"{len(plan.files)} files, {human_size(plan.total_bytes)} ({plan.total_bytes:,} B)")
    return "\n".join(lines)


def human_size(size: int) -> str:
    """Bytes as B, KiB, MiB, GiB or TiB with one decimal."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _check_verify(out: Path, force: bool) -> str | None:
    report = read_report(out)
    verdict = report.verdict if report else None
    if force or verdict in PUSHABLE_VERDICTS:
        return verdict
    if report is None:
        raise Fp8kvError(f"{out}: no {REPORT_FILE.as_posix()}; run `{verify_command(out)}` first, or pass --force")
    reasons = "; ".join(r.message for r in report.reasons)
    detail = f" ({reasons})" if reasons else ""
    raise Fp8kvError(
        f"{out / REPORT_FILE}: the last verify says {verdict or 'nothing'}{detail}; "
        "fix the checkpoint and verify again, or pass --force"
    )


def _upload(plan: PushPlan, api: Any) -> str:
    from huggingface_hub import CommitOperationAdd, HfApi, get_token

    if api is None and get_token() is None:
        raise Fp8kvError(f"{plan.repo_id}: no Hub token; log in with `hf auth login` or set HF_TOKEN, then push again")
    api = api if api is not None else HfApi()
    try:
        # private=None lets the Hub's default (or the organisation's setting) apply.
        api.create_repo(plan.repo_id, repo_type="model", private=True if plan.private else None, exist_ok=True)
        if plan.revision and plan.revision != "main":
            api.create_branch(plan.repo_id, repo_type="model", branch=plan.revision, exist_ok=True)
        # Links are read through: the Hub gets the bytes of the file each one points to.
        operations = [CommitOperationAdd(path_in_repo=f.path_in_repo,
                                         path_or_fileobj=f.content if f.content is not None else str(f.local_path))
                      for f in plan.files]
        info = api.create_commit(
            plan.repo_id, operations, commit_message=plan.commit_message, repo_type="model", revision=plan.revision
        )
    except Exception as exc:  # noqa: BLE001 - every Hub failure becomes one line without the token
        raise _push_error(plan.repo_id, exc) from exc
    return str(getattr(info, "commit_url", None) or info)


def _push_error(repo_id: str, exc: Exception) -> Fp8kvError:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status == 401:
        return Fp8kvError(f"{repo_id}: the Hub refused the credentials; log in with `hf auth login` or set HF_TOKEN")
    if status == 403:
        return Fp8kvError(f"{repo_id}: the token has no write access to this repository or namespace")
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return Fp8kvError(f"{repo_id}: upload failed ({type(exc).__name__}: {_without_token(text)})")


def _without_token(text: str) -> str:
    from huggingface_hub import get_token

    token = get_token()
    return text.replace(token, "hf_***") if token else text
