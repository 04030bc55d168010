"""`Engine.generate(..., proofs=False)`: the same engine and the same samples, without capture or proofs."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny_model):
    from gpu_workers.config import WorkerConfig
    from gpu_workers.engine import Engine

    engine = Engine(tiny_model(), 0, WorkerConfig(dtype="float32"), max_model_len=256)
    yield engine
    engine.close()


def _recorded_steps(engine) -> int:
    source = engine.capture.source
    return engine.llm.collective_rpc(lambda worker: len(worker.model_runner._toploc_recorders[source].steps))[0]


def test_proofs_off_gives_the_same_samples_without_proofs_and_records_nothing(engine):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, int(n)).tolist() for n in (4, 17, 40, 9, 63, 25)]
    seeds = [11, 12, 13, 14, 15, 16]
    settings = dict(temperature=1.0, top_p=0.9, max_tokens=45)
    off = engine.generate(prompts, seeds, proofs=False, **settings)
    assert _recorded_steps(engine) == 0  # the hook stayed inactive through a whole generation
    on = engine.generate(prompts, seeds, **settings)
    off_again = engine.generate(prompts[::-1], seeds[::-1], proofs=False, **settings)

    assert [c.tokens for c in off] == [c.tokens for c in on] == [c.tokens for c in off_again[::-1]]
    for a, b in zip(off, on):
        assert a.prompt_tokens == b.prompt_tokens and a.finish == b.finish
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert a.proofs == [] and a.hidden.numel() == 0
        assert len(b.proofs) == math.ceil(len(b.tokens) / 32) and b.hidden.shape[0] == len(b.tokens)
    other = engine.generate(prompts, [s + 100 for s in seeds], proofs=False, **settings)
    assert [c.tokens for c in other] != [c.tokens for c in off]  # the seeds reach the engine
