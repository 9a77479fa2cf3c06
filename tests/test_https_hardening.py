"""https inputs hardened (issue 21, point 4), against real local servers:

- the whole-download deadline holds against a server that drips bytes (in
  the body and in the headers), and nothing is left behind;
- the connection goes to the address that passed the public-address check:
  a resolver that answers differently the second time is asked once, and its
  second answer is never dialled; the name is still what TLS verifies;
- a URL's query (a presigned URL's key) is never in a message, a log record,
  a Ray entrypoint or Ray's job log: the request travels in the submission's
  runtime_env instead, and the driver reads it from there.
"""

from __future__ import annotations

import http.server
import ipaddress
import json
import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest
from helpers import REPO
from videojob import runtimekey
from videojob.driver_protocol import REQUEST_ENV, DriverRequest, GroupRequest, decode_request, result_of
from videojob.redaction import redact_url
from videojob.settings import RunSettings
from videojob_runtime.errors import JobFailure
from videojob_runtime.fetch import is_public
from videojob_runtime.inputs import fetch_https, staged_inputs
from videojob_runtime.request import JobRequest

PY = sys.executable
BODY = b"\x89PNG not really, but bytes all the same" * 10
DRIP_S = 0.5
SECRET = "s3cr3t-Expires-1700000000"


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a client that gave up (the deadline tests) is expected
        pass


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 - http.server's name
        server = self.server
        path = self.path.split("?", 1)[0]
        with server.lock:
            server.seen.append((self.path, self.headers.get("Host")))
        if path == "/face.png":
            self._send(200, BODY)
        elif path == "/drip.png":  # announces 1000 bytes, sends one every DRIP_S
            self._head(200, {"Content-Length": "1000"})
            self._drip(b"x" * 1000)
        elif path == "/drip-ok.png":  # four bytes, slowly, well within the deadline
            self._head(200, {"Content-Length": "4"})
            self._drip(b"abcd", every=0.2)
        elif path == "/drip-headers.png":  # never finishes its headers
            self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Pad: ")
            self._drip(b"y" * 1000)
        elif path == "/short.png":  # announces more than it sends, then hangs up
            self._head(200, {"Content-Length": "100"})
            self.wfile.write(b"z" * 10)
            self.close_connection = True
        elif path == "/to-private.png":
            self._head(302, {"Location": f"https://private.test:{server.port}/face.png", "Content-Length": "0"})
        elif path == "/to-http.png":
            self._head(302, {"Location": f"http://images.test:{server.port}/face.png?v={SECRET}",
                             "Content-Length": "0"})
        else:
            self._send(404, b"not here")

    def _head(self, code: int, headers: dict[str, str]) -> None:
        self.send_response(code)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _send(self, code: int, body: bytes) -> None:
        self._head(code, {"Content-Length": str(len(body))})
        self.wfile.write(body)

    def _drip(self, data: bytes, every: float = DRIP_S) -> None:
        for byte in data:
            if self.server.stopping.wait(every):  # the server is closing: stop at once
                return
            try:
                self.wfile.write(bytes([byte]))
            except OSError:  # the client gave up: what the deadline tests expect
                return

    def log_message(self, *args):
        pass


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An HTTPS server on 127.0.0.1 whose certificate (signed by a CA of the test's)
    names images.test and private.test, never other.test; ``seen``: (path, Host) per GET."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command is needed to make the test server's certificate")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"), "-days", "1", "-subj", "/CN=hardening-test-ca",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    (d / "server.ext").write_text("subjectAltName=DNS:images.test,DNS:private.test,IP:127.0.0.1\n"
                                  "extendedKeyUsage=serverAuth\n")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(d / "server.key"), "-out", str(d / "server.csr"), "-subj", "/CN=images.test")
    _openssl("x509", "-req", "-in", str(d / "server.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
             "-CAcreateserial", "-days", "1", "-extfile", str(d / "server.ext"), "-out", str(d / "server.pem"))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(d / "server.pem"), str(d / "server.key"))
    httpd = _Server(("127.0.0.1", 0), _Handler)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
    httpd.lock, httpd.seen, httpd.stopping = threading.Lock(), [], threading.Event()
    httpd.port, httpd.ca = httpd.server_address[1], str(d / "ca.pem")
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    yield httpd
    httpd.stopping.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


