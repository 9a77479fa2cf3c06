"""`python hack/cluster/podrunner ...` and `python -m podrunner ...` (hack/cluster on sys.path)."""
import sys
from pathlib import Path

if __package__ in (None, ""):
    here = Path(__file__).resolve().parent
    # Run as a directory: sys.path[0] is this package's own dir; its modules must not be
    # importable as top-level names. Import it as the package `podrunner` instead.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(here.parent))

from podrunner.cli import main  # noqa: E402

sys.exit(main())
