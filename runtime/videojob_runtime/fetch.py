"""Fetching one https input: checked, pinned, bounded in size and in time.

- The host is resolved once per hop (``resolver``: ``socket.getaddrinfo``'s
  signature), every address it answers is checked (public only unless
  VIDEOJOB_INPUT_ALLOW_PRIVATE_HOSTS), and the connection goes to a checked
  address: a name that answers a public address to the check and a private
  one to the connection (DNS rebinding) never reaches the private one. The
  name stays in the Host header, in SNI and in the certificate check.
- ``input_fetch_deadline_s`` bounds the whole transfer, however the server
  sends its bytes: each read waits at most the time left (and at most
  ``input_fetch_timeout_s``), the deadline is checked after every read of
  any size, and a watchdog shuts the socket at the deadline for the phases
  whose reads are not ours (the TLS handshake, the headers).
- Redirects are followed a few times, each target checked like the first uri.
- Proxies named in the environment are not used: a proxy would resolve the
  name itself, past the check.
- Messages name the field and the setting, and show the uri without its
  query (``redact_url``): a presigned URL's query is its key.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Callable

from videojob.api.uris import uri_problem
from videojob.redaction import redact_url
from videojob.settings import RunSettings

from .errors import JobFailure

CHUNK = 64 * 1024
MAX_REDIRECTS = 5
REDIRECTS = {301, 302, 303, 307, 308}
Resolver = Callable[..., list]
Address = tuple[int, tuple]  # (family, sockaddr) as getaddrinfo answers it


NAT64_PREFIXES = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries, where a network routes it there: IPv4-mapped
    (::ffff:a.b.c.d), 6to4 (2002:a.b.c.d::), NAT64 (64:ff9b::a.b.c.d and the local-use
    64:ff9b:1::/48) and the deprecated IPv4-compatible ::a.b.c.d."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if any(address in net for net in NAT64_PREFIXES) or (int(address) >> 32 == 0 and int(address) > 1):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Not loopback, private, link-local (169.254.169.254), multicast or reserved; for an
    IPv6 address that carries an IPv4 one (NAT64, 6to4, mapped), that one too: 64:ff9b::a9fe:a9fe
    reaches 169.254.169.254 through a NAT64 gateway."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = embedded_ipv4(address)
        if inner is not None and not is_public(inner):
            return False
    return address.is_global and not address.is_multicast


class _Deadline:
    """The time one input may take in all, and a watchdog that enforces it on a socket."""

    def __init__(self, seconds: float):
        self.seconds, self.end = seconds, time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def passed(self) -> bool:
        return self.left() <= 0

    def watch(self, sock: socket.socket) -> threading.Timer:
        """Shut ``sock`` down (a duplicate of it, so the TLS wrapper is left alone)
        when the deadline passes: a read blocked in a drip then ends at once."""
        twin = sock.dup()

        def shut() -> None:
            try:
                twin.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        timer = threading.Timer(max(self.left(), 0), shut)
        timer.daemon = True
        timer.twin = twin  # closed with the timer (``_stop``)
        timer.start()
        return timer


def _stop(timer: threading.Timer | None) -> None:
    if timer is not None:
        timer.cancel()
        timer.twin.close()


class _PinnedConnection(http.client.HTTPSConnection):
    """An HTTPS connection to addresses already checked: ``host`` (the name) goes into
    the Host header, SNI and the certificate check; only ``addresses`` are dialled."""

    def __init__(self, host: str, port: int, addresses: list[Address], context: ssl.SSLContext,
                 timeout: float, deadline: _Deadline):
        super().__init__(host, port, timeout=timeout, context=context)
        self.addresses, self.tls, self.deadline = addresses, context, deadline
        self.pinned: ssl.SSLSocket | None = None
        self.watchdog: threading.Timer | None = None

    def connect(self) -> None:
        error: OSError | None = None
        for family, sockaddr in self.addresses:
            raw = socket.socket(family, socket.SOCK_STREAM)
            try:
                raw.settimeout(max(min(self.timeout, self.deadline.left()), 0.001))
                self.watchdog = self.deadline.watch(raw)
                raw.connect(sockaddr)
                self.sock = self.pinned = self.tls.wrap_socket(raw, server_hostname=self.host)
                return
            except OSError as exc:
                _stop(self.watchdog)
                self.watchdog = None
                raw.close()
                error = exc
        raise error or OSError("no address to connect to")

    def release(self) -> None:
        """Close it and stop its watchdog (``close`` alone, which http.client calls once the
        headers are read, leaves the watchdog on for the body)."""
        self.close()
        _stop(self.watchdog)
        self.watchdog = None


def _resolve_within(resolver: Resolver, host: str | None, port: int, deadline: _Deadline) -> list:
    """``resolver``'s answer, given up when the input's deadline passes first (TimeoutError): a
    resolver that hangs (a DNS server that never answers) counted for nothing before."""
    answer: dict = {}

    def resolve() -> None:
        try:
            answer["infos"] = resolver(host, port, proto=socket.IPPROTO_TCP)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            answer["error"] = exc

    thread = threading.Thread(target=resolve, name="videojob-resolve", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline.left()))
    if thread.is_alive():
        raise TimeoutError(f"resolving {host} took longer than the deadline")
    if "error" in answer:
        raise answer["error"]
    return answer["infos"]


def _checked_addresses(uri: str, field: str, settings: RunSettings, resolver: Resolver,
                       address_allowed: Callable[[ipaddress.IPv4Address | ipaddress.IPv6Address], bool],
                       deadline: _Deadline) -> list[Address]:
    """The addresses of ``uri``'s host, resolved once, each one checked."""
    parsed = urllib.parse.urlsplit(uri)
    try:
        infos = _resolve_within(resolver, parsed.hostname, parsed.port or 443, deadline)
    except TimeoutError:
        raise _late(field, uri, deadline) from None
    except OSError as exc:
        raise JobFailure(f"{field}: {redact_url(uri)}: host {parsed.hostname} does not resolve ({exc})",
                         stage="inputs", field=field) from None
    addresses: list[Address] = []
    for family, _type, _proto, _name, sockaddr in infos:
        if not settings.input_allow_private_hosts:
            address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            if not address_allowed(address):
                raise JobFailure(
                    f"{field}: {redact_url(uri)}: host {parsed.hostname} is at {address}, not a public address; "
                    "inputs are fetched from public hosts only (VIDEOJOB_INPUT_ALLOW_PRIVATE_HOSTS=true allows "
                    "others)", stage="inputs", field=field)
        if (family, sockaddr) not in addresses:
            addresses.append((family, sockaddr))
    if not addresses:
        raise JobFailure(f"{field}: {redact_url(uri)}: host {parsed.hostname} has no address", stage="inputs",
                         field=field)
    return addresses


