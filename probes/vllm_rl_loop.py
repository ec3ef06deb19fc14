"""An RL loop in one process: a transformers policy and a vLLM engine (fp8 KV cache) side by side, fresh scales
from the policy's rollouts handed to the running engine after every weight update, and checked live.

Runs in vLLM's venv with fp8kv installed there (`pip install --no-deps -e .`; docs/vllm-live-scales.md):

    bench/.vllm-venv/bin/python probes/vllm_rl_loop.py --out bench/results/vllm_rl_loop.json

The policy is the bundled model in float32. The engine starts on a folder `fp8kv.api.save_scales` wrote from the
policy and the scales of its first rollouts. Then, per step:

1. update: a few AdamW steps on four records of the bundled model's calibration text (standing in for an RL
   objective);
2. refit: the policy's weights into the engine by vLLM's own `reload_weights` (weights alone, no scales); the
   engine scores the prompts (`stale`: new weights, the last step's scales);
3. scales of the policy's sampled rollouts (`api.observing`, `api.scales_from`), handed over by `api.send_scales`
   and read back by `api.check_engine_scales`; on the step named by `--drop-step` they are not sent, and the
   check must say so, before they are sent after all;
4. the engine scores the prompts (`after`), and so does a fresh engine, in a child process, started on the folder
   `api.save_scales` writes for the step (`fresh`). Predicted: `after` equals `fresh` bit for bit, and differs
   from `stale`, since an fp8 cache reads the scales;
5. lifecycle: `reload_weights` with the policy's weights again, `sleep(level=2)` then `wake_up()`, and
   `reload_weights` from the step's folder (weights and scales); the check after each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_live_scales import engine, machine, max_difference, prompt_logprobs

from fp8kv import api
from fp8kv.json_fields import to_json_value
from fp8kv.models import BUNDLED_CALIBRATION_TEXT, BUNDLED_HELDOUT_TEXT, BUNDLED_MODEL_DIR

from outputs import write_json  # probes/outputs.py

ROLLOUT_PROMPT_TOKENS = 24
ROLLOUT_NEW_TOKENS = 32
SCORED_TOKENS = 64
TRAIN_TOKENS = 128


def records(path: Path, count: int, offset: int = 0) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()[offset:offset + count]
    return [json.loads(line)["text"] for line in lines]


def attention_isa(worker: Any) -> list[str]:
    """For `collective_rpc`: the ISA vLLM's CPU attention picked for the layers (`layer.isa`)."""
    return sorted({str(m.isa) for m in worker.get_model().modules() if hasattr(m, "isa")})


def policy_logprobs(policy: Any, scored: list[list[int]]) -> list[list[float]]:
    """The policy's own log-probability of each token after the first (float32, no fp8 cache)."""
    rows = []
    with torch.no_grad():
        for ids in scored:
            logits = policy(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            rows.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist())
    return rows


