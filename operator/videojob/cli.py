"""The `videojob` command line.

Subcommands are small functions over the same library the operator uses, so
what `videojob validate` says is what the operator would say.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml

from .api import InvalidVideoJob, Problem, parse_videojob
from .crd import render_crd

# Exit codes, one table for validate, plan and run (docs/running.md "Exit codes").
EXIT_OK = 0
EXIT_BAD_INPUT = 1  # a file, flag or field is wrong; the message names it
EXIT_JOB_FAILED = 2  # the job ran and failed, or could not be placed or finished (stage and reason printed)
EXIT_DOES_NOT_FIT = 3  # no layout fits the GPUs (the reason names the smallest change that would)


def _emit(text: str) -> None:
    """Print to stdout; when the reader has gone (``videojob plan --json | head``),
    stop writing quietly instead of ending in BrokenPipeError."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_gone()


def _stdout_gone() -> None:
    """Point stdout at /dev/null, so nothing more (the interpreter's final flush
    included) is written to a pipe whose reader has gone."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag or value is bad input, exit 1 (the exit-code table;
    argparse's own 2 is what a failed job exits with). The message names the flag
    and, for a choice, the valid values."""

    def error(self, message: str):  # noqa: ANN201 - argparse's signature
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


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
        _emit(line)
    if not problems:
        _emit(f"{len(args.files)} file(s) valid")
        return EXIT_OK
    return EXIT_BAD_INPUT


def _cmd_crd(args: argparse.Namespace) -> int:
    text = render_crd()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        _emit(text.rstrip("\n"))
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


# A bare number on --gpu-memory/--host-memory is GiB ("24" is a 24 GiB GPU); above
# this it is surely a byte count written without a unit, and refused.
_BARE_GIB_LIMIT = 16384


def memory_flag(value: str, flag: str) -> int:
    """Bytes in a --gpu-memory/--host-memory value: a bare number is GiB (24 -> 24 GiB),
    else a size with its unit (24GiB, 24Gi, 80GB, 512Mi). Unlike ``resources.gpuMemory``,
    a Kubernetes quantity where a bare number is bytes, a flag is read as people write GPU sizes."""
    import re

    from .api import parse_bytes
    from .planner import GiB

    text = value.strip()
    if re.fullmatch(r"[0-9]+(\.[0-9]+)?", text):
        number = float(text)
        if number <= 0:
            raise InvalidVideoJob([Problem(flag, f"{value!r} is zero; a memory size must be positive")])
        if number > _BARE_GIB_LIMIT:
            raise InvalidVideoJob([Problem(flag, f"{value!r}: a bare number is GiB, and {number:g} GiB is not a "
                                                 "size this flag describes; write the unit, e.g. 24GiB or 80GB")])
        return int(number * GiB)
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise InvalidVideoJob([Problem(flag, f"{exc}; a bare number is GiB (e.g. {flag} 24)")]) from None


def _inventory_from_args(args: argparse.Namespace):
    from .planner import GiB, Inventory

    gpu_memory = memory_flag(args.gpu_memory, "--gpu-memory")
    host = memory_flag(args.host_memory, "--host-memory") if args.host_memory else 64 * GiB * args.gpus
    if args.gpus < 1 or args.gpus > 8:
        raise InvalidVideoJob([Problem("--gpus", f"must be between 1 and 8 (got {args.gpus})")])
    return Inventory(gpu_memory=gpu_memory, gpus_per_node=args.gpus, host_memory=host, gpu_type=args.gpu_type)


# GPU sizes (GiB) and host RAM sizes tried for the flag that would make a plan fit.
_TRY_GPU_GIB = (12, 16, 24, 32, 40, 48, 80, 96, 141, 192)
_TRY_HOST_GIB = (32, 64, 128, 256, 512, 1024, 2048)
MAX_GPUS = 8


