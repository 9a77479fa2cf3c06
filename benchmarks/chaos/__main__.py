"""``python benchmarks/chaos [--seed N] [--jobs N] [--minutes M] [--out PATH]``: one seeded
chaos soak; its figures go to benchmarks/results/chaos.json (machine.write_result).
Exit 1 when a check failed (lost, duplicated or left over), 0 when all passed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]
if sys.path[1] == str(HERE):  # `python benchmarks/chaos` puts this folder first: the package is what we import
    del sys.path[1]

from chaos.soak import run  # noqa: E402
from machine import RESULTS, git_state, write_result  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=100)
    p.add_argument("--minutes", type=float, default=20.0,
                   help="the soak's length: jobs are created in its first half, faults injected until three "
                        "quarters of it; then every job is waited for (up to half as long again, at least 5 min)")
    p.add_argument("--out", type=Path, default=RESULTS / "chaos.json")
    p.add_argument("--workdir", type=Path, help="logs and outputs (default: a new temp dir, kept)")
    args = p.parse_args(argv)
    # The header's commit is the tree's at the end: a soak lasts 20 minutes, so the
    # tree it started on is kept too, and whether the two differ.
    at_start = git_state()
    result = run(args.seed, args.jobs, args.minutes, workdir=args.workdir)
    provenance = {"atStart": at_start, "treeChangedDuringRun": at_start != git_state()}
    out = write_result("chaos.json", {"benchmark": "chaos", **provenance, **result}, args.out)
    print(f"chaos: {'passed' if result['passed'] else 'FAILED'}: lost {result.get('lost')}, duplicated "
          f"{result.get('duplicated')}, left over {result.get('leftOver')}; {out}", file=sys.stderr)
    for problem in result["problems"]:
        print(f"  - {problem}", file=sys.stderr)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