class Resolver:
    """A resolver of the test's: each name answers its list of addresses in turn
    (the last one again once the list runs out); ``asked`` lists the names asked."""

    def __init__(self, answers: dict[str, list[str]]):
        self.answers, self.asked = answers, []

    def __call__(self, host, port, *args, **kwargs):
        self.asked.append(host)
        turn = self.asked.count(host) - 1
        choices = self.answers.get(host)
        if not choices:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (choices[min(turn, len(choices) - 1)],
                                                                              port))]


def _only_the_server(address) -> bool:
    """The tests' "public" address: the server's (every other one counts as private)."""
    return str(address) == "127.0.0.1"


def _settings(server, tmp_path, **overrides) -> RunSettings:
    return RunSettings(**{"input_ca_bundle": server.ca, "input_fetch_timeout_s": 2.0, "input_fetch_deadline_s": 3.0,
                          "input_max_bytes": 100_000, "input_staging_root": str(tmp_path / "staging"),
                          **overrides})


def _fetch(server, tmp_path, path: str, field: str = "spec.image", resolver: Resolver | None = None, **overrides):
    resolver = resolver or Resolver({"images.test": ["127.0.0.1"], "private.test": ["127.0.0.3"]})
    return fetch_https(f"https://images.test:{server.port}{path}", tmp_path / "copy", field,
                       _settings(server, tmp_path, **overrides), resolver=resolver, address_allowed=_only_the_server)


# -- the deadline ----------------------------------------------------------------------


@pytest.mark.parametrize("field", ["spec.image", "spec.faceImage"])
def test_a_dripping_body_cannot_stretch_the_deadline(server, tmp_path, field):
    """One byte every 0.5 s never trips the 2 s read timeout; the 3 s deadline still ends it."""
    started = time.monotonic()
    with pytest.raises(JobFailure) as exc:
        _fetch(server, tmp_path, "/drip.png", field)
    took = time.monotonic() - started
    # the drip would take 1000 x DRIP_S; the deadline ended it (a loaded machine may add seconds)
    assert 2.9 <= took < 3.0 + 10.0 < 1000 * DRIP_S, f"the deadline is 3 s, the fetch took {took:.1f} s"
    assert exc.value.message == (f"{field}: https://images.test:{server.port}/drip.png took longer than 3 s to "
                                 "download (VIDEOJOB_INPUT_FETCH_DEADLINE_S)")
    assert exc.value.details == {"field": field, "deadline_s": 3.0}
    assert not (tmp_path / "copy").exists(), "a partial file was left"


def test_dripping_headers_cannot_stretch_the_deadline(server, tmp_path):
    started = time.monotonic()
    with pytest.raises(JobFailure, match=r"took longer than 2 s to download \(VIDEOJOB_INPUT_FETCH_DEADLINE_S\)"):
        _fetch(server, tmp_path, "/drip-headers.png", input_fetch_deadline_s=2.0)
    assert time.monotonic() - started < 2.0 + 1.0
    assert not (tmp_path / "copy").exists()


def test_a_slow_body_within_the_deadline_arrives_whole(server, tmp_path):
    assert _fetch(server, tmp_path, "/drip-ok.png", input_fetch_deadline_s=10.0) == 4
    assert (tmp_path / "copy").read_bytes() == b"abcd"


def test_a_body_cut_short_is_a_failure_not_a_file(server, tmp_path):
    with pytest.raises(JobFailure, match=r"^spec.image: .*/short.png could not be fetched: the connection ended "
                                         r"after 10 of the 100 bytes announced$"):
        _fetch(server, tmp_path, "/short.png")
    assert not (tmp_path / "copy").exists()


# -- the address that was checked is the one dialled --------------------------------------


def test_the_connection_goes_to_the_address_that_passed_the_check(server, tmp_path):
    """images.test answers the server's address, then a "private" one (DNS rebinding):
    it is asked once, and a listener on the second answer never sees a connection."""
    trap = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        trap.bind(("127.0.0.2", server.port))  # the same port: only the address differs
    except OSError as exc:
        pytest.fail(f"cannot listen on 127.0.0.2:{server.port} for the test ({exc})")
    trap.listen(8)
    trap.setblocking(False)
    resolver = Resolver({"images.test": ["127.0.0.1", "127.0.0.2"]})
    try:
        before = len(server.seen)
        assert _fetch(server, tmp_path, "/face.png", resolver=resolver) == len(BODY)
        assert (tmp_path / "copy").read_bytes() == BODY
        assert resolver.asked == ["images.test"], "the name was resolved again after the check"
        with pytest.raises(BlockingIOError):
            trap.accept()  # nothing connected to the second answer
        # The name, not the address, is what the server was asked for (Host) and what TLS verified (SNI).
        assert server.seen[before:] == [("/face.png", f"images.test:{server.port}")]
    finally:
        trap.close()


