"""Long-lived services are started for their first user and stopped after their last
(a pytest plugin, loaded by conftest.py).

A session fixture in ``RELEASED`` (a control plane, Kueue, the shared Ray head) would
otherwise idle until the run ends, taking a share of the two cores from every test
after its last user. So collection moves the modules that use one of them together,
at the place of the first such module (each module keeps its own order), and right
after the teardown of the last test in the run that uses it the fixture is finished
(tests between its users that do not use it leave it running).

When `make test` builds Go tools beside the streams (a machine that has not cached them,
hack/test_streams.sh), it names them in ``VIDEOJOB_TOOLS_PENDING`` in the order it builds
them: the modules that need one then run after the rest of their stream, those needing
the earliest-built tools first, so that neither stream starts by waiting for a build.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

# In the order their groups are formed: a module using two of them follows the last.
RELEASED = ("full_cluster", "e2e_cluster", "kueue", "ray_head")


def _session_def(item, name: str):
    """The session-scoped fixture ``name`` resolves to for ``item`` (None: not used, or a
    module's own narrower fixture of that name)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get(name) if info else None
    if not defs or name not in item.fixturenames:
        return None
    return defs[-1] if defs[-1].scope == "session" else None


def _module(item) -> str:
    return item.nodeid.split("::")[0]


TOOLS_PENDING_VARIABLE = "VIDEOJOB_TOOLS_PENDING"
# Which Go tool (hack/cluster/build-gotool.sh) a module needs: by the fixtures it uses, or a
# helper it names that runs the tool.
TOOL_FIXTURES = {"helm": {"helm"}, "kwok": {"full_cluster"}, "kuberay": {"full_cluster", "e2e_cluster"},
                 "kueue": {"kueue"}}
TOOL_NAMED = {"helm": re.compile(r"helm_binary\(|chart_install_support|e2e_support")}


def tools_needed(path: Path, fixturenames: set[str]) -> set[str]:
    """The Go tools (names in build-gotool.sh's sense) that the module at ``path`` needs."""
    try:
        text = path.read_text()
    except OSError:
        text = ""
    return {tool for tool, fixtures in TOOL_FIXTURES.items() if fixtures & fixturenames} | \
        {tool for tool, named in TOOL_NAMED.items() if named.search(text)}


def _after_pending_tools(items, pending: list[str]) -> None:
    """Moves the modules that need a pending tool to the end, by the last of them to be built."""
    used: dict[str, set[str]] = {}
    paths: dict[str, Path] = {}
    for item in items:
        used.setdefault(_module(item), set()).update(item.fixturenames)
        paths[_module(item)] = Path(str(item.fspath))
    rank = {module: max((pending.index(t) for t in tools_needed(paths[module], names) if t in pending), default=-1)
            for module, names in used.items()}
    items.sort(key=lambda item: rank[_module(item)])  # stable: each group keeps its order


def pytest_collection_modifyitems(session, config, items):
    pending = [t for t in os.environ.get(TOOLS_PENDING_VARIABLE, "").split(",") if t]
    unknown = sorted(set(pending) - set(TOOL_FIXTURES))
    if unknown:
        raise ValueError(f"{TOOLS_PENDING_VARIABLE}: unknown tools {unknown}; known: {sorted(TOOL_FIXTURES)}")
    for name in RELEASED:
        modules = {_module(item) for item in items if _session_def(item, name) is not None}
        if not modules:
            continue
        first = next(i for i, item in enumerate(items) if _module(item) in modules)
        together = [item for item in items if _module(item) in modules]
        rest = [item for item in items if _module(item) not in modules]
        items[:] = rest[:first] + together + rest[first:]
    if pending:
        _after_pending_tools(items, pending)


_last_users: dict[str, str] | None = None  # fixture name -> node id of the last test that uses it


def _find_last_users(items) -> dict[str, str]:
    found: dict[str, str] = {}
    for item in items:
        for name in RELEASED:
            if _session_def(item, name) is not None:
                found[name] = item.nodeid
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    global _last_users
    yield
    if _last_users is None:  # the run's final list (after deselection), once
        _last_users = _find_last_users(item.session.items)
    for name in RELEASED:
        fixturedef = _session_def(item, name)
        if fixturedef is not None and fixturedef.cached_result is not None and _last_users.get(name) == item.nodeid:
            fixturedef.finish(item._request)  # its last user is done
