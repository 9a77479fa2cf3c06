"""URI types for model sources, input images and output locations, and the one
containment check every kind of URI goes through.

Schemes:
  pvc://CLAIM/sub/path   a PersistentVolumeClaim mounted into the actors
  local://sub/path       relative to the runtime's root (VIDEOJOB_DATA_ROOT
                         for inputs, VIDEOJOB_OUTPUT_ROOT for outputs,
                         VIDEOJOB_MODEL_ROOT for model sources); an operator
                         job's pvc:// and local:// paths are inside its
                         namespace's directory of that root or claim
  hf://ORG/NAME[@REV]    a hub id resolved from an offline cache (sources only)
  https://HOST/path      fetched once per job by the driver (input images only;
                         plain http is refused: anyone on the path could swap it)
  s3://BUCKET/key/path   an object (inputs), a key prefix (outputs, model
                         sources) in the admin's S3 store (endpoint, region and
                         credentials from the runtime's settings, never the
                         spec); an operator job's keys are under its
                         namespace's folder of the admin's fixed tenant
                         prefix, BUCKET/<tenant prefix>/<namespace>/key/path

Containment: a spec is written by a user the runtime must not trust, and the
path part of a pvc://, local:// or s3:// uri becomes a file name on the
actors (an s3:// key is also cached under its own name). So it
is relative and normalised: no leading '/', no empty ('//'), '.' or '..'
segments, no backslash, no control character (C0, DEL, C1), no invisible
Unicode character nor one that looks like or folds (NFKC) to '/', '\\' or
'.', and no '%' at all: nothing here decodes percent-escapes, and refusing
them outright means '%2e%2e' or '%2f' cannot hide a segment from a reader
that would. A single trailing '/' is allowed (a directory).

One table of rules per kind (``URI_RULES``) is the only definition: each rule
is a RE2 pattern that CEL's ``matches()`` and Python's ``re`` read the same
way (no look-arounds, no ``\\s``; ``$`` is made strict for Python), so the
API server, ``videojob validate`` (the pydantic types below) and the runtime
(``uri_problem``, called again by the resolver on the actor) give the same
verdict. Kubernetes object names have their own rule here too
(``name_problem``): a job's name becomes its output file names; and so do
namespace names (``namespace_problem``): an operator job's locations resolve
in its namespace's own directory (the runtime's ``locations``).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field

from .common import Cel

UriKind = Literal["output", "input", "source"]
MAX_URI_LENGTH = 1024

_PATH_SCHEMES = r"^(pvc|local|s3)://"
# Unicode characters that are invisible (zero-width, bidi controls, BOM), that
# are spaces other than ' ', or that look like or NFKC-fold to '/', '\' or '.'
# (U+2024 ONE DOT LEADER folds to '.', U+FE30 to '..', U+2100 to 'a/c'). The
# folding and the invisible ones are generated from the Unicode tables
# (``lookalike_ranges``: NFKC forms holding '/', '\' or '.'; categories Cf, Zs,
# Zl, Zp) and kept here as ranges (unicodedata 14.0.0, Python 3.11), so the
# CRD does not change with the Python that writes it; tests/test_uris.py fails
# when the running Python's tables name a character they lack. The rest look
# alike without folding, listed by hand. Listed as characters, not escapes: CEL
# gets them as \\uXXXX in its string literal.
_FOLDING_RANGES = ((0x2024, 0x2026), (0x2100, 0x2101), (0x2105, 0x2106), (0x2488, 0x249B), (0x33C2, 0x33C2),
                   (0x33C7, 0x33C7), (0x33D8, 0x33D8), (0xFE19, 0xFE19), (0xFE30, 0xFE30), (0xFE52, 0xFE52),
                   (0xFE68, 0xFE68), (0xFF0E, 0xFF0F), (0xFF3C, 0xFF3C), (0x1F100, 0x1F100))
_INVISIBLE_RANGES = ((0x00A0, 0x00A0), (0x00AD, 0x00AD), (0x0600, 0x0605), (0x061C, 0x061C), (0x06DD, 0x06DD),
                     (0x070F, 0x070F), (0x0890, 0x0891), (0x08E2, 0x08E2), (0x1680, 0x1680), (0x180E, 0x180E),
                     (0x2000, 0x200F), (0x2028, 0x202F), (0x205F, 0x2064), (0x2066, 0x206F), (0x3000, 0x3000),
                     (0xFEFF, 0xFEFF), (0xFFF9, 0xFFFB), (0x110BD, 0x110BD), (0x110CD, 0x110CD),
                     (0x13430, 0x13438), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0001, 0xE0001),
                     (0xE0020, 0xE007F))


def lookalike_ranges() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(characters whose NFKC form holds '/', '\\' or '.'; invisible ones: Cf, Zs but ' ', Zl,
    Zp) as ranges, from the running Python's Unicode tables: what the two tables above hold."""
    import unicodedata

    def ranges(codes: list[int]) -> list[tuple[int, int]]:
        out: list[list[int]] = []
        for code in codes:
            if out and out[-1][1] == code - 1:
                out[-1][1] = code
            else:
                out.append([code, code])
        return [(a, b) for a, b in out]

    folding, invisible = [], []
    for code in range(0x80, 0x110000):
        ch = chr(code)
        folded = unicodedata.normalize("NFKC", ch)
        if folded != ch and any(c in folded for c in "/\\."):
            folding.append(code)
        if unicodedata.category(ch) in ("Cf", "Zs", "Zl", "Zp"):
            invisible.append(code)
    return ranges(folding), ranges(invisible)


