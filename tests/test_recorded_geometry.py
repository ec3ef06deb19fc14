"""fp8kv.json records the attention geometry fp8kv wrote a folder with; readers use it while config.json is
the file fp8kv wrote, and read the config through transformers otherwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fp8kv.checkpoint.kvscales import KVScales
from fp8kv.checkpoint.provenance import Provenance, read_provenance
from fp8kv.checkpoint.source import SourceCheckpoint
from fp8kv.checkpoint.writer import write_checkpoint
from fp8kv.errors import Fp8kvError
from fp8kv.geometry import AttentionGeometry
from fp8kv.tools.factory import make_checkpoint
from fp8kv.tools.zoo import make_zoo_checkpoint

RECORD = Provenance(version="0.1.0", command=None, format="compressed-tensors")


def _written(source: Path, out: Path) -> Path:
    layers = AttentionGeometry.from_dir(source).kv_layers
    scales = KVScales.from_floats(dict.fromkeys(layers, 0.01), dict.fromkeys(layers, 0.02))
    return write_checkpoint(source, out, scales, record=RECORD)


@pytest.fixture(scope="module")
def llama_out(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("geometry")
    return _written(make_checkpoint("llama", root / "src"), root / "out")


@pytest.fixture
def transformers_reads(monkeypatch) -> list[str]:
    """The configs read through transformers' config classes during a test."""
    calls: list[str] = []
    real = AttentionGeometry.from_config.__func__

    def counted(cls, config, source="config.json"):
        calls.append(source)
        return real(cls, config, source)

    monkeypatch.setattr(AttentionGeometry, "from_config", classmethod(counted))
    return calls


@pytest.mark.parametrize("build", [lambda root: make_checkpoint("gemma3", root / "src"),
                                   lambda root: make_zoo_checkpoint("deepseek_v3", root / "src")],
                         ids=["gemma3-sliding", "deepseek_v3-mla"])
def test_the_record_holds_what_transformers_reads(tmp_path, build):
    out = _written(build(tmp_path), tmp_path / "out")
    recorded = read_provenance(out).geometry
    assert recorded == AttentionGeometry.from_dir(out)
    assert Provenance.from_json(read_provenance(out).to_json()).geometry == recorded


def test_an_unchanged_config_is_not_read_through_transformers(llama_out, transformers_reads):
    source = SourceCheckpoint.open(llama_out)
    assert transformers_reads == [] and source.geometry == read_provenance(llama_out).geometry


def test_an_edited_config_is_read_through_transformers(llama_out, tmp_path, transformers_reads):
    edited = tmp_path / "edited"
    shutil.copytree(llama_out, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    SourceCheckpoint.open(edited)
    assert transformers_reads == [str(edited / "config.json")]


def test_an_older_record_without_geometry_still_reads(llama_out, tmp_path, transformers_reads):
    older = tmp_path / "older"
    shutil.copytree(llama_out, older)
    data = json.loads((older / "fp8kv.json").read_text())
    del data["geometry"]
    (older / "fp8kv.json").write_text(json.dumps(data))
    assert read_provenance(older).geometry is None
    assert SourceCheckpoint.open(older).geometry == read_provenance(llama_out).geometry
    assert transformers_reads == [str(older / "config.json")]


def test_a_geometry_that_contradicts_itself_is_not_a_record(llama_out):
    data = json.loads((llama_out / "fp8kv.json").read_text())
    data["geometry"]["kv_layers"] = [0, 7]
    with pytest.raises(Fp8kvError, match="not an fp8kv provenance record .*contradicts its layer count"):
        Provenance.from_json(json.dumps(data))
