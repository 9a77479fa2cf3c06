"""What a parallel layout needs of a job, written once for the validator and the planner.

A rule is an expression over a few variables (the video size, guidance,
the degrees, the cache policy) with the model's facts as constants. The same
expression object renders as CEL (the CRD: ``kubectl apply`` refuses the
job) and evaluates in Python (``videojob validate``, and the planner, which
uses it to decide which degrees it may enumerate). So a spec that validates
never fails to plan for a reason the spec alone decides, and the two
validators cannot drift: there is nothing to keep in step by hand.

The variables, and where they come from:
  width, height, frames, guidance   the spec's values, else the model's defaults
  ulysses, ring, cfg                the degrees (a spec's ``parallel`` override, or a planner candidate)
  cache                             the cache policy, ``auto`` resolved for the model
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .catalog import CATALOG, ModelInfo

Env = Mapping[str, Any]


# -- a tiny expression language: integer and boolean arithmetic, CEL or Python -----

class Expr:
    """An expression that renders as CEL and evaluates in Python, identically."""

    def cel(self, names: Mapping[str, str]) -> str:
        raise NotImplementedError

    def eval(self, env: Env) -> Any:
        raise NotImplementedError

    # arithmetic (integers: // is CEL's / on ints, which truncates; operands here are never negative)
    def __add__(self, other): return _Bin("+", self, lift(other))
    def __sub__(self, other): return _Bin("-", self, lift(other))
    def __mul__(self, other): return _Bin("*", self, lift(other))
    def __floordiv__(self, other): return _Bin("/", self, lift(other))
    def __mod__(self, other): return _Bin("%", self, lift(other))

    # comparisons and logic (not Python's ==: these build expressions)
    def eq(self, other): return _Bin("==", self, lift(other))
    def ne(self, other): return _Bin("!=", self, lift(other))
    def gt(self, other): return _Bin(">", self, lift(other))
    def le(self, other): return _Bin("<=", self, lift(other))
    def __and__(self, other): return _Bin("&&", self, lift(other))
    def __or__(self, other): return _Bin("||", self, lift(other))


@dataclass(frozen=True, eq=False)
class Const(Expr):
    value: Any

    def cel(self, names: Mapping[str, str]) -> str:
        if isinstance(self.value, bool):
            return "true" if self.value else "false"
        if isinstance(self.value, float):
            return repr(float(self.value))  # CEL never mixes int and double: keep the ".0"
        if isinstance(self.value, str):
            return "'" + self.value.replace("\\", "\\\\").replace("'", "\\'") + "'"
        return str(int(self.value))

    def eval(self, env: Env) -> Any:
        return self.value


@dataclass(frozen=True, eq=False)
class Var(Expr):
    name: str

    def cel(self, names: Mapping[str, str]) -> str:
        return names[self.name]

    def eval(self, env: Env) -> Any:
        return env[self.name]


_PY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a // b,
       "%": lambda a, b: a % b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b, ">": lambda a, b: a > b,
       "<=": lambda a, b: a <= b, "&&": lambda a, b: bool(a) and bool(b), "||": lambda a, b: bool(a) or bool(b)}


@dataclass(frozen=True, eq=False)
class _Bin(Expr):
    op: str
    left: Expr
    right: Expr

    def cel(self, names: Mapping[str, str]) -> str:
        return f"({self.left.cel(names)} {self.op} {self.right.cel(names)})"

    def eval(self, env: Env) -> Any:
        if self.op == "&&":
            return bool(self.left.eval(env)) and bool(self.right.eval(env))
        if self.op == "||":
            return bool(self.left.eval(env)) or bool(self.right.eval(env))
        return _PY[self.op](self.left.eval(env), self.right.eval(env))


def lift(value: Any) -> Expr:
    return value if isinstance(value, Expr) else Const(value)


WIDTH, HEIGHT, FRAMES, GUIDANCE = Var("width"), Var("height"), Var("frames"), Var("guidance")
ULYSSES, RING, CFG, CACHE = Var("ulysses"), Var("ring"), Var("cfg"), Var("cache")
SP = ULYSSES * RING
WORLD = SP * CFG


def latent_tokens(model: ModelInfo) -> Expr:
    """The transformer's patch tokens (catalog ``Arch.tokens``, as an expression)."""
    arch = model.arch
    side = arch.vae_spatial * arch.patch_hw
    if arch.vae_temporal == 1:
        latent = FRAMES
    else:
        latent = (FRAMES - 1) // arch.vae_temporal + 1
        latent = (latent + (arch.patch_t - 1)) // arch.patch_t * arch.patch_t  # CogVideoX 1.5 pads to patch_t
    return latent // arch.patch_t * (HEIGHT // side) * (WIDTH // side)


