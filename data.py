"""Calibration data in: records from a dataset or local files, tokenized one record per sample.

Every record becomes one sample that starts at position 0, as a real prompt does: tokenized with
the tokenizer's defaults (the chat template for chat `messages`), truncated to `seq_len`, never
packed with another record. Samples are shuffled with a seed, so the same inputs give the same
samples on every run, and batched with right padding that the observer masks out.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import logging
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator
from urllib.parse import urlparse

from fp8kv.errors import Fp8kvError, UsageError
from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_MODEL_ALIAS

if TYPE_CHECKING:  # DataRequest, the command line's defaults, needs no torch
    import torch

DEFAULT_DATASET = "HuggingFaceH4/ultrachat_200k"
DEFAULT_SPLIT = "train_sft"
LOCAL_SPLIT = "train"
# Local file suffix -> datasets builder. Text files give one sample per paragraph.
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
HUB_PROBE_SECONDS = 3.0
BUNDLED_DATASET = BUNDLED_MODEL_ALIAS
"""`--dataset bundled`: the bundled model's calibration split (verify: its held-out split)."""
FALLBACK_NOTE = (
    f"{DEFAULT_DATASET} cannot be loaded (offline and not cached), so the scales are calibrated on the bundled "
    "model's own corpus of Python documentation"
)
GENERATED_DATASET = "generated"
"""`--dataset generated`: text the model writes itself, answering instructions through its chat template."""
DATASET_CHOICES = "a .txt/.jsonl/.parquet file, a Hub dataset org/name, or 'generated' (text the model writes itself)"
# The instructions the model answers for `--dataset generated`: verify's held-out text answers others.
_INSTRUCTIONS = {
    "calibration": (
        "Explain how a bicycle gear system works.", "Write a short story about a lighthouse keeper.",
        "Give three tips for learning a new language.", "Describe the water cycle to a child.",
        "Write a polite email asking for a deadline extension.", "What causes the seasons on Earth?",
        "Summarize the plot of a detective novel you invent.", "List the steps to bake bread at home.",
        "Explain what a database index is and why it helps.", "Write a poem about autumn in a city.",
        "Compare trains and planes for a 500 km trip.", "Write a Python function that reverses a list, and explain it.",
        "How do vaccines train the immune system?", "Describe a busy market in the morning.",
        "Give advice to someone starting their first job.", "Explain the rules of chess briefly.",
    ),
    "heldout": (
        "Explain how a refrigerator keeps food cold.", "Write a short story about a lost dog finding home.",
        "Give three tips for sleeping better.", "Describe how plants make food from sunlight.",
        "Write a thank-you note to a teacher.", "Why is the sky blue?",
        "Invent a recipe for a vegetable soup.", "Explain what a computer network is.",
    ),
}
GENERATION = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
GENERATION_BATCH = 8  # prompts sampled together (left-padded)


@dataclass(frozen=True)
class DataRequest:
    """What calibration data to use. `dataset=None` means the default, with an offline fallback."""

    dataset: str | None = None
    split: str | None = None
    text_column: str | None = None
    num_samples: int = 512
    seq_len: int = 2048
    seed: int = 42


@dataclass(frozen=True)
class CalibrationData:
    """Tokenized samples (one per record) and where they came from.

    `note` is one line for the user when the bundled corpus replaced the default dataset.
    """

    samples: list[list[int]]
    dataset: str
    split: str
    text_column: str
    note: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.samples)


