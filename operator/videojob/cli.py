"""The `videojob` command line.

Subcommands are small functions over the same library the operator uses, so
what `videojob validate` says is what the operator would say.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml

from .api import InvalidVideoJob, Problem, parse_videojob
from .crd import render_crd

# Exit codes, one table for validate, plan and run (README "Exit codes").
EXIT_OK = 0
EXIT_BAD_INPUT = 1  # a file, flag or field is wrong; the message names it
EXIT_JOB_FAILED = 2  # the job ran and failed, or could not be placed or finished (stage and reason printed)
EXIT_DOES_NOT_FIT = 3  # no layout fits the GPUs (the reason names the smallest change that would)


def _documents(path: Path) -> Iterator[tuple[str, object]]:
    """(label, document) for each YAML document in a file; problems as exceptions."""
    text = path.read_text()
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    if not docs:
        raise InvalidVideoJob([Problem("(document)", "the file holds no YAML document")])
    for index, doc in enumerate(docs):
        label = str(path) if len(docs) == 1 else f"{path}[{index}]"
        yield label, doc


def validate_files(paths: Sequence[str]) -> list[str]:
    """One line per problem, ``FILE: FIELD: REASON``; empty when all are valid."""
    lines: list[str] = []
    for name in paths:
        path = Path(name)
        try:
            for label, doc in _documents(path):
                try:
                    parse_videojob(doc)
                except InvalidVideoJob as exc:
                    lines += [f"{label}: {p.field}: {p.message}" for p in exc.problems]
        except OSError as exc:
            lines.append(f"{name}: (file): cannot read: {exc.strerror or exc}")
        except yaml.YAMLError as exc:
            lines.append(f"{name}: (yaml): not valid YAML: {str(exc).splitlines()[0]}")
        except InvalidVideoJob as exc:
            lines += [f"{name}: {p.field}: {p.message}" for p in exc.problems]
    return lines


def _cmd_validate(args: argparse.Namespace) -> int:
    problems = validate_files(args.files)
    for line in problems:
        print(line)
    if not problems:
        print(f"{len(args.files)} file(s) valid")
        return EXIT_OK
    return EXIT_BAD_INPUT


def _cmd_crd(args: argparse.Namespace) -> int:
    text = render_crd()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _plan_spec_from_args(args: argparse.Namespace):
    """The spec to plan: a file's, or one built from --model/--width/... flags."""
    from .api import parse_spec

    if args.file:
        docs = list(_documents(Path(args.file)))
        if len(docs) != 1:
            raise InvalidVideoJob([Problem("(document)", "plan takes a file with exactly one VideoJob")])
        return parse_videojob(docs[0][1]).spec
    if not args.model:
        raise InvalidVideoJob([Problem("--model", "give a FILE or --model ID (see `videojob plan --help`)")])
    video = {k: v for k, v in (("width", args.width), ("height", args.height), ("frames", args.frames)) if v}
    sampling = {k: v for k, v in (("steps", args.steps), ("guidanceScale", args.guidance)) if v is not None}
    data = {"model": {"name": args.model, "dtype": args.dtype}, "prompt": "(plan)", "video": video,
            "sampling": sampling, "cache": {"policy": args.cache}}
    flags = {"spec.model.name": "--model", "spec.video.width": "--width", "spec.video.height": "--height",
             "spec.video.frames": "--frames", "spec.sampling.steps": "--steps",
             "spec.sampling.guidanceScale": "--guidance", "spec.model.dtype": "--dtype", "spec.cache.policy": "--cache"}
    try:
        return parse_spec(data, for_plan=True)  # a plan needs no input images
    except InvalidVideoJob as exc:
        raise InvalidVideoJob([Problem(flags.get(p.field, p.field), p.message) for p in exc.problems]) from None


