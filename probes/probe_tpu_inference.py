"""Runs tpu-inference's own fp8 KV-cache write and records what it does, for fp8kv's tests to check against.

Runs in the venv probes/tpu_inference_venv.sh builds (tpu-inference without vLLM, JAX, libtpu); no TPU needed:

    bash probes/tpu_inference_venv.sh
    bench/.tpu-inference-venv/bin/python probes/probe_tpu_inference.py [--out-dir tests/golden]

Writes tpu-inference-<version>.json and .safetensors into --out-dir:
  - `cpu/scale=S`: the bytes tpu-inference's `quantize_kv` stores on JAX's CPU backend for every bf16 bit pattern;
  - `tpu-compiled/scale=S`: the same function compiled ahead of time for TPU topologies (libtpu compiles with no
    TPU attached), its optimized program read back from the HLO text and evaluated here in numpy. A compiled
    program is not a TPU run: the TPU's f32 to e4m3 conversion is taken to round to nearest even;
  - the JSON: the programs' operations and constants per scale, which model path holds which scale (read from the
    package's source with `ast`: vLLM is not installed), and provenance.
"""

from __future__ import annotations

import argparse
import ast
import base64
import datetime
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np

REPO = Path(__file__).resolve().parents[1]
DIST = "tpu-inference"
# Scales whose bytes are stored (3 x 2 x 64 KiB keeps the golden file small), then scales recorded in the JSON only
# (programs, constants, byte counts and hashes) to show the reciprocal's rule holds beyond three values.
STORED_SCALES = (0.02, 0.0173, 0.1)
SWEEP_SCALES = (1.0, 0.5, 3.7, 0.0427, 0.003, 1e-4)
# (topology name, TPU_ACCELERATOR_TYPE): libtpu's host init wants an accelerator type even when it only compiles.
TOPOLOGIES = (("v6e:2x2", "v6e-4"), ("v5e:2x2", "v5litepod-4"))
TPU_COMPILE_ENV = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_SKIP_MDS_QUERY": "1"}
FP8_MAX = 448.0
BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
HLO_DTYPES = {"bf16": BF16, "f32": np.float32, "f16": np.float16, "f64": np.float64, "f8e4m3fn": E4M3,
              "f8e5m2": ml_dtypes.float8_e5m2, "u8": np.uint8, "s32": np.int32}
SCALE_ATTRS = {"_k_scale", "_v_scale", "_k_scale_float", "_v_scale_float", "k_scale", "v_scale"}
WRITE_FUNCTIONS = {"quantize_kv", "static_per_tensor_quantize_tensor"}
# The JAX model modules fp8kv's architectures map to (gemma4_mm wraps gemma4 for the multimodal Gemma 4).
JAX_MODELS = ("llama3", "qwen3", "qwen2", "gemma4", "gemma4_mm")


def scale_key(scale: float) -> str:
    return repr(float(scale))


def bf16_patterns() -> np.ndarray:
    """The input set: every bf16 bit pattern, 0 to 65535 in order."""
    return np.arange(65536, dtype=np.uint16).view(BF16)


def package_dir() -> Path:
    """tpu_inference's installed folder, found without importing it (its __init__ imports vLLM)."""
    return Path(str(importlib.metadata.distribution(DIST).locate_file("tpu_inference")))


