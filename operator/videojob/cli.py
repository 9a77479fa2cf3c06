"""The `videojob` command line.

Subcommands are small functions over the same library the operator uses, so
what `videojob validate` says is what the operator would say.

This module builds the parser and dispatches; each subcommand lives in a module
of ``videojob.commands`` (validate, crd, plan, run, serve for `operator`,
profile), what they share in ``videojob.commands.common``. Every name that was
importable from here before that split still is (re-exported below).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .commands.common import (
    EXIT_BAD_INPUT,
    EXIT_DOES_NOT_FIT,
    EXIT_JOB_FAILED,
    EXIT_OK,
    _documents,
    _emit,
    _stdout_gone,
)
from .commands.crd import _cmd_crd
from .commands.plan import (
    _BARE_GIB_LIMIT,
    _TRY_GPU_GIB,
    _TRY_HOST_GIB,
    MAX_GPUS,
    _cmd_plan,
    _inventory_from_args,
    _plan_spec_from_args,
    fits_with_flags,
    memory_flag,
)
from .commands.profile import _cmd_profile
from .commands.run import (
    _cmd_run,
    _inputs_dir,
    _progress_bar,
    _run_logging,
    _RunLog,
    _text_field,
    _unquoted,
    apply_overrides,
)
from .commands.serve import _cmd_operator
from .commands.validate import _cmd_validate, validate_files

__all__ = [
    "EXIT_BAD_INPUT", "EXIT_DOES_NOT_FIT", "EXIT_JOB_FAILED", "EXIT_OK", "MAX_GPUS",
    "apply_overrides", "build_parser", "fits_with_flags", "main", "memory_flag", "validate_files",
    # private, but imported by tests (_run_logging) or kept importable from here as before the split
    "_BARE_GIB_LIMIT", "_TRY_GPU_GIB", "_TRY_HOST_GIB", "_Parser", "_RunLog", "_cmd_crd", "_cmd_operator",
    "_cmd_plan", "_cmd_profile", "_cmd_run", "_cmd_validate", "_documents", "_emit", "_inputs_dir",
    "_inventory_from_args", "_plan_spec_from_args", "_progress_bar", "_run_logging", "_stdout_gone",
    "_text_field", "_unquoted",
]


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag or value is bad input, exit 1 (the exit-code table;
    argparse's own 2 is what a failed job exits with). The message names the flag
    and, for a choice, the valid values."""

    def error(self, message: str):  # noqa: ANN201 - argparse's signature
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="videojob", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    validate = sub.add_parser("validate", help="check VideoJob files; exit 1 with one line per problem")
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.set_defaults(func=_cmd_validate)

    crd = sub.add_parser("crd", help="print the VideoJob CRD generated from the API models")
    crd.add_argument("--out", help="write to this file instead of stdout")
    crd.set_defaults(func=_cmd_crd)

    plan = sub.add_parser(
        "plan",
        help="what fits on which GPUs, and how (exit 0 fits, 1 bad input, 3 nothing fits)",
        description="Plan GPU memory and layout for a VideoJob file or for --model/--width/... flags.",
    )
    plan.add_argument("file", nargs="?", metavar="FILE", help="a VideoJob YAML file")
    plan.add_argument("--model", help="catalog id, e.g. cogvideox-5b (instead of FILE)")
    plan.add_argument("--width", type=int)
    plan.add_argument("--height", type=int)
    plan.add_argument("--frames", type=int)
    plan.add_argument("--steps", type=int)
    plan.add_argument("--guidance", type=float)
    plan.add_argument("--dtype", default="bfloat16", help="with --model (default bfloat16)")
    plan.add_argument("--cache", default="auto", help="with --model: off, auto, fbcache, dbcache, teacache")
    plan.add_argument("--gpu-memory", default="80GiB",
                      help="memory per GPU: a bare number is GiB (24 = 24GiB), or give the unit: 24GiB, 24Gi, "
                           "80GB (default 80GiB; the spec's resources.gpuMemory overrides it)")
    plan.add_argument("--gpus", type=int, default=1, help="GPUs in the node, 1 to 8 (default 1)")
    plan.add_argument("--host-memory", help="host RAM of the node, like --gpu-memory (default 64GiB per GPU)")
    plan.add_argument("--gpu-type", default="a100", type=str.lower, choices=["a100", "l40", "h100", "h200", "generic"],
                      help="scales the time estimates (default a100)")
    plan.add_argument("--fp8-weights", action="store_true",
                      help="store the denoiser's weights in fp8 (layerwise casting; slightly changes output)")
    plan.add_argument("--json", action="store_true",
                      help='print {"chosen", "alternatives", "reason"} (and "fitsWith" when nothing fits)')
    plan.add_argument("--all", action="store_true", help="list every alternative in the table")
    plan.add_argument("--sweep", metavar="MODEL", help="per GPU size, the largest video that fits")
    plan.set_defaults(func=_cmd_plan)

    run = sub.add_parser("run", help="plan for this machine and run on embedded local Ray; writes OUT/NAME.mp4/.png/.json")
    run.add_argument("file", metavar="FILE")
    run.add_argument("--out", help="output directory; overrides spec.output.uri (default: spec.output.uri, "
                                    "local:// under VIDEOJOB_OUTPUT_ROOT, default ./out)")
    run.add_argument("--inputs", metavar="DIR",
                     help="where local:// inputs (spec.image, spec.faceImage) are read: local://a.png is DIR/a.png "
                          "(default: VIDEOJOB_DATA_ROOT, else the current directory)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="override a spec field, e.g. --set parallel.ulysses=2 --set cache.policy=off")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.set_defaults(func=_cmd_run)

    operator = sub.add_parser("operator", help="run the VideoJob operator (kopf): plan, queue and run jobs on Ray",
                              description="Settings come from VIDEOJOB_* environment variables "
                                          "(README: the operator).")
    operator.add_argument("--namespace", action="append", help="watch this namespace (repeatable)")
    operator.add_argument("--all-namespaces", action="store_true", help="watch every namespace (the default "
                                                                        "when neither flag nor VIDEOJOB_NAMESPACES)")
    operator.add_argument("--standalone", action="store_true",
                          help="no peering with other operator replicas (one replica; tests)")
    operator.add_argument("--verbose", action="store_true")
    operator.set_defaults(func=_cmd_operator)

    profile = sub.add_parser(
        "profile",
        help="measure each model's memory under FakeTensorMode and write the planner's calibration table",
    )
    profile.add_argument("--out", default="calibration.json",
                         help="where to write the table (default ./calibration.json; `make calibrate` writes the "
                              "planner's own, operator/videojob/planner/calibration.json)")
    profile.add_argument("--models", help="comma-separated catalog ids (default: all)")
    profile.add_argument("--no-merge", action="store_true", help="with --models, drop the other models' entries")
    profile.set_defaults(func=_cmd_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (`| head`): what it read is all it wanted
        _stdout_gone()
        return EXIT_OK
    return code


if __name__ == "__main__":
    raise SystemExit(main())