def fits_with_flags(spec, request, inventory, args: argparse.Namespace) -> list[str]:
    """The single flag changes of this command that would make a plan that fits
    nothing fit, smallest first per flag: ``--gpus N`` (the default 1 is less than
    a job's parallel override may pin), ``--gpu-memory``, ``--host-memory``."""
    from dataclasses import replace

    from .planner import GiB, choose, inventory_for_spec

    def fits(candidate) -> bool:
        return choose(request, inventory_for_spec(spec, candidate), exhaustive=False).chosen is not None

    fixes: list[str] = []
    for gpus in range(inventory.gpus_per_node + 1, MAX_GPUS + 1):
        host = inventory.host_memory if args.host_memory else 64 * GiB * gpus  # the default follows --gpus
        if fits(replace(inventory, gpus_per_node=gpus, host_memory=host)):
            fixes.append(f"--gpus {gpus}")
            break
    if not spec.resources.gpu_memory:  # the spec's gpuMemory overrides --gpu-memory: no use suggesting it
        bigger = [g for g in _TRY_GPU_GIB if g * GiB > inventory.gpu_memory]
        found = next((g for g in bigger if fits(replace(inventory, gpu_memory=g * GiB))), None)
        if found is not None:
            fixes.append(f"--gpu-memory {found}GiB")
    bigger_host = [h for h in _TRY_HOST_GIB if h * GiB > inventory.host_memory]
    found = next((h for h in bigger_host if fits(replace(inventory, host_memory=h * GiB))), None)
    if found is not None:
        fixes.append(f"--host-memory {found}GiB")
    if not fixes and not spec.resources.gpu_memory:  # bigger GPUs in a bigger host, both at once
        pair = next(((g, h) for g in bigger for h in bigger_host
                     if fits(replace(inventory, gpu_memory=g * GiB, host_memory=h * GiB))), None)
        if pair is not None:
            fixes.append(f"--gpu-memory {pair[0]}GiB --host-memory {pair[1]}GiB")
    return fixes


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
            _emit(json.dumps(rows, indent=2) if args.json else render_sweep(args.sweep, rows, inventory))
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
    fits_with = [] if result.chosen else fits_with_flags(spec, request, inventory, args)
    if args.json:
        _emit(json.dumps({**result.to_json(), **({} if result.chosen else {"fitsWith": fits_with})}, indent=2))
    else:
        _emit(render_plan(spec, inventory, result, show_all=args.all, fits_with=fits_with))
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


def _unquoted(raw: str) -> str:
    """A text value as written, or the text inside its quotes: ``"off"`` and ``'off'``
    are off (users quote words YAML would read as booleans), with YAML's escapes."""
    text = raw.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            return raw
        if isinstance(value, str):
            return value
    return raw


def apply_overrides(doc: dict, assignments: Sequence[str]) -> dict:
    """``--set parallel.ulysses=2``: set a dotted spec field. Text fields take the
    value as written (or the text inside its quotes: ``cache.policy="off"`` is off);
    others read it as YAML (numbers, booleans, null, lists)."""
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
            node[path[-1]] = _unquoted(raw)
        else:
            node[path[-1]] = yaml.safe_load(raw) if raw else ""
    return doc


def _progress_bar(progress: dict) -> None:
    steps = progress.get("steps") or 0
    done = progress.get("step") or 0
    width = 30
    filled = int(width * done / steps) if steps else 0
    stage = progress.get("stage") or progress.get("state", "")
    try:
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{steps} steps  {stage:<8}")
        sys.stderr.flush()
    except OSError:  # a terminal or pipe that went away: the run goes on without its bar
        pass


class _RunLog(logging.Handler):
    """The run's log (the runtime's records and Ray's own start-up lines), kept in
    memory and written as NAME.log beside the result only when the job failed:
    a successful run leaves the video, the poster and the result, nothing else."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # noqa: BLE001 - logging's own rule: a bad record never stops the run
            self.handleError(record)

    def write(self, path: Path) -> None:
        # O_NOFOLLOW: a link placed at the log's name is refused, not written through.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as out:
            out.write("\n".join(self.lines) + ("\n" if self.lines else ""))


@contextlib.contextmanager
def _run_logging() -> Iterator[_RunLog]:
    """The run's log for the ``videojob`` loggers; Ray's records arrive as
    ``videojob.ray`` (``videojob_runtime.local.ray_logs_to``): all go to the log,
    and Ray's errors also to stderr, so they surface while its chatter does not."""
    run_log = _RunLog()
    root = logging.getLogger("videojob")
    ray_errors = logging.StreamHandler(sys.stderr)
    ray_errors.setLevel(logging.ERROR)
    ray_errors.setFormatter(logging.Formatter("ray: %(levelname)s %(message)s"))
    ray_logger = logging.getLogger("videojob.ray")
    level = root.level
    root.addHandler(run_log)
    root.setLevel(logging.INFO)
    ray_logger.addHandler(ray_errors)
    try:
        yield run_log
    finally:
        ray_logger.removeHandler(ray_errors)
        root.removeHandler(run_log)
        root.setLevel(level)