@dataclass(frozen=True)
class Batch:
    """Right-padded samples: `input_ids`, `attention_mask` int64 [batch, seq] (mask 1 = real token)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def load_calibration_data(request: DataRequest, tokenizer: Any, *, fallback: bool = False,
                          model: Any = None, held_out: bool = False) -> CalibrationData:
    """Open the requested records, shuffle them with `request.seed`, tokenize `request.num_samples` of them.

    `fallback`: the bundled corpus may replace an unloadable default dataset (for the bundled models only;
    anything else is one `UsageError` naming --dataset). `model`: a loaded causal LM, needed only for
    `--dataset generated`, whose `held_out` text answers other instructions than calibration's.
    The bundled corpus is small: asking it for more samples than it has uses all of them, with a note.
    """
    if request.num_samples < 1 or request.seq_len < 1:
        raise Fp8kvError("--num-samples and --seq-len must be at least 1")
    if request.dataset == GENERATED_DATASET:
        return generate_text(request, tokenizer, model, "heldout" if held_out else "calibration")
    records, name, split, note = _open(request, fallback)
    column = _text_column(records, request.text_column, name)
    samples = _tokenize(records.shuffle(seed=request.seed), column, tokenizer, request.seq_len, request.num_samples)
    if len(samples) < request.num_samples and _is_bundled(name):
        short = (f"the bundled corpus has {len(samples)} records, fewer than the {request.num_samples} samples asked "
                 f"for; all {len(samples)} are used")
        note = f"{note}; {short}" if note else short
    elif len(samples) < request.num_samples:
        tokens = sum(len(s) for s in samples)
        raise Fp8kvError(
            f"{name} (split {split!r}, column {column!r}): found {len(samples)} non-empty records "
            f"({tokens} tokens) but --num-samples is {request.num_samples}; "
            + (f"lower --num-samples to {len(samples)} or give more text" if samples else "give it text")
        )
    return CalibrationData(samples, name, split, column, note)


def sample_digests(samples: Iterable[list[int]]) -> tuple[str, ...]:
    """"LENGTH:HASH" of each sample, HASH a short sha256 of its tokens: enough to tell a record read again, never
    the text itself. The whole sample, not a prefix: chat samples share their template's first tokens."""
    return tuple(f"{len(sample)}:{_token_hash(sample)}" for sample in samples)


def repeated_prefixes(samples: list[list[int]]) -> list[int]:
    """Per sample, its longest prefix that an earlier sample begins with too (0 for the first). Chat samples share
    their template's first tokens (SmolLM2's generated text: 24 of them), and a sample's prediction after a prefix
    an earlier sample holds is the same prediction made again."""
    earlier: list[tuple[int, ...]] = []  # sorted: the one sharing most with a sample sits next to it
    longest = []
    for sample in map(tuple, samples):
        at = bisect.bisect_left(earlier, sample)
        longest.append(max((_shared(sample, earlier[i]) for i in (at - 1, at) if 0 <= i < len(earlier)), default=0))
        earlier.insert(at, sample)
    return longest


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def samples_seen(samples: Iterable[list[int]], digests: Iterable[str]) -> int:
    """How many of `samples` begin with a sample of `digests` (the same record read at the same or a longer
    --seq-len)."""
    seen = set(digests)
    lengths = sorted({int(digest.split(":", 1)[0]) for digest in seen})
    return sum(any(len(sample) >= n and f"{n}:{_token_hash(sample[:n])}" in seen for n in lengths)
               for sample in samples)


def _token_hash(tokens: list[int]) -> str:
    # the ids as decimal text: the same digest on every machine (an int array's bytes follow the CPU's byte order)
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def make_batches(samples: list[list[int]], batch_size: int, pad_id: int) -> list[Batch]:
    """Group samples (longest first, so padding stays small) into right-padded batches."""
    import torch

    if batch_size < 1:
        raise Fp8kvError("--batch-size must be at least 1")
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i]), i))
    batches = []
    for start in range(0, len(order), batch_size):
        group = [samples[i] for i in order[start : start + batch_size]]
        width = len(group[0])
        ids = torch.full((len(group), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(group), width), dtype=torch.int64)
        for row, sample in enumerate(group):
            ids[row, : len(sample)] = torch.tensor(sample, dtype=torch.int64)
            mask[row, : len(sample)] = 1
        batches.append(Batch(ids, mask))
    return batches


