"""The operator runs as a user the password database does not know.

Pods run with a numeric runAsUser (the chart's 65532; OpenShift picks arbitrary
UIDs) that an image's /etc/passwd need not list. kopf's default peering
identity asks ``getpass.getuser()``, which then raises KeyError and the
operator crash-loops (found by the pod runner, tests/test_cluster_e2e.py, where
the host has no such user); the operator gives kopf an identity of its own.
"""
from __future__ import annotations

import os
import pwd
import subprocess
import sys

import pytest

from videojob.controller import handlers


def test_identity_needs_no_password_entry(monkeypatch):
    def unknown(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", unknown)
    who = handlers.identity()
    assert who.startswith("videojob-operator@") and str(os.getpid()) in who


def test_kopf_gets_the_identity(monkeypatch):
    """handlers.run hands kopf.run that identity (kopf never calls getpass.getuser)."""
    seen = {}

    def fake_run(**kwargs):
        seen.update(kwargs)

    monkeypatch.setattr(handlers.kopf, "run", fake_run)
    monkeypatch.setattr(handlers, "build_registry", lambda settings: (object(), _Stoppable()))
    handlers.run(handlers.OperatorSettings(), ["default"])
    assert seen.get("identity") == handlers.identity()


class _Stoppable:
    def stop(self) -> None:
        pass


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_a_uid_without_a_name_breaks_getpass():
    """The premise, on this machine: a uid nobody named makes getpass.getuser() fail."""
    uid = 65000 + os.getpid() % 500
    try:
        pwd.getpwuid(uid)
    except KeyError:
        pass
    else:  # pragma: no cover - a host that happens to name it
        return
    code = "import getpass\ntry:\n    getpass.getuser()\nexcept KeyError:\n    print('KeyError')\n"
    env = {k: v for k, v in os.environ.items() if k not in ("LOGNAME", "USER", "LNAME", "USERNAME")}
    out = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable,
                          "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "KeyError", out
