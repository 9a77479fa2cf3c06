"""Small shared helpers for tests (no fixtures here: see conftest.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, TypeVar

import yaml

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
INVALID = sorted((REPO / "tests" / "data" / "invalid").glob("*.yaml"))

T = TypeVar("T")


def expected_field(path: Path) -> str:
    """The field a bad example must be rejected for, from its `# field:` header."""
    first = path.read_text().splitlines()[0]
    if not first.startswith("# field: "):
        raise ValueError(f"{path} lacks its '# field: spec.x' header line")
    return first.removeprefix("# field: ").strip()


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def wait_for(what: str, probe: Callable[[], T], timeout: float = 30.0, interval: float = 0.2) -> T:
    """Poll ``probe`` until it returns a truthy value; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: T = probe()
    while not last:
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)
        last = probe()
    return last