def load_quantization():
    """tpu_inference.layers.common.quantization as a module of its own: it imports only jax, so it loads without
    the package top."""
    path = package_dir() / "layers" / "common" / "quantization" / "__init__.py"
    spec = importlib.util.spec_from_file_location("tpu_inference_common_quantization", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kv_write(quantization, scale: float):
    """The key path of tpu-inference's KV write, with a Python-float scale as `layer._k_scale_float` is."""
    import jax.numpy as jnp

    def write(key):
        stored, _ = quantization.quantize_kv(jnp.float8_e4m3fn, key, None, scale, 1.0)
        return stored

    return write


# --- compiling for TPU (run in a child process: libtpu reads its environment once, when it loads) ---


def compile_for_tpu(topology: str, out: Path) -> None:
    """Compiles the write for `topology` with no TPU and writes the programs' texts as JSON to `out`."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    quantization = load_quantization()
    # get_topology_desc's first parameter is the topology name, the second the platform
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    sharding = jax.sharding.SingleDeviceSharding(devices[0])

    def compiled(fn, shape, dtype):
        arg = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        lowered = jax.jit(fn, in_shardings=sharding, out_shardings=sharding).lower(arg)
        return lowered.as_text(), lowered.compile().as_text()

    programs = {}
    for scale in STORED_SCALES + SWEEP_SCALES:
        stablehlo, optimized = compiled(kv_write(quantization, scale), (65536,), jnp.bfloat16)
        programs[scale_key(scale)] = {"stablehlo": stablehlo, "optimized": optimized}
    scale = STORED_SCALES[0]
    write = kv_write(quantization, scale)
    # a cache-shaped K ([tokens, kv heads, head dim]) and a K computed in float32 then rounded to bf16 (the write
    # fused with its producer, as in a model): does either change the write's arithmetic?
    _, shaped = compiled(write, (64, 8, 128), jnp.bfloat16)
    _, producer = compiled(lambda k: write((k * 1.5).astype(jnp.bfloat16)), (64, 8, 128), jnp.float32)
    result = {"device_kind": devices[0].device_kind, "devices": len(devices), "programs": programs,
              "shaped": {"scale": scale_key(scale), "optimized": shaped},
              "producer": {"scale": scale_key(scale), "optimized": producer}}
    out.write_text(json.dumps(result))


def tpu_programs(topology: str, accelerator_type: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "programs.json"
        env = {**os.environ, **TPU_COMPILE_ENV, "TPU_ACCELERATOR_TYPE": accelerator_type}
        done = subprocess.run([sys.executable, __file__, "--compile-for", topology, "--compile-out", str(out)],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"compiling for {topology} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


# --- reading and evaluating an optimized HLO program ---

_HEADER = re.compile(r"^(ENTRY )?%(?P<name>[\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?P<root>ROOT )?%(?P<name>[\w.\-]+) = (?P<dtype>\w+)\[(?P<shape>[\d,]*)\]\S* "
                          r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<attrs>.*)$")


def parse_hlo(text: str) -> tuple[dict[str, list[dict]], str]:
    """{computation: [instruction, ...]} and the entry computation's name, from `compiled.as_text()`."""
    computations: dict[str, list[dict]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = computations.setdefault(header["name"], [])
                entry = header["name"] if header.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            raise ValueError(f"unparsed HLO instruction: {line.strip()[:200]}")
        calls = re.search(r"calls=%([\w.\-]+)", match["attrs"])
        shape = tuple(int(d) for d in match["shape"].split(",") if d)
        args = [a.strip() for a in match["args"].split(",") if a.strip()]
        current.append({"name": match["name"], "dtype": match["dtype"], "shape": shape, "op": match["op"],
                        "args": args, "root": bool(match["root"]), "calls": calls[1] if calls else None})
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def write_computation(computations: dict[str, list[dict]], entry: str) -> str:
    """The computation doing the arithmetic: the fusion the entry's root calls, else the entry itself."""
    root = next(i for i in computations[entry] if i["root"])
    return root["calls"] if root["op"] == "fusion" else entry


def op_lines(instructions: list[dict]) -> list[str]:
    """The computation's instructions without layouts and metadata, e.g. `%multiply.1 = f32 multiply(%a, %b)`."""
    return [f"{'ROOT ' if i['root'] else ''}%{i['name']} = {i['dtype']} {i['op']}({', '.join(i['args'])})"
            for i in instructions]


def formula(instructions: list[dict]) -> str:
    """The computation as one expression: x is the parameter; dtype(...) a conversion; bf16(50) a constant."""
    by_name = {i["name"]: i for i in instructions}

    def expr(name: str) -> str:
        i = by_name[name.lstrip("%")]
        args = [expr(a) for a in i["args"]] if i["op"] not in ("constant", "parameter") else []
        symbols = {"multiply": "*", "divide": "/", "add": "+", "subtract": "-"}
        if i["op"] == "parameter":
            return f"x:{i['dtype']}"
        if i["op"] == "constant":
            return f"{i['dtype']}({i['args'][0]})"
        if i["op"] in ("broadcast", "copy", "bitcast", "reshape"):
            return args[0]
        if i["op"] == "convert":
            return f"{i['dtype']}({args[0]})"
        if i["op"] in symbols:
            return f"({args[0]} {symbols[i['op']]} {args[1]}):{i['dtype']}"
        return f"{i['op']}:{i['dtype']}({', '.join(args)})"

    return expr(next(i for i in instructions if i["root"])["name"])


def evaluate(computations: dict[str, list[dict]], name: str, params: list[np.ndarray]) -> np.ndarray:
    """Runs an HLO computation in numpy/ml_dtypes: f32 arithmetic is IEEE round to nearest even, conversions round
    to nearest even (ml_dtypes), and arithmetic on a narrower float type is done in float32 and rounded back, as
    XLA does. Only the operations a quantization program uses are known; any other one is an error."""
    with np.errstate(all="ignore"):  # overflow to inf and NaN inputs are part of the input set
        return _evaluate(computations, name, params)


def _evaluate(computations: dict[str, list[dict]], name: str, params: list[np.ndarray]) -> np.ndarray:
    values: dict[str, np.ndarray] = {}
    for i in computations[name]:
        dtype = HLO_DTYPES[i["dtype"]]
        args = [values[a.lstrip("%")] for a in i["args"]] if i["op"] not in ("constant", "parameter") else []
        op = i["op"]
        if op == "parameter":
            value = params[int(i["args"][0])]
        elif op == "constant":
            value = np.asarray(float(i["args"][0]), dtype=np.float64).astype(np.float32).astype(dtype)
        elif op == "broadcast":
            if args[0].ndim:
                raise ValueError("only scalar broadcasts are evaluated")
            value = np.full(i["shape"], args[0], dtype=dtype)
        elif op in ("copy", "bitcast", "reshape"):
            value = args[0].reshape(i["shape"])
        elif op == "convert":
            value = args[0].astype(dtype)
        elif op in ("multiply", "divide", "add", "subtract", "maximum", "minimum"):
            a, b = (arg.astype(np.float32) for arg in args)
            value = getattr(np, op)(a, b).astype(dtype)
        elif op == "clamp":
            low, x, high = (arg.astype(np.float32) for arg in args)
            value = np.minimum(np.maximum(x, low), high).astype(dtype)  # NaN propagates, as XLA's clamp does
        elif op == "fusion":
            value = evaluate(computations, i["calls"], args)
        else:
            raise ValueError(f"HLO operation {op!r} is not evaluated here")
        values[i["name"]] = value
        if i["root"]:
            return value
    raise ValueError(f"computation {name} has no ROOT")


def program(text: str) -> dict:
    computations, entry = parse_hlo(text)
    name = write_computation(computations, entry)
    return {"computations": computations, "entry": entry, "write": name,
            "instructions": computations[name]}


def constants(instructions: list[dict]) -> list[dict]:
    """The program's constants other than the clamp bounds, with their bits."""
    found = []
    for i in instructions:
        if i["op"] != "constant" or abs(float(i["args"][0])) == FP8_MAX:
            continue
        value = np.asarray(float(i["args"][0])).astype(np.float32).astype(HLO_DTYPES[i["dtype"]])
        bits = value.view(np.uint16 if value.itemsize == 2 else np.uint32)
        found.append({"dtype": i["dtype"], "text": i["args"][0], "value": float(value),
                      "bits": f"0x{int(bits):0{2 * value.itemsize}x}"})
    return found


def stablehlo_lines(text: str) -> list[str]:
    """The lowered program's body lines (what JAX hands the compiler, before any optimization)."""
    return [line.strip() for line in text.splitlines() if "stablehlo." in line or "call @" in line]


# --- the reciprocal constant ---


def bf16_round(value: Fraction) -> float:
    """`value` (> 0, in bf16's normal range) rounded once to bf16, to nearest even."""
    exponent = value.numerator.bit_length() - value.denominator.bit_length()
    if Fraction(2) ** exponent > value:
        exponent -= 1
    scaled = value / Fraction(2) ** (exponent - 7)  # in [128, 256)
    whole = scaled.numerator // scaled.denominator
    rest = scaled - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2):
        whole += 1
    return float(Fraction(whole) * Fraction(2) ** (exponent - 7))


def reciprocal_candidates(scale: float) -> dict:
    """What the reciprocal constant could be, each rounded differently."""
    scale_bf16 = np.float64(scale).astype(BF16)
    exact = Fraction(1) / Fraction(float(scale_bf16))
    return {
        "bf16(1 / bf16(scale)), the quotient in f32": float(
            (np.float32(1) / scale_bf16.astype(np.float32)).astype(BF16)),
        "bf16(1 / bf16(scale)), rounded once from the exact quotient": bf16_round(exact),
        "bf16(1 / scale), the Python float's reciprocal": float(np.float64(1 / scale).astype(BF16)),
        "f32(1 / bf16(scale))": float(np.float32(1) / scale_bf16.astype(np.float32)),
    }


def double_rounding_check() -> dict:
    """Whether computing 1/s in f32 and rounding to bf16 ever differs from rounding the exact 1/s once, over every
    normal positive bf16 s whose reciprocal is a normal bf16."""
    bits = np.arange(0x0080, 0x7F80, dtype=np.uint16)
    scales = bits.view(BF16)
    via_f32 = (np.float32(1) / scales.astype(np.float32)).astype(BF16).astype(np.float64)
    checked = differ = 0
    for s, r in zip(scales.astype(np.float64), via_f32):
        exact = Fraction(1) / Fraction(float(s))
        if not (Fraction(2) ** -126 <= exact <= Fraction(float(ml_dtypes.finfo(BF16).max))):
            continue
        checked += 1
        differ += int(bf16_round(exact) != r)
    return {"scales_checked": checked, "differ": differ,
            "what": "every normal positive bf16 scale with a normal bf16 reciprocal: bf16(f32(1) / f32(s)) against "
                    "1/s rounded once to bf16"}


def scale_rounding(quantization) -> dict:
    """How JAX rounds the Python-float scale to bf16: once from float64, or through float32 (as a float32 tensor
    cast to bf16 is)? A scale just above a bf16 midpoint by less than float32 resolves tells them apart."""
    import jax
    import jax.numpy as jnp

    scale = 1 + 2**-8 + 2**-30
    text = jax.jit(kv_write(quantization, scale)).lower(jnp.ones(8, jnp.bfloat16)).as_text()
    constant = re.search(r"constant dense<([^>]+)> : tensor<bf16>", text)
    if constant is None:
        raise ValueError("no bf16 scale constant in the lowered program")
    once, via_f32 = (float(np.float64(scale).astype(BF16)), float(np.float32(scale).astype(BF16)))
    jax_value = float(np.float64(float(constant[1])).astype(BF16))
    return {"scale": scale, "jax_bf16": jax_value, "rounded_once_from_float64": once, "through_float32": via_f32,
            "rule": "once from float64" if jax_value == once else "through float32",
            "note": "a float32 scale (a checkpoint's, or layer._k_scale_float taken from one) is exact in float64, "
                    "so both rules give it the same bf16"}


# --- comparing bytes ---


def fp8_ordinal(codes: np.ndarray) -> np.ndarray:
    """e4m3fn bytes as integers in value order (+0 and -0 both 0), so a difference counts fp8 steps."""
    magnitude = (codes & 0x7F).astype(np.int32)
    return np.where(codes & 0x80, -magnitude, magnitude)


def compare(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> dict:
    differ = (a != b) & mask
    steps = np.abs(fp8_ordinal(a) - fp8_ordinal(b))[differ]
    return {"differ": int(differ.sum()), "of": int(mask.sum()),
            "max_fp8_steps": int(steps.max()) if steps.size else 0}


def sha256(data: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


# --- what the package's source says (ast only: importing it would import vLLM) ---


class Source:
    def __init__(self, package: Path):
        self.root = package.parent
        self.package = package
        self.trees: dict[str, ast.Module] = {}

    def tree(self, rel: str) -> ast.Module:
        if rel not in self.trees:
            self.trees[rel] = ast.parse((self.root / rel).read_text(), filename=rel)
        return self.trees[rel]

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.package.rglob("*.py"))


def module_file(module: str) -> str:
    return module.replace(".", "/") + ".py"


def function(tree: ast.AST, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def string_constants(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def where(rel: str, node: ast.AST) -> str:
    return f"{rel}:{node.lineno}"


def model_impl_type(src: Source) -> dict:
    rel = "tpu_inference/envs.py"
    for node in ast.walk(src.tree(rel)):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "env_with_choices"
                and ast.literal_eval(node.args[0]) == "MODEL_IMPL_TYPE"):
            return {"default": ast.literal_eval(node.args[1]), "choices": ast.literal_eval(node.args[2]),
                    "at": where(rel, node)}
    raise ValueError("MODEL_IMPL_TYPE not found in envs.py")


def model_loader(src: Source) -> dict:
    rel = "tpu_inference/models/common/model_loader.py"
    tree = src.tree(rel)
    preferred = None
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if getattr(target, "id", "") == "_VLLM_PREFERRED_ARCHITECTURES":
            preferred = {"architectures": sorted(string_constants(node.value)), "at": where(rel, node)}
    resolve = function(tree, "resolve_model_architecture")
    rule = next(n for n in ast.walk(resolve) if isinstance(n, ast.Assign) and isinstance(n.value, ast.IfExp)
                and "_VLLM_PREFERRED_ARCHITECTURES" in ast.unparse(n.value.test))
    registry_fn = function(tree, "_get_model_architecture")
    imported = {alias.asname or alias.name: n.module for n in ast.walk(registry_fn)
                if isinstance(n, ast.ImportFrom) for alias in n.names}
    registry = {}
    for node in ast.walk(registry_fn):
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript)
                and getattr(node.targets[0].value, "id", "") == "_MODEL_REGISTRY"):
            arch = ast.literal_eval(node.targets[0].slice)
            cls = node.value.id
            registry[arch] = {"class": cls, "file": module_file(imported[cls]), "line": node.lineno}
    return {"vllm_preferred": preferred, "auto_rule": {"code": ast.unparse(rule), "at": where(rel, rule)},
            "jax_registry": {"at": rel, "architectures": registry}}


def scale_assignments(src: Source) -> list[dict]:
    """Every assignment to a K/V scale attribute anywhere in the package (and a class field of that name)."""
    found = []
    for rel in src.files():
        tree = src.tree(rel)
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            value = None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets, value = [node.target], node.value
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and len(node.args) == 3
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value in SCALE_ATTRS):
                found.append({"at": where(rel, node), "target": ast.unparse(node), "value": ast.unparse(node.args[2]),
                              "constant": isinstance(node.args[2], ast.Constant)})
                continue
            for target in targets:
                attr = target.attr if isinstance(target, ast.Attribute) else None
                if attr is None and isinstance(node, ast.AnnAssign) and isinstance(target, ast.Name):
                    attr = target.id if target.id.startswith("_") else None  # a dataclass field `_k_scale: float = 1`
                if attr in SCALE_ATTRS:
                    constant = isinstance(value, ast.Constant)
                    found.append({"at": where(rel, node), "target": ast.unparse(target),
                                  "value": ast.unparse(value) if value is not None else None, "constant": constant,
                                  **({"constant_value": value.value} if constant else {})})
    return found