def test_the_certificate_is_checked_against_the_name_not_the_address(server, tmp_path):
    """other.test resolves to the server, whose certificate does not name it: refused."""
    resolver = Resolver({"other.test": ["127.0.0.1"]})
    with pytest.raises(JobFailure, match="^spec.image: .* its certificate could not be verified") as exc:
        fetch_https(f"https://other.test:{server.port}/face.png", tmp_path / "copy", "spec.image",
                    _settings(server, tmp_path), resolver=resolver, address_allowed=_only_the_server)
    assert "VIDEOJOB_INPUT_CA_BUNDLE" in exc.value.message and not (tmp_path / "copy").exists()


@pytest.mark.parametrize("address", ["10.0.0.1", "169.254.169.254", "127.0.0.1"])
def test_a_name_that_resolves_to_a_private_address_is_refused(server, tmp_path, address):
    """With the real policy (public addresses only), before any connection."""
    resolver = Resolver({"images.test": [address]})
    before = len(server.seen)
    with pytest.raises(JobFailure) as exc:
        fetch_https(f"https://images.test:{server.port}/face.png", tmp_path / "copy", "spec.faceImage",
                    _settings(server, tmp_path), resolver=resolver)
    assert exc.value.message == (
        f"spec.faceImage: https://images.test:{server.port}/face.png: host images.test is at {address}, not a "
        "public address; inputs are fetched from public hosts only (VIDEOJOB_INPUT_ALLOW_PRIVATE_HOSTS=true "
        "allows others)")
    assert resolver.asked == ["images.test"] and len(server.seen) == before and not (tmp_path / "copy").exists()


def test_a_redirect_to_a_name_that_resolves_private_is_refused(server, tmp_path):
    before = len(server.seen)
    with pytest.raises(JobFailure, match=r"host private.test is at 127.0.0.3, not a public address"):
        _fetch(server, tmp_path, "/to-private.png")
    assert [path for path, _ in server.seen[before:]] == ["/to-private.png"], "the redirect was followed"


# -- queries never shown -------------------------------------------------------------------


def test_redact_url():
    assert redact_url("https://h.example:8443/a/b.png?X-Amz-Date=1&v=2") == "https://h.example:8443/a/b.png?<redacted>"
    assert redact_url("https://h.example/a.png#part") == "https://h.example/a.png#<redacted>"
    assert redact_url("https://h.example/a.png?") == "https://h.example/a.png?<redacted>"
    assert redact_url("pvc://inputs/a.png") == "pvc://inputs/a.png"


@pytest.mark.parametrize("path,expected", [
    ("/missing.png", "answered 404"),
    ("/drip.png", "took longer than 3 s"),
    ("/to-http.png", "redirects to 'http://images.test:{port}/face.png?<redacted>', refused"),
])
def test_a_failing_fetch_never_shows_the_query(server, tmp_path, caplog, path, expected):
    caplog.set_level(logging.DEBUG)
    before = len(server.seen)
    with pytest.raises(JobFailure) as exc:
        _fetch(server, tmp_path, f"{path}?v={SECRET}&expires=1")
    assert exc.value.message.startswith(f"spec.image: https://images.test:{server.port}{path}?<redacted> ")
    assert expected.format(port=server.port) in exc.value.message
    assert SECRET not in exc.value.message and SECRET not in json.dumps(exc.value.to_dict())
    assert not any(SECRET in record.getMessage() for record in caplog.records)
    assert server.seen[before][0] == f"{path}?v={SECRET}&expires=1", "the fetch itself sends the query"


def test_a_staged_face_whose_embeddings_fail_never_shows_the_query(server, tmp_path, caplog):
    """The face is there, its .npz (fetched with the same query) is not."""
    caplog.set_level(logging.DEBUG)
    request = JobRequest(job_id="q", model_id="tiny-consisid", task="identity", prompt="a face", width=64, height=64,
                         frames=9, fps=8, steps=2, guidance=6.0,
                         face_image=f"https://127.0.0.1:{server.port}/face.png?v={SECRET}")
    settings = _settings(server, tmp_path, input_allow_private_hosts=True)
    with pytest.raises(JobFailure) as exc:
        with staged_inputs(request, settings):
            pytest.fail("a failed fetch must not run the job")
    assert exc.value.message.startswith(f"spec.faceImage: https://127.0.0.1:{server.port}/face.png.npz?<redacted> "
                                        "answered 404")
    assert not any(SECRET in record.getMessage() for record in caplog.records)