def latent_rows(model: ModelInfo) -> Expr:
    return HEIGHT // (model.arch.vae_spatial * model.arch.patch_hw)


# -- the rules -------------------------------------------------------------------

@dataclass(frozen=True)
class LayoutRule:
    """``holds(model)`` is None when the rule does not apply to the model."""

    key: str
    field: str  # under spec
    holds: Callable[[ModelInfo], Expr | None]
    explain: Callable[[ModelInfo, Env], str]  # why it fails, with the numbers and the fix
    cel_message: str  # a CEL string expression


def _sp_degrees(model: ModelInfo, env: Env, rule: "LayoutRule") -> list[int]:
    """Sequence-parallel degrees (ulysses x ring, up to 8) for which ``rule`` holds here."""
    expr = rule.holds(model)
    return [sp for sp in range(1, 9) if expr.eval({**env, "ulysses": sp, "ring": 1, "cfg": 1})]


def _single_rank(degree: str) -> LayoutRule:
    var = {"ulysses": ULYSSES, "ring": RING, "cfg": CFG}[degree]
    return LayoutRule(
        key=f"single-rank-{degree}", field=f"parallel.{degree}",
        holds=lambda m: None if m.sequence_parallel else var.eq(1),
        explain=lambda m, env: (f"{m.id} runs on one GPU (xfuser has no parallel pipeline for it): "
                                f"set parallel.{degree} to 1"),
        cel_message=f"self.model.name + ' runs on one GPU (xfuser has no parallel pipeline for it): "
                    f"set parallel.{degree} to 1'",
    )


def _divides_heads() -> LayoutRule:
    def explain(m: ModelInfo, env: Env) -> str:
        valid = [d for d in range(1, 9) if m.attention_heads % d == 0]
        return (f"ulysses {env['ulysses']} does not divide the {m.attention_heads} attention heads of {m.id}; "
                f"use one of {valid}, or ring for the rest")

    return LayoutRule(
        key="ulysses-divides-heads", field="parallel.ulysses",
        holds=lambda m: (Const(m.attention_heads) % ULYSSES).eq(0) if m.sequence_parallel else None,
        explain=explain,
        cel_message="'ulysses must divide the attention heads of ' + self.model.name",
    )


def _cfg_supported() -> LayoutRule:
    return LayoutRule(
        key="cfg-supported", field="parallel.cfg",
        holds=lambda m: CFG.eq(1) if (m.sequence_parallel and not m.cfg_parallel) else None,
        explain=lambda m, env: f"xfuser has no CFG parallel for {m.id}: set parallel.cfg to 1 (use ulysses or ring)",
        cel_message="'xfuser has no CFG parallel for ' + self.model.name + ': set parallel.cfg to 1'",
    )


def _cfg_needs_guidance() -> LayoutRule:
    return LayoutRule(
        key="cfg-needs-guidance", field="parallel.cfg",
        holds=lambda m: CFG.eq(1) | GUIDANCE.gt(1.0) if m.sequence_parallel else None,
        explain=lambda m, env: (f"parallel.cfg 2 splits the conditional and unconditional passes, which "
                                f"guidanceScale {env['guidance']} (<= 1) does not run: set cfg to 1"),
        cel_message="'parallel.cfg 2 needs sampling.guidanceScale above 1: set cfg to 1'",
    )


def _sp_needs_guidance() -> LayoutRule:
    return LayoutRule(
        key="sp-needs-guidance", field="parallel",
        holds=lambda m: SP.eq(1) | GUIDANCE.gt(1.0) if (m.sequence_parallel and m.sp_needs_guidance) else None,
        explain=lambda m, env: (f"xfuser runs {m.id} sequence-parallel only with guidance above 1 "
                                f"(guidanceScale {env['guidance']}): raise it or set ulysses and ring to 1"),
        cel_message="'xfuser runs ' + self.model.name + ' sequence-parallel only with sampling.guidanceScale above 1'",
    )


