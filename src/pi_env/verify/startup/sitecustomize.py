"""pi-env's Python start-up for verify commands: mounted read-only in the sandbox, in a dir put
first on PYTHONPATH while verify runs (pi_env.verify); pi-env itself never imports it.

The verifier's modules come before the agent's files: a top-level import is first looked up on
sys.path without the agent's work dir (PI_ENV_WORKDIR), so a `pytest.py`, `json.py` or
`unittest.py` the agent left there is imported only when nothing of the verifier's (the
standard library, installed packages, the verifier's own dirs) has that name. The hidden verify
files' own top-level modules (PI_ENV_VERIFIER_MODULES: a staged `test/` package) are found as
Python would find them. The module `python3 -m NAME` runs (a runner: pytest, unittest) is the
verifier's alone: where nothing of the verifier's has that name, it is not found (as beside an
empty work dir), never the agent's `pytest.py`. Everything else is as Python does it: the
script's dir and the cwd stay on sys.path, so a check that imports the agent's module still
finds it. Then the interpreter's own sitecustomize, which this file shadows, runs.
"""

import importlib.machinery
import os
import sys


def _main_module():
    """The top-level name of the module `-m` runs, or None (a script, -c, the REPL)."""
    argv = getattr(sys, "orig_argv", None)
    if argv is None:
        try:
            with open("/proc/self/cmdline", "rb") as cmdline:
                argv = [arg.decode("utf-8", "surrogateescape") for arg in cmdline.read().split(b"\0")[:-1]]
        except OSError:
            return None
    args = iter(argv[1:])
    for arg in args:
        if arg == "--" or not arg.startswith("-") or arg == "-":
            return None
        for at, flag in enumerate(arg[1:], 1):
            if flag == "m":
                return (arg[at + 1 :] or next(args, "")).split(".")[0] or None
            if flag == "c":
                return None
            if flag in "WX":
                if not arg[at + 1 :]:
                    next(args, None)
                break
            if flag == "-":  # a long option (--check-hash-based-pycs takes a value)
                if arg == "--check-hash-based-pycs":
                    next(args, None)
                break
    return None


def _pi_env_verify_startup(runner):
    here = os.path.dirname(os.path.abspath(__file__))
    # `here` stays on sys.path: the verifier's helpers (pi_env_check) are imported from it.
    workdir = os.path.realpath(os.environ.get("PI_ENV_WORKDIR") or "/nonexistent/pi-env")
    verifiers = set(filter(None, os.environ.get("PI_ENV_VERIFIER_MODULES", "").split(",")))
    seen = {}

    def agents(entry):
        if not isinstance(entry, str):
            return False
        key = entry or os.getcwd()  # "": the cwd, whichever it is at the time
        if key not in seen:
            real = os.path.realpath(key)
            seen[key] = real == workdir or real.startswith(workdir.rstrip(os.sep) + os.sep)
        return seen[key]

    stdlib, me = os.path.dirname(os.__file__) + os.sep, sys._getframe().f_code.co_filename
    reserved = getattr(sys, "stdlib_module_names", frozenset())  # type: frozenset  # every platform's (3.10+)

    def stdlib_optional():
        """Is the import being made by a standard library module's own top-level code? (Its
        optional imports: `msvcrt` in subprocess, `org.python.core` in copy and pickle.)"""
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith("<frozen") or frame.f_code.co_filename == me):
            frame = frame.f_back  # type: ignore[assignment]  # the import system and this finder
        if frame is None or frame.f_code.co_name != "<module>":
            return False
        filename = frame.f_code.co_filename
        return filename.startswith(stdlib) and not any(part in filename for part in ("site-packages", "dist-packages"))

    class VerifierFirst:
        """A top-level module from the verifier's part of sys.path when it has one. Where it has
        none, the agent's is still never taken for: the module `-m` runs, a name the standard
        library reserves on any platform, or what a standard library module imports at its top
        (its optional imports): those are not found, as beside an empty work dir."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            if path is not None or name in verifiers:  # a submodule, or a hidden file's: as usual
                return None
            entries = [entry for entry in sys.path if not agents(entry)]
            if len(entries) == len(sys.path):
                return None  # nothing of the agent's on sys.path: the usual search
            spec = importlib.machinery.PathFinder.find_spec(name, entries)
            if spec is None and (name == runner or name in reserved or stdlib_optional()):
                raise ModuleNotFoundError(
                    f"No module named {name!r} (pi-env: a runner, a standard library name or a standard "
                    "library module's own import is never the agent's)",
                    name=name,
                )
            return spec

        @staticmethod
        def invalidate_caches():
            seen.clear()

    # Package metadata (entry points: pytest's plugins, versions) is the verifier's: distributions
    # are never looked for in the agent's part of sys.path.
    plain = getattr(importlib.machinery.PathFinder, "find_distributions", None)
    if plain is not None:

        def find_distributions(context=None, *args, **kwargs):
            if context is not None and isinstance(vars(context), dict):
                vars(context)["path"] = [entry for entry in context.path if not agents(entry)]
                return plain(context, *args, **kwargs)
            return plain(*args, **kwargs)

        importlib.machinery.PathFinder.find_distributions = staticmethod(find_distributions)  # type: ignore[method-assign]

    # After the builtin and frozen importers, before the path search.
    finders = sys.meta_path
    index = finders.index(importlib.machinery.PathFinder) if importlib.machinery.PathFinder in finders else len(finders)
    finders.insert(index, VerifierFirst)

    # The interpreter's own sitecustomize (Debian has one), as it would have run without this file.
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [e for e in sys.path if not agents(e)])
    if (
        spec is not None
        and spec.loader is not None
        and spec.origin
        and os.path.dirname(os.path.abspath(spec.origin)) != here
    ):
        module = type(sys)("sitecustomize")  # importlib.util would cost 3 ms of start-up (contextlib)
        module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


_pi_env_verify_startup(_main_module())
del _pi_env_verify_startup, _main_module