def test_the_runtimes_own_checks_never_quote_a_query():
    """The API's rules run again in the runtime (``locations.check_uri``), and a rank
    refuses an https input the driver did not stage: neither shows the query."""
    from videojob_runtime.inputs import resolve_input
    from videojob_runtime.locations import resolve

    with pytest.raises(JobFailure, match=r"must not carry a signature") as exc:
        resolve(f"https://images.example/a.png?sig={SECRET}", "input", "spec.image")
    assert exc.value.message.startswith("spec.image: 'https://images.example/a.png?<redacted>' ")
    with pytest.raises(JobFailure, match="was not fetched by the job's driver") as exc:
        resolve_input(f"https://images.example/a.png?v={SECRET}", "spec.faceImage")
    assert SECRET not in exc.value.message and "a.png?<redacted>" in exc.value.message


def test_the_api_never_quotes_a_query_in_its_refusals():
    from videojob.api import InvalidVideoJob, parse_videojob

    doc = {"apiVersion": "videojob.io/v1alpha1", "kind": "VideoJob", "metadata": {"name": "q"},
           "spec": {"model": {"name": "cogvideox-5b-i2v"}, "task": "i2v", "prompt": "p",
                    "image": f"http://images.example/a.png?v={SECRET}"}}
    with pytest.raises(InvalidVideoJob) as exc:
        parse_videojob(doc)
    assert "http:// is refused" in str(exc.value) and "?<redacted>" in str(exc.value)
    assert SECRET not in str(exc.value)


def _driver_request(image: str) -> DriverRequest:
    return DriverRequest(namespace="team-a", name="q", uid="0123abcd-0000-0000-0000-000000000000",
                         group=GroupRequest(name="vj-0123abcd"),
                         job={"model_id": "tiny-cogvideox-i2v", "task": "i2v", "prompt": "a cat", "width": 64,
                              "height": 64, "frames": 9, "fps": 8, "steps": 2, "guidance": 6.0, "image": image})