def _inventory_from_args(args: argparse.Namespace):
    from .api import parse_bytes
    from .planner import GiB, Inventory

    try:
        gpu_memory = parse_bytes(args.gpu_memory)
        host = parse_bytes(args.host_memory) if args.host_memory else 64 * GiB * args.gpus
    except ValueError as exc:
        raise InvalidVideoJob([Problem("--gpu-memory/--host-memory", str(exc))]) from None
    if args.gpus < 1 or args.gpus > 8:
        raise InvalidVideoJob([Problem("--gpus", f"must be between 1 and 8 (got {args.gpus})")])
    return Inventory(gpu_memory=gpu_memory, gpus_per_node=args.gpus, host_memory=host, gpu_type=args.gpu_type)


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from dataclasses import replace

    from .planner import choose, inventory_for_spec, request_from_spec, sweep
    from .planner.report import render_plan, render_sweep

    try:
        inventory = _inventory_from_args(args)
        if args.sweep:
            from .catalog import get_model

            try:
                get_model(args.sweep)
            except KeyError as exc:
                raise InvalidVideoJob([Problem("--sweep", str(exc.args[0]))]) from None
            rows = sweep(args.sweep, inventory, steps=args.steps)
            print(json.dumps(rows, indent=2) if args.json else render_sweep(args.sweep, rows, inventory))
            return EXIT_OK
        spec = _plan_spec_from_args(args)
    except (InvalidVideoJob, OSError, yaml.YAMLError) as exc:
        problems = exc.problems if isinstance(exc, InvalidVideoJob) else [Problem("(file)", str(exc))]
        for p in problems:
            print(f"{args.file or 'plan'}: {p.field}: {p.message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    request = request_from_spec(spec)
    if args.fp8_weights:
        request = replace(request, fp8_weights=True)
    result = choose(request, inventory_for_spec(spec, inventory))
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(render_plan(spec, inventory, result, show_all=args.all))
    return EXIT_OK if result.chosen else EXIT_DOES_NOT_FIT


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


def _text_field(path: list[str]) -> bool:
    """Whether the spec field at this camelCase path holds text (str, or a Literal
    of strings): then ``--set`` keeps the value as written, so ``cache.policy=off``
    stays "off" instead of YAML's boolean false."""
    import types
    import typing

    from pydantic import BaseModel

    from .api import VideoJobSpec

    model: Any = VideoJobSpec
    annotation: Any = None
    for part in path:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return False
        field = next((f for name, f in model.model_fields.items() if part in (name, f.alias)), None)
        if field is None:
            return False
        annotation = field.annotation
        while True:
            origin = typing.get_origin(annotation)
            if origin is typing.Annotated:
                annotation = typing.get_args(annotation)[0]
            elif origin in (typing.Union, types.UnionType):
                annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
            else:
                break
        model = annotation
    if typing.get_origin(annotation) is typing.Literal:
        return all(isinstance(v, str) for v in typing.get_args(annotation))
    return annotation is str


def apply_overrides(doc: dict, assignments: Sequence[str]) -> dict:
    """``--set parallel.ulysses=2``: set a dotted spec field. Text fields take the
    value as written; others read it as YAML (numbers, booleans, null, lists)."""
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise InvalidVideoJob([Problem("--set", f"{item!r} is not KEY=VALUE, e.g. parallel.ulysses=2")])
        path = key.removeprefix("spec.").split(".")
        node = doc.setdefault("spec", {})
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise InvalidVideoJob([Problem("--set", f"spec.{'.'.join(path[:-1])} is not an object")])
            node = child
        if _text_field(path) and raw != "null":
            node[path[-1]] = raw
        else:
            node[path[-1]] = yaml.safe_load(raw) if raw else ""
    return doc


def _progress_bar(progress: dict) -> None:
    steps = progress.get("steps") or 0
    done = progress.get("step") or 0
    width = 30
    filled = int(width * done / steps) if steps else 0
    stage = progress.get("stage") or progress.get("state", "")
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{steps} steps  {stage:<8}")
    sys.stderr.flush()


def _log_to_file(path: Path) -> None:
    """Full tracebacks and runtime logs go to a file; the terminal gets one line per failure."""
    import logging

    path.parent.mkdir(parents=True, exist_ok=True)
    # O_NOFOLLOW: a link placed at the log's name is refused, not written through.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    handler = logging.StreamHandler(os.fdopen(fd, "w"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("videojob")
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def _cmd_run(args: argparse.Namespace) -> int:
    try:
        docs = list(_documents(Path(args.file)))
        if len(docs) != 1:
            raise InvalidVideoJob([Problem("(document)", "run takes a file with exactly one VideoJob")])
        job = parse_videojob(apply_overrides(docs[0][1], args.set or []))
    except (InvalidVideoJob, OSError, yaml.YAMLError) as exc:
        problems = exc.problems if isinstance(exc, InvalidVideoJob) else [Problem("(file)", str(exc))]
        for p in problems:
            print(f"{args.file}: {p.field}: {p.message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        from videojob_runtime.local import output_location, run_local
    except ImportError as exc:
        print(f"run: needs the runtime dependencies (pip install 'videojob[runtime]'): {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from .settings import RunSettings

    settings = RunSettings()
    out = Path(args.out) if args.out else None
    from videojob_runtime.errors import JobFailure

    try:
        directory, where = output_location(job, out, settings)
    except JobFailure as exc:  # spec.output.uri leaves its root (a link pointing out): the message names it
        print(f"{args.file}: {exc.message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    log_path = directory / f"{job.name or 'video'}.log"
    _log_to_file(log_path)
    if not args.quiet:
        print(f"output: {where}", file=sys.stderr)
    result = run_local(job, out, on_progress=None if args.quiet else _progress_bar, settings=settings)
    if not args.quiet:
        sys.stderr.write("\n")
    if not result.get("ok"):
        error = result["error"]
        where_failed = error.get("summary") or f"failed in {error.get('stage') or 'run'}"
        print(f"{job.name}: {where_failed}: {error['reason']}: {error['message'].splitlines()[0]}", file=sys.stderr)
        print(f"  details: {log_path}" + (f", {result['output']['result']}" if result.get("output") else ""),
              file=sys.stderr)
        return result.get("exit", EXIT_JOB_FAILED)
    plan, timings = result["plan"], result["timings"]
    print(f"{job.name}: {result['output']['video']} ({result['output']['bytes']} bytes), "
          f"poster {result['output']['poster']}, result {result['output']['result']}")
    print(f"  layout: {plan['summary']} on {plan['gpus']} {result['device']} rank(s); {result['reason']}")
    print("  seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items())
          + f"; wall {result['wall']['total']:.1f} (Ray start {result['wall']['ray']:.1f}, group {result['wall']['group']:.1f})")
    print(f"  memory: measured peak {result['measuredPeakGiB']:.3f} GiB per rank, planned {plan['peakGiBPerGPU']} GiB; "
          f"collectives per rank {result['collectives_per_rank']}")
    print(f"  seed {result['seed']}, frames {result['frames_digest']}")
    ray_info = result.get("ray") or {}
    print(f"  ray: {'embedded local cluster' if ray_info.get('embedded') else 'cluster'} at {ray_info.get('address')}")
    return EXIT_OK


def _cmd_operator(args: argparse.Namespace) -> int:
    """kopf inside: watch VideoJobs and run them on Ray."""
    import logging

    from pydantic import ValidationError

    from .settings import OperatorSettings

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = OperatorSettings()
    except ValidationError as exc:
        for error in exc.errors():
            print(f"operator: VIDEOJOB_{'_'.join(map(str, error['loc'])).upper()}: {error['msg']}", file=sys.stderr)
        return EXIT_BAD_INPUT
    namespaces = list(args.namespace or []) or ([] if args.all_namespaces else settings.namespaces)
    from .controller.handlers import run

    run(settings, namespaces, standalone=args.standalone)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="videojob", description=__doc__.splitlines()[0])
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
    plan.add_argument("--gpu-memory", default="80GiB", help="memory per GPU (default 80GiB)")
    plan.add_argument("--gpus", type=int, default=1, help="GPUs in the node (default 1)")
    plan.add_argument("--host-memory", help="host RAM of the node (default 64GiB per GPU)")
    plan.add_argument("--gpu-type", default="a100", choices=["a100", "l40", "h100", "h200", "generic"],
                      help="scales the time estimates (default a100)")
    plan.add_argument("--fp8-weights", action="store_true",
                      help="store the denoiser's weights in fp8 (layerwise casting; slightly changes output)")
    plan.add_argument("--json", action="store_true", help='print {"chosen", "alternatives", "reason"}')
    plan.add_argument("--all", action="store_true", help="list every alternative in the table")
    plan.add_argument("--sweep", metavar="MODEL", help="per GPU size, the largest video that fits")
    plan.set_defaults(func=_cmd_plan)

    run = sub.add_parser("run", help="plan for this machine and run on embedded local Ray; writes OUT/NAME.mp4/.png/.json")
    run.add_argument("file", metavar="FILE")
    run.add_argument("--out", help="output directory; overrides spec.output.uri (default: spec.output.uri, "
                                    "local:// under VIDEOJOB_OUTPUT_ROOT, default ./out)")
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
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
