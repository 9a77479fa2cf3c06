"""`videojob run`: plan for this machine and run one VideoJob on embedded local
Ray: the file with its ``--set`` overrides, the progress bar, and the run's log
(written beside the result only when the job failed)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml

from ..api import InvalidVideoJob, Problem, parse_videojob
from .common import EXIT_BAD_INPUT, EXIT_JOB_FAILED, EXIT_OK, _documents, _emit

def _text_field(path: list[str]) -> bool:
    """Whether the spec field at this camelCase path holds text (str, or a Literal
    of strings): then ``--set`` keeps the value as written, so ``cache.policy=off``
    stays "off" instead of YAML's boolean false."""
    import types
    import typing

    from pydantic import BaseModel

    from ..api import VideoJobSpec

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
    from ..settings import RunSettings

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
