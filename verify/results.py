"""What verify measures, as the frozen types its stages hand each other and report.json holds.

`VerifyReport` (verify/report.py) serializes them with `json_fields.to_json_value` and reads them back by
their type hints (`json_fields.dataclass_from_json`), so a field nobody writes cannot be read.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8kv.checks import FAIL, WARN, Finding


@dataclass(frozen=True)
class StaticSummary:
    """What the checkpoint files say, before any model runs: the conventions holding scales, which ones the
    config declares, whether it has a kv_cache_scheme, the strategy, and KV layers without or beyond scales."""

    conventions: tuple[str, ...]
    declared: dict[str, bool]  # convention -> whether the config files declare it
    has_kv_cache_scheme: bool
    strategy: str | None
    kv_layers: tuple[int, ...]
    missing_layers: tuple[int, ...]
    unexpected_layers: tuple[int, ...]


# The paired measures where more is better; for the others (KL, negative log-likelihood) less is.
HIGHER_IS_BETTER = frozenset({"top1_agreement"})


@dataclass(frozen=True)
class PairedDifference:
    """One measure with these scales minus the same measure with unit scales, paired over the held-out sequences:
    `measure` is "kl_mean", "top1_agreement" or "nll" (mean negative log-likelihood per predicted token, whose
    exp is the perplexity); `difference` = `ours` - `theirs`, per token, with the sign-flip test's 95 % interval
    [`low`, `high`] over `sequences` sequences and `tokens` tokens, and its one-sided p-value `p_worse` that these
    scales do worse (verify/intervals.py)."""

    measure: str
    ours: float
    theirs: float
    difference: float
    low: float
    high: float
    sequences: int
    tokens: int
    p_worse: float

    @property
    def lower_is_better(self) -> bool:
        return self.measure not in HIGHER_IS_BETTER

    def says_worse(self) -> bool:
        """Whether the interval puts these scales on the worse side of unit scales, zero excluded."""
        return self.low > 0 if self.lower_is_better else self.high < 0

    def says_better(self) -> bool:
        return self.high < 0 if self.lower_is_better else self.low > 0

    def tokens_to_tell(self) -> int | None:
        """About how many held-out tokens would give an interval that excludes zero, where this one does not
        (its width shrinks as one over the square root of the tokens); None where it already does, or for no
        difference at all."""
        half = (self.high - self.low) / 2
        if self.says_worse() or self.says_better() or not abs(self.difference) > 0 or not half > 0:
            return None
        return int(self.tokens * (half / abs(self.difference)) ** 2) + 1


@dataclass(frozen=True)
class Accuracy:
    """The held-out logits of the fp8 caches against the bf16 cache: perplexities, mean and max KL(bf16 || fp8)
    per next-token distribution (nats), top-1 agreement; `_unit`: the same fp8 cache with unit scales;
    `versus_unit`: those measures of the two fp8 caches compared sequence by sequence (empty where either
    went non-finite)."""

    ppl_bf16: float
    ppl_fp8: float
    ppl_fp8_unit: float
    kl_mean: float
    kl_max: float
    top1_agreement: float
    kl_mean_unit: float
    kl_max_unit: float
    top1_agreement_unit: float
    versus_unit: tuple[PairedDifference, ...] = ()


@dataclass(frozen=True)
class QueryCost:
    """What also quantizing Q with q_scale costs (fp8 attention), against the bf16 cache."""

    kl_mean: float
    kl_max: float
    top1_agreement: float
    ppl: float
    max_q_scale: float
    kl_mean_kv_only: float  # the fp8 cache's mean KL with Q unquantized, for comparison


@dataclass(frozen=True)
class CacheShares:
    """One KV layer of the fp8 cache on the held-out text: exact shares of K and V values clamped at ±MAX,
    and the NaN/inf values it stored."""

    k_saturation: float
    v_saturation: float
    nan_with_clamp: int


@dataclass(frozen=True)
class Readback:
    """Whether the runtime's cache holds the file's scales, bit for bit, over `layers` KV layers."""

    equal: bool
    layers: int
    mismatches: tuple[str, ...]  # one line per value that differs


@dataclass(frozen=True)
class LayerRatio:
    """The largest |x| / scale of K and of V one cache layer saw on the held-out text."""

    layer: int
    k_max_ratio: float
    v_max_ratio: float


@dataclass(frozen=True)
class LayerCheck:
    """One cache layer on the held-out text: the largest |x| / scale observed, and what the fp8 cache did
    (exact shares of values clamped at ±MAX, NaN/inf values stored)."""

    layer: int
    k_max_ratio: float
    v_max_ratio: float
    k_saturation: float
    v_saturation: float
    nan_with_clamp: int

    @classmethod
    def of(cls, ratio: LayerRatio, shares: CacheShares) -> LayerCheck:
        return cls(ratio.layer, ratio.k_max_ratio, ratio.v_max_ratio, shares.k_saturation, shares.v_saturation,
                   shares.nan_with_clamp)


@dataclass(frozen=True)
class GenerationMatch:
    """Shares of greedy tokens of the fp8 cache matching the bf16 cache's, per phase (None: no position)."""

    prefill_match: float | None
    decode_match: float | None
    prefix_match: float | None


