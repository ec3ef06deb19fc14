"""fp8kv installs as one `fp8kv` package with its console script, configs and bundled model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import fp8kv
from fp8kv.cli import app

REPO = Path(fp8kv.__file__).parent
# Repository folders that are not part of the package.
NOT_PACKAGED = {".venv", ".git", ".ci", "tests", "bench", "probes", "tools", "build", "dist", "out", "__pycache__"}


def _commands() -> list[str]:
    return sorted(typer.main.get_command(app).commands)


def test_console_script_lists_commands() -> None:
    script = Path(sys.executable).parent / "fp8kv"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Usage: fp8kv" in result.stdout
    assert _commands(), "the CLI has no commands"
    for command in _commands():
        assert command in result.stdout
    listed = [line.split()[0] for line in result.stdout.split("Commands:")[1].splitlines() if line.strip()]
    assert listed == ["calibrate", "verify", "eval", "inspect", "load-check", "convert", "card", "push", "conformance"]  # the workflow's order


def test_every_command_has_help() -> None:
    for command in _commands():
        result = CliRunner().invoke(app, [command, "--help"], prog_name="fp8kv")
        assert result.exit_code == 0, result.output
        assert f"Usage: fp8kv {command}" in " ".join(result.output.split())


def _source_copy(destination: Path) -> Path:
    """The repository's own files, what git tracks and the new ones it does not ignore, so building touches
    nothing shared: never a venv, build output or cache in the tree (bench/'s engine venvs are tens of GB)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in listed:
        if name and (REPO / name).is_file() and Path(name).parts[0] not in NOT_PACKAGED - {"tests", "bench", "tools"}:
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, destination / name)
    return destination


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install --target` (non-editable) of a copy of the repository; returns the target."""
    root = tmp_path_factory.mktemp("packaging")
    source = _source_copy(root / "src")
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True,
        timeout=300,
    )
    return target


def test_install_has_only_the_fp8kv_package_at_top_level(installed: Path) -> None:
    top = {p.name for p in installed.iterdir()}
    assert "fp8kv" in top
    generic = top - {"fp8kv", "bin"} - {name for name in top if name.startswith("fp8kv-")}
    assert not generic, f"generic top-level names installed: {sorted(generic)}"
    assert not (installed / "fp8kv" / "tests").exists()
    assert not (installed / "fp8kv" / "bench").exists()
    assert not (installed / "fp8kv" / "probes").exists()
    assert not (installed / "fp8kv" / "tools").exists()  # the model builders are development tools


def _package_files() -> list[Path]:
    """What the package must ship, relative to the repository: modules, configs, bundled model."""
    files = []
    for entry in sorted(REPO.iterdir()):
        if entry.name in NOT_PACKAGED or entry.name.startswith(".") or entry.suffix == ".egg-info":
            continue
        for path in [entry] if entry.is_file() else sorted(entry.rglob("*")):
            relative = path.relative_to(REPO)
            data = relative.match("configs/*.toml") or relative.parts[:2] == ("models", "bundled")
            if path.is_file() and (path.suffix == ".py" or data):
                files.append(relative)
    return files


def test_install_has_every_module_and_data_file(installed: Path) -> None:
    package = installed / "fp8kv"
    for name in ("cli.py", "calibrate", "runtime", "configs", "models/__init__.py"):
        assert (package / name).exists(), name
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (package / "models" / "bundled" / "model" / name).is_file(), name
    for name in ("calibration.jsonl", "heldout.jsonl"):
        assert (package / "models" / "bundled" / "data" / name).is_file(), name
    missing = sorted(str(p) for p in _package_files() if not (package / p).is_file())
    assert not missing, f"not installed: {missing}"


def test_installed_package_imports_from_target(installed: Path) -> None:
    code = (
        "import fp8kv, fp8kv.cli, fp8kv.models as m; "
        "print(fp8kv.__file__); print(m.BUNDLED_MODEL_DIR.joinpath('config.json').is_file())"
    )
    env = {**os.environ, "PYTHONPATH": str(installed)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
        check=True,
    )
    location, bundled = result.stdout.split()
    assert Path(location).is_relative_to(installed)
    assert bundled == "True"