def _char_class(ranges: tuple[tuple[int, int], ...]) -> str:
    return "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in ranges)


_LOOKALIKES = (
    _char_class(_FOLDING_RANGES) + _char_class(_INVISIBLE_RANGES)
    + "\u034f\u115f\u1160\u3164\ufe00-\ufe0f\uffa0"  # invisible, neither Cf nor a space: CGJ, fillers, VS
    + "\u2044\u2215\u29f8"  # look like '/' without folding to it
    + "\u2216\u29f5\u29f9"  # look like a backslash
)


def cel_string(text: str) -> str:
    """``text`` as a CEL single-quoted string literal (backslashes doubled,
    anything outside printable ASCII as \\uXXXX), so a regex reaches RE2 as written."""
    out = []
    for ch in text:
        if ch in "\\'":
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "'" + "".join(out) + "'"


def _python(pattern: str) -> re.Pattern[str]:
    """The pattern for Python's ``re``: ``$`` there also matches before a final
    newline, RE2's only at the very end; ``\\Z`` is RE2's ``$``."""
    return re.compile(pattern.replace("$", r"\Z"))


def _forbid(pattern: str, message: str) -> Cel:
    """A rule that fails when ``pattern`` is found anywhere in the value."""
    compiled = _python(pattern)
    return Cel(rule=f"!self.matches({cel_string(pattern)})", message=message,
               check=lambda v: compiled.search(v) is None)


def _require(pattern: str, message: str, only_for: str = "") -> Cel:
    """A rule that fails unless ``pattern`` is found (for values starting with ``only_for``)."""
    compiled = _python(pattern)
    rule = f"self.matches({cel_string(pattern)})"
    if only_for:
        rule = f"!self.startsWith({cel_string(only_for)}) || {rule}"
    return Cel(rule=rule, message=message,
               check=lambda v: not v.startswith(only_for) or compiled.search(v) is not None)


def _schemes_rule(schemes: tuple[str, ...]) -> Cel:
    prefixes = tuple(f"{s}://" for s in schemes)
    return Cel(
        rule=" || ".join(f"self.startsWith({cel_string(p)})" for p in prefixes),
        message=f"must start with one of: {', '.join(prefixes)}",
        check=lambda v: v.startswith(prefixes),
    )


_NO_HTTP = Cel(
    rule="!self.startsWith('http://')",
    message="http:// is refused: use https:// (an image fetched in clear text can be swapped on the way)",
    check=lambda v: not v.startswith("http://"),
)
_HAS_LOCATION = _require(r"^[a-z][a-z0-9]*://[^/]", "must name a location after the scheme, e.g. local://videos/my-job")
_NOT_ABSOLUTE = _forbid(r"^[a-z][a-z0-9]*:///", "must not be an absolute path: write scheme://name/path with no leading '/'")
_NO_CONTROL = _forbid(r"[\x00-\x1f\x7f-\x9f]",
                      "must not contain control characters (newline, tab, NUL, DEL and the like)")