def kv_writes(src: Source) -> list[dict]:
    """Every call of the write functions, with the scales it passes."""
    found = []
    for rel in src.files():
        for node in ast.walk(src.tree(rel)):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if name in WRITE_FUNCTIONS:
                    found.append({"at": where(rel, node), "call": ast.unparse(node)})
    return found


def write_source(src: Source) -> dict:
    rel = "tpu_inference/layers/common/quantization/__init__.py"
    tree = src.tree(rel)
    quantize = function(tree, "static_per_tensor_quantize_tensor")
    ret = next(n for n in ast.walk(quantize) if isinstance(n, ast.Return))
    imports = sorted({alias.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                      for alias in n.names} | {n.module for n in tree.body if isinstance(n, ast.ImportFrom)})
    rel_utils = "tpu_inference/utils.py"
    aliases = next(n for n in src.tree(rel_utils).body if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", "") == "_DTYPE_STR_ALIAS_TO_JAX_DTYPE")
    return {"static_per_tensor_quantize_tensor": {"returns": ast.unparse(ret.value), "at": where(rel, ret)},
            "quantize_kv": {"at": where(rel, function(tree, "quantize_kv"))},
            "module_imports": imports,
            "kv_cache_dtype_strings": {"map": {ast.literal_eval(k): ast.unparse(v) for k, v in
                                               zip(aliases.value.keys, aliases.value.values)},
                                       "at": where(rel_utils, aliases)}}


def attention_case(rel: str, method: ast.FunctionDef) -> dict:
    """How a quantization config's get_quant_method answers for an Attention layer."""

    def summary(node: ast.AST, body: list[ast.stmt]) -> dict:
        block = ast.Module(body=body, type_ignores=[])
        returns = [ast.unparse(n.value) if n.value is not None else "None"
                   for n in ast.walk(block) if isinstance(n, ast.Return)]
        logged = [s for n in ast.walk(block) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                  and n.func.attr.startswith(("warning", "info", "error")) for s in string_constants(n)]
        return {"at": where(rel, node), "returns": returns or ["None (falls through)"], "logs": logged}

    for node in ast.walk(method):
        if isinstance(node, ast.match_case) and "Attention()" in ast.unparse(node.pattern):
            return summary(node.pattern, node.body)
        if isinstance(node, ast.If) and re.search(r"isinstance\(\w+, Attention\)", ast.unparse(node.test)):
            return summary(node, node.body)
    default = next((n for n in ast.walk(method) if isinstance(n, ast.match_case) and ast.unparse(n.pattern) == "_"),
                   None)
    return {"at": where(rel, default.pattern if default else method), "returns": ["None (no Attention case: the default case)"],
            "logs": []}


def quantization_configs(src: Source) -> dict:
    rel = "tpu_inference/layers/vllm/quantization/__init__.py"
    tree = src.tree(rel)
    consts_rel = "tpu_inference/layers/common/quant_methods.py"
    consts = {n.targets[0].id: n.value.value for n in src.tree(consts_rel).body
              if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)}
    imported = {alias.name: n.module for n in tree.body if isinstance(n, ast.ImportFrom) for alias in n.names}
    table = next(n for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
                 and getattr(n.target, "id", "") == "method_to_config")
    configs = {}
    for key, value in zip(table.value.keys, table.value.values):
        name = consts[key.attr] if isinstance(key, ast.Attribute) else None
        cls = value.id
        cls_rel = module_file(imported[cls])
        cls_node = next(n for n in src.tree(cls_rel).body if isinstance(n, ast.ClassDef) and n.name == cls)
        bases = [ast.unparse(b) for b in cls_node.bases]
        method = next((n for n in cls_node.body if isinstance(n, ast.FunctionDef) and n.name == "get_quant_method"),
                      None)
        configs[str(name)] = {"class": cls, "bases": bases, "file": cls_rel,
                              "attention": attention_case(cls_rel, method) if method else None}
    raise_node = next(n for n in ast.walk(function(tree, "get_tpu_quantization_config")) if isinstance(n, ast.Raise))
    unsupported = {"at": where(rel, raise_node), "raises": ast.unparse(raise_node.exc),
                   "not_in_table": [m for m in ("modelopt", "quark", "fp8") if m not in consts.values()]}
    return {"table_at": where(rel, table), "configs": configs, "unsupported_method": unsupported}


