"""The test suite's guard on optional packages, in every process a test starts.

tests/conftest.py puts this folder first on PYTHONPATH, so every Python process a test
starts (run_train.sh's ranks, scripts, a nested pytest) runs this file at start-up, as
`sitecustomize`; the pytest process itself calls `install()` from conftest. Two switches:

- `TITAN_TEST_HIDE=pkg,...`: those packages cannot be imported (as if not installed), to
  prove that the tests needing them skip instead of failing;
- `TITAN_TEST_IMPORT_LOG=path`: each import of an optional package by titan's or the tests'
  code appends `<test id>\\t<package>` there (the test from pytest's PYTEST_CURRENT_TEST, which
  child processes inherit), so that the suite can check each such test declares the package
  with `@pytest.mark.needs`.

Self-contained: it runs before anything else of titan or the tests is importable.
"""

import builtins
import importlib.machinery
import importlib.util
import os
import sys

# optional package -> the extra of pyproject.toml that installs it for users
OPTIONAL = {
    "torchao": "float8",
    "torchft": "torchft",
    "wandb": "wandb",
    "matplotlib": "plot",
    "lm_eval": "eval",
    "transformers": "test",
    "peft": "test",
    "ruff": "test",
    "moto": "test",
    "s3fs": "s3",
    "upath": "s3",
    "PIL": "vision",
}
# importers whose imports count as the project's own (libraries' imports of each other are
# theirs to guard)
_OWN = ("titan", "tests", "benchmarks", "scripts", "__main__", "conftest")


def hidden() -> set[str]:
    return {p for p in os.environ.get("TITAN_TEST_HIDE", "").split(",") if p}


class _Hide:
    """A meta-path finder that answers for hidden packages before the real ones can."""

    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(
                f"No module named {name!r} (hidden by TITAN_TEST_HIDE)", name=name
            )
        return None


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def _logging_import(real):
    def __import__(name, globals=None, locals=None, fromlist=(), level=0):
        module = real(name, globals, locals, fromlist, level)
        top = name.partition(".")[0]
        # imported (a failed attempt uses nothing) by a module of ours: pytest.importorskip
        # passes no globals, and a test that uses it skips by itself
        if level == 0 and top in OPTIONAL and globals is not None:
            if str(globals.get("__name__", "")).partition(".")[0] in _OWN:
                _log(top)
        return module

    __import__._titan_guard = True
    return __import__


def _log(package: str) -> None:
    path, test = os.environ.get("TITAN_TEST_IMPORT_LOG"), _current_test()
    if path and test:
        # one short append: concurrent ranks' lines do not interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{test}\t{package}\n".encode())
        finally:
            os.close(fd)


def install() -> None:
    """Idempotent: a process that ran this as sitecustomize and then imports it again (the
    pytest process) keeps one guard."""
    names = hidden()
    if names and not any(
        isinstance(f, _Hide) or type(f).__name__ == "_Hide" for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _Hide(names))
        real_find_spec = importlib.util.find_spec

        def find_spec(name, package=None):
            if name.partition(".")[0] in names:
                return None
            return real_find_spec(name, package)

        importlib.util.find_spec = find_spec
        for name in list(sys.modules):
            if name.partition(".")[0] in names:
                del sys.modules[name]
    if not getattr(builtins.__import__, "_titan_guard", False):
        builtins.__import__ = _logging_import(builtins.__import__)


def _run_next_sitecustomize() -> None:
    """The sitecustomize this one shadows (a distribution's, say) still runs."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    install()
    _run_next_sitecustomize()
