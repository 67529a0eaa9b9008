"""pi_env.harness against the real packages: openenv's harness protocols and TrainingTrace
validation, and TRL 1.16's HarnessRolloutWorker loop, on real Pi rollouts (bubblewrap sandbox,
transparent_proxy) against the scripted engine-like server.

These need the optional extra (`pip install -e '.[openenv]'`, plus `.[trl]` for the TRL test);
without it they are skipped with the reason. `bash scripts/test_harness.sh` installs both into
`.venv-harness` and runs this file.
"""

import json
import math
import os
import pickle
import re
import subprocess
import sys
import threading
import time
from functools import partial
from importlib.util import find_spec

import pytest

import pi_env
from helpers import bash, direct_answer, processes_of_uid, scripted_config, wait_for
from pi_env import PiConfig, PiTask, TaskError
from pi_env.scripted import Fault, ScriptedTurn

HAVE_OPENENV = find_spec("openenv") is not None
HAVE_TRL = HAVE_OPENENV and find_spec("trl") is not None and find_spec("datasets") is not None
if os.environ.get("HARNESS_TIER") == "1" and not HAVE_TRL:  # set by scripts/test_harness.sh
    raise RuntimeError("HARNESS_TIER=1, but openenv, trl or datasets is not importable: the tier runs every test")
needs_openenv = pytest.mark.skipif(
    not HAVE_OPENENV, reason="openenv is not installed (optional extra: pip install -e '.[openenv]'; "
                             "bash scripts/test_harness.sh runs these tests)")
needs_trl = pytest.mark.skipif(
    not HAVE_TRL, reason="trl 1.16 is not installed (optional extra: pip install -e '.[openenv,trl]' with the CPU "
                         "torch; bash scripts/test_harness.sh runs this test)")


TWO_TURNS = [bash("echo hi > a.txt"), ScriptedTurn(reasoning="checking", text="All done.")]
TASKS = [PiTask(task_id="write-a", instruction="write a.txt", verify=["test -f a.txt"]),
         PiTask(task_id="half", instruction="write b.txt", verify=["test -f a.txt", "test -f b.txt"]),
         PiTask(task_id="never", instruction="write c.txt", verify=["false"])]


@pytest.fixture(scope="module")
def oe():
    """openenv's harness module (imported once: its cold import takes about 10 s)."""
    import openenv.core.harness as harness

    return harness


@pytest.fixture
def factory_for(server):
    """factory_for(script, **config) -> a HarnessSessionFactory against the scripted server."""
    from pi_env.harness import HarnessSessionFactory

    def make(script, *, tasks=TASKS, sampling=None, **overrides):
        key = server.add_script(script)
        return HarnessSessionFactory(scripted_config(server, key, **overrides), tasks=tasks, sampling=sampling)

    return make


# -- no openenv needed ----------------------------------------------------------------------


