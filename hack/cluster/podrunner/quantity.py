"""Kubernetes resource quantities ("500m", "1Gi", "1e3") as exact fractions."""
from __future__ import annotations

import math
import re
from fractions import Fraction

_SUFFIXES = {
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30), "Ti": Fraction(2**40),
    "Pi": Fraction(2**50), "Ei": Fraction(2**60),
}
_RE = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(.*)$")


def parse_quantity(text: str | int | float) -> Fraction:
    """Exact value of a quantity; ValueError naming the text if it is not one."""
    if isinstance(text, (int, float)):
        return Fraction(text)
    m = _RE.match(str(text).strip())
    if not m:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number, suffix = Fraction(m.group(1)), m.group(2)
    if suffix in _SUFFIXES:
        return number * _SUFFIXES[suffix]
    exp = re.fullmatch(r"[eE]([+-]?\d+)", suffix)
    if exp:
        return number * Fraction(10) ** int(exp.group(1))
    raise ValueError(f"{text!r} is not a Kubernetes quantity (unknown suffix {suffix!r})")


def _ceil(value: Fraction) -> int:
    return math.ceil(value)


def resource_value(resource: str, quantity: str | None, divisor: str | None) -> str:
    """What the kubelet puts in a resourceFieldRef env var or downwardAPI file: cpu as
    ceil(milli(q) / milli(divisor)), everything else as ceil(value(q) / value(divisor))."""
    q = parse_quantity(quantity) if quantity is not None else Fraction(0)
    d = parse_quantity(divisor) if divisor not in (None, "") else Fraction(0)
    if d == 0:
        d = Fraction(1)   # the API server stores an unset divisor as "0": the kubelet reads it as 1
    if resource.endswith(".cpu"):
        return str(_ceil(Fraction(_ceil(q * 1000)) / _ceil(d * 1000)))
    return str(_ceil(Fraction(_ceil(q)) / _ceil(d)))
