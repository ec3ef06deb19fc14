"""The catalogue of bad inputs: every case gets one clear error line and damages nothing.

Each case builds its inputs in a fresh folder, runs one fp8kv command through typer's runner and
asserts: a non-zero exit, exactly one `fp8kv: error:` line on stderr naming the file (or tensor,
layer, id) and the problem, no traceback, no output folder and no temp folder left behind, and the
whole case folder (sources, datasets, reports) byte-for-byte unchanged.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import fp8kv.checkpoint.writer as writer_module
from fp8kv.checkpoint.digest import checkpoint_digest
from fp8kv.checkpoint.source import MAX_HEADER_BYTES
from fp8kv.cli import app
from fp8kv.errors import ExitCode
from fp8kv.checks import FAIL, Finding
from fp8kv.tools.factory import make_checkpoint
from tests.reports import report_for, write_report

DATA_ARGS = ["--num-samples", "2", "--seq-len", "16", "--batch-size", "2"]


def tree_hash(root: Path) -> str:
    """sha256 over every entry under `root`: relative path, kind, link target or bytes."""
    digest = hashlib.sha256()
    if not root.exists():
        return "absent"
    for path in sorted(root.rglob("*")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        if path.is_symlink():
            digest.update(b"L" + os.readlink(path).encode())
        elif path.is_file():
            digest.update(b"F" + _read_raw(path))
        else:
            digest.update(b"D")
    return digest.hexdigest()


def _read_raw(path: Path) -> bytes:
    """File bytes through os.read, so a test that injects errors into open() can still hash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 2**20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One factory checkpoint, one dataset and one calibrated checkpoint for the whole module."""
    root = tmp_path_factory.mktemp("bad_inputs")
    src = make_checkpoint("llama", root / "src")
    data = write_jsonl(root / "data.jsonl", [{"text": f"calibration sample number {i} with a few words"}
                                             for i in range(6)])
    calibrated = root / "calibrated"
    result = CliRunner().invoke(app, ["calibrate", str(src), "--out", str(calibrated), "--dataset", str(data),
                                      *DATA_ARGS, "--mode", "copy"])
    assert result.exit_code == 0, result.output
    return {"src": src, "data": data, "calibrated": calibrated}


@dataclass
class Env:
    """A case's own folder with lazily made copies of the shared inputs."""

    root: Path
    shared: dict[str, Path]

    def copy(self, key: str, name: str | None = None) -> Path:
        target = self.root / (name or key)
        shutil.copytree(self.shared[key], target, symlinks=True)
        return target

    @property
    def data(self) -> Path:
        return self.shared["data"]

    @property
    def out(self) -> Path:
        return self.root / "out"


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def safetensors_file(folder: Path) -> Path:
    (weights,) = [p for p in folder.glob("*.safetensors") if p.name != "kv_scales.safetensors"]
    return weights