def _holds_the_request(text: str, request: DriverRequest) -> bool:
    """Whether ``text`` shows the request's query, plainly or in the request's base64."""
    encoded = request.encode()
    return SECRET in text or encoded in text or encoded[len(encoded) // 2:len(encoded) // 2 + 40] in text


def test_a_request_with_a_query_stays_off_the_entrypoint():
    request = _driver_request(f"https://images.example/a.png?v={SECRET}")
    entrypoint, runtime_env = request.submission("/opt/py/bin/python")
    assert entrypoint == "/opt/py/bin/python -m videojob_runtime.driver --request-env"
    assert SECRET not in entrypoint and request.encode() not in entrypoint
    sealed = runtime_env["env_vars"][REQUEST_ENV]
    assert sealed.startswith(runtimekey.SEALED_PREFIX) and not _holds_the_request(json.dumps(runtime_env), request), \
        "Ray's job table and its runtime env agent's log keep the runtime_env: the request goes sealed"
    assert decode_request(runtimekey.unseal(sealed).decode())[0] == request, "the driver gets it whole"
    # Without a query nothing changes: the command line every driver version reads.
    plain = _driver_request("https://images.example/a.png")
    assert plain.submission("python") == (plain.entrypoint("python"), None)


class _RayJobs(http.server.BaseHTTPRequestHandler):
    """Ray's Jobs API as far as a submission goes: it keeps the POST bodies."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.server.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        body = json.dumps({"submission_id": self.server.bodies[-1]["submission_id"]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_operator_submits_the_query_in_the_body_not_the_entrypoint():
    """The operator's own submission path (DriverLaunch.submit, HttpRayClient) to a Jobs API of the test's."""
    from videojob.controller.groups import DriverLaunch
    from videojob.raycluster.client import HttpRayClient

    ray = http.server.HTTPServer(("127.0.0.1", 0), _RayJobs)
    ray.bodies = []
    thread = threading.Thread(target=ray.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        request = _driver_request(f"https://images.example/a.png?v={SECRET}")
        entrypoint, runtime_env = request.submission("python")
        client = HttpRayClient(f"http://127.0.0.1:{ray.server_address[1]}", retries=0)
        assert DriverLaunch("python").submit(client, "vj-q-a1", entrypoint, {"videojob.io/name": "q"},
                                             runtime_env=runtime_env) is True
    finally:
        ray.shutdown()
        ray.server_close()
        thread.join(timeout=10)
    (body,) = ray.bodies
    assert not _holds_the_request(json.dumps(body), request), "the body Ray keeps shows the request"
    sealed = body["runtime_env"]["env_vars"][REQUEST_ENV]
    assert decode_request(runtimekey.unseal(sealed).decode())[0].job["image"].endswith(SECRET)


def test_the_driver_reads_the_request_from_its_environment_and_forgets_it(tmp_path):
    """``--request-env`` as Ray's job supervisor starts it: the request in the environment
    and in the job config's runtime_env. It is decoded (the job then fails at its output
    root, before Ray), and neither its output nor its logs show the query."""
    not_a_dir = tmp_path / "outputs-is-a-file"
    not_a_dir.write_text("")
    encoded = _driver_request(f"https://images.example/a.png?v={SECRET}").encode()
    config = {"runtime_env": {"env_vars": {REQUEST_ENV: encoded, "KEEP": "1"}}, "metadata": {}}
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1", "VIDEOJOB_OUTPUT_ROOT": str(not_a_dir),
           REQUEST_ENV: encoded, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(config)}
    done = subprocess.run([PY, "-m", "videojob_runtime.driver", "--request-env"], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)
    result = result_of(done.stdout)
    assert result["error"].get("field") == "spec.output.uri", done.stdout
    assert SECRET not in done.stdout and SECRET not in done.stderr


def test_a_request_sealed_under_another_runtime_key_fails_naming_the_secret(tmp_path):
    """The driver opens a sealed request with its own runtime key (the chart's Secret, mounted
    in the operator and every Ray pod); a Ray cluster with another key answers
    RuntimeKeyMismatch, saying what to mount, and shows nothing of the request."""
    request = _driver_request(f"https://images.example/a.png?v={SECRET}")
    sealed = request.submission("python")[1]["env_vars"][REQUEST_ENV]  # under this process's key
    other = tmp_path / "other-key"
    other.write_text("x" * 64)
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1", REQUEST_ENV: sealed, runtimekey.KEY_ENV: str(other)}
    done = subprocess.run([PY, "-m", "videojob_runtime.driver", "--request-env"], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)
    result = result_of(done.stdout)
    assert result["error"]["reason"] == "RuntimeKeyMismatch" and "runtime key Secret" in result["error"]["message"]
    assert not _holds_the_request(done.stdout + done.stderr, request)


def test_the_runtime_key_is_made_once_per_user_and_a_configured_one_must_exist(tmp_path, monkeypatch):
    """Without VIDEOJOB_RUNTIME_KEY_FILE one machine's processes share a key made on first use
    (0600; two makers at once end with one key); a configured file that is missing or short is
    an error naming the setting, never a new key the other side lacks."""
    monkeypatch.delenv(runtimekey.KEY_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(runtimekey, "_cache", {})
    makers = [threading.Thread(target=runtimekey.load) for _ in range(4)]
    for maker in makers:
        maker.start()
    for maker in makers:
        maker.join(timeout=30)
    path = tmp_path / "config" / "videojob" / "runtime-key"
    assert oct(path.stat().st_mode & 0o777) == "0o600" and len(path.read_bytes().strip()) == 64
    assert runtimekey.load() == path.read_bytes().strip()
    assert sorted(p.name for p in path.parent.iterdir()) == ["runtime-key"], "no temporary file is left"
    assert runtimekey.unseal(runtimekey.seal(b"x")) == b"x"
    monkeypatch.setenv(runtimekey.KEY_ENV, str(tmp_path / "mounted" / "key"))
    with pytest.raises(runtimekey.RuntimeKeyError, match="VIDEOJOB_RUNTIME_KEY_FILE.*does not exist"):
        runtimekey.load()
    assert not (tmp_path / "mounted").exists()
    (tmp_path / "short").write_text("abc")
    monkeypatch.setenv(runtimekey.KEY_ENV, str(tmp_path / "short"))
    with pytest.raises(runtimekey.RuntimeKeyError, match="at least 32"):
        runtimekey.load()


def test_forget_request_env_drops_it_from_the_job_config(monkeypatch):
    from videojob_runtime.request_env import JOB_CONFIG_ENV, forget_request_env

    config = {"runtime_env": {"env_vars": {REQUEST_ENV: "e30=", "KEEP": "1"}, "pip": ["x"]}, "metadata": {"a": "b"}}
    monkeypatch.setenv(REQUEST_ENV, "e30=")
    monkeypatch.setenv(JOB_CONFIG_ENV, json.dumps(config))
    forget_request_env()
    assert REQUEST_ENV not in os.environ
    assert json.loads(os.environ[JOB_CONFIG_ENV]) == {"runtime_env": {"env_vars": {"KEEP": "1"}, "pip": ["x"]},
                                                      "metadata": {"a": "b"}}



# -- issue 36, 15 ------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["64:ff9b::a9fe:a9fe", "64:ff9b:1::a00:1", "2002:a00:1::1", "::ffff:127.0.0.1",
                                     "::a00:1"])
def test_ipv6_forms_of_a_private_ipv4_address_are_not_public(address):
    """NAT64 (64:ff9b::/96 and the local 64:ff9b:1::/48), 6to4 and IPv4-mapped or -compatible
    addresses reach the IPv4 address they carry (169.254.169.254, 10.0.0.1, 127.0.0.1 here);
    they passed `is_public`."""
    assert not is_public(ipaddress.ip_address(address))


def test_a_public_ipv4_address_through_nat64_stays_public():
    assert is_public(ipaddress.ip_address("64:ff9b::808:808")) and is_public(ipaddress.ip_address("2606:4700::1111"))


def test_a_resolver_that_never_answers_is_bounded_by_the_fetch_deadline(tmp_path):
    """The name was resolved outside the deadline: a DNS server that never answers held the
    input for the resolver's own timeouts (minutes), whatever VIDEOJOB_INPUT_FETCH_DEADLINE_S said."""
    release = threading.Event()

    def hangs(host, port, *args, **kwargs):
        release.wait(60)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    settings = RunSettings(input_fetch_timeout_s=0.5, input_fetch_deadline_s=0.5,
                           input_staging_root=str(tmp_path / "staging"))
    start = time.monotonic()
    try:
        with pytest.raises(JobFailure, match="took longer than 0.5 s to download"):
            fetch_https("https://images.test/face.png", tmp_path / "copy", "spec.image", settings, resolver=hangs)
    finally:
        release.set()
    assert time.monotonic() - start < 5.0 and not (tmp_path / "copy").exists()


