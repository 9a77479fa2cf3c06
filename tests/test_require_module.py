"""``helpers.require_module``: a missing module skips a test, except where nothing may skip.

With CI=true or VIDEOJOB_REQUIRE_CLUSTER=1 (``make test``), a test module whose
runtime extra is missing must fail, not skip quietly (``pytest.importorskip``
at module level did that). Checked with a real pytest run in a subprocess, on a
test file that needs a module no environment has.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO

MISSING = "videojob_no_such_module_for_require_module"
AT_MODULE_LEVEL = f"""
from helpers import require_module

require_module({MISSING!r})


def test_needs_it():
    pass
"""
IN_A_TEST = f"""
from helpers import require_module


def test_needs_it():
    require_module({MISSING!r}, reason="the runtime extra")
"""


def _pytest(tmp_path, source: str, **env: str) -> subprocess.CompletedProcess:
    test = tmp_path / "test_needs_missing.py"
    test.write_text(source)
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "VIDEOJOB_REQUIRE_CLUSTER")}
    clean["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), clean.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", str(test), "-q", "-p", "no:cacheprovider", "-rs",
                           "--rootdir", str(tmp_path)], cwd=tmp_path, env={**clean, **env},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("where", ["module", "test"])
@pytest.mark.parametrize("env", [{"VIDEOJOB_REQUIRE_CLUSTER": "1"}, {"CI": "true"}], ids=["require", "ci"])
def test_a_missing_module_fails_where_nothing_may_skip(tmp_path, where, env):
    run = _pytest(tmp_path, AT_MODULE_LEVEL if where == "module" else IN_A_TEST, **env)
    out = run.stdout + run.stderr
    assert run.returncode not in (0, 5), f"pytest passed or collected nothing:\n{out[-3000:]}"
    assert " skipped" not in out.splitlines()[-1], out[-3000:]
    assert f"{MISSING} cannot be imported" in out and "install the runtime extra" in out, out[-3000:]


@pytest.mark.parametrize("where", ["module", "test"])
def test_a_missing_module_skips_elsewhere(tmp_path, where):
    run = _pytest(tmp_path, AT_MODULE_LEVEL if where == "module" else IN_A_TEST)
    out = run.stdout + run.stderr
    # 5: a module skipped as a whole leaves nothing collected
    assert run.returncode in (0, 5) and "1 skipped" in out, out[-3000:]
    assert MISSING in out, f"the skip does not name the module:\n{out[-3000:]}"


def test_a_present_module_is_returned(monkeypatch):
    from helpers import require_module

    monkeypatch.setenv("VIDEOJOB_REQUIRE_CLUSTER", "1")
    assert require_module("json") is __import__("json")
