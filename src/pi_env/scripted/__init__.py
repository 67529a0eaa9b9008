"""The scripted OpenAI-compatible server: the engine behind the `oracle` endpoint (it replays a
task's reference solution through the real Pi) and the one model the tests talk to. Everything
it emits is synthetic and marked so. `server.py` is the server; `token_engine.py` its
engine-like token behaviour over a real tokenizer; `script.py` what both build on (the script,
the synthetic tokenizer). CLI: `python -m pi_env.scripted`."""

from pi_env.scripted.script import Fault, ScriptedToolCall, ScriptedTurn
from pi_env.scripted.server import EngineQuirks, ReceivedRequest, ScriptedServer

__all__ = ["EngineQuirks", "Fault", "ReceivedRequest", "ScriptedServer", "ScriptedToolCall", "ScriptedTurn"]