def generate_text(request: DataRequest, tokenizer: Any, model: Any, split: str) -> CalibrationData:
    """`request.num_samples` samples the model writes: an instruction of `split` through its chat template, then
    its sampled answer (`GENERATION`, seeded with `request.seed`), up to `request.seq_len` tokens in all."""
    if model is None:
        raise Fp8kvError(f"--dataset {GENERATED_DATASET} needs the model loaded to write its text")
    if not getattr(tokenizer, "chat_template", None):
        raise Fp8kvError(f"{tokenizer.name_or_path}: has no chat template, which --dataset {GENERATED_DATASET} "
                         "needs to prompt the model; pass --dataset with a text file or a Hub dataset")
    import torch

    instructions = _INSTRUCTIONS[split]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": instructions[i % len(instructions)]}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
               for i in range(request.num_samples)]
    longest = max(len(p) for p in prompts)
    if longest >= request.seq_len:
        raise Fp8kvError(f"--seq-len {request.seq_len} leaves no room to generate after prompts of {longest} tokens")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(request.seed)
        samples = [ids for start in range(0, len(prompts), GENERATION_BATCH)
                   for ids in _sample(model, prompts[start:start + GENERATION_BATCH], request.seq_len, tokenizer)]
    settings = ", ".join(f"{k} {v}" for k, v in GENERATION.items() if k != "do_sample")
    purpose = "held-out" if split == "heldout" else "calibration"
    note = (f"{purpose} text written by the model itself: {len(samples)} answers to {split} instructions through "
            f"its chat template (sampling with {settings}, seed {request.seed})")
    return CalibrationData(samples, GENERATED_DATASET, split, "chat", note)


def _sample(model: Any, prompts: list[list[int]], seq_len: int, tokenizer: Any) -> list[list[int]]:
    """Each prompt followed by the model's sampled continuation, cut at its end-of-sequence token."""
    import torch

    device, pad, width = next(model.parameters()).device, pad_id(tokenizer), max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=seq_len - width, pad_token_id=pad,
                             eos_token_id=tokenizer.eos_token_id, **GENERATION)
    samples = []
    for prompt, row in zip(prompts, out[:, width:].tolist()):
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        samples.append(prompt + row[:end])
    return samples


def _open(request: DataRequest, fallback: bool):
    """(records, name, split, note) for the request; the default falls back to the bundled corpus if allowed."""
    if request.dataset is None:
        split = request.split or DEFAULT_SPLIT
        try:
            return _load_named(DEFAULT_DATASET, split) + (None,)
        except Fp8kvError as exc:
            if not fallback:
                raise UsageError(f"{DEFAULT_DATASET} cannot be loaded (offline and not cached), and the bundled "
                                 f"corpus fits only the bundled models: pass --dataset ({DATASET_CHOICES})") from None
            if not BUNDLED_CALIBRATION_TEXT.is_file():
                raise Fp8kvError(f"{exc}; the bundled corpus {BUNDLED_CALIBRATION_TEXT} is missing too") from None
            return _load_local(BUNDLED_CALIBRATION_TEXT, None) + (FALLBACK_NOTE,)
    if request.dataset == BUNDLED_DATASET:
        return _load_local(BUNDLED_CALIBRATION_TEXT, request.split) + (None,)
    path = Path(request.dataset).expanduser()
    if path.exists():
        return _load_local(path, request.split) + (None,)
    if _looks_like_path(request.dataset):  # a typo in a path must not become a Hub download
        raise Fp8kvError(f"{request.dataset}: no such file or folder (a Hub dataset is named org/name)")
    return _load_named(request.dataset, request.split or DEFAULT_SPLIT) + (None,)


def _looks_like_path(name: str) -> bool:
    return (name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name
            or Path(name).suffix.lower() in LOCAL_BUILDERS)


def _is_bundled(name: str) -> bool:
    """The bundled model's calibration or held-out split (they live side by side)."""
    return Path(name).resolve().parent == BUNDLED_CALIBRATION_TEXT.resolve().parent