def model_paths(src: Source) -> dict:
    loader = model_loader(src)
    assignments = scale_assignments(src)
    writes = kv_writes(src)
    models = {}
    for name in JAX_MODELS:
        rel = f"tpu_inference/models/jax/{name}.py"
        if not (src.root / rel).exists():
            continue
        jax_imports = sorted({n.module for n in ast.walk(src.tree(rel)) if isinstance(n, ast.ImportFrom)
                              and (n.module or "").startswith("tpu_inference.models.jax.")})
        models[name] = {
            "file": rel,
            "architectures": sorted(a for a, r in loader["jax_registry"]["architectures"].items()
                                    if r["file"] == rel),
            "scale_assignments": [f"{a['at']}: {a['target']} = {a['value']}" for a in assignments
                                  if a["at"].startswith(rel + ":")],
            "kv_writes_at": [w["at"] for w in writes if w["at"].startswith(rel + ":")],
            "imports_jax_models": jax_imports,
        }
    jax_scales = [a for a in assignments if a["target"].split(".")[-1] in ("_k_scale", "_v_scale")]
    return {
        "model_impl_type": model_impl_type(src),
        **loader,
        "jax_models": models,
        "jax_scale_attributes": {
            "what": "every assignment to _k_scale/_v_scale anywhere in the package (attribute or class field)",
            "count": len(jax_scales),
            "only_constants": all(a["constant"] for a in jax_scales),
            "constants": sorted({a["constant_value"] for a in jax_scales if a["constant"]}),
            "not_constant": [a for a in jax_scales if not a["constant"]],
        },
        "scale_assignments": [f"{a['at']}: {a['target']} = {a['value']}" for a in assignments],
        "kv_writes": writes,
        "quantization_configs": quantization_configs(src),
    }


