"""Uris as they may be shown: without their query or fragment.

An https input may be a presigned URL whose query is the key to the file
(the API refuses the common signature and token names, not every name a
store may use). Every message, event, log line and Ray entrypoint that
quotes an input uri quotes ``redact_url(uri)`` instead; only the fetch itself
and the request the driver receives outside its command line hold it whole.
"""

from __future__ import annotations

REDACTED = "<redacted>"


def redact_url(uri: object) -> str:
    """``scheme://host/path`` of ``uri``: what follows its first ``?`` or ``#``
    shown as ``?<redacted>`` (``#<redacted>``). Credentials before the host are
    the API's to refuse, quoting them so the spec's author sees which part."""
    text = str(uri)
    cuts = [i for i in (text.find("?"), text.find("#")) if i >= 0]
    if not cuts:
        return text
    return f"{text[:min(cuts)]}{text[min(cuts)]}{REDACTED}"