_NO_LOOKALIKE = _forbid(f"[{_LOOKALIKES}]",
                        "must not contain invisible Unicode characters, spaces other than ' ', or characters that "
                        "look like or fold to '/', '\\' or '.' (e.g. U+200B, U+2024, U+FF0F): write plain ones")
_NO_BACKSLASH = _forbid(r"\\", "must not contain a backslash: separate path segments with '/'")
_NO_PERCENT = _forbid(
    _PATH_SCHEMES + "[^%]*%",
    "must not contain '%': percent-escapes are not decoded here (write the character itself), and "
    "'%2e' or '%2f' would hide '.' or '/' from this check",
)
_NO_EMPTY_SEGMENT = _forbid(
    _PATH_SCHEMES + "(?s:.*)//",
    "must not contain '//' (an empty path segment; after pvc://CLAIM it would make the path absolute)",
)
_NO_DOT_SEGMENT = _forbid(
    _PATH_SCHEMES + "((?s:.*)/)?[.][.]?(/|$)",
    "must not contain '.' or '..' path segments (paths stay inside their root, written without detours)",
)
_PVC_CLAIM = _require(
    r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/|$)",
    "pvc:// must be followed by a claim name (lower-case letters, digits, '-'), e.g. pvc://videos/my-job",
    only_for="pvc://",
)
_HF_ID = _require(
    r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._-]+)?$",
    "hf:// must be followed by ORG/NAME[@REVISION], e.g. hf://THUDM/CogVideoX-5b",
    only_for="hf://",
)
# S3's rule for bucket names (3-63 lower-case letters, digits, '.' and '-',
# starting and ending with a letter or digit); the key after it is a path
# under the rules above, and never carries a query, fragment or credentials.
_S3_FORM = _require(
    r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^?#@]*)?$",
    "s3:// must be followed by a bucket name (3-63 lower-case letters, digits, '.' and '-') and an optional "
    "/key/path with no '?', '#' or '@' (credentials and signatures come from the cluster's settings, never "
    "the spec), e.g. s3://videos/my-job",
    only_for="s3://",
)
_S3_BUCKET_NOT_IP = _forbid(
    r"^s3://[0-9]{1,3}[.][0-9]{1,3}[.][0-9]{1,3}[.][0-9]{1,3}(/|$)",
    "s3:// bucket names must not be shaped like an IP address, e.g. 192.168.0.1 (S3's bucket rule)",
)
_S3_BUCKET_DOTS = _forbid(
    r"^s3://[^/]*([.][.]|[.]-|-[.])",
    "s3:// bucket names must not contain '..', '.-' or '-.' (S3's bucket rule)",
)
_HTTPS_NO_USERINFO = _forbid(
    r"^https://[^/?#]*@",
    "must not carry credentials (user:password@ before the host): anyone who can read the job could read them",
)
# Signed URLs and API keys in the query (or fragment): S3 and GCS signatures and
# session tokens, Azure SAS (sig), OAuth and generic tokens, keys, passwords. A
# spec's image uri travels in the driver's request into Ray's job table and logs.
_SECRET_PARAMS = ("x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|x-goog-credential|"
                  "googleaccessid|awsaccesskeyid|signature|sig|token|access_token|id_token|refresh_token|"
                  "auth|authorization|api_key|apikey|key|secret|client_secret|password|passwd|credential|"
                  "credentials")
_HTTPS_NO_SECRET_QUERY = _forbid(
    rf"^https://[^?#]*[?#](.*[&;#])?(?i:{_SECRET_PARAMS})=",
    "must not carry a signature, token, key or password in its query (X-Amz-Signature=, sig=, token=, "
    "key= and the like): the uri reaches the driver's request, Ray's job table and logs, and anyone who can "
    "read the job; put the image on a volume (pvc://) or at an address that needs no secret",
)
_HTTPS_PORT = _require(
    r"^https://([^/?#:\[]*|\[[^/?#\]]*\])(:0*([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|"
    r"655[0-2][0-9]|6553[0-5]))?([/?#]|$)",
    "https:// takes a :port from 1 to 65535 after the host (or none: 443)",
    only_for="https://",
)
_HTTPS_NO_ENCODED_PARAM_NAME = _forbid(
    r"^https://[^?#]*[?#](.*[&;#])?[^=&;#]*%[0-9A-Fa-f]{2}[^=&;#]*=",
    "must not percent-encode a query parameter's name (X-Amz-Signatur%65= hides a signature from the check "
    "for secrets in the query): write names plainly",
)
_HTTPS_FORM = _require(
    r"^https://([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?([/?#][^ ]*)?$",
    "https:// must be followed by a host name, an optional :port and a path with no spaces "
    "(percent-encode them), e.g. https://example.com/images/face.png",
    only_for="https://",
)