@dataclass(frozen=True)
class GenerationDetails:
    """What the generation comparison ran: prompts, decode steps, tokens read from shared prefix pages,
    and the bf16 cache's greedy tokens per prompt."""

    prompts: int
    new_tokens: int
    shared_tokens: int
    greedy_tokens: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class EngineResult:
    """One engine model's run over the held-out samples."""

    engine: str
    ppl: float
    nan_rows: int  # logit rows (one per token) with any NaN/inf
    rows: int
    sequences_lost: int  # samples with any non-finite logit
    sequences: int
    first_nonfinite_layer: int | None  # first KV layer whose cache holds a NaN/inf value
    source: str  # the engine, version and file the model reproduces
    verdict: str  # PASS or FAIL for a released engine, "bug model" for a bug
    attention: str = "float32"  # the attention arithmetic its logits come from (the runner's `arithmetic`)
    unread: str = ""  # why the checkpoint's scales do not reach this engine's cache ("": they do)
    known_by: str = ""  # how fp8kv knows what this release does ("": a bug model)
    # against the bf16 cache, and these scales against this engine's own write at unit scales
    accuracy: Accuracy | None = None
    selected_by: str = ""  # a hardware path of its release (the name's /PATH): what makes the release take it


@dataclass(frozen=True)
class Fidelity:
    """KL(transformers || runtime bf16 cache) over `tokens` tokens of `samples` held-out samples.

    `noise` is KL(transformers || transformers with another attention implementation), None where the
    model has one; `bound` = max(MIN_BOUND, NOISE_FACTOR x noise).
    """

    kl_mean: float
    kl_max: float
    noise: float | None
    bound: float
    samples: int
    tokens: int

    @property
    def reproduces(self) -> bool:
        return self.kl_mean <= self.bound  # NaN does not reproduce

    @property
    def refuses(self) -> bool:
        """The runtime is measurably not the model: verify judges nothing."""
        return self.noise is not None and not self.reproduces

    def reasons(self) -> list[Finding]:
        """One FAIL finding when the runtime is not the model (verify then judges nothing); WARN without noise."""
        if self.reproduces:
            return []
        if self.noise is None:
            return [Finding(WARN, f"verify's bf16 runtime is {self.kl_mean:.2e} (mean KL) from transformers on "
                                  f"this model, above {self.bound:.0e}; the model has one attention "
                                  "implementation, so its own rounding noise, and whether this is within it, "
                                  "is unknown")]
        return [Finding(FAIL, f"verify's bf16 runtime does not reproduce transformers on this model: mean KL "
                              f"{self.kl_mean:.2e} against transformers' own forward exceeds the bound "
                              f"{self.bound:.1e}; its fp8 numbers would judge the runtime, not the model, "
                              "so nothing was judged")]


@dataclass(frozen=True)
class Nvfp4Writes:
    """What one NVFP4 cache wrote on the held-out text, every layer's K and V together: blocks whose e4m3 scale
    saturated at 448, fell in e4m3's subnormals, or rounded to 0 over a nonzero value; values clipped at ±6 block
    scales; values whose e2m1 x block scale passed 448, which an fp8 read cannot hold; values written; and, where K
    is an fp8 e4m3 cache (fp8_k_nvfp4_v), the K values clamped at ±448 (0 where K is NVFP4, as in reports before
    fp8_k_nvfp4_v was judged)."""

    saturated_scales: int
    subnormal_scales: int
    zeroed_blocks: int
    clipped_values: int
    fp8_read_over: int
    values: int
    fp8_k_clamped: int = 0


@dataclass(frozen=True)
class VersusFp8:
    """An NVFP4 cache's held-out logits against the fp8 cache's at fp8kv's fp8 scales: mean and max KL(fp8 ||
    NVFP4) per next-token distribution (nats), top-1 agreement, and the fp8 cache's perplexity."""

    kl_mean: float
    kl_max: float
    top1_agreement: float
    ppl_fp8: float


@dataclass(frozen=True)
class Nvfp4PathResult:
    """One NVFP4 path (`verify.nvfp4.Nvfp4Path`: an engine release's, or fp8kv's own for fp8_k_nvfp4_v) run on the
    held-out text: the global scales it runs per KV layer (the stored value times its loader's `factor`; 1.0 where
    it does not load them), the read its attention takes ("fp8": blocks dequantized into e4m3, sm100; "float32":
    sm80, sm90, sm120, and fp8kv's own), what its cache wrote, its logits against the bf16 cache (`accuracy`, whose
    unit scales are the same path at global scale 1.0) and against the fp8 cache, and its verdict."""

    path: str
    known_by: str
    read: str
    loads: bool
    factor: float
    k_scales: tuple[float, ...]
    v_scales: tuple[float, ...]
    writes: Nvfp4Writes
    accuracy: Accuracy
    versus_fp8: VersusFp8
    verdict: str


@dataclass(frozen=True)
class Nvfp4Check:
    """verify of an NVFP4 folder: the convention its global scales are stored in (`stored = amax x headroom /
    divisor`), the fp8 cache at fp8kv's fp8 scales of the same observation (amax x headroom / 448) against the
    bf16 cache, one result per engine path, and the folder's kv dtype (nvfp4 in reports written before
    fp8_k_nvfp4_v was judged)."""

    convention: str
    divisor: float
    fp8: Accuracy
    paths: tuple[Nvfp4PathResult, ...]
    kv_dtype: str = "nvfp4"
