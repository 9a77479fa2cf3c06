"""Cross-field rules on the spec, each written as CEL and as Python.

The CRD carries the CEL forms (``x-kubernetes-validations`` on ``spec`` with a
``fieldPath``), so ``kubectl apply`` rejects a bad job before the operator
sees it; ``videojob validate`` and the operator run the Python forms. Rules
that depend on the model are generated from the catalog, grouped by value so
the CRD stays small.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Callable, Optional

from ..catalog import CATALOG, FrameRule, ModelInfo
from ..layout_rules import LAYOUT_RULES, rendered, resolved_cache
from .common import cel_list
from .spec import MAX_GPUS_PER_JOB, VideoJobSpec


@dataclass(frozen=True)
class SpecRule:
    """``field``: camelCase path under spec; ``check`` returns a message or None."""

    field: str
    cel: str
    cel_message: str
    check: Callable[[VideoJobSpec], Optional[str]]
    # False for rules about what only running needs (the input images): a
    # plan (`videojob plan --model consisid`) does not need them.
    for_plan: bool = True

    def to_crd(self) -> dict[str, str]:
        return {
            "rule": self.cel,
            "messageExpression": self.cel_message,
            "fieldPath": "." + self.field,
        }


def _grouped(key: Callable[[ModelInfo], object]) -> list[tuple[object, tuple[str, ...]]]:
    models = sorted(CATALOG.values(), key=lambda m: repr(key(m)))
    return [
        (value, tuple(m.id for m in group))
        for value, group in groupby(models, key=lambda m: key(m))
    ]


def _has(path: str) -> str:
    parts = path.split(".")
    return " && ".join(f"has(self.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))


def _when(path: str, ids: tuple[str, ...], condition: str) -> str:
    """CEL: if ``path`` is set and the model is one of ``ids``, ``condition`` holds."""
    return f"!({_has(path)}) || !(self.model.name in {cel_list(ids)}) || ({condition})"


def _frame_rules() -> list[SpecRule]:
    rules = []
    for rule, ids in _grouped(lambda m: m.frames):
        f = "self.video.frames"
        condition = f"{f} >= {rule.minimum} && {f} <= {rule.maximum}"
        if rule.step > 1:
            condition += f" && ({f} - {rule.offset}) % {rule.step} == 0"
        desc = rule.describe()

        def check(spec: VideoJobSpec, rule: FrameRule = rule, ids=ids, desc=desc):
            frames = spec.video.frames
            if frames is None or spec.model.name not in ids or rule.accepts(frames):
                return None
            return (
                f"{frames} frames is not valid for {spec.model.name}: frames must be "
                f"{desc}; nearest valid value is {rule.nearest(frames)}"
            )

        rules.append(
            SpecRule(
                field="video.frames",
                cel=_when("video.frames", ids, condition),
                cel_message=f"'frames must be {desc} for model ' + self.model.name",
                check=check,
            )
        )
    return rules


def _size_rules() -> list[SpecRule]:
    rules = []
    for dim in ("width", "height"):
        for (multiple, low, high), ids in _grouped(
            lambda m: (m.size_multiple, m.min_size, m.max_size)
        ):
            v = f"self.video.{dim}"
            condition = f"{v} % {multiple} == 0 && {v} >= {low} && {v} <= {high}"
            desc = f"a multiple of {multiple} between {low} and {high}"

            def check(spec, dim=dim, ids=ids, multiple=multiple, low=low, high=high, desc=desc):
                value = getattr(spec.video, dim)
                if value is None or spec.model.name not in ids:
                    return None
                if value % multiple == 0 and low <= value <= high:
                    return None
                nearest = min(max(round(value / multiple) * multiple, low), high)
                return (
                    f"{dim} {value} is not valid for {spec.model.name}: {dim} must be "
                    f"{desc}; nearest valid value is {nearest}"
                )

            rules.append(
                SpecRule(
                    field=f"video.{dim}",
                    cel=_when(f"video.{dim}", ids, condition),
                    cel_message=f"'{dim} must be {desc} for model ' + self.model.name",
                    check=check,
                )
            )
        for model in (m for m in CATALOG.values() if m.fixed_resolution):
            native = getattr(model, f"native_{dim}")

            def fixed(spec, dim=dim, model=model, native=native):
                value = getattr(spec.video, dim)
                if spec.model.name != model.id or value is None or value == native:
                    return None
                return (
                    f"{model.id} only generates {model.native_width}x{model.native_height} "
                    f"(learned positional embeddings): set {dim} to {native} or leave it out"
                )

            rules.append(
                SpecRule(
                    field=f"video.{dim}",
                    cel=_when(f"video.{dim}", (model.id,), f"self.video.{dim} == {native}"),
                    cel_message=(
                        f"'{model.id} only generates {model.native_width}x{model.native_height}:"
                        f" set {dim} to {native} or leave it out'"
                    ),
                    check=fixed,
                )
            )
    return rules


def _task_rules() -> list[SpecRule]:
    rules = []
    for tasks, ids in _grouped(lambda m: m.tasks):

        def check(spec, tasks=tasks, ids=ids):
            if spec.task is None or spec.model.name not in ids or spec.task in tasks:
                return None
            return (
                f"task {spec.task!r} is not supported by {spec.model.name}; "
                f"it supports: {', '.join(tasks)}; pick another model or task"
            )

        rules.append(
            SpecRule(
                field="task",
                cel=_when("task", ids, f"self.task in {cel_list(tasks)}"),
                cel_message=f"'model ' + self.model.name + ' supports tasks {', '.join(tasks)} only'",
                check=check,
            )
        )
    return rules


def _effective_task_cel(task: str) -> str:
    default_ids = tuple(m.id for m in CATALOG.values() if m.tasks[0] == task)
    return f"(has(self.task) ? self.task == '{task}' : self.model.name in {cel_list(default_ids)})"


def _input_rules() -> list[SpecRule]:
    rules = []
    for task, field, wire in (("i2v", "image", "image"), ("identity", "face_image", "faceImage")):
        is_task = _effective_task_cel(task)

        def needs(spec, task=task, field=field, wire=wire):
            if spec.effective_task == task and getattr(spec, field) is None:
                return f"task {task} needs {wire}: set it to the image's uri (e.g. pvc://inputs/{wire}.png)"
            return None

        def unused(spec, task=task, field=field, wire=wire):
            if spec.effective_task != task and getattr(spec, field) is not None:
                return f"only task {task} uses {wire}; remove it or set task: {task}"
            return None

        rules.append(
            SpecRule(
                field=wire,
                cel=f"!{is_task} || has(self.{wire})",
                cel_message=f"'task {task} needs {wire}: set it to the image uri'",
                check=needs,
                for_plan=False,
            )
        )
        rules.append(
            SpecRule(
                field=wire,
                cel=f"{is_task} || !has(self.{wire})",
                cel_message=f"'{wire} is only used by task {task}; remove it or set task: {task}'",
                check=unused,
            )
        )
    return rules


def _cache_rules() -> list[SpecRule]:
    rules = []
    for caches, ids in _grouped(lambda m: m.caches):

        def check(spec, caches=caches, ids=ids):
            if spec.model.name not in ids or spec.cache.policy in caches:
                return None
            return (
                f"cache policy {spec.cache.policy!r} is not supported by {spec.model.name}; "
                f"use one of: {', '.join(caches)}"
            )

        rules.append(
            SpecRule(
                field="cache.policy",
                cel=_when("cache.policy", ids, f"self.cache.policy in {cel_list(caches)}"),
                cel_message=f"'model ' + self.model.name + ' supports cache policies {', '.join(caches)} only'",
                check=check,
            )
        )
    return rules


def spec_layout_env(spec: VideoJobSpec, model: ModelInfo) -> dict:
    """The layout rules' variables for a spec (``layout_rules``): its values, else the model's defaults."""
    p = spec.parallel
    g = spec.sampling.guidance_scale
    return {
        "width": spec.video.width if spec.video.width is not None else model.native_width,
        "height": spec.video.height if spec.video.height is not None else model.native_height,
        "frames": spec.video.frames if spec.video.frames is not None else model.native_frames,
        "guidance": g if g is not None else model.default_guidance,
        "ulysses": p.ulysses if p else 1, "ring": p.ring if p else 1, "cfg": p.cfg if p else 1,
        "cache": resolved_cache(model, spec.cache.policy),
    }


def _parallel_rules() -> list[SpecRule]:
    """A ``parallel`` override must be runnable: every layout rule, from its one
    definition (``layout_rules``), as CEL per group of models and as Python."""
    rules = []
    for layout_rule in LAYOUT_RULES:
        for condition, ids in rendered(layout_rule).items():

            def check(spec, layout_rule=layout_rule, ids=ids):
                if spec.parallel is None or spec.model.name not in ids:
                    return None
                model = CATALOG[spec.model.name]
                env = spec_layout_env(spec, model)
                return None if layout_rule.holds(model).eval(env) else layout_rule.explain(model, env)

            rules.append(
                SpecRule(
                    field=layout_rule.field,
                    cel=f"!has(self.parallel) || !(self.model.name in {cel_list(ids)}) || {condition}",
                    cel_message=layout_rule.cel_message,
                    check=check,
                )
            )

    def fits_max_gpus(spec):
        p = spec.parallel
        if p is None or p.world_size <= spec.resources.max_gpus:
            return None
        return (
            f"ulysses x ring x cfg = {p.world_size} GPUs exceeds resources.maxGPUs "
            f"{spec.resources.max_gpus}: lower a degree or raise maxGPUs"
        )

    def deg(name: str) -> str:
        return f"(has(self.parallel.{name}) ? self.parallel.{name} : 1)"

    rules.append(
        SpecRule(
            field="parallel",
            cel=(
                f"!has(self.parallel) || {deg('ulysses')} * {deg('ring')} * {deg('cfg')} <= "
                f"(has(self.resources) && has(self.resources.maxGPUs) ? self.resources.maxGPUs : {MAX_GPUS_PER_JOB})"
            ),
            cel_message="'ulysses x ring x cfg must not exceed resources.maxGPUs'",
            check=fits_max_gpus,
        )
    )
    return rules


def _memory_rules() -> list[SpecRule]:
    forced = "has(self.memory) && has(self.memory.offload) && self.memory.offload != 'none'"

    def needs_allow(spec):
        m = spec.memory
        if m is None or m.offload in (None, "none") or spec.resources.allow_offload:
            return None
        return (f"memory.offload {m.offload} contradicts resources.allowOffload false: "
                "set allowOffload true or memory.offload none")

    def one_rank(spec):
        m, p = spec.memory, spec.parallel
        if m is None or m.offload in (None, "none") or p is None or p.world_size == 1:
            return None
        return (f"memory.offload {m.offload} runs on one GPU, but parallel asks for {p.world_size}: "
                "drop the parallel override or set memory.offload none")

    def deg(name: str) -> str:
        return f"(has(self.parallel.{name}) ? self.parallel.{name} : 1)"

    def decode_needs_no_offload(spec):
        m = spec.memory
        if m is None or not m.decode_offload or m.offload in (None, "none"):
            return None
        return (f"memory.decodeOffload moves the denoiser off the GPU for the decode, which offload {m.offload} "
                "already does: drop decodeOffload or set memory.offload none")

    return [
        SpecRule(
            field="memory.decodeOffload",
            cel=f"!(has(self.memory) && has(self.memory.decodeOffload) && self.memory.decodeOffload) || !({forced})",
            cel_message="'memory.decodeOffload needs memory.offload none'",
            check=decode_needs_no_offload,
        ),
        SpecRule(
            field="memory.offload",
            cel=f"!({forced}) || !has(self.resources) || !has(self.resources.allowOffload) || self.resources.allowOffload",
            cel_message="'memory.offload ' + self.memory.offload + ' contradicts resources.allowOffload false'",
            check=needs_allow,
        ),
        SpecRule(
            field="memory.offload",
            cel=f"!({forced}) || !has(self.parallel) || {deg('ulysses')} * {deg('ring')} * {deg('cfg')} == 1",
            cel_message="'memory.offload ' + self.memory.offload + ' runs on one GPU: drop the parallel override or set offload none'",
            check=one_rank,
        ),
    ]


def _checkpoint_rules() -> list[SpecRule]:
    def one_of(spec: VideoJobSpec) -> Optional[str]:
        c = spec.checkpoint
        if c is None or c.every_steps is None or c.every_seconds is None:
            return None
        return "checkpoint.everySteps and checkpoint.everySeconds are both set: keep one"

    return [SpecRule(
        field="checkpoint.everySeconds",
        cel="!has(self.checkpoint) || !has(self.checkpoint.everySteps) || !has(self.checkpoint.everySeconds)",
        cel_message="'checkpoint.everySteps and checkpoint.everySeconds are both set: keep one'",
        check=one_of,
    )]


SPEC_RULES: tuple[SpecRule, ...] = tuple(
    _frame_rules()
    + _size_rules()
    + _task_rules()
    + _input_rules()
    + _cache_rules()
    + _parallel_rules()
    + _memory_rules()
    + _checkpoint_rules()
)


def spec_problems(spec: VideoJobSpec, for_plan: bool = False) -> list[tuple[str, str]]:
    """(field under spec, message) for every cross-field rule the spec breaks
    (``for_plan``: only those that matter to a plan, not to running it)."""
    problems = []
    for rule in SPEC_RULES:
        if for_plan and not rule.for_plan:
            continue
        message = rule.check(spec)
        if message:
            problems.append((rule.field, message))
    return problems