def mean_difference(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = [(x, y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True)]
    return sum(abs(x - y) for x, y in pairs) / len(pairs)


class Loop:
    """The policy, its optimizer, the prompts, and the engine once started."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.policy = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR, padding_side="left")
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=args.lr)
        texts = records(BUNDLED_HELDOUT_TEXT, args.rollouts + args.scored)
        rollout_ids = [self.tokenizer(t)["input_ids"][:ROLLOUT_PROMPT_TOKENS] for t in texts[:args.rollouts]]
        self.rollout_prompts = self.tokenizer.pad({"input_ids": rollout_ids}, return_tensors="pt")
        self.scored = [self.tokenizer(t)["input_ids"][:SCORED_TOKENS] for t in texts[args.rollouts:]]
        self.train_batch = self.tokenizer(records(BUNDLED_CALIBRATION_TEXT, 4), return_tensors="pt", padding=True,
                                          truncation=True, max_length=TRAIN_TOKENS)
        self.llm: Any = None

    def rollout_scales(self, step: int) -> api.ScaleSet:
        torch.manual_seed(step)
        with api.observing(self.policy) as observation:
            self.policy.generate(**self.rollout_prompts, max_new_tokens=ROLLOUT_NEW_TOKENS, do_sample=True,
                                 pad_token_id=self.tokenizer.pad_token_id)
        return api.scales_from(observation.statistics())

    def update(self) -> float:
        """`--train-steps` AdamW steps on the training batch; the loss before the last."""
        self.policy.train()
        labels = self.train_batch["input_ids"].masked_fill(self.train_batch["attention_mask"] == 0, -100)
        loss = torch.tensor(0.0)
        for _ in range(self.args.train_steps):
            loss = self.policy(**self.train_batch, labels=labels).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
        self.policy.eval()
        return loss.item()

    def save(self, scales: api.ScaleSet, step: int) -> Path:
        return api.save_scales(scales, self.policy, self.work / f"step{step}", tokenizer=self.tokenizer)

    def refit(self) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(self.policy.state_dict().items())})

    def check(self, sent: api.ScaleSet, after: str, checks: list[dict[str, Any]]) -> bool:
        found = api.check_engine_scales(self.llm, sent)
        print(f"-- check after {after}: {'holds the sent scales' if found.ok else 'DOES NOT hold the sent scales'}")
        if not found.ok:
            print(api.render_engine_check(found))
        checks.append({"after": after, "ok": found.ok, "check": to_json_value(found)})
        return found.ok

    def score(self) -> list[list[float]]:
        return prompt_logprobs(self.llm, [{"prompt_token_ids": ids} for ids in self.scored])


def fresh_logprobs(folder: Path, scored: list[list[int]], timeout: int) -> list[list[float]] | str:
    """A fresh engine on `folder`, in a child process (one engine per process): its prompt log-probabilities,
    or why there are none."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--fresh", str(folder), "--scored-ids", json.dumps(scored),
                   "--result", str(result)]
        try:
            child = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"no answer in {timeout} s"
        if not result.exists():
            lines = [line for line in child.stderr.splitlines() if line.strip()]
            return lines[-1] if lines else f"exited with status {child.returncode}"
        return json.loads(result.read_text())


def run_step(loop: Loop, step: int, sent: api.ScaleSet) -> tuple[dict[str, Any], api.ScaleSet]:
    """One weight update and everything checked after it; the scales the engine holds at its end."""
    started = time.perf_counter()
    checks: list[dict[str, Any]] = []
    loss = loop.update()
    loop.refit()
    loop.check(sent, "reload_weights with the new weights (no scales): the last step's scales stay", checks)
    stale = loop.score()
    scales = loop.rollout_scales(step)
    dropped = step == loop.args.drop_step
    if dropped:  # the update a refit path forgets: the check must catch it
        caught = not loop.check(scales, "the new scales were NOT sent (dropped on purpose)", checks)
        checks[-1]["caught"] = caught
    api.send_scales(loop.llm, scales)
    loop.check(scales, "send_scales", checks)
    after = loop.score()
    folder = loop.save(scales, step)
    fresh = fresh_logprobs(folder, loop.scored, loop.args.timeout)
    loop.refit()
    loop.check(scales, "reload_weights with the same weights (no scales)", checks)
    loop.llm.sleep(level=2)
    loop.llm.wake_up()
    loop.check(scales, "sleep(level=2), wake_up()", checks)
    loop.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
    loop.check(scales, "reload_weights from the step's folder (weights and scales)", checks)
    changed = sum(scales.scales.k[i] != sent.scales.k[i] or scales.scales.v[i] != sent.scales.v[i]
                  for i in scales.table.layers)
    record: dict[str, Any] = {
        "step": step, "loss": loss, "dropped": dropped, "layers_with_new_scales": changed,
        "k_scales": {i: scales.scales.k[i][0] for i in scales.table.layers},
        "v_scales": {i: scales.scales.v[i][0] for i in scales.table.layers},
        "checks": checks, "stale_vs_after": max_difference(stale, after),
        "after_vs_policy_mean": mean_difference(after, policy_logprobs(loop.policy, loop.scored)),
        "seconds": None}
    if isinstance(fresh, str):
        record |= {"after_vs_fresh": None, "fresh_error": fresh, "as_predicted": False}
    else:
        record["after_vs_fresh"] = max_difference(after, fresh)
        record["as_predicted"] = record["after_vs_fresh"] == 0.0 and record["stale_vs_after"] > 0.0
    record["checks_as_expected"] = all(c["ok"] != ("caught" in c) for c in checks)
    record["seconds"] = round(time.perf_counter() - started, 1)
    return record, scales