def _refused(uri: str, field: str) -> str | None:
    """What the API's rules (and https-only) say against ``uri``, or None."""
    problem = uri_problem(uri, "input")
    if problem is None and not uri.startswith("https://"):
        problem = "is not https:// (only https inputs are fetched)"
    return problem


def _too_big(field: str, uri: str, limit: int) -> JobFailure:
    return JobFailure(f"{field}: {redact_url(uri)} is larger than {limit} bytes, the limit for an https input "
                      "(VIDEOJOB_INPUT_MAX_BYTES): use a smaller file or put it on a volume (pvc://)",
                      stage="inputs", field=field, limit=limit)


def _late(field: str, uri: str, deadline: _Deadline) -> JobFailure:
    return JobFailure(f"{field}: {redact_url(uri)} took longer than {deadline.seconds:g} s to download "
                      "(VIDEOJOB_INPUT_FETCH_DEADLINE_S)", stage="inputs", field=field, deadline_s=deadline.seconds)


def _open(uri: str, field: str, settings: RunSettings, deadline: _Deadline, resolver: Resolver,
          address_allowed) -> tuple[_PinnedConnection, http.client.HTTPResponse, str]:
    """The connection and the 2xx response for ``uri`` after its redirects, and the uri that answered."""
    context = ssl.create_default_context(cafile=settings.input_ca_bundle)
    first = uri
    for _hop in range(MAX_REDIRECTS + 1):
        addresses = _checked_addresses(uri, field, settings, resolver, address_allowed, deadline)
        parsed = urllib.parse.urlsplit(uri)
        conn = _PinnedConnection(parsed.hostname, parsed.port or 443, addresses, context,
                                 settings.input_fetch_timeout_s, deadline)
        try:
            target = urllib.parse.urlunsplit(("", "", parsed.path or "/", parsed.query, ""))
            conn.request("GET", target, headers={"User-Agent": "videojob", "Accept-Encoding": "identity"})
            response = conn.getresponse()
        except BaseException:
            conn.release()
            raise
        if 200 <= response.status < 300:
            return conn, response, uri
        location = response.getheader("Location")
        conn.release()
        if response.status not in REDIRECTS or not location:
            raise JobFailure(f"{field}: {redact_url(first)} answered {response.status} {response.reason}: check the "
                             "URL", stage="inputs", field=field, status=response.status)
        following = urllib.parse.urljoin(uri, location)
        problem = _refused(following, field)
        if problem is not None:
            raise JobFailure(f"{field}: {redact_url(first)} redirects to {redact_url(following)!r}, refused: it "
                             f"{problem}", stage="inputs", field=field)
        uri = following
    raise JobFailure(f"{field}: {redact_url(first)} redirects more than {MAX_REDIRECTS} times", stage="inputs",
                     field=field)


