"""pi-env's Python start-up for verify commands: mounted read-only in the sandbox, in a dir put
first on PYTHONPATH while verify runs (pi_env.verify); pi-env itself never imports it.

The verifier's modules come before the agent's files: a top-level import is first looked up on
sys.path without the agent's work dir (PI_ENV_WORKDIR), so a `pytest.py`, `json.py` or
`unittest.py` the agent left there is imported only when nothing of the verifier's (the
standard library, installed packages, the verifier's own dirs) has that name. The hidden verify
files' own top-level modules (PI_ENV_VERIFIER_MODULES: a staged `test/` package) are found as
Python would find them. Everything else is as Python does it: the script's dir and the cwd stay
on sys.path, so a check that imports the agent's module still finds it. Then the interpreter's
own sitecustomize, which this file shadows, runs.
"""

import importlib.machinery
import os
import sys


def _pi_env_verify_startup():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [entry for entry in sys.path if entry != here]
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

    class VerifierFirst:
        """A top-level module from the verifier's part of sys.path when it has one."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            if path is not None or name in verifiers:  # a submodule, or a hidden file's: as usual
                return None
            entries = [entry for entry in sys.path if not agents(entry)]
            if len(entries) == len(sys.path):
                return None  # nothing of the agent's on sys.path: the usual search
            return importlib.machinery.PathFinder.find_spec(name, entries)

        @staticmethod
        def invalidate_caches():
            seen.clear()

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


_pi_env_verify_startup()
del _pi_env_verify_startup
