"""The `verifiers` adapter (`gpu_workers.envs.verifiers_adapter`): environments written against verifiers' classic
API (tests/verifiers_envs.py) played through our episode protocol with scripted model turns.

Reference: verifiers itself. The same environment is driven by its own rollout loop (`MultiTurnEnv.rollout`) with
a stand-in chat client that returns the same model turns as the chat API would (content and tool calls), and
scored by its own rubric (`score_rollout`); the episode's environment turns, conversation and reward must equal
what verifiers made of them.
"""

from __future__ import annotations

import asyncio
import copy
import random
import socket
import sys
import types

import numpy as np
import pytest

from bridge.rollouts import FINISH_LENGTH, FINISH_STOP
from gpu_workers.envs import EpisodeLimits, get_environment
from gpu_workers.envs.episode import Protocol, judge, model_turns, play, turn_seed
from gpu_workers.tasks.dataset import Task

try:
    import verifiers as vf
except ImportError as err:  # the `verifiers` extra is not installed
    vf, WHY = None, f"verifiers is not installed (pip install -e '.[verifiers]' -c constraints.txt): {err}"
else:
    WHY = ""
needs_vf = pytest.mark.skipif(vf is None, reason=WHY)
# verifiers' own scoring of an async reward function (which it does not await) leaves its coroutine unawaited
pytestmark = pytest.mark.filterwarnings("ignore:coroutine 'async_correct' was never awaited:RuntimeWarning")
TASK = Task(prompt="Guess my number.", reward="exact", answer="5")


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model())


@pytest.fixture(scope="module")
def stop(tokenizer) -> int:
    return int(tokenizer.convert_tokens_to_ids("<|im_end|>"))


def env(load: str, **config):
    return get_environment("verifiers", {"load": f"verifiers_envs:{load}", **config})


def scripted(tokenizer, stop, scripts: list[list[str]], seeds: list[int]):
    """`generate` for `play`: turn k of sample i is scripts[i][k] then the stop token (found by its turn seed)."""
    who = {turn_seed(s, k): (i, k) for i, s in enumerate(seeds) for k in range(8)}

    def generate(prompts, turn_seeds, caps):
        outs = []
        for seed, cap in zip(turn_seeds, caps):
            i, k = who[seed]
            ids = ([int(t) for t in tokenizer.encode(scripts[i][k], add_special_tokens=False)] + [stop])[:cap]
            finish = FINISH_STOP if ids[-1] == stop else FINISH_LENGTH
            outs.append(types.SimpleNamespace(tokens=ids, logprobs=[0.0] * len(ids), full_logprobs=None, hidden=None))
            outs[-1].finish = finish
        return outs

    return generate


def play_one(protocol, task, seed, script):
    tokenizer_generate = scripted(protocol.tokenizer, protocol.stop, [script], [seed])
    (rollout,) = play(protocol, [task], [seed], tokenizer_generate)
    return rollout


def protocol_for(environment, tokenizer, stop, **limits) -> Protocol:
    p = Protocol.for_tokenizer(environment, tokenizer, EpisodeLimits(**{"max_turns": 4, **limits}), [stop])
    p.tokenizer, p.stop = tokenizer, stop
    return p


class ChatClient:
    """What verifiers' rollout calls for each model turn: returns the scripted turns as ChatCompletions, with
    their tool calls as the chat API's tool parser gives them (ids call_<turn>_<i>)."""

    def __init__(self, turns: list[tuple[str, list[tuple[str, str]]]]):
        self.turns, self.seen = list(turns), []
        self.chat = types.SimpleNamespace(completions=types.SimpleNamespace(create=self.create))

    async def create(self, model, messages, **kwargs):
        turn = len(self.seen)
        self.seen.append(copy.deepcopy(messages))
        content, calls = self.turns[turn]
        tool_calls = [
            {"id": f"call_{turn}_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)
        ]
        return vf.types.ChatCompletion.model_validate(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 1,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": content, "tool_calls": tool_calls or None},
                    }
                ],
            }
        )