def set_header(path: Path, length: int, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(length.to_bytes(8, "little") + header + data)


def edit_scales(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = folder / "kv_scales.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != "kv_scales.safetensors"}
    index["weight_map"].update(dict.fromkeys(tensors, "kv_scales.safetensors"))
    index_path.write_text(json.dumps(index))


class _Evil:
    """A pickle that creates a marker file when loaded: proof that nothing unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@dataclass
class Case:
    """`build(env)` makes the inputs and returns (args, text the error must name, regex of the problem)."""

    id: str
    build: Callable[[Env], tuple[list[str], str, str]]


def calibrate_args(model: Path | str, env: Env, *extra: str, data: Path | None = None) -> list[str]:
    return ["calibrate", str(model), "--dataset", str(data or env.data), *DATA_ARGS, "--out", str(env.out), *extra]


# ---- source folders -------------------------------------------------------------------------

def missing_folder(env):
    return calibrate_args(env.root / "nope", env), str(env.root / "nope"), "no such checkpoint folder"


def empty_folder(env):
    (env.root / "empty").mkdir()
    return ["convert", str(env.root / "empty"), "--to", "modelopt", "--out", str(env.out)], "empty", "the folder is empty"


def source_is_a_file(env):
    (env.root / "model.txt").write_text("not a folder")
    return ["inspect", str(env.root / "model.txt")], "model.txt", "not a folder"


def unreadable_weights(env, monkeypatch):
    # Tests run as root, which ignores chmod 000; so the kernel's EACCES is injected at open().
    src = env.copy("src")
    weights = safetensors_file(src)
    real_open = io.open

    def denying_open(file, *args, **kwargs):
        if os.fspath(file) == str(weights):
            raise PermissionError(errno.EACCES, "Permission denied", str(weights))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", denying_open)
    monkeypatch.setattr(io, "open", denying_open)
    return ["inspect", str(src)], str(weights), "Permission denied"


def unreadable_config(env):
    src = env.copy("src")
    (src / "config.json").write_bytes(b"\xff\xfe\x00 not utf-8")
    return ["inspect", str(src)], str(src / "config.json"), "cannot be read as JSON"


# ---- config.json ------------------------------------------------------------------------------

def config_broken_json(env):
    src = env.copy("src")
    (src / "config.json").write_text('{"model_type": "llama", ')
    return calibrate_args(src, env), str(src / "config.json"), "cannot be read as JSON"


def config_missing(env):
    src = env.copy("src")
    (src / "config.json").unlink()
    return ["inspect", str(src)], str(src / "config.json"), "not found"


def config_no_head_counts(env):
    src = env.copy("src")
    edit_config(src, num_attention_heads=None)
    return calibrate_args(src, env), str(src / "config.json"), "'num_attention_heads' is missing"


def config_heads_not_divisible(env):
    src = env.copy("src")
    edit_config(src, num_key_value_heads=3)
    return ["inspect", str(src)], str(src / "config.json"), "not a multiple of num_key_value_heads=3"


def config_head_dim_inconsistent(env):
    src = env.copy("src")
    edit_config(src, head_dim=32)  # the k_proj weights hold 2 heads x 16
    return calibrate_args(src, env), "k_proj", "head_dim"


def config_hidden_not_divisible(env):
    src = env.copy("src")
    edit_config(src, hidden_size=66, head_dim=None)
    return ["inspect", str(src)], str(src / "config.json"), r"hidden size \(66\) is not a multiple of the number of attention heads"


# ---- safetensors ------------------------------------------------------------------------------

def st_corrupt_header(env):
    src = env.copy("src")
    weights = safetensors_file(src)
    set_header(weights, 12, b"{not json!!}", b"\0" * 64)
    return calibrate_args(src, env), str(weights), "header is not valid JSON"


def st_truncated(env):
    src = env.copy("src")
    weights = safetensors_file(src)
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) - 100])
    return calibrate_args(src, env), str(weights), "points outside the file's data"


def st_header_too_large(env):
    src = env.copy("src")
    weights = safetensors_file(src)
    # A sparse file holding as many bytes as the header claims: only the bound refuses it.
    claimed = MAX_HEADER_BYTES + 1
    with open(weights, "wb") as handle:
        handle.write(claimed.to_bytes(8, "little"))
        handle.truncate(claimed + 64)
    return ["inspect", str(src)], str(weights), f"over the {MAX_HEADER_BYTES} byte bound"


def st_too_short(env):
    src = env.copy("src")
    weights = safetensors_file(src)
    weights.write_bytes(b"abc")
    return ["inspect", str(src)], str(weights), "too short to be a safetensors file"


def st_non_finite_weights(env):
    src = env.copy("src")
    weights = safetensors_file(src)
    tensors = load_file(weights)
    for name in tensors:
        if name.endswith("k_proj.weight"):
            tensors[name][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    return calibrate_args(src, env), "layers [0, 1]", "NaN or infinite"


def st_missing_lm_head(env):
    src = env.copy("src")
    edit_config(src, tie_word_embeddings=False)
    weights = safetensors_file(src)
    tensors = load_file(weights)
    del tensors["lm_head.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    return calibrate_args(src, env), "lm_head.weight", "missing \\(randomly initialized\\)"


# ---- index ------------------------------------------------------------------------------------

def _sharded(env) -> Path:
    src = env.root / "sharded"
    make_checkpoint("llama", src, max_shard_bytes=40_000)
    return src


def _rewrite_index(src: Path, shard: str) -> None:
    path = src / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = shard
    path.write_text(json.dumps(index))


def index_missing_shard(env):
    src = _sharded(env)
    _rewrite_index(src, "model-00009-of-00009.safetensors")
    return ["inspect", str(src)], "model.safetensors.index.json", "'model-00009-of-00009.safetensors', which is missing"


def index_parent_path(env):
    src = _sharded(env)
    _rewrite_index(src, "../x.safetensors")
    return calibrate_args(src, env), "model.safetensors.index.json", "escapes the checkpoint folder"


def index_absolute_path(env):
    src = _sharded(env)
    _rewrite_index(src, "/etc/passwd")
    return ["convert", str(src), "--to", "modelopt", "--out", str(env.out)], "index.json", "escapes the checkpoint folder"


def symlink_escaping(env):
    src = env.copy("src")
    weights = safetensors_file(src)
    outside = env.root / "elsewhere.safetensors"
    weights.rename(outside)
    weights.symlink_to(outside)
    return calibrate_args(src, env), str(weights), "symlink points outside the checkpoint folder"


def index_not_an_object(env):
    src = _sharded(env)
    (src / "model.safetensors.index.json").write_text('{"weight_map": []}')
    return ["inspect", str(src)], "model.safetensors.index.json", "needs a non-empty 'weight_map' object"


# ---- pickle -----------------------------------------------------------------------------------

def _pickle_only(env, name: str):
    src = env.copy("src")
    safetensors_file(src).unlink()
    marker = env.root / "UNPICKLED"
    (src / name).write_bytes(pickle.dumps(_Evil(marker)))
    return src


def pickle_bin(env):
    src = _pickle_only(env, "pytorch_model.bin")
    return calibrate_args(src, env), "pytorch_model.bin", "never loads pickle files"


def pickle_pt(env):
    src = _pickle_only(env, "model.pt")
    return ["inspect", str(src)], "model.pt", "never loads pickle files"


# ---- datasets ---------------------------------------------------------------------------------

def data_empty(env):
    path = env.root / "empty.jsonl"
    path.write_text("")
    return calibrate_args(env.shared["src"], env, data=path), str(path), "empty"


def data_missing_path(env):
    path = env.root / "data" / "calib.jsonl"
    return calibrate_args(env.shared["src"], env, data=path), str(path), "no such file or folder"


def data_too_short(env):
    path = write_jsonl(env.root / "short.jsonl", [{"text": "just one record"}])
    return calibrate_args(env.shared["src"], env, data=path), str(path), "found 1 non-empty records"


def data_binary(env):
    path = env.root / "noise.jsonl"
    path.write_bytes(bytes(range(256)) * 8)
    return calibrate_args(env.shared["src"], env, data=path), str(path), "cannot be read as json"


def data_wrong_column(env):
    return (calibrate_args(env.shared["src"], env, "--text-column", "body"), str(env.data),
            "no column 'body'; columns are \\['text'\\]")


def data_no_text_column(env):
    path = write_jsonl(env.root / "other.jsonl", [{"body": f"text {i}"} for i in range(4)])
    return calibrate_args(env.shared["src"], env, data=path), str(path), "no 'text' or 'messages' column"


def data_unsupported_type(env):
    path = env.root / "corpus.xml"
    path.write_text("<text>hello</text>")
    return calibrate_args(env.shared["src"], env, data=path), str(path), "unsupported file type"


def data_chat_without_template(env):
    src = env.copy("src")
    (src / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    path = write_jsonl(env.root / "chat.jsonl", [{"messages": [{"role": "user", "content": f"hi {i}"}]}
                                                 for i in range(4)])
    return calibrate_args(src, env, data=path), "messages", "no chat template"


def tokenizer_missing(env):
    src = env.copy("src")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (src / name).unlink(missing_ok=True)
    return calibrate_args(src, env), str(src), "no usable tokenizer"


# ---- output folder ----------------------------------------------------------------------------

def out_exists(env):
    out = shutil.copytree(env.shared["calibrated"], env.out)
    return calibrate_args(env.shared["src"], env), str(out), "already exists; pass --overwrite to replace it$"


def overwrite_user_folder(env):
    env.out.mkdir()
    (env.out / "notes.txt").write_text("the user's own file")
    return [*calibrate_args(env.shared["src"], env), "--overwrite"], str(env.out), \
        r"holds files fp8kv did not write \(notes.txt\); --overwrite replaces only what fp8kv wrote there"


def overwrite_user_notes_in_output(env):
    out = shutil.copytree(env.shared["calibrated"], env.out)
    (out / "MY_NOTES.txt").write_text("the user's notes")
    (out / "generation_config.json").write_text("{}")
    return [*calibrate_args(env.shared["src"], env), "--overwrite"], str(out), \
        r"holds files fp8kv did not write \(MY_NOTES.txt\)"


def out_inside_source(env):
    src = env.copy("src")
    args = ["calibrate", str(src), "--dataset", str(env.data), *DATA_ARGS, "--out", str(src / "scaled")]
    return args, str(src / "scaled"), "must not be inside the source checkpoint"


def out_is_a_file(env):
    (env.root / "out").write_text("a file")
    return ["convert", str(env.copy("calibrated")), "--to", "modelopt", "--out", str(env.out), "--overwrite"], \
        str(env.out), "exists and is not a folder"


def out_unwritable(env):
    # Root ignores chmod, so "cannot write here" is made with a parent that is a regular file.
    (env.root / "blocker").write_text("a file, not a folder")
    out = env.root / "blocker" / "out"
    return ["convert", str(env.copy("calibrated")), "--to", "quark", "--out", str(out)], str(out), "cannot create"


def calibrate_out_unwritable(env):
    (env.root / "blocker").write_text("a file, not a folder")
    out = env.root / "blocker" / "out"
    args = ["calibrate", str(env.shared["src"]), "--dataset", str(env.data), *DATA_ARGS, "--out", str(out)]
    return args, str(out), "cannot create the output folder"


def e5m2_in_compressed_tensors(env):
    return calibrate_args(env.shared["src"], env, "--kv-dtype", "fp8_e5m2"), "compressed-tensors", \
        "stores fp8_e4m3 KV caches only; fp8_e5m2 needs --format quark or vllm-json"


def per_head_in_modelopt(env):
    return calibrate_args(env.shared["src"], env, "--per-head", "--format", "modelopt"), "modelopt", \
        "per-head \\(attn_head\\) scales can only be written as compressed-tensors"


def disk_full(env, monkeypatch):
    def no_space(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(writer_module, "_write_bytes", no_space)
    return ["calibrate", str(env.shared["src"]), "--dataset", str(env.data), *DATA_ARGS, "--out", str(env.out)], \
        "kv_scales.safetensors", "No space left on device"


def disk_full_on_copy(env, monkeypatch):
    def no_space(src, dst, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    ckpt = env.copy("calibrated")
    monkeypatch.setattr(writer_module.shutil, "copyfile", no_space)
    return ["convert", str(ckpt), "--to", "modelopt", "--out", str(env.out), "--mode", "copy"], \
        str(env.root), "No space left on device"


# ---- unsupported models -----------------------------------------------------------------------

def unsupported_architecture(env):
    src = env.copy("src")
    edit_config(src, model_type="nosuchmodel", architectures=["NoSuchForCausalLM"])
    return calibrate_args(src, env), "nosuchmodel", "not an architecture"


def mla_model(env):
    src = env.copy("src")
    edit_config(src, kv_lora_rank=16)
    return calibrate_args(src, env), str(src / "config.json"), "MLA"


# ---- scales -----------------------------------------------------------------------------------

def scales_conflicting(env):
    ckpt = env.copy("calibrated")

    def add_modelopt(tensors):
        tensors["model.layers.0.self_attn.k_proj.k_scale"] = tensors["model.layers.0.self_attn.k_scale"] * 2

    edit_scales(ckpt, add_modelopt)
    return ["convert", str(ckpt), "--to", "quark", "--out", str(env.out)], "layer 0", "disagrees with modelopt"


def scales_wrong_shape(env):
    ckpt = env.copy("calibrated")

    def reshape(tensors):
        tensors["model.layers.1.self_attn.v_scale"] = torch.ones(2, 2)

    edit_scales(ckpt, reshape)
    return ["verify", str(ckpt), "--report", str(env.out)], "model.layers.1.self_attn.v_scale", "has shape \\[2, 2\\]"


def scales_wrong_dtype(env):
    ckpt = env.copy("calibrated")

    def to_int(tensors):
        tensors["model.layers.0.self_attn.k_scale"] = torch.ones(1, dtype=torch.int32)

    edit_scales(ckpt, to_int)
    return ["inspect", str(ckpt)], "model.layers.0.self_attn.k_scale", "dtype torch.int32"


def scales_vllm_json_not_a_number(env):
    ckpt = env.copy("calibrated")
    bad = {"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": "big"}}}}
    (ckpt / "kv_cache_scales.json").write_text(json.dumps(bad))
    return ["inspect", str(ckpt)], "kv_cache_scales.json", "layer 0 scale 'big' is not a number"


# ---- verify -----------------------------------------------------------------------------------

def verify_missing_dir(env):
    return ["verify", str(env.root / "gone")], str(env.root / "gone"), "no such checkpoint folder"


def verify_bad_thresholds_toml(env):
    path = env.root / "t.toml"
    path.write_text("[fail\nkl_mean = ")
    return ["verify", str(env.copy("calibrated")), "--thresholds", str(path)], str(path), "not valid TOML"


def verify_unknown_threshold(env):
    path = env.root / "t.toml"
    path.write_text("[fail]\nkl_maen = 0.1\n")
    return ["verify", str(env.copy("calibrated")), "--thresholds", str(path)], str(path), "unknown threshold"


def verify_missing_thresholds(env):
    path = env.root / "none.toml"
    return ["verify", str(env.copy("calibrated")), "--thresholds", str(path)], str(path), "No such file"


def verify_missing_prompts(env):
    path = env.root / "prompts.txt"
    return ["verify", str(env.copy("calibrated")), "--prompts", str(path)], str(path), "no such prompts file"


def verify_report_unwritable(env):
    (env.root / "blocker").write_text("a file, not a folder")
    report = env.root / "blocker" / "report"
    return ["verify", str(env.copy("calibrated")), "--report", str(report)], str(report), \
        "cannot create the output folder \\(.*blocker is not a folder\\)"


def conformance_pack_unwritable(env, monkeypatch):
    # refused before minutes of work: the model is never loaded
    monkeypatch.setattr("fp8kv.conformance.run.load_model", lambda *a, **k: pytest.fail("loaded before --out"))
    (env.root / "blocker").write_text("a file, not a folder")
    pack = env.root / "blocker" / "pack"
    return ["conformance", "reference", str(env.copy("calibrated")), "--out", str(pack)], str(pack), \
        "cannot create the output folder \\(.*blocker is not a folder\\)"


def verify_model_is_a_file(env):
    (env.root / "model.safetensors").write_text("not a folder")
    return ["verify", str(env.root / "model.safetensors")], "model.safetensors", "is a file, not a folder"


# ---- push and card ----------------------------------------------------------------------------

def push_missing_dir(env):
    return ["push", str(env.root / "gone"), "--repo-id", "org/name", "--dry-run"], str(env.root / "gone"), \
        "no fp8kv.json"


def push_not_verified(env):
    ckpt = env.copy("calibrated")
    return ["push", str(ckpt), "--repo-id", "org/name", "--dry-run"], str(ckpt), "run `fp8kv verify"


def push_corrupt_report(env):
    ckpt = env.copy("calibrated")
    (ckpt / "verify").mkdir()
    (ckpt / "verify" / "report.json").write_text('{"verdict": "PA')
    return ["push", str(ckpt), "--repo-id", "org/name", "--dry-run"], "report.json", "cannot be read as JSON"


def push_failed_verdict(env):
    ckpt = env.copy("calibrated")
    write_report(ckpt, report_for(ckpt, (Finding(FAIL, "mean KL too high"),)))
    return ["push", str(ckpt), "--repo-id", "org/name", "--dry-run"], "report.json", "says FAIL \\(mean KL too high\\)"


def push_stale_report(env):
    ckpt = env.copy("calibrated")
    digest = checkpoint_digest(ckpt)
    stale = replace(digest, scales={**digest.scales, "model.layers.1.self_attn.v_scale": "sha256:" + "0" * 64})
    write_report(ckpt, replace(report_for(ckpt), digest=stale))  # judged other scales
    return ["push", str(ckpt), "--repo-id", "org/name", "--dry-run"], "report.json", \
        "judged other files than .* \\(scale model.layers.1.self_attn.v_scale changed\\)"


def card_report_without_digest(env):
    ckpt = env.copy("calibrated")
    path = write_report(ckpt, report_for(ckpt))
    written = json.loads(path.read_text())
    del written["digest"]
    path.write_text(json.dumps(written))
    return ["card", str(ckpt)], "report.json", "has no valid checkpoint digest"


def card_given_a_file(env):
    path = env.root / "README.md"
    path.write_text("# not a folder")
    return ["card", str(path)], str(path), "is a file, not a folder"


def verify_prompts_is_a_folder(env):
    (env.root / "prompts").mkdir()
    return ["verify", str(env.copy("calibrated")), "--prompts", str(env.root / "prompts")], \
        str(env.root / "prompts"), "is a folder; --prompts takes a text file"


def card_not_calibrated(env):
    src = env.copy("src")
    return ["card", str(src)], str(src), "no fp8kv.json"


CASES = [Case(f.__name__, f) for f in (
    missing_folder, empty_folder, source_is_a_file, unreadable_weights, unreadable_config,
    config_broken_json, config_missing, config_no_head_counts, config_heads_not_divisible,
    config_head_dim_inconsistent, config_hidden_not_divisible,
    st_corrupt_header, st_truncated, st_header_too_large, st_too_short, st_non_finite_weights, st_missing_lm_head,
    index_missing_shard, index_parent_path, index_absolute_path, symlink_escaping, index_not_an_object,
    pickle_bin, pickle_pt,
    data_empty, data_missing_path, data_too_short, data_binary, data_wrong_column, data_no_text_column, data_unsupported_type,
    data_chat_without_template, tokenizer_missing,
    out_exists, overwrite_user_folder, overwrite_user_notes_in_output, out_inside_source, out_is_a_file, out_unwritable, calibrate_out_unwritable,
    e5m2_in_compressed_tensors, per_head_in_modelopt, disk_full, disk_full_on_copy,
    unsupported_architecture, mla_model,
    scales_conflicting, scales_wrong_shape, scales_wrong_dtype, scales_vllm_json_not_a_number,
    verify_missing_dir, verify_bad_thresholds_toml, verify_unknown_threshold, verify_missing_thresholds,
    verify_missing_prompts, verify_report_unwritable, verify_model_is_a_file, conformance_pack_unwritable,
    push_missing_dir, push_not_verified, push_corrupt_report, push_failed_verdict, push_stale_report,
    card_report_without_digest,
    card_not_calibrated, card_given_a_file, verify_prompts_is_a_folder,
)]


def _build(case: Case, env: Env, monkeypatch) -> tuple[list[str], str, str]:
    if "monkeypatch" in case.build.__code__.co_varnames[: case.build.__code__.co_argcount]:
        return case.build(env, monkeypatch)
    return case.build(env)


def assert_one_error_line(stderr: str, named: str, problem: str) -> None:
    lines = [line for line in stderr.splitlines() if line.startswith("fp8kv: error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr, stderr
    assert named in lines[0], f"error line does not name {named!r}: {lines[0]}"
    assert re.search(problem, lines[0]), f"error line does not say {problem!r}: {lines[0]}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_clear_error_and_damages_nothing(case, shared, tmp_path, monkeypatch):
    env = Env(tmp_path, shared)
    shared_before = {key: tree_hash(path) for key, path in shared.items() if path.is_dir()}
    args, named, problem = _build(case, env, monkeypatch)
    before = tree_hash(tmp_path)
    out_existed = env.out.exists()

    result = CliRunner().invoke(app, args)
    monkeypatch.undo()  # restore open()/the writer before hashing

    assert result.exit_code == ExitCode.ERROR, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    assert_one_error_line(result.stderr, named, problem)
    assert tree_hash(tmp_path) == before, "the case folder changed: partial output or a modified source"
    assert out_existed or not env.out.exists()
    assert not list(tmp_path.rglob("*fp8kv-tmp*")) and not list(tmp_path.rglob("*fp8kv-old*"))
    assert not (tmp_path / "UNPICKLED").exists(), "a pickle file was loaded"
    assert {key: tree_hash(path) for key, path in shared.items() if path.is_dir()} == shared_before


def test_catalogue_covers_every_command_that_reads_a_folder_once_per_problem(shared, tmp_path, monkeypatch):
    """No two cases test the same problem of the same command, and each command that reads a user's folder
    or file has cases."""
    problems = []
    for case in CASES:
        (tmp_path / case.id).mkdir()
        args, _, problem = _build(case, Env(tmp_path / case.id, shared), monkeypatch)
        monkeypatch.undo()
        problems.append((args[0], problem))
    duplicates = sorted({p for p in problems if problems.count(p) > 1})
    assert not duplicates, duplicates
    assert {command for command, _ in problems} == {"calibrate", "verify", "inspect", "convert", "card", "push",
                                                    "conformance"}


@pytest.mark.parametrize("case", [c for c in CASES if c.id in ("config_broken_json", "pickle_bin", "out_exists")],
                         ids=lambda c: c.id)
def test_real_console_script_gives_the_same_one_line(case, shared, tmp_path):
    """A few cases through `python -m fp8kv` in a subprocess: the error exit code, one line, nothing changed."""
    env = Env(tmp_path, shared)
    args, named, problem = case.build(env)
    before = tree_hash(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "fp8kv", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert proc.returncode == ExitCode.ERROR, proc.stderr
    assert_one_error_line(proc.stderr, named, problem)
    assert tree_hash(tmp_path) == before


# The fixes error lines suggest, in the forms the catalogue's messages use.
_PASS = re.compile(r"pass (--[\w-]+)(?: (?!to\b|or\b|it\b|with\b)([^\s;,)]+))?")
_LOWER = re.compile(r"lower (--[\w-]+) to (\d+)")
_RUN = re.compile(r"run `(fp8kv [^`]+)`")


def _follow(args: list[str], line: str) -> list[list[str]] | None:
    """The commands that carry out what `line` suggests for `args`: options to pass or lower, or an fp8kv
    command to run first (a bare `fp8kv verify` means this folder); None when it suggests none of these."""
    if (match := _LOWER.search(line)) is not None:
        at = args.index(match[1])
        return [[*args[:at + 1], match[2], *args[at + 2:]]]
    if (match := _RUN.search(line)) is not None:
        first = match[1].split()[1:]
        if len(first) == 1:
            first.append(args[1])
        return [first, args]
    if (match := _PASS.search(line)) is not None and match[1] != "--dataset":
        return [[*args, match[1], *([match[2]] if match[2] and not match[2].startswith("--") else [])]]
    return None


def test_every_suggested_fix_works(shared, tmp_path, monkeypatch):
    """Each catalogue error that suggests an option or a command is followed to the letter: the same
    error line must not come back (the suggestion is one the CLI accepts and that helps)."""
    followed = []
    for case in CASES:
        env = Env(tmp_path / case.id, shared)
        env.root.mkdir()
        with monkeypatch.context() as patch:
            args, _, _ = _build(case, env, patch)
            stderr = CliRunner().invoke(app, args).stderr
            line = next(line for line in stderr.splitlines() if line.startswith("fp8kv: error:"))
        steps = _follow(args, line)
        if steps is None:
            continue
        for step in steps:
            result = CliRunner().invoke(app, step)
        assert result.exit_code != ExitCode.USAGE, (case.id, line, steps, result.output)
        assert line not in result.stderr, (case.id, line, steps, result.stderr)
        followed.append(case.id)
    assert {"out_exists", "data_too_short", "push_not_verified", "push_failed_verdict"} <= set(followed), followed
