"""tests/coverage-audit.json is current (issue 35): every test marked `slow` is in it, and
whatever a slow test reaches in operator/ or runtime/ that `make test` does not (or a slow
test that did not pass in the audit) says why in tests/coverage-audit-why.json. `make coverage-audit` writes the file
(hack/coverage_audit.py)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
AUDIT = REPO / "tests" / "coverage-audit.json"
_spec = importlib.util.spec_from_file_location("coverage_audit", REPO / "hack" / "coverage_audit.py")
coverage_audit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage_audit)


def _audit() -> dict:
    if not AUDIT.is_file():
        pytest.skip("tests/coverage-audit.json does not exist: `make coverage-audit` has not been run yet "
                    "(both tiers under coverage, about an hour on 2 cores)")
    return json.loads(AUDIT.read_text())


def test_every_slow_test_is_in_the_audit():
    audit = _audit()
    slow = {nodeid for nodeids in coverage_audit.slow_tests(["tests"]).values() for nodeid in nodeids}
    listed = set(audit["slowTests"])
    assert not slow - listed and not listed - slow, (
        f"tests/coverage-audit.json is not current, run `make coverage-audit`: marked slow but not in it: "
        f"{sorted(slow - listed)}; in it but not marked slow (any more): {sorted(listed - slow)}")


def test_what_only_slow_tests_reach_says_why():
    audit, whys = _audit(), coverage_audit.load_whys()
    unexplained = [f"{section} {name}" for section in ("slowTests", "slowModulesSubprocessOnly")
                   for name, e in audit[section].items()
                   if (e["onlyLines"] or e["onlyBranches"] or e.get("outcome", "passed") != "passed")
                   and not (whys[section].get(name) or "").strip()]
    assert not unexplained, ("these reach lines or branches of operator/ or runtime/ that `make test` does not "
                             "(or did not pass in the audit): give each a why in tests/coverage-audit-why.json "
                             "(a scale figure, a soak), or a test in `make test` that reaches them: "
                             + "; ".join(unexplained))
    stale = [f"{section} {name}" for section, named in whys.items() for name in named if name not in audit[section]]
    assert not stale, f"tests/coverage-audit-why.json names what the audit does not have: {stale}"


def test_what_coverage_lost_is_what_the_entries_list():
    """Coverage before and after the split: the whole suite (both tiers, all that `make test`
    ran before slow tests left it) reaches exactly the fast tier's lines and branches plus
    those the entries list, each with its why (the test above)."""
    audit = _audit()
    fast, every = audit["fastTier"], audit["withSlow"]
    assert (fast["lines"], fast["branches"]) == (every["lines"], every["branches"]), "different source trees"
    entries = [e for section in ("slowTests", "slowModulesSubprocessOnly") for e in audit[section].values()]
    lines = set().union(*(coverage_audit.parse_lines(e["onlyLines"]) for e in entries))
    branches = {spec for e in entries for spec in e["onlyBranches"]}
    assert every["coveredLines"] - fast["coveredLines"] == len(lines)
    assert every["coveredBranches"] - fast["coveredBranches"] == len(branches)


def test_the_audit_lists_ranges_and_takes_the_written_why():
    fast_lines, fast_arcs = {"a.py": {1, 2}}, {"a.py": {(1, 2)}}
    lines, arcs = {"a.py": {1, 2, 3, 4, 5, 9}, "b.py": {7}}, {"a.py": {(1, 2), (3, 5), (9, -1)}}
    got = coverage_audit.entry(lines, arcs, fast_lines, fast_arcs, "the 200-job soak")
    assert got == {"onlyLines": ["a.py:3-5,9", "b.py:7"], "onlyBranches": ["a.py:3->5", "a.py:9->exit"],
                   "why": "the 200-job soak"}
    assert coverage_audit.parse_lines(got["onlyLines"]) == {("a.py", 3), ("a.py", 4), ("a.py", 5), ("a.py", 9),
                                                            ("b.py", 7)}
    assert coverage_audit.entry(fast_lines, fast_arcs, fast_lines, fast_arcs, None) == {
        "onlyLines": [], "onlyBranches": [], "why": None}