@pytest.mark.parametrize("uri", ["https://images.test:65536/face.png", "https://images.test:0/face.png",
                                 "https://[2606:4700::1111]:99999/face.png"])
def test_a_port_past_65535_is_refused_naming_the_field(uri):
    """It passed the URI rule and failed later, in the runtime, without naming the field."""
    from videojob.api.uris import uri_problem

    assert uri_problem(uri, "input") == "https:// takes a :port from 1 to 65535 after the host (or none: 443)"


def test_the_lookalike_tables_hold_every_character_the_unicode_tables_name():
    """Generated from unicodedata (NFKC forms holding '/', '\\' or '.'; invisible categories):
    U+FE30 and U+FE19 fold to '..' and '...', U+2100 to 'a/c'; the hand-made list missed them."""
    from videojob.api import uris

    folding, invisible = uris.lookalike_ranges()

    def codes(ranges):
        return {c for a, b in ranges for c in range(a, b + 1)}

    assert codes(folding) <= codes(uris._FOLDING_RANGES), "run lookalike_ranges() and update the table"
    assert codes(invisible) <= codes(uris._INVISIBLE_RANGES), "run lookalike_ranges() and update the table"
    for ch in "\ufe30\ufe19\u2100\u2101\u2105\u2106":
        assert uris.uri_problem(f"local://a{ch}b/x", "output") is not None, f"U+{ord(ch):04X} passed"


@pytest.mark.parametrize("uri", ["https://images.test/face.png?X-Amz-Signatur%65=abc",
                                 "https://images.test/face.png?w=1&%73ig=abc"])
def test_a_percent_encoded_parameter_name_cannot_hide_a_signature(uri):
    """Issue 36, 13: X-Amz-Signatur%65= passed the rule for secrets in the query."""
    from videojob.api.uris import uri_problem

    assert "must not percent-encode a query parameter's name" in uri_problem(uri, "input")
    assert uri_problem("https://images.test/face.png?caption=a%20cat", "input") is None