def fetch_https(uri: str, target: Path, field: str, settings: RunSettings, *,
                resolver: Resolver = socket.getaddrinfo, address_allowed=is_public) -> int:
    """Download ``uri`` to ``target`` (a new file); the bytes written. Refuses
    anything the API would, stops at ``settings.input_max_bytes`` while
    streaming and at ``settings.input_fetch_deadline_s`` however slowly the
    bytes come, and turns every network failure into a JobFailure naming
    ``field``; nothing is left at ``target`` when it fails. ``resolver`` and
    ``address_allowed``: how names become addresses and which are public."""
    problem = _refused(uri, field)
    if problem is not None:
        raise JobFailure(f"{field}: {redact_url(uri)!r} {problem}", stage="inputs", field=field)
    limit = settings.input_max_bytes
    deadline = _Deadline(settings.input_fetch_deadline_s)
    conn = None
    try:
        conn, response, _ = _open(uri, field, settings, deadline, resolver, address_allowed)
        declared = response.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_big(field, uri, limit)
        written = 0
        with open(target, "xb") as out:  # "x": a new file, never through something already there
            while True:
                left = deadline.left()
                if left <= 0:
                    raise _late(field, uri, deadline)
                conn.pinned.settimeout(min(settings.input_fetch_timeout_s, left))
                chunk = response.read1(CHUNK)  # what one read brings: a drip returns byte by byte
                if deadline.passed():
                    raise _late(field, uri, deadline)
                if not chunk:
                    break
                written += len(chunk)
                if written > limit:
                    raise _too_big(field, uri, limit)
                out.write(chunk)
        if response.length:  # what is left of a Content-Length: the server stopped short of it
            raise JobFailure(f"{field}: {redact_url(uri)} could not be fetched: the connection ended after "
                             f"{written} of the {declared} bytes announced", stage="inputs", field=field)
        return written
    except JobFailure:
        target.unlink(missing_ok=True)
        raise
    except (OSError, http.client.HTTPException) as exc:  # timeouts, TLS, a dropped connection
        target.unlink(missing_ok=True)
        if deadline.passed():
            raise _late(field, uri, deadline) from None
        if isinstance(exc, TimeoutError):
            text = (f"no answer within {settings.input_fetch_timeout_s:g} s (VIDEOJOB_INPUT_FETCH_TIMEOUT_S): "
                    "check that the host serves it")
        elif isinstance(exc, ssl.SSLCertVerificationError):
            text = (f"its certificate could not be verified ({exc.verify_message}): the server must present "
                    "a certificate a known authority signed (VIDEOJOB_INPUT_CA_BUNDLE names extra ones)")
        else:
            text = f"could not be fetched: {exc}"
        raise JobFailure(f"{field}: {redact_url(uri)} {text}", stage="inputs", field=field) from None
    finally:
        if conn is not None:
            conn.release()