def test_core_import_stays_free_of_openenv():
    code = ("import sys, pi_env, pi_env.rollout; from pi_env import PiSessionFactory; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('openenv', 'trl', 'torch')], sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_harness_without_openenv_names_the_extra():
    # A fresh interpreter where openenv cannot be imported, installed here or not.
    code = "import sys; sys.modules['openenv'] = None; import pi_env.harness"
    outcome = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert outcome.returncode != 0
    assert "ImportError: pi_env.harness needs the openenv package: pip install 'pi-env[openenv]'" in outcome.stderr


def test_core_factory_forces_sampling_only_where_it_can():
    from pi_env import PiSessionFactory

    factory = PiSessionFactory(PiConfig(), sampling={"temperature": 0.7, "top_k": -1})
    assert factory.config.mode.name == "transparent_proxy"  # nobody chose a mode: the one that can force it
    assert factory.config.mode.sampling == {"temperature": 0.7, "top_k": -1}
    chosen = PiConfig(mode={"name": "transparent_proxy", "sampling": {"seed": 3}})
    factory = PiSessionFactory(chosen, sampling={"temperature": 0.7, "top_k": -1})
    assert factory.config.mode.sampling == {"seed": 3, "temperature": 0.7, "top_k": -1}
    assert chosen.mode.sampling == {"seed": 3}  # the caller's config is not changed
    with pytest.raises(ValueError, match="black_box relays"):
        PiSessionFactory(PiConfig(mode="black_box"), sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="black_box relays"):
        PiSessionFactory(mode="black_box", sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        PiSessionFactory(sampling={"temperature": 1.0, "max_tokens": 5})


# -- task selection (no rollout) ------------------------------------------------------------


@needs_openenv
def test_create_argument_selects_the_task_and_a_seed_always_the_same_one():
    from pi_env.harness import HarnessSessionFactory, dataset_rows

    factory = HarnessSessionFactory(PiConfig(), tasks=[t.model_dump() for t in TASKS])
    select = factory.select_task
    # A prompt that names no task: the seed chooses, the same seed always the same task.
    for seed in range(7):
        chosen = {select("solve the task", seed=seed).task_id for _ in range(3)}
        assert chosen == {TASKS[seed % 3].task_id}
    assert select([{"role": "user", "content": "unrelated"}], seed=4) == TASKS[1]
    # A prompt that is a task's instruction or id selects it, whatever the seed.
    for seed in (None, 0, 1, 2):
        messages = [{"role": "system", "content": "x"}, {"role": "user", "content": "write b.txt"}]
        assert select(messages, seed=seed) == TASKS[1]
        assert select("  write c.txt\n", seed=seed) == TASKS[2]
        assert select("write-a", seed=seed) == TASKS[0]
    assert select([{"role": "user", "content": [{"type": "text", "text": "write c.txt"}]}]) == TASKS[2]
    # Dataset rows (TRL's conversational format, or with an explicit task or task_id).
    for task, row in zip(TASKS, dataset_rows(TASKS)):
        assert select(row) == task and select(row["prompt"]) == task
    assert select({"prompt": "ignored", "task_id": "never"}) == TASKS[2]
    assert select({"prompt": "ignored", "task": {"instruction": "own", "verify": ["true"]}}).instruction == "own"
    # A task itself.
    assert select(TASKS[2], seed=0) is TASKS[2]
    assert select({"instruction": "a dict task", "verify": ["true"]}).verify == ["true"]
    with pytest.raises(TaskError, match="no seed"):
        select("unrelated")
    with pytest.raises(TaskError, match="not among"):
        select({"prompt": "x", "task_id": "missing"})
    # Without a task list the prompt is the task (no verify: it will be unscored).
    bare = HarnessSessionFactory(PiConfig())
    assert bare.select_task([{"role": "user", "content": "do it"}], seed=3).instruction == "do it"
    with pytest.raises(TaskError):
        bare.select_task(42)


@needs_openenv
def test_factory_is_openenv_and_picklable_as_trl_passes_it(oe):
    from openenv.core.harness.capture.upstream import training_sampling

    from pi_env.harness import HarnessSessionFactory

    make = partial(HarnessSessionFactory, PiConfig(endpoint={"name": "http://127.0.0.1:9/v1", "model": "m"}), tasks=TASKS)
    factory = pickle.loads(pickle.dumps(make))(sampling=training_sampling({"temperature": 0.6}))  # TRL spawns
    assert isinstance(factory, oe.ResourceSessionFactory)
    assert isinstance(factory, pi_env.PiSessionFactory)  # the core factory itself, with openenv's contract
    assert factory.config.mode == "transparent_proxy"
    assert factory.config.mode.sampling == {"temperature": 0.6, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                             "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                             "repetition_penalty": 1.0}
    assert HarnessSessionFactory(PiConfig(mode="black_box")).config.mode == "black_box"  # a chosen mode stays


# -- real rollouts --------------------------------------------------------------------------


@pytest.mark.needs_bwrap
@pytest.mark.slow
@needs_openenv
def test_sessions_satisfy_openenv_and_the_training_trace_passes_its_validation(oe, factory_for, server):
    from openenv.core.harness.capture.upstream import training_sampling
    from openenv.core.harness.capture.validate import check_turn, validate_training_turn

    factory = factory_for(TWO_TURNS, sampling=training_sampling({"temperature": 0.7}))
    factory.set_policy_version(7)  # the trainer's step: every turn says which weights made it
    key = factory.config.endpoint.api_key
    with factory.create([{"role": "user", "content": "write a.txt"}], seed=11, episode_id="ep-1") as session:
        assert isinstance(session, oe.ResourceSession)
        assert isinstance(session, oe.LoopOwningSession) and isinstance(session, oe.TrainableSession)
        assert session.task == TASKS[0] and session.initial_messages()[0]["content"] == "write a.txt"
        assert session.list_tools() == []
        assert session.wait_for_completion(timeout_s=120) == 0
        trace = session.fetch_training_trace()
        proxy = session.fetch_proxy_trace()
        verdict = session.verify([])
        result = session.result
    assert type(trace) is oe.TrainingTrace and len(trace.turns) == 2
    # openenv's own validation, again, on every path a consumer takes.
    oe.TrainingTrace.model_validate(trace.model_dump())
    entries = trace.to_trace_entries()
    rebuilt = oe.TrainingTrace.from_entries(entries)  # (it adds node_id to each turn's metadata)
    assert [t.model_dump(exclude={"metadata"}) for t in rebuilt.turns] == \
        [t.model_dump(exclude={"metadata"}) for t in trace.turns]
    requests = [r.body for r in server.requests if r.api_key == key]
    assert len(requests) == 2
    for turn, request, pi_turn in zip(trace.turns, requests, result.proxy_turns):
        validate_training_turn(turn.prompt_token_ids, turn.completion_token_ids, turn.per_token_logps, turn.loss_mask)
        assert check_turn(turn.prompt_token_ids, turn.completion_token_ids, turn.per_token_logps).ok
        direct = direct_answer(server, key, request)  # what the engine itself says to this request
        assert turn.prompt_token_ids == direct["prompt_token_ids"]
        assert turn.completion_token_ids == direct["choices"][0]["token_ids"] == pi_turn.completion_token_ids
        assert turn.per_token_logps == [e["logprob"] for e in direct["choices"][0]["logprobs"]["content"]]
        assert turn.loss_mask == [0] * len(turn.prompt_token_ids) + [1] * len(turn.completion_token_ids)
        assert turn.request["messages"] == request["messages"] and turn.request["temperature"] == 0.7
        assert turn.metadata["sampling_params"]["temperature"] == 0.7
    assert [t.node_id for t in trace.turns] == ["ep-1:0", "ep-1:1"]
    # Append-only conversation: each prompt extends the previous prompt + completion.
    first, second = trace.turns
    assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(first.completion_token_ids)] == \
        first.prompt_token_ids + first.completion_token_ids
    assert entries[0]["response"]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "bash"
    assert entries[1]["response"]["choices"][0]["message"]["reasoning_content"] == "checking"
    # The diagnostic view: same ids, plus the reward mirror once finished.
    assert [p["completion_token_ids"] for p in proxy] == [t.completion_token_ids for t in trace.turns]
    assert all(p["reward"] == 1.0 and p["metadata"]["node_id"].startswith("ep-1:") for p in proxy)
    assert verdict.env_reward == 1.0 and verdict.done and verdict.metrics["error_kind"] is None
    assert verdict.artifacts["episode_id"] == "ep-1" and verdict.artifacts["seed"] == 11
    # What a trainer computes staleness from (docs/async-rl.md): per turn, and the trace's span.
    assert [t.metadata["policy_version"] for t in trace.turns] == [7, 7]
    assert verdict.artifacts["policy_version_min"] == verdict.artifacts["policy_version_max"] == 7
    assert verdict.artifacts["session_id"] == result.session_id and result.session_id
    assert result.trace_path is None  # no trace_dir: the trace was scratch, deleted with the rollout


@pytest.mark.needs_bwrap
@pytest.mark.slow
@needs_openenv
@pytest.mark.parametrize("agent", ["mini-swe-agent", "qwen-code"])
def test_a_trainer_switches_the_agent_with_one_argument(oe, agent):
    """The same factory, `agent=` named: the oracle drives that agent's own tools, and its
    training trace passes openenv's validation like Pi's."""
    from openenv.core.harness.capture.validate import validate_training_turn

    from pi_env.harness import HarnessSessionFactory

    task = PiTask(task_id="hello", instruction="Create hello.txt containing hello.", verify=["grep -qx hello hello.txt"],
                  solution=[{"tool": "write", "path": "hello.txt", "content": "hello\n"}])
    factory = HarnessSessionFactory(PiConfig(), tasks=[task], agent=agent)
    with factory.create(seed=0) as session:
        assert session.wait_for_completion(timeout_s=300) == 0
        trace, verdict, result = session.fetch_training_trace(), session.verify([]), session.result
    assert result.agent == agent and verdict.env_reward == 1.0, result.error
    assert len(trace.turns) == len([t for t in result.proxy_turns if t.extra_call is None]) >= 2
    for turn in trace.turns:
        validate_training_turn(turn.prompt_token_ids, turn.completion_token_ids, turn.per_token_logps, turn.loss_mask)


@pytest.mark.needs_bwrap
@pytest.mark.slow
@needs_openenv
def test_training_sampling_is_forced_on_every_model_call(factory_for, server):
    from openenv.core.harness.capture.upstream import training_sampling

    sampling = training_sampling({"temperature": 0.3, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                  "repetition_penalty": 1.0})
    factory = factory_for(TWO_TURNS, sampling=sampling)
    with factory.create("write a.txt") as session:
        session.wait_for_completion(timeout_s=120)
    requests = [r.body for r in server.requests if r.api_key == factory.config.endpoint.api_key]
    assert len(requests) == 2
    for body in requests:
        assert {k: body.get(k) for k in sampling} == sampling  # top_k 0 arrives as openenv's -1


@pytest.mark.needs_bwrap
@pytest.mark.slow
@needs_openenv
def test_the_same_seed_rolls_out_the_same_task(factory_for):
    factory = factory_for(TWO_TURNS)
    for seed, reward in ((3, 1.0), (4, 0.5), (3, 1.0)):  # tasks[0] and tasks[1]: TWO_TURNS writes a.txt only
        with factory.create([{"role": "user", "content": "any prompt"}], seed=seed) as session:
            assert session.task == TASKS[seed % 3]
            assert session.verify([]).env_reward == reward


@pytest.mark.needs_bwrap
@pytest.mark.slow
@needs_openenv
@pytest.mark.parametrize("case", ["setup_failed", "agent_error", "endpoint_error", "no_verify", "zero"])
def test_verify_is_none_when_unscorable_and_the_reward_otherwise(factory_for, case):
    script = TWO_TURNS
    task = PiTask(instruction="write a.txt", verify=["test -f nothing-here"])
    if case == "setup_failed":
        task = PiTask(instruction="x", setup=["exit 3"], verify=["true"])
    elif case in ("agent_error", "endpoint_error"):
        status = 400 if case == "agent_error" else 500
        script = [ScriptedTurn(fault=Fault(http_status=status, body={"error": {"message": "boom"}}))]
        task = PiTask(instruction="x", verify=["true"])
    elif case == "no_verify":
        task = PiTask(instruction="x")
    factory = factory_for(script, tasks=None)
    with factory.create(task) as session:
        session.wait_for_completion(timeout_s=120)
        verdict = session.verify([{"role": "assistant", "content": "ignored"}])
        trace = session.fetch_training_trace()  # still valid: failed calls generated nothing
    if case == "zero":  # the agent ran and the verify command failed: a real 0
        assert verdict.env_reward == 0.0 and verdict.metrics["error_kind"] is None
        assert len(trace.turns) == 2
    else:
        assert verdict.env_reward is None and verdict.metrics["error_kind"] == case
        assert len(trace.turns) == (2 if case == "no_verify" else 0)  # the agent ran, or generated nothing


@pytest.mark.needs_bwrap
@pytest.mark.slow
@needs_openenv
def test_timeouts_raise_timeout_error_and_captured_turns_stay_trainable(factory_for):
    """The caller's limit raises TimeoutError (the rollout goes on); the agent's own limit, passed
    after a model call, kills the agent, which is then verified and scored as truncated (never
    dropped: a time-out must not turn a 0 into a sample the trainer leaves out)."""
    script = [bash("echo hi > a.txt"), ScriptedTurn(text="late", fault=Fault(hang_s=300))]
    factory = factory_for(script, tasks=None)
    task = PiTask(instruction="x", verify=["test -f a.txt", "false"], timeouts={"agent_s": 30})  # room for Pi to start
    with factory.create(task) as session:
        assert session.pi_session.wait_for_start(120)
        uid = session.pi_session.sandbox.uid
        with pytest.raises(TimeoutError):
            session.wait_for_completion(timeout_s=0.2)  # the caller's limit: the rollout goes on
        started = time.monotonic()
        session.wait_for_completion()  # the agent's own limit: killed, verified, scored
        assert time.monotonic() - started < 120  # the agent's 30 s limit, not the 300 s hang
        trace = session.fetch_training_trace()
        verdict = session.verify([])
    assert len(trace.turns) == 1 and trace.turns[0].completion_token_ids  # the answered call
    assert verdict.env_reward == 0.5 and verdict.metrics["error_kind"] is None  # what it left: a.txt
    assert verdict.metrics["truncated"] is True and verdict.metrics["stop_reason"] == "timeout"
    assert processes_of_uid(uid) == []


@pytest.mark.needs_bwrap
@pytest.mark.slow
@needs_openenv
def test_close_from_another_thread_ends_a_running_rollout_unscored(factory_for):
    factory = factory_for([ScriptedTurn(text="late", fault=Fault(hang_s=60))], tasks=None)
    session = factory.create(PiTask(instruction="x", verify=["true"]))
    assert session.pi_session.wait_for_start(120)
    uid = session.pi_session.sandbox.uid
    outcome = {}
    waiter = threading.Thread(target=lambda: outcome.setdefault("exit", session.wait_for_completion()))
    waiter.start()
    time.sleep(1.5)
    closers = [threading.Thread(target=session.close) for _ in range(3)]  # idempotent, concurrent
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(30)
    waiter.join(30)
    assert not waiter.is_alive() and outcome["exit"] == -1
    verdict = session.verify([])
    assert verdict.env_reward is None and verdict.metrics["error_kind"] == "infra"
    assert "closed" in verdict.artifacts["error"]
    session.close()
    assert processes_of_uid(uid) == []


@pytest.mark.needs_bwrap
@pytest.mark.slow
@needs_openenv
def test_create_returns_before_setup_and_close_ends_a_setup_at_once(factory_for):
    """A trainer that stops (TRL's worker closes the sessions it holds) must not wait for a
    setup: create() returns once the task and endpoint are checked, and close() mid-setup ends
    the rollout unscored with nothing left running."""
    factory = factory_for([ScriptedTurn(text="never asked")], tasks=None)
    task = PiTask(instruction="x", setup=["sleep 600"], verify=["true"], timeouts={"setup_s": 900})
    started = time.monotonic()
    session = factory.create(task)
    assert time.monotonic() - started < 120  # not the 600 s setup
    uid = wait_for(lambda: session.pi_session.sandbox, 120, "the sandbox").uid
    time.sleep(1)  # the setup command is running
    closed = time.monotonic()
    session.close()
    assert session.wait_for_completion(timeout_s=120) == -1
    assert time.monotonic() - closed < 120
    verdict = session.verify([])
    assert verdict.env_reward is None and verdict.metrics["error_kind"] == "infra"
    assert processes_of_uid(uid) == []
    assert session.pi_session.wait_for_start(0)


@pytest.mark.needs_bwrap
@pytest.mark.slow
@needs_openenv
@pytest.mark.parametrize("case", ["no_ids", "null_logprobs", "black_box"])
def test_a_capture_that_breaks_the_contract_raises(factory_for, server, case):
    from pi_env.scripted.server import EngineQuirks

    script = TWO_TURNS
    overrides = {}
    if case == "no_ids":
        server.quirks = EngineQuirks(ignore_return_token_ids=True)  # an engine without return_token_ids
    elif case == "null_logprobs":
        script = [ScriptedTurn(text="a long enough answer", null_logprob_every=3)]
    else:
        overrides = {"mode": "black_box"}
    factory = factory_for(script, tasks=None, **overrides)
    with factory.create(PiTask(instruction="write a.txt", verify=["true"])) as session:
        session.wait_for_completion(timeout_s=120)
        with pytest.raises(ValueError) as raised:
            session.fetch_training_trace()
        assert session.verify([]).env_reward == 1.0  # the reward is still the rollout's
    message = str(raised.value)
    expected = {"no_ids": "model call 0 .*no prompt_token_ids", "null_logprobs": "model call 0 .*have no logprob",
                "black_box": "black_box mode captures no tokens"}[case]
    assert re.search(expected, message), message


# -- TRL 1.16's HarnessRolloutWorker loop, for real ---------------------------------------------


def _stand_in_tokenizer():
    """A tokenizer built here (no hub): TRL's worker reads its pad id for a metric and needs a
    chat template it knows, which it never renders when the agent owns its loop."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_chat_template

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                        pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = qwen3_chat_template
    return tokenizer


def _drain(unread) -> int:
    """Read what a multiprocessing queue holds now; how many items."""
    import queue

    count = 0
    while True:
        try:
            unread.get_nowait()
        except queue.Empty:
            return count
        count += 1


@pytest.mark.needs_bwrap
@pytest.mark.slow
@pytest.mark.timeout(900)  # the spawned child imports torch, trl and openenv: minutes on a loaded machine
@needs_trl
def test_trl_harness_rollout_worker_trains_on_pi_env_sessions(server, monkeypatch):
    """TRL 1.16's `HarnessRolloutWorker`, for real: it spawns its child process, which builds our
    factory with `sampling=training_sampling(...)`, creates a session per rollout with the
    group's seed, waits, fetches and maps the training trace, verifies, reconciles sequences,
    computes GRPO advantages and queues the samples a trainer consumes. Stand-ins: the worker's
    check that vLLM is installed (vLLM serves the model and takes weight updates; with the agent
    owning its loop the worker never calls it: the model is the scripted engine-like server) and
    the tokenizer above. No trainer steps: that part needs the GPU."""
    import queue

    from accelerate.state import PartialState
    from datasets import Dataset
    from trl.experimental.async_grpo import async_rollout_worker
    from trl.experimental.async_grpo.openenv_harness import HarnessRolloutWorker

    from pi_env.harness import HarnessSessionFactory, dataset_rows

    PartialState()  # what the trainer's Accelerator does before the worker logs
    monkeypatch.setattr(async_rollout_worker, "is_vllm_available", lambda: True)
    # Each rollout's setup draws a coin, so a group's rewards may differ (setup cannot reach the
    # host: a phase with network gets the internet, never the host's loopback).
    fetch = "python3 -c 'import secrets; print(secrets.randbelow(2))' > .parity"
    tasks = [PiTask(task_id=f"parity-{i}", instruction=f"task {i}: write a.txt", setup=[fetch],
                    verify=["test -f a.txt", "test \"$(cat .parity)\" = 1"]) for i in range(2)]
    key = server.add_script(TWO_TURNS)
    worker = HarnessRolloutWorker(
        harness_session_factory=partial(HarnessSessionFactory, scripted_config(server, key), tasks=tasks),
        model_name="scripted-model", dataset=Dataset.from_list(dataset_rows(tasks)), reward_funcs=[],
        processing_class=_stand_in_tokenizer(), eos_token_ids=[1], num_generations=2, max_inflight_tasks=2,
        temperature=0.9, top_p=1.0, top_k=0, child_ready_timeout=240)
    samples = []
    worker.start()
    try:
        deadline = time.monotonic() + 480
        while len(samples) < 4 and time.monotonic() < deadline:
            worker.check_health(stale_after_s=120)
            _drain(worker.metrics_queue)  # what the trainer's log() does each step
            try:
                samples.append(worker.rollout_buffer.get(timeout=1))
            except queue.Empty:
                pass
    finally:
        child = worker._process
        # Keep reading while it stops, as a trainer does (samples, and metrics in its log()): a child
        # whose queues still hold data cannot exit (multiprocessing's feeder thread waits for a reader).
        stopper = threading.Thread(target=worker.stop)
        stopper.start()
        while stopper.is_alive():
            if not _drain(worker.rollout_buffer) + _drain(worker.metrics_queue):
                time.sleep(0.05)
    assert child.exitcode == 0  # the child closed its in-flight sessions and ended by itself
    assert len(samples) == 4, f"{len(samples)} samples"
    by_group = {}
    for sample in samples:
        by_group.setdefault(sample.group_id, []).append(sample)
    assert sorted(by_group) == [0, 1] and all(len(group) == 2 for group in by_group.values())
    requests = [r.body for r in server.requests if r.api_key == key]
    assert requests and all(body["temperature"] == 0.9 and body["top_p"] == 1.0 and body["top_k"] == -1
                            for body in requests)  # TRL's policy, forced by the gateway
    for group_id, group in by_group.items():
        # Both samples of a group ran the same task (the group's seed); the coin made each pass
        # (1.0) or half-fail (0.5): GRPO's advantages are +1 and -1 around a split group's mean,
        # 0 in a group whose rewards are equal.
        assert {s.prompt[0]["content"] for s in group} == {tasks[group_id].instruction}
        rewards = [s.metrics["reward"] for s in group]
        assert set(rewards) <= {0.5, 1.0}
        split = len(set(rewards)) == 2
        # Each sequence is, bit for bit, the engine's last prompt of that conversation plus
        # what it generated then, with the mask on generated tokens and their logprobs.
        last = next(body for body in requests if tasks[group_id].instruction in json.dumps(body["messages"])
                    and any(m.get("role") == "assistant" for m in body["messages"]))
        direct = direct_answer(server, key, last)
        for sample in group:
            expected = (1.0 if sample.metrics["reward"] == 1.0 else -1.0) if split else 0.0
            assert math.isclose(sample.advantage, expected, abs_tol=1e-6)
            ids, mask, logps = sample.input_ids.tolist(), sample.completion_mask.tolist(), sample.old_log_probs.tolist()
            assert ids == direct["prompt_token_ids"] + direct["choices"][0]["token_ids"]
            generated = [lp for lp, m in zip(logps, mask) if m]
            assert len(generated) == sum(mask) > 0 and all(lp == 0.0 for lp, m in zip(logps, mask) if not m)
            last_logps = [e["logprob"] for e in direct["choices"][0]["logprobs"]["content"]]
            assert generated[-len(last_logps):] == pytest.approx(last_logps, abs=1e-6)  # float32 in the sample
            assert sample.completion[-1] == {"role": "assistant", "content": "All done."}