def _load_local(path: Path, split: str | None):
    import datasets

    if split not in (None, LOCAL_SPLIT):
        raise Fp8kvError(f"{path}: local files have one split, {LOCAL_SPLIT!r}; drop --split {split}")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix.lower() in LOCAL_BUILDERS)
    if not files:
        raise Fp8kvError(f"{path}: no {', '.join(LOCAL_BUILDERS)} files found")
    builders = {LOCAL_BUILDERS.get(p.suffix.lower()) for p in files}
    if None in builders:
        raise Fp8kvError(f"{path}: unsupported file type; use one of {', '.join(LOCAL_BUILDERS)}")
    if len(builders) > 1:
        raise Fp8kvError(f"{path}: mixes file types ({', '.join(sorted(builders))}); keep one kind per folder")
    if all(p.stat().st_size == 0 for p in files):
        raise Fp8kvError(f"{path}: is empty; give a file with calibration text")
    builder = builders.pop()
    options = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        # Built in a private temp folder and held in memory: nothing lands in ~/.cache.
        with _quiet_datasets(), tempfile.TemporaryDirectory(prefix="fp8kv-data-") as cache:
            records = datasets.load_dataset(builder, data_files=[str(p) for p in files], split=LOCAL_SPLIT,
                                            cache_dir=cache, keep_in_memory=True, **options)
    except Exception as exc:  # datasets raises many types for unreadable files
        cause = exc.__cause__ or exc  # DatasetGenerationError hides the parser's reason in its cause
        raise Fp8kvError(f"{path}: cannot be read as {builder} ({type(cause).__name__}: {cause})") from None
    return records, str(path), LOCAL_SPLIT


def _load_named(name: str, split: str):
    import datasets

    offline = not _hub_reachable()
    try:
        with _offline_mode(offline):
            records = datasets.load_dataset(name, split=split)
    except Exception as exc:  # offline, unknown dataset, unknown split: all one message
        where = " (offline and not cached)" if offline else ""
        raise Fp8kvError(f"dataset {name!r} split {split!r} cannot be loaded{where}: {exc}") from None
    return records, name, split


def _hub_reachable() -> bool:
    """A quick TCP probe, so an offline machine fails in milliseconds rather than after retries."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=HUB_PROBE_SECONDS).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _offline_mode(offline: bool) -> Iterator[None]:
    """Load from the local cache only (no network retries) while `offline`."""
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    if offline:
        datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _text_column(records: Any, requested: str | None, name: str) -> str:
    columns = list(records.column_names)
    if requested is not None:
        if requested not in columns:
            raise Fp8kvError(f"{name}: no column {requested!r}; columns are {sorted(columns)}")
        return requested
    for candidate in ("text", "messages"):
        if candidate in columns:
            return candidate
    choice = f" {columns[0]}" if len(columns) == 1 else f" with one of {sorted(columns)}"
    raise Fp8kvError(f"{name}: no 'text' or 'messages' column; pass --text-column{choice}")


def _tokenize(records: Any, column: str, tokenizer: Any, seq_len: int, wanted: int) -> list[list[int]]:
    samples: list[list[int]] = []
    for value in records.select_columns([column]):
        ids = _encode(value[column], tokenizer)[:seq_len]
        if ids:
            samples.append(ids)
        if len(samples) == wanted:
            break
    return samples


def tokenize_texts(texts: Iterable[Any], tokenizer: Any, seq_len: int) -> list[list[int]]:
    """One sample per non-empty text (a string or chat messages), tokenized and truncated as a calibration record is."""
    return [ids for ids in (_encode(text, tokenizer)[:seq_len] for text in texts) if ids]


def _encode(value: Any, tokenizer: Any) -> list[int]:
    """Token ids of one record: a string, or a chat (list of {role, content})."""
    if isinstance(value, str):
        return list(tokenizer(value)["input_ids"]) if value.strip() else []
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        if not value:
            return []
        if not getattr(tokenizer, "chat_template", None):  # joining turns would calibrate on unseen text
            raise Fp8kvError(
                f"{getattr(tokenizer, 'name_or_path', 'the tokenizer')}: has no chat template, but the records are "
                "chat messages; give plain text (a 'text' column, or --text-column naming one), or use a tokenizer "
                "with a chat template"
            )
        return list(tokenizer.apply_chat_template(value, tokenize=True, return_dict=False))
    if value is None:
        return []
    raise Fp8kvError(f"column values must be text or chat messages, found {type(value).__name__}")


def pad_id(tokenizer: Any) -> int:
    """The id right padding uses (its value never matters: padding is masked and never observed)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def load_tokenizer(model_dir: Path, trust_remote_code: bool):
    """The checkpoint's own tokenizer, or one clear error naming the folder."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise Fp8kvError(f"{model_dir}: no usable tokenizer ({exc})") from None
