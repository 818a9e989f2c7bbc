"""Test-suite setup: the benchmark harness (`bench/`, not part of the installed package)
is importable from every test module. The repository root is appended, not prepended, so
the installed jaxsub (with its built extension) still wins over the source tree."""

import pathlib
import sys

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import pytest


@pytest.fixture
def fresh_layout(tmp_path, monkeypatch):
    """Never touch the user's real layout cache (XDG_CACHE_HOME under tmp_path); forget
    the selections remembered in this process before and after the test."""
    from jaxsub import layout

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    layout.clear_memo()
    yield
    layout.clear_memo()


@pytest.fixture
def fallback_log(monkeypatch):
    """The (op, reason) of each fallback log line during the test, in order."""
    from jaxsub import _ffi

    calls = []
    monkeypatch.setattr(_ffi, "fallback", lambda op_name, reason, **_: calls.append((op_name, reason)))
    return calls
