"""`videojob profile`: the runtime's calibration run (needs torch), which writes
the planner's calibration table."""

from __future__ import annotations

import argparse
import sys

from .common import EXIT_BAD_INPUT

def _cmd_profile(args: argparse.Namespace) -> int:
    """Runtime side (needs torch): measure the models and write the calibration table."""
    try:
        from videojob_runtime.profiling.calibrate import main as profile_main
    except ImportError as exc:
        print(f"profile: needs the runtime dependencies (pip install 'videojob[runtime]'): {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    argv = ["--out", args.out]
    if args.models:
        argv += ["--models", args.models]
    if args.no_merge:
        argv.append("--no-merge")
    return profile_main(argv)