def reference(environment, turns):
    """verifiers' own rollout and score of the environment's first dataset row with the model turns `turns`."""
    row = environment.dataset[0]
    completion, state = asyncio.run(
        environment.rollout(ChatClient(turns), "m", row["prompt"], answer=row["answer"], task="default", info={})
    )
    score = asyncio.run(
        environment.rubric.score_rollout(row["prompt"], completion, row["answer"], state, task="default", info={})
    )
    return row["prompt"], completion, state, score


def conversation_tokens(tokenizer, messages) -> str:
    """The chat template over a whole conversation (roles and text): the independent rendering."""
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    rendered = tokenizer.apply_chat_template(plain, tokenize=False)
    return rendered.removesuffix("\n")


@needs_vf
def test_a_multiturn_env_plays_as_verifiers_itself_plays_it(tokenizer, stop):
    adapter = env("load_guess")
    protocol = protocol_for(adapter, tokenizer, stop)
    script = ["7", "I think 3", "hmm", "5"]
    r = play_one(protocol, TASK, 11, script)
    prompt, completion, state, score = reference(adapter.env, [(t, []) for t in script])
    # verifiers: Too high, Too low, asks for a number, then complete; reward 1 + 0.5 / 4 turns + 0.01 * 3 replies
    # + 0.001 * 3 guesses logged in its state
    assert [m["content"] for m in completion if m["role"] == "user"] == [
        "Too high.",
        "Too low.",
        "Please answer with a number.",
    ]
    assert score.reward == pytest.approx(1.158) and state["turn"] == 4
    assert r.turns == 4 and r.ended == "the environment ended the episode" and r.finish == FINISH_STOP
    assert tokenizer.decode(r.tokens, skip_special_tokens=False) == conversation_tokens(tokenizer, prompt + completion)
    assert r.reward == pytest.approx(score.reward) and r.success
    assert r.reason == "verifiers rubric: correct=1, few_turns=0.25, env_replies=3, logged_guesses=3"
    episode = adapter.start(TASK, 11)
    assert [episode.respond(t) is None for t in script] == [False, False, False, True]
    assert episode.prompt_messages() == prompt and episode.completion == completion
    # the validator's re-run of the same environment accepts it and recomputes the reward
    j = judge(protocol, TASK, 11, r.tokens, r.sampled, r.prompt_len, r.finish)
    assert j.passed, j.reasons
    assert j.reward == pytest.approx(score.reward) and j.turns == 4
    # a forged environment turn ("Too low." for "Too high.") is rejected
    a, b = model_turns(np.array(r.sampled), r.prompt_len)[:2]
    forged_env = protocol.renderer.env_tokens([_turn("Too low.")], stop)
    tokens = r.tokens[: a[1]] + forged_env + r.tokens[b[0] :]
    sampled = r.sampled[: a[1]] + [0] * len(forged_env) + r.sampled[b[0] :]
    j = judge(protocol, TASK, 11, tokens, sampled, r.prompt_len, r.finish)
    assert not j.passed and "environment turn 0 is not the environment's" in j.reasons[0]


def _turn(text):
    from gpu_workers.envs import EnvTurn

    return EnvTurn(text)


@needs_vf
def test_an_episode_our_limits_end_is_scored_as_verifiers_scores_it_at_that_many_turns(tokenizer, stop):
    """max_turns 2 here (the environment allows 6): the environment's answer to turn 2 is never shown, and the
    reward is what verifiers gives an environment whose own max_turns is 2."""
    script = ["7", "3", "5"]
    r = play_one(protocol_for(env("load_guess"), tokenizer, stop, max_turns=2), TASK, 3, script)
    _, completion, state, score = reference(env("load_guess", args={"max_turns": 2}).env, [(t, []) for t in script])
    assert r.turns == 2 and state["turn"] == 2 and completion[-1] == {"role": "assistant", "content": "3"}
    # 0.5 / 2 turns + 0.01 * 1 reply + 0.001 * 1 guess logged: the reply to turn 2 and its state are not scored
    assert r.reward == pytest.approx(score.reward) == pytest.approx(0.261) and not r.success


