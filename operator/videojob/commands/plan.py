"""`videojob plan`: what fits on which GPUs, and how; when nothing fits, the
single flag change of this command that would make it fit."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from ..api import InvalidVideoJob, Problem, parse_videojob
from .common import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT, EXIT_OK, _documents, _emit

def _plan_spec_from_args(args: argparse.Namespace):
    """The spec to plan: a file's, or one built from --model/--width/... flags."""
    from ..api import parse_spec

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

    from ..api import parse_bytes
    from ..planner import GiB

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
    from ..planner import GiB, Inventory

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

    from ..planner import GiB, choose, inventory_for_spec

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

    from ..planner import choose, inventory_for_spec, request_from_spec, sweep
    from ..planner.report import render_plan, render_sweep

    try:
        inventory = _inventory_from_args(args)
        if args.sweep:
            from ..catalog import get_model

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