def report(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"vLLM {m['vllm']}, torch {m['torch']}, transformers {m['transformers']}, attention ISA "
             f"{result['attention_isa']}, CPU flags {m['cpu_flags']}",
             f"engine started in {result['engine_start_s']} s; start-up check: "
             f"{'holds the loaded scales' if result['start_check_ok'] else 'DOES NOT hold the loaded scales'}",
             f"{'step':>4} {'loss':>6} {'new':>4} {'stale-after':>12} {'after-fresh':>12} {'after-policy':>13} "
             f"{'checks':>7} {'predicted':>9} {'s':>6}"]
    for s in result["steps"]:
        lines += step_lines(s)
    lines.append("stale-after / after-fresh: max |difference| of the engine's prompt log-probabilities; after-policy: "
                 "mean |difference| from the float32 policy's own; checks: how many held the sent scales (a dropped "
                 "update's must not)")
    return "\n".join(lines)


def step_lines(s: dict[str, Any]) -> list[str]:
    """A step's row of the table, and a line on a dropped update."""
    checks = f"{sum(c['ok'] for c in s['checks'])}/{len(s['checks'])}"
    after_fresh = "error" if s["after_vs_fresh"] is None else f"{s['after_vs_fresh']:.3g}"
    row = (f"{s['step']:>4} {s['loss']:>6.3f} {s['layers_with_new_scales']:>4} {s['stale_vs_after']:>12.4g} "
           f"{after_fresh:>12} {s['after_vs_policy_mean']:>13.4g} {checks:>7} "
           f"{'yes' if s['as_predicted'] else 'NO':>9} {s['seconds']:>6}")
    return [row, *(f"     dropped update: the check {'caught it' if c['caught'] else 'MISSED it'}"
                   for c in s["checks"] if "caught" in c)]


def score_fresh(folder: str, scored: list[list[int]]) -> list[list[float]]:
    return prompt_logprobs(engine(folder, "fp8"), [{"prompt_token_ids": ids} for ids in scored])


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--steps", type=int, default=3, help="weight updates")
    options.add_argument("--drop-step", type=int, default=2, help="the step whose scales are dropped on purpose (0: none)")
    options.add_argument("--train-steps", type=int, default=4, help="AdamW steps per update")
    options.add_argument("--lr", type=float, default=1e-4)
    options.add_argument("--rollouts", type=int, default=8, help="sampled rollouts per step")
    options.add_argument("--scored", type=int, default=4, help="held-out prompts the engines score")
    options.add_argument("--out", type=Path, help="where to write the results JSON")
    options.add_argument("--timeout", type=int, default=600, help="seconds for each fresh engine")
    options.add_argument("--fresh", help=argparse.SUPPRESS)
    options.add_argument("--result", help=argparse.SUPPRESS)
    options.add_argument("--scored-ids", help=argparse.SUPPRESS)
    args = options.parse_args()
    if args.fresh:
        Path(args.result).write_text(json.dumps(score_fresh(args.fresh, json.loads(args.scored_ids))))
        sys.stdout.flush()
        os._exit(0)  # the engine's exit handlers can hang

    with tempfile.TemporaryDirectory(prefix="fp8kv-rl-") as tmp:
        loop = Loop(args, Path(tmp))
        scales = loop.rollout_scales(0)
        started = time.perf_counter()
        loop.llm = engine(str(loop.save(scales, 0)), "fp8")
        result: dict[str, Any] = {"machine": machine(), "engine_start_s": round(time.perf_counter() - started, 1),
                                  "attention_isa": loop.llm.collective_rpc(attention_isa)[0], "options": {
                                      k: v for k, v in vars(args).items() if k not in ("fresh", "result", "scored_ids",
                                                                                       "out")}}
        result["start_check_ok"] = api.check_engine_scales(loop.llm, scales).ok
        # Without sleep mode (which vLLM's CPU platform refuses) sleep and wake_up reach the workers, which only log.
        result["sleep_mode_enabled"] = loop.llm.llm_engine.vllm_config.model_config.enable_sleep_mode
        result["steps"] = []
        for step in range(1, args.steps + 1):
            record, scales = run_step(loop, step, scales)
            result["steps"].append(record)
            print("\n".join(step_lines(record)), flush=True)
    result["machine"]["load_average_after"] = os.getloadavg()
    print(report(result))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # a running engine: its exit handlers can hang