@needs_vf
def test_tool_calls_written_as_text_run_the_tools_as_the_chat_api_would(tokenizer, stop):
    adapter = env("load_tools")
    protocol = protocol_for(adapter, tokenizer, stop)
    add23 = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
    script = [
        f"Let me add.<tool_call>{add23}</tool_call>",
        '<tool_call>{"name": "capital", "arguments": {"country": "France"}}</tool_call>\n'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        "The answer is 5.",
    ]
    calls = [
        ("Let me add.", [("add", '{"a": 2, "b": 3}')]),
        ("", [("capital", '{"country": "France"}'), ("nope", "{}")]),
        ("The answer is 5.", []),
    ]
    r = play_one(protocol, TASK, 5, script)
    prompt, completion, state, score = reference(adapter.env, calls)
    tool_outputs = [m["content"] for m in completion if m["role"] == "tool"]
    assert tool_outputs == ["5", "Paris", "'nope'"]  # the unknown tool: verifiers' error message (KeyError's)
    assert score.reward == pytest.approx(1.0 + 0.1 * 3)
    assert r.turns == 3 and r.reward == pytest.approx(score.reward)
    episode = adapter.start(TASK, 5)
    assert [episode.respond(t) is None for t in script] == [False, False, True]
    assert episode.completion == completion and episode.prompt == prompt  # tool calls, ids, tool messages
    # the model is shown the tools and the call format in the system message
    text = tokenizer.decode(r.tokens[: r.prompt_len])
    assert '"name": "add"' in text and '"name": "capital"' in text and "<tool_call>" in text
    # the environment turns are verifiers' tool messages (two calls: one turn of two tool messages)
    spans = model_turns(np.array(r.sampled), r.prompt_len)
    env_texts = [tokenizer.decode(r.tokens[b:a], skip_special_tokens=False) for (_, b), (a, _) in zip(spans, spans[1:])]
    assert env_texts == [
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>tool\nParis<|im_end|>\n<|im_start|>tool\n'nope'<|im_end|>\n<|im_start|>assistant\n",
    ]
    j = judge(protocol, TASK, 5, r.tokens, r.sampled, r.prompt_len, r.finish)
    assert j.passed and j.reward == pytest.approx(score.reward)
    # a malformed call is no call (the chat API's parser leaves it as text): the episode ends there
    bad = play_one(protocol, TASK, 6, ["<tool_call>{add 2 3}</tool_call>"])
    assert bad.turns == 1 and bad.ended == "the environment ended the episode" and bad.reward == 0.0


@needs_vf
def test_async_reward_functions_are_awaited(tokenizer, stop):
    adapter = env("load_async_reward")
    r = play_one(protocol_for(adapter, tokenizer, stop), TASK, 1, ["9", "5"])
    assert r.reward == pytest.approx(1.0 + 0.25 / 2) and r.reason == "verifiers rubric: async_correct=1, few_turns=0.5"
    _, completion, state, _ = reference(env("load_guess").env, [("9", []), ("5", [])])
    with pytest.raises(TypeError):  # verifiers 0.1.2's own scoring does not await them
        asyncio.run(adapter.env.rubric.score_rollout([], completion, "5", state))

    async def inside_a_running_loop():  # coroutines then run on a helper thread's loop
        episode = adapter.start(TASK, 1)
        assert episode.respond("9")[0].text == "Too high." and episode.respond("5") is None
        return episode.reward().value

    assert asyncio.run(inside_a_running_loop()) == pytest.approx(r.reward)