def _inputs_dir(args: argparse.Namespace) -> str:
    """Where `videojob run` reads local:// inputs: --inputs, else VIDEOJOB_DATA_ROOT, else here."""
    return args.inputs if args.inputs is not None else (os.environ.get("VIDEOJOB_DATA_ROOT") or os.getcwd())


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
    for flag, value in (("--out", args.out), ("--inputs", args.inputs)):
        if value is not None and not value.strip():
            print(f"run: {flag}: empty; name a directory", file=sys.stderr)
            return EXIT_BAD_INPUT
    inputs = _inputs_dir(args)
    if not Path(inputs).is_dir():
        named = f"--inputs {args.inputs}" if args.inputs is not None else f"VIDEOJOB_DATA_ROOT {inputs}"
        print(f"run: {named}: not a directory; local:// inputs are read under it", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        from videojob_runtime.local import run_local
    except ImportError as exc:
        print(f"run: needs the runtime dependencies (pip install 'videojob[runtime]'): {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from .settings import RunSettings

    settings = RunSettings()
    out = Path(args.out) if args.out is not None else None

    def ready(info: dict) -> None:
        if args.quiet:
            return
        print(f"output: {info['output']}", file=sys.stderr)
        if info.get("inputs"):
            print(f"inputs: local:// under {info['inputs']}", file=sys.stderr)

    with _run_logging() as run_log:
        result = run_local(job, out, on_progress=None if args.quiet else _progress_bar, settings=settings,
                           inputs_dir=inputs, on_ready=ready,
                           inputs_setting="--inputs DIR (default: VIDEOJOB_DATA_ROOT, else the current directory)")
    if not result.get("ok"):
        error = result["error"]
        code = result.get("exit", EXIT_JOB_FAILED)
        if code == EXIT_BAD_INPUT:  # found before anything ran: nothing was written
            print(f"{args.file}: {error['message'].splitlines()[0]}", file=sys.stderr)
            return code
        if not args.quiet and result.get("ray") is not None:
            sys.stderr.write("\n")  # past the progress bar
        where_failed = error.get("summary") or f"failed in {error.get('stage') or 'run'}"
        print(f"{job.name}: {where_failed}: {error['reason']}: {error['message'].splitlines()[0]}", file=sys.stderr)
        record = (result.get("output") or {}).get("result")
        if record:  # the failure record was written: the full log goes beside it
            log_path = Path(record).with_suffix(".log")
            try:
                run_log.write(log_path)
                print(f"  details: {log_path}, {record}", file=sys.stderr)
            except OSError as exc:
                print(f"  details: {record} (the log could not be written: {exc.strerror or exc})", file=sys.stderr)
        return code
    if not args.quiet:
        sys.stderr.write("\n")
    stale = Path(result["output"]["result"]).with_suffix(".log")
    if stale.is_file() and not stale.is_symlink():  # an earlier failed run's log: not this run's
        stale.unlink()
    plan, timings = result["plan"], result["timings"]
    _emit(f"{job.name}: {result['output']['video']} ({result['output']['bytes']} bytes), "
          f"poster {result['output']['poster']}, result {result['output']['result']}")
    _emit(f"  layout: {plan['summary']} on {plan['gpus']} {result['device']} rank(s); {result['reason']}")
    _emit("  seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items())
          + f"; wall {result['wall']['total']:.1f} (Ray start {result['wall']['ray']:.1f}, "
            f"group {result['wall']['group']:.1f})")
    _emit(f"  memory: measured peak {result['measuredPeakGiB']:.3f} GiB per rank, planned {plan['peakGiBPerGPU']} "
          f"GiB; collectives per rank {result['collectives_per_rank']}")
    _emit(f"  seed {result['seed']}, frames {result['frames_digest']}")
    ray_info = result.get("ray") or {}
    _emit(f"  ray: {'embedded local cluster' if ray_info.get('embedded') else 'cluster'} at {ray_info.get('address')}")
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