# Order sets which message a value breaking several rules gets: what it is
# (scheme), then what it contains, then its structure.
_CONTAINED = (_NO_CONTROL, _NO_LOOKALIKE, _NO_BACKSLASH, _NO_PERCENT, _NO_EMPTY_SEGMENT,
              _NO_DOT_SEGMENT, _PVC_CLAIM, _S3_FORM, _S3_BUCKET_DOTS, _S3_BUCKET_NOT_IP)
URI_RULES: dict[str, tuple[Cel, ...]] = {
    "output": (_schemes_rule(("pvc", "local", "s3")), _NOT_ABSOLUTE, _HAS_LOCATION, *_CONTAINED),
    "input": (_NO_HTTP, _schemes_rule(("pvc", "local", "https", "s3")), _NOT_ABSOLUTE, _HAS_LOCATION, *_CONTAINED,
              _HTTPS_NO_USERINFO, _HTTPS_NO_SECRET_QUERY, _HTTPS_NO_ENCODED_PARAM_NAME, _HTTPS_FORM, _HTTPS_PORT),
    "source": (_schemes_rule(("hf", "pvc", "local", "s3")), _NOT_ABSOLUTE, _HAS_LOCATION, *_CONTAINED, _HF_ID),
}


def uri_problem(uri: object, kind: UriKind) -> str | None:
    """What is wrong with ``uri`` as a ``kind`` uri (None: well formed and
    contained). The same rules as the API types and the CRD's CEL; the runtime
    calls it again because a request may reach it without passing either."""
    if not isinstance(uri, str):
        return f"must be a string (got {type(uri).__name__})"
    if not 1 <= len(uri) <= MAX_URI_LENGTH:
        return f"must have 1 to {MAX_URI_LENGTH} characters (got {len(uri)})"
    for rule in URI_RULES[kind]:
        if not rule.check(uri):
            return rule.message
    return None


# Kubernetes' rule for object names (a DNS-1123 subdomain), the one the API
# server applies to metadata.name; checked again wherever a name becomes a path.
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS1123_MAX_LENGTH = 253
_DNS1123 = _python(DNS1123_SUBDOMAIN)


def name_problem(name: object) -> str | None:
    """What is wrong with ``name`` as a Kubernetes object name (None: valid).
    A job's name becomes NAME.mp4/.png/.json/.log, so this is also its file-name rule."""
    if not isinstance(name, str) or not name:
        return "is required (a string)"
    if len(name) > DNS1123_MAX_LENGTH:
        return f"must have at most {DNS1123_MAX_LENGTH} characters (got {len(name)})"
    if _DNS1123.search(name) is None:
        return (f"{name!r} is not a DNS-1123 subdomain (Kubernetes' rule for object names): lower-case letters, "
                "digits, '-' and '.', starting and ending with a letter or digit, e.g. my-video-1")
    return None


DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_LABEL = _python(DNS1123_LABEL)


def namespace_problem(namespace: object) -> str | None:
    """What is wrong with ``namespace`` as a Kubernetes namespace name (a DNS-1123 label; None: valid).
    A job's namespace becomes the directory its local:// and pvc:// locations resolve in."""
    if not isinstance(namespace, str) or not namespace:
        return "is required (a string)"
    if len(namespace) > 63 or _LABEL.search(namespace) is None:
        return (f"{namespace!r} is not a DNS-1123 label (Kubernetes' rule for namespace names): at most 63 "
                "lower-case letters, digits and '-', starting and ending with a letter or digit")
    return None


_URI_FIELD = Field(min_length=1, max_length=MAX_URI_LENGTH)

OutputUri = Annotated[str, _URI_FIELD, *URI_RULES["output"]]
InputUri = Annotated[str, _URI_FIELD, *URI_RULES["input"]]
SourceUri = Annotated[str, _URI_FIELD, *URI_RULES["source"]]