@needs_vf
def test_unseeded_randomness_is_drawn_from_the_task_and_seed(tokenizer, stop):
    adapter = env("load_guess", args={"hints": True})

    def env_turns(seed):
        episode = adapter.start(TASK, seed)
        return [episode.respond(t)[0].text for t in ("9", "1", "8")]

    before = random.getstate()
    first = env_turns(7)
    assert random.getstate() == before  # the process's own generator is left as it was
    assert env_turns(7) == first and first[0].startswith("Too high. (hint ")
    assert len({tuple(env_turns(s)) for s in (7, 8, 9)}) == 3
    assert len(set(first)) == 3  # every call draws afresh
    # and the validator's re-run of a worker's episode gets the same hints
    protocol = protocol_for(adapter, tokenizer, stop)
    r = play_one(protocol, TASK, 7, ["9", "1", "5"])
    assert judge(protocol, TASK, 7, r.tokens, r.sampled, r.prompt_len, r.finish).passed


@needs_vf
def test_network_and_processes_are_refused_while_the_environment_runs(tokenizer, stop, tmp_path):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        adapter = env("load_network", args={"port": server.getsockname()[1]})
        r = play_one(protocol_for(adapter, tokenizer, stop), TASK, 1, ["7", "5"])
        assert r.turns == 1 and r.reward == 0.0 and not r.success
        assert "socket.getaddrinfo" in r.ended and "may not use the network" in r.ended  # create_connection's lookup
        with pytest.raises(TimeoutError):
            server.accept()  # nothing connected
    marker = tmp_path / "ran"
    call = f'<tool_call>{{"name": "shell", "arguments": {{"command": "touch {marker}"}}}}</tool_call>'
    r = play_one(protocol_for(env("load_shell_tool"), tokenizer, stop), TASK, 1, [call, "done"])
    assert r.turns == 1 and r.reward == 0.0 and "subprocess.Popen" in r.ended
    assert not marker.exists()
    # outside the environment's calls nothing is blocked
    with socket.create_server(("127.0.0.1", 0)) as s, socket.create_connection(s.getsockname()):
        pass


@needs_vf
@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"load": "no_such_module:load"}, "cannot import 'no_such_module'"),
        ({"load": "verifiers_envs:load_nothing"}, "has no function 'load_nothing'"),
        ({"load": "verifiers_envs"}, "module 'verifiers_envs' has no function 'load_environment'"),
        ({"load": ""}, 'expected "package.module:function"'),
        ({}, 'expected "package.module:function"'),
        ({"load": "verifiers_envs:load_not_an_env"}, "returned dict, not a verifiers MultiTurnEnv"),
        ({"load": "verifiers_envs:load_broken"}, "raised RuntimeError: this environment cannot be built"),
        ({"load": "verifiers_envs:load_guess", "args": {"colour": 1}}, "raised TypeError"),
        ({"load": "verifiers_envs:load_guess", "args": [1]}, "data.env_config.args: expected a table"),
        ({"load": "verifiers_envs:load_with_client"}, "holds a model client"),
        ({"load": "verifiers_envs:load_judge"}, "scores with a judge model"),
        ({"load": "verifiers_envs:load_completion_env"}, "message_type 'completion'"),
        ({"load": "verifiers_envs:load_guess", "tool_call": "hermes"}, r"no setting \['tool_call'\]"),
        ({"load": "verifiers_envs:load_guess", "tool_calls": "json"}, "expected 'hermes' or 'none'"),
    ],
)
def test_a_bad_load_path_or_environment_is_refused_naming_why(config, match):
    with pytest.raises(ValueError, match=match):
        get_environment("verifiers", config)


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    from gpu_workers.config import DataConfig
    from gpu_workers.envs.verifiers_adapter import VerifiersUnavailable

    assert DataConfig(env="verifiers").env == "verifiers"  # registered whether or not verifiers is installed
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(VerifiersUnavailable, match=r'pip install -e "\.\[verifiers\]" -c constraints.txt'):
        get_environment("verifiers", {"load": "verifiers_envs:load_guess"})
    monkeypatch.setitem(sys.modules, "verifiers", types.ModuleType("verifiers"))
    with pytest.raises(VerifiersUnavailable, match="has no classic MultiTurnEnv"):
        get_environment("verifiers", {"load": "verifiers_envs:load_guess"})
