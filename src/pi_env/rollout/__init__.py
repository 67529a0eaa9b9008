"""The rollout: the only room that composes the others.

stage files -> setup (first failure aborts) -> agent -> kill what it left running ->
the world back as setup left it, but the agent's output -> clear logs/verifier ->
stage verify_files -> run every verify command -> reward -> collect.

A newcomer follows one rollout through these files, in this order:

- `factory.py`   `PiSessionFactory.create` / `run_rollout`: a session for a task.
- `session.py`   `PiSession`: the phases in order, on its threads; wait, close.
- `phases.py`    each phase, a public function over the rollout's context.
- `context.py`   `RolloutContext`: what the phases share and make; `fail` (unscored).
- `steps.py`     a multi-step Harbor task's later steps, over the same phases.
- `shared.py`    `FactoryState`: the config, backend, agent runtime and policy version
                 the factory's sessions share.
- `clock.py`     the phases' timing and the caller's live events.
- `gate_api.py`  interception_gate: the trainer's next_request / deliver.

The rooms they ask: `pi_env.judge` (scored or unscored, the reward), `pi_env.verify` (verify's
world and room), `pi_env.specs` (what the session asks of the gateway and the sandbox),
`pi_env.task_setup` (setup commands), `pi_env.agent` (the agent's files and start),
`pi_env.turns` (the gateway's records as turns), `pi_env.read_budget` (every read of what the
agent wrote).
"""

from .factory import PiSessionFactory, run_rollout, unscored_by
from .session import PiSession

__all__ = ["PiSession", "PiSessionFactory", "run_rollout", "unscored_by"]