# --- the probe ---


def provenance(package: Path) -> dict:
    dist = importlib.metadata.distribution(DIST)
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    wheel_hash = direct.get("archive_info", {}).get("hashes", {}).get("sha256")
    wheel_url = direct.get("url", "")
    wheel_path = Path(wheel_url.removeprefix("file://")) if wheel_url.startswith("file://") else None
    if wheel_path and wheel_path.exists():
        wheel_hash_file = hashlib.sha256(wheel_path.read_bytes()).hexdigest()
        if wheel_hash and wheel_hash_file != wheel_hash:
            raise SystemExit(f"{wheel_path} does not hash to the sha256 pip recorded")
        wheel_hash = wheel_hash_file
    # the installed files read here must be the wheel's, unmodified: their hashes against the wheel's RECORD
    used = ["tpu_inference/layers/common/quantization/__init__.py"]
    modified = []
    for path in dist.files or []:
        if str(path) in used and path.hash is not None:
            digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_binary()).digest()).rstrip(b"=").decode()
            if digest != path.hash.value:
                modified.append(str(path))
    import jax
    import jaxlib
    import safetensors

    return {
        "tpu_inference": dist.version,
        "wheel": wheel_path.name if wheel_path else None,
        "wheel_sha256": wheel_hash,
        "run_files_match_wheel_record": not modified,
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "libtpu": importlib.metadata.version("libtpu"),
        "ml_dtypes": ml_dtypes.__version__, "numpy": np.__version__, "safetensors": safetensors.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([sys.executable, *sys.argv]),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
    }


