"""Test helpers shipped with pi-env: the scripted OpenAI-compatible server (synthetic answers)."""

from typing import TYPE_CHECKING

__all__ = ["Fault", "ReceivedRequest", "ScriptedServer", "ScriptedToolCall", "ScriptedTurn"]

if TYPE_CHECKING:
    from pi_env.testing.scripted import (
        Fault,
        ReceivedRequest,
        ScriptedServer,
        ScriptedToolCall,
        ScriptedTurn,
    )


def __getattr__(name: str):
    # Imported lazily so `python -m pi_env.testing.scripted` does not find the module already
    # imported by its package (runpy warns about that).
    if name in __all__:
        from pi_env.testing import scripted

        return getattr(scripted, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
