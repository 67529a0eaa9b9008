"""pi_env.workspace.tinker against the real tinker-cookbook (0.5.8 / 0.6.x): envs built through
`build_agent_tool_env`, episodes run by the cookbook's own rollout loop (`do_group_rollout`)
with a scripted token policy, the qwen3_instruct renderer over a real HF tokenizer, limits,
`step(action, *, extra=...)`, and pickling of the builders.

The tokenizer: no model tokenizer can be downloaded here, so the test builds one offline with
the `tokenizers` library: byte-level (256 byte tokens, no merges) plus Qwen's chat special
tokens, saved with `save_pretrained` and loaded by the cookbook's own `get_tokenizer(<dir>)`
(AutoTokenizer). Every text round-trips exactly, which is all the renderer needs; what it does
not exercise is a real model vocabulary's merges.

Needs the optional extra (`pip install -e '.[tinker]'`); `bash scripts/test_harness.sh` installs
it into `.venv-harness` and runs this file. Without it the tests are skipped with the reason.
"""

import asyncio
import json
import os
import pickle
from importlib.util import find_spec

import pytest

from pi_env.workspace import WorkspaceLimits, WorkspaceTask, generate_tasks
from pi_env.workspace.oracle import reference_program

HAVE_TINKER = find_spec("tinker_cookbook") is not None
if os.environ.get("HARNESS_TIER") == "1" and not HAVE_TINKER:  # set by scripts/test_harness.sh
    raise RuntimeError("HARNESS_TIER=1, but tinker_cookbook is not importable: the tier runs every test")
pytestmark = [
    pytest.mark.skipif(not HAVE_TINKER, reason="tinker-cookbook is not installed (optional extra: pip install "
                                               "-e '.[tinker]'; bash scripts/test_harness.sh runs these tests)"),
    pytest.mark.needs_bwrap,
]
RENDERER = "qwen3_instruct"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return str(path)


class ScriptedPolicy:
    """A cookbook TokenCompleter that answers turn k of a conversation with turns[k] (encoded
    with the env's tokenizer, ended by <|im_end|>). Synthetic: it stands in for the sampler.
    It reads k from the prompt, so one policy serves every env of a group."""

    def __init__(self, tokenizer, turns: list[str], stop_reason: str = "stop"):
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.stop_reason = stop_reason
        self.prompts: list[str] = []

    async def __call__(self, model_input, stop, *, max_tokens=None):
        from tinker_cookbook.completers import TokensWithLogprobs

        prompt = self.tokenizer.decode(model_input.to_ints())
        self.prompts.append(prompt)
        turn = prompt.count("<|im_start|>assistant") - 1  # the prompt ends with the open turn
        text = self.turns[turn] if turn < len(self.turns) else "I give up."
        tokens = self.tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
        return TokensWithLogprobs(tokens=tokens, maybe_logprobs=[0.0] * len(tokens), stop_reason=self.stop_reason)


def tool_call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def oracle_text(task: WorkspaceTask) -> list[str]:
    return [tool_call("write", path=task.program, content=reference_program(task)),
            tool_call("bash", command=task.command),
            f"The answer is {task.expected}"]


def builder_for(task, tokenizer_dir, **options):
    from pi_env.workspace.tinker import WorkspaceEnvGroupBuilder

    return WorkspaceEnvGroupBuilder(task, model_name=tokenizer_dir, renderer_name=RENDERER, **options)


def rollout(builder, policy):
    """The cookbook's own group rollout (make_envs, episodes, group rewards, cleanup)."""
    from tinker_cookbook.rl.rollouts import do_group_rollout

    return asyncio.run(do_group_rollout(builder, policy))