def probe(out_dir: Path) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CPU run: never look for a TPU here
    import jax
    import jax.numpy as jnp
    from safetensors.numpy import save_file

    package = package_dir()
    version = importlib.metadata.version(DIST)
    quantization = load_quantization()
    x = bf16_patterns()
    x32 = x.astype(np.float32)
    finite, nan, inf = np.isfinite(x32), np.isnan(x32), np.isinf(x32)
    scales = STORED_SCALES + SWEEP_SCALES

    cpu_device = jax.devices("cpu")[0]
    cpu, cpu_programs = {}, {}
    for scale in scales:
        fn = jax.jit(kv_write(quantization, scale))
        arg = jax.device_put(jnp.asarray(x), cpu_device)
        lowered = fn.lower(arg)
        cpu_programs[scale_key(scale)] = {"stablehlo": lowered.as_text(), "optimized": lowered.compile().as_text()}
        cpu[scale_key(scale)] = np.asarray(fn(arg)).view(np.uint8)

    targets = {}
    for topology, accelerator_type in TOPOLOGIES:
        print(f"compiling for {topology} ...", file=sys.stderr)
        targets[topology] = {"accelerator_type": accelerator_type, **tpu_programs(topology, accelerator_type)}

    tensors: dict[str, np.ndarray] = {}
    per_scale = {}
    reference = TOPOLOGIES[0][0]
    for scale in scales:
        key = scale_key(scale)
        cpu_program = program(cpu_programs[key]["optimized"])
        cpu_eval = evaluate(cpu_program["computations"], cpu_program["entry"], [x]).view(np.uint8)
        detailed = scale in STORED_SCALES or scale == 1.0  # the op lists of the rest only repeat these
        entry: dict = {
            "stored": scale in STORED_SCALES,
            "scale_bf16": {"value": float(np.float64(scale).astype(BF16)),
                           "bits": f"0x{int(np.float64(scale).astype(BF16).view(np.uint16)):04x}"},
            "stablehlo_scale": next(line for line in stablehlo_lines(cpu_programs[key]["stablehlo"])
                                    if "stablehlo.constant" in line and "tensor<bf16>" in line),
            "cpu": {"formula": formula(cpu_program["instructions"]),
                    "constants": constants(cpu_program["instructions"]),
                    **({"ops": op_lines(cpu_program["instructions"])} if detailed else {}),
                    "evaluated_program_vs_run": compare(cpu_eval, cpu[key], ~nan)},
        }
        evaluated, programs = {}, {}
        for topology, target in targets.items():
            programs[topology] = program(target["programs"][key]["optimized"])
            evaluated[topology] = evaluate(programs[topology]["computations"], programs[topology]["entry"],
                                           [x]).view(np.uint8)
        tpu, ref_program = evaluated[reference], programs[reference]["instructions"]
        c = constants(ref_program)
        candidates = reciprocal_candidates(scale)
        if detailed:
            entry["reciprocal_candidates"] = candidates
        entry["tpu_compiled"] = {
            "formula": formula(ref_program), "constants": c,
            **({"ops": op_lines(ref_program)} if detailed else {}),
            "reciprocal_matches": sorted(name for name, value in candidates.items()
                                         if [k["value"] for k in c] == [value]),
            "topologies_same_program": all(op_lines(p["instructions"]) == op_lines(ref_program)
                                           for p in programs.values()),
            "topologies_same_bytes": all(compare(evaluated[t], tpu, ~nan)["differ"] == 0 for t in evaluated),
            "stablehlo_same_as_cpu": all(stablehlo_lines(t["programs"][key]["stablehlo"])
                                         == stablehlo_lines(cpu_programs[key]["stablehlo"])
                                         for t in targets.values()),
        }
        if not entry["tpu_compiled"]["topologies_same_program"]:
            entry["tpu_compiled"]["per_topology"] = {t: {"formula": formula(p["instructions"]),
                                                         "ops": op_lines(p["instructions"])}
                                                     for t, p in programs.items()}
        entry["sha256_finite"] = {"cpu": sha256(cpu[key][finite]), "tpu-compiled": sha256(tpu[finite])}
        entry["cpu_vs_tpu_compiled"] = {"finite": compare(cpu[key], tpu, finite)}
        if detailed:
            entry["cpu_vs_tpu_compiled"].update(inf=compare(cpu[key], tpu, inf), nan=compare(cpu[key], tpu, nan))
            entry["nan_bytes"] = {"cpu": sorted(f"0x{b:02x}" for b in set(cpu[key][nan].tolist())),
                                  "tpu_compiled": sorted(f"0x{b:02x}" for b in set(tpu[nan].tolist()))}
        per_scale[key] = entry
        if scale in STORED_SCALES:
            tensors[f"cpu/scale={key}"] = cpu[key]
            tensors[f"tpu-compiled/scale={key}"] = tpu

    # the cache-shaped and producer-fused programs, against the 1-D one at the same scale
    variants: dict = {}
    for topology, target in targets.items():
        base = program(target["programs"][target["shaped"]["scale"]]["optimized"])["instructions"]
        shaped = program(target["shaped"]["optimized"])["instructions"]
        producer = op_lines(program(target["producer"]["optimized"])["instructions"])
        same = topology != reference and producer == variants[reference]["k_from_f32_producer"].get("ops")
        variants[topology] = {"scale": target["shaped"]["scale"],
                              "k_64x8x128_same_formula": formula(shaped) == formula(base),
                              "k_from_f32_producer": {"same_program_as": reference} if same else {
                                  "formula": formula(program(target["producer"]["optimized"])["instructions"]),
                                  "ops": producer}}
    variants["what"] = ("k_64x8x128: the write of a cache-shaped K [tokens, kv heads, head dim]; k_from_f32_producer: "
                        "write((k_f32 * 1.5).astype(bf16)), the write fused with a float32 producer, as in a model")
    double_rounding = double_rounding_check()
    cpu_formula = per_scale[scale_key(STORED_SCALES[0])]["cpu"]["formula"]
    tpu_formula = per_scale[scale_key(STORED_SCALES[0])]["tpu_compiled"]["formula"]
    result = {
        "what": f"tpu-inference {version}'s fp8 KV-cache write (quantize_kv), run on JAX's CPU backend and compiled "
                "ahead of time for TPU topologies with no TPU (compiled for TPU, not run on TPU), and which model path "
                "holds which K/V scale, read from the package's source",
        "provenance": provenance(package),
        "input": {
            "description": "all bf16 bit patterns 0..65535 in order: np.arange(65536, dtype=np.uint16).view(bfloat16)",
            "count": int(x.size), "finite": int(finite.sum()), "inf": int(inf.sum()), "nan": int(nan.sum()),
            "scale": "a Python float, as layer._k_scale_float and the JAX models' self._k_scale are",
            "cache_dtype": "float8_e4m3fn",
        },
        "tensors": {
            "dtype": "uint8: the float8_e4m3fn bytes, one per input, in input order",
            "names": sorted(tensors),
            "cpu": "quantize_kv run on JAX's CPU backend (XLA:CPU)",
            "tpu-compiled": f"the optimized program compiled for {reference} ({targets[reference]['device_kind']}), "
                            "evaluated in numpy/ml_dtypes; every topology compiled gives the same bytes where a scale's "
                            "tpu_compiled.topologies_same_bytes is true",
            "nan": "compare finite inputs only: a NaN input's byte on XLA:CPU depends on the CPU's ISA flags (its sign "
                   "is not fixed), and what a TPU stores for NaN is not known from a compiled program; NaN inputs are "
                   "the patterns with exponent 0xff and a nonzero mantissa (x != x)",
            "sha256_finite": "sha256 of the bytes at finite inputs only, in input order, per scale (every scale, "
                             "stored or not)",
        },
        "write_source": write_source(Source(package)),
        "write_as_compiled": {
            "cpu": cpu_formula,
            "tpu_compiled": tpu_formula,
            "tpu_compiled_in_words": "fp8(clamp_f32(f32(x) * f32(c), -448, 448)) with c = bf16(1 / bf16(scale)): the "
                                     "divide by the weakly typed bf16 scale becomes a multiply by a bf16 reciprocal "
                                     "constant, the product and the clamp are float32 (the bf16 rounding of x / "
                                     "scale is gone), one rounding from float32 to e4m3; at scale 1.0 no multiply",
            "reciprocal": "c as the compiler emits it equals bf16(f32(1) / f32(bf16(scale))); double rounding cannot "
                          "separate that from rounding the exact 1 / bf16(scale) once (checked below), so c is the "
                          "correctly rounded bf16 reciprocal of bf16(scale)",
            "reciprocal_double_rounding": double_rounding,
            "scale_to_bf16": scale_rounding(quantization),
            "evaluation": "numpy/ml_dtypes: f32 multiply IEEE round to nearest even, f32 to e4m3fn round to nearest "
                          "even; that the TPU's f32 to e4m3 conversion rounds to nearest even is assumed",
        },
        "tpu_targets": {t: {"accelerator_type": v["accelerator_type"], "device_kind": v["device_kind"],
                            "devices": v["devices"]} for t, v in targets.items()},
        "stablehlo": {"scale": scale_key(STORED_SCALES[0]),
                      "lines": stablehlo_lines(cpu_programs[scale_key(STORED_SCALES[0])]["stablehlo"])},
        "tpu_compiled_variants": variants,
        "scales": per_scale,
        "model_paths": model_paths(Source(package)),
    }

    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"tpu-inference-{version}"
    json_path, tensors_path = out_dir / f"{stem}.json", out_dir / f"{stem}.safetensors"
    # written beside the target and renamed over it: a reader never sees half a file
    tmp = out_dir / f".{stem}.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"source": f"tpu-inference {version}", "json": json_path.name})
    os.chmod(tmp, 0o644)
    os.replace(tmp, tensors_path)
    tmp = out_dir / f".{stem}.json.tmp"
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, json_path)
    print(f"wrote {json_path} and {tensors_path.name}")
    print(f"cpu:          {cpu_formula}")
    print(f"tpu-compiled: {tpu_formula}")
    for key, entry in per_scale.items():
        f = entry["cpu_vs_tpu_compiled"]["finite"]
        c = entry["tpu_compiled"]["constants"]
        print(f"scale {key:>8}: c = {[k['text'] + ' ' + k['bits'] for k in c]}, cpu vs tpu-compiled differ in "
              f"{f['differ']} of {f['of']} finite inputs (at most {f['max_fp8_steps']} fp8 step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=REPO / "tests" / "golden",
                        help="Where tpu-inference-<version>.json and .safetensors go.")
    parser.add_argument("--compile-for", help=argparse.SUPPRESS)  # the child process that compiles for TPU
    parser.add_argument("--compile-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile_for:
        compile_for_tpu(args.compile_for, args.compile_out)
    else:
        probe(args.out_dir)


if __name__ == "__main__":
    main()
