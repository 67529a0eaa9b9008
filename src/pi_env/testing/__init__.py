"""Test doubles shipped with pi-env: loopback stand-ins for the remote sandbox services
(`fake_hf_sandbox`, `fake_e2b`) and a small real tokenizer built offline (`tiny_tokenizer`).
The scripted OpenAI-compatible server is product code (the oracle endpoint runs on it): it lives
in `pi_env.scripted`."""

_MOVED = ("EngineQuirks", "Fault", "ReceivedRequest", "ScriptedServer", "ScriptedToolCall", "ScriptedTurn")


def __getattr__(name: str):
    # The old import path of the scripted server's names, kept only while code written against
    # it lands; new code imports them from pi_env.scripted.
    if name in _MOVED:
        import pi_env.scripted

        return getattr(pi_env.scripted, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