def tokenizer_of(tokenizer_dir):
    """The policy's own tokenizer instance: a HF fast tokenizer must not be shared with the
    renderer, which encodes in worker threads ("Already borrowed")."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_oracle_episodes_through_the_cookbook_rollout_loop(tokenizer_dir):
    tasks = generate_tasks(6, seed=5)
    tasks = [tasks[0], tasks[5]]  # families take turns, then languages
    assert {t.language for t in tasks} == {"python", "javascript"}
    for task in tasks:
        builder = builder_for(task, tokenizer_dir, group_size=2)
        tok = tokenizer_of(tokenizer_dir)
        policy = ScriptedPolicy(tok, oracle_text(task))
        group = rollout(builder, policy)
        assert group.get_total_rewards() == [1.0, 1.0], task.task_id
        for trajectory in group.trajectories_G:
            assert trajectory.stop_reason == "completed" and len(trajectory.transitions) == 3
            final = trajectory.transitions[-1].metrics
            assert final["output_correct"] == 1.0 and final["final_correct"] == 1.0
            assert final["infrastructure_error"] == 0.0
        first_prompt = policy.prompts[0]
        assert '"name": "bash"' in first_prompt and task.question in first_prompt  # tools declared
        # the program's run came back to the model as a tool response (both envs: 2 such prompts)
        assert sum('"output_correct": true' in p and "<tool_response>" in p for p in policy.prompts) == 2
        assert builder._episodes == []  # cleanup ran; each sandbox was closed at grading


def test_shaped_and_eval_rewards_and_sandbox_closed_at_episode_end(tokenizer_dir):
    task = generate_tasks(1, seed=9)[0]
    wrong_final = oracle_text(task)[:2] + ["The answer is -1"]
    tok = tokenizer_of(tokenizer_dir)
    group = rollout(builder_for(task, tokenizer_dir), ScriptedPolicy(tok, wrong_final))
    assert group.get_total_rewards() == [pytest.approx(0.9)]
    group = rollout(builder_for(task, tokenizer_dir, mode="eval"), ScriptedPolicy(tok, wrong_final))
    assert group.get_total_rewards() == [0.0]

    async def one_episode():
        builder = builder_for(task, tokenizer_dir)
        (env,) = await builder.make_envs()
        episode = builder._episodes[0]
        await env.initial_observation()
        for text in oracle_text(task)[:2]:
            step = await env.step(tok.encode(text + "<|im_end|>", add_special_tokens=False), extra=None)
            assert not step.episode_done
        host_dir = episode.workspace._sandbox.host_dir
        assert os.path.isdir(host_dir)
        step = await env.step(tok.encode(oracle_text(task)[2] + "<|im_end|>", add_special_tokens=False),
                              extra={"stop_reason": "stop"})
        assert step.episode_done and step.reward == 1.0
        assert not os.path.exists(host_dir)  # graded, then the sandbox was deleted
        await builder.cleanup()

    asyncio.run(one_episode())


def test_step_with_length_stop_and_limits(tokenizer_dir):
    task = generate_tasks(1, seed=4)[0]
    tok = tokenizer_of(tokenizer_dir)

    async def length_stop():
        builder = builder_for(task, tokenizer_dir)
        (env,) = await builder.make_envs()
        await env.initial_observation()
        step = await env.step(tok.encode("<tool_call>\n{\"name\": \"wri", add_special_tokens=False),
                              extra={"stop_reason": "length"})
        await builder.cleanup()
        return step

    step = asyncio.run(length_stop())
    assert step.episode_done and step.reward == -0.1 and step.metrics["stop/max_tokens"] == 1.0

    # max_turns: a model that keeps reading ends after 2 turns, graded (nothing achieved: 0.0)
    reader = ScriptedPolicy(tok, [tool_call("read", path=next(iter(task.files)))] * 5)
    group = rollout(builder_for(task, tokenizer_dir, max_turns=2), reader)
    assert group.trajectories_G[0].stop_reason == "max_turns" and len(group.trajectories_G[0].transitions) == 2
    assert group.get_total_rewards() == [0.0]

    # max_tool_calls: two calls in one turn with a budget of one: only the write runs, then stop
    both = tool_call("write", path=task.program, content=reference_program(task)) + tool_call("bash", command=task.command)
    group = rollout(builder_for(task, tokenizer_dir, max_tool_calls=1), ScriptedPolicy(tok, [both]))
    trajectory = group.trajectories_G[0]
    assert trajectory.stop_reason == "max_tool_calls"
    assert group.get_total_rewards() == [pytest.approx(0.15)]  # the write succeeded, nothing ran

    # max_trajectory_tokens: the prompt alone is over budget
    group = rollout(builder_for(task, tokenizer_dir, max_trajectory_tokens=100, max_generation_tokens=10),
                    ScriptedPolicy(tok, oracle_text(task)))
    assert group.trajectories_G[0].stop_reason == "max_tokens" and group.get_total_rewards() == [-0.1]


def test_tool_calls_in_one_turn_run_in_order(tokenizer_dir):
    task = generate_tasks(1, seed=6)[0]
    tok = tokenizer_of(tokenizer_dir)
    turn = (tool_call("write", path=task.program, content="print(0)\n" if task.language == "python" else "console.log(0)\n")
            + tool_call("edit", path=task.program, oldText="0", newText=str(task.expected))
            + tool_call("bash", command=task.command))
    group = rollout(builder_for(task, tokenizer_dir), ScriptedPolicy(tok, [turn, f"It is {task.expected}"]))
    assert group.get_total_rewards() == [1.0]


def test_missing_runtime_is_an_infrastructure_error_through_the_adapter(tokenizer_dir):
    from pi_env.workspace import available_languages

    if "julia" in available_languages():
        pytest.skip("julia is installed here")
    task = generate_tasks(1, languages=["julia"], require_runtimes=False)[0]
    tok = tokenizer_of(tokenizer_dir)
    turns = [tool_call("write", path=task.program, content="println(1)\n"), tool_call("bash", command=task.command),
             f"{task.expected}"]
    group = rollout(builder_for(task, tokenizer_dir), ScriptedPolicy(tok, turns))
    assert group.get_total_rewards() == [-0.1]
    assert group.trajectories_G[0].transitions[-1].metrics["infrastructure_error"] == 1.0


def test_builders_pickle_and_the_dataset_builder_makes_disjoint_splits(tokenizer_dir):
    from pi_env.workspace.tinker import WorkspaceDatasetBuilder, WorkspaceEnvGroupBuilder

    task = generate_tasks(1)[0]
    builder = builder_for(task, tokenizer_dir, group_size=3, limits=WorkspaceLimits(timeout_s=5))
    copy = pickle.loads(pickle.dumps(builder))
    assert isinstance(copy, WorkspaceEnvGroupBuilder) and copy.task == task and copy.group_size == 3
    assert copy.limits.timeout_s == 5

    async def made():
        envs = await builder.make_envs()  # live envs (and renderer) do not travel with a pickle
        again = pickle.loads(pickle.dumps(builder))
        assert again._episodes == [] and len(builder._episodes) == 3
        await builder.cleanup()
        return envs, await again.make_envs(), again

    envs, envs_again, again = asyncio.run(made())
    assert len(envs) == 3 and len(envs_again) == 3
    asyncio.run(again.cleanup())

    dataset_builder = WorkspaceDatasetBuilder(model_name=tokenizer_dir, renderer_name=RENDERER, batch_size=4,
                                              group_size=2, n_train=10, n_eval=3, seed=2)
    dataset_builder = pickle.loads(pickle.dumps(dataset_builder))
    train, test = asyncio.run(dataset_builder())
    assert len(train) == 3 and len(test) == 1
    assert [len(train.get_batch(i)) for i in range(3)] == [4, 4, 2]
    train_builders = [b for i in range(len(train)) for b in train.get_batch(i)]
    test_builders = test.get_batch(0)
    assert {b.group_size for b in train_builders} == {2} and {b.mode for b in train_builders} == {"train"}
    assert {b.group_size for b in test_builders} == {1} and {b.mode for b in test_builders} == {"eval"}
    assert not {b.task.digest() for b in train_builders} & {b.task.digest() for b in test_builders}
    pickle.loads(pickle.dumps(train.get_batch(0)))
    with pytest.raises(IndexError):
        train.get_batch(3)