def _tokens_divisible() -> LayoutRule:
    def explain(m: ModelInfo, env: Env) -> str:
        tokens = latent_tokens(m).eval(env)
        sp = env["ulysses"] * env["ring"]
        return (f"ulysses x ring = {sp} does not divide the {tokens} latent tokens of this video "
                f"({env['width']}x{env['height']}, {env['frames']} frames; xfuser would pad them without "
                f"masking); sequence-parallel degrees that do: {_sp_degrees(m, env, rule)}")

    rule = LayoutRule(
        key="tokens-divisible", field="parallel",
        # Height-split models are covered by rows-divisible (rows divide => tokens divide).
        holds=lambda m: (latent_tokens(m) % SP).eq(0) if (m.sequence_parallel and m.sp_split != "height") else None,
        explain=explain,
        cel_message="'ulysses x ring must divide the latent tokens of the video (see videojob plan)'",
    )
    return rule


def _rows_divisible() -> LayoutRule:
    def explain(m: ModelInfo, env: Env) -> str:
        rows = latent_rows(m).eval(env)
        sp = env["ulysses"] * env["ring"]
        return (f"ulysses x ring = {sp} does not divide the {rows} latent patch rows of height {env['height']} "
                f"({m.id} splits the latent height across ranks); degrees that do: {_sp_degrees(m, env, rule)}")

    rule = LayoutRule(
        key="rows-divisible", field="parallel",
        holds=lambda m: (latent_rows(m) % SP).eq(0) if (m.sequence_parallel and m.sp_split == "height") else None,
        explain=explain,
        cel_message="'ulysses x ring must divide the latent patch rows (height / 16) for ' + self.model.name",
    )
    return rule


def _fbcache_one_rank() -> LayoutRule:
    return LayoutRule(
        key="fbcache-one-rank", field="cache.policy",
        holds=lambda m: CACHE.ne("fbcache") | WORLD.eq(1) if "fbcache" in m.caches else None,
        explain=lambda m, env: ("fbcache decides per rank, and ranks that disagree deadlock: use dbcache or "
                                "teacache with a parallel layout, or drop the parallel override"),
        cel_message="'fbcache runs on one GPU: use dbcache or teacache with parallel'",
    )


LAYOUT_RULES: tuple[LayoutRule, ...] = (
    _single_rank("ulysses"), _single_rank("ring"), _single_rank("cfg"),
    _divides_heads(), _cfg_supported(), _cfg_needs_guidance(), _sp_needs_guidance(),
    _rows_divisible(), _tokens_divisible(), _fbcache_one_rank(),
)


def layout_problem(model: ModelInfo, env: Env) -> tuple[LayoutRule, str] | None:
    """The first rule this layout breaks, with the explanation (None: it can run)."""
    for rule in LAYOUT_RULES:
        expr = rule.holds(model)
        if expr is not None and not expr.eval(env):
            return rule, rule.explain(model, env)
    return None


# -- CEL bindings of the variables for a spec ---------------------------------------

def _spec_value(path: str, default: str) -> str:
    parts = path.split(".")
    has = " && ".join(f"has(self.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))
    return f"({has} ? self.{path} : {default})"


def resolved_cache(model: ModelInfo, policy: str) -> str:
    """``auto`` as the planner resolves it for this model (one place: here)."""
    if policy == "auto":
        return next((c for c in ("dbcache", "fbcache", "teacache") if c in model.caches), "off")
    return policy


def cel_names(model: ModelInfo) -> dict[str, str]:
    """CEL for each variable, over ``self`` (the spec), with this model's defaults."""
    policy = _spec_value("cache.policy", "'auto'")
    auto = Const(resolved_cache(model, "auto")).cel({})
    return {
        "width": _spec_value("video.width", str(model.native_width)),
        "height": _spec_value("video.height", str(model.native_height)),
        "frames": _spec_value("video.frames", str(model.native_frames)),
        "guidance": _spec_value("sampling.guidanceScale", repr(float(model.default_guidance))),
        "ulysses": "(has(self.parallel.ulysses) ? self.parallel.ulysses : 1)",
        "ring": "(has(self.parallel.ring) ? self.parallel.ring : 1)",
        "cfg": "(has(self.parallel.cfg) ? self.parallel.cfg : 1)",
        "cache": f"({policy} == 'auto' ? {auto} : {policy})",
    }


def rendered(rule: LayoutRule) -> dict[str, tuple[str, ...]]:
    """The rule's CEL condition per group of models it renders identically for."""
    groups: dict[str, list[str]] = {}
    for model in CATALOG.values():
        expr = rule.holds(model)
        if expr is not None:
            groups.setdefault(expr.cel(cel_names(model)), []).append(model.id)
    return {cel: tuple(ids) for cel, ids in groups.items()}
