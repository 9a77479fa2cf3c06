"""Containment (issue 8): a hostile user writes the VideoJob.

One table of hostile values per field that becomes a path: the output uri,
the input images, the model source and the job's name. Every row must be
refused, naming its field, by ``videojob validate`` (and ``parse_videojob``),
by the real API server (the CRD's CEL; the name by the server's own rule) and
by the runtime's resolver on its own (a request may reach a rank without
passing either). Then what only the filesystem can show: a symbolic link
inside a root that points out of it. Then https inputs against a real local
HTTPS server (a self-signed certificate the fetcher is told to trust, so
verification stays on): timeout, size limit, 404, redirects, the per-job
directory removed afterwards, and one fetch for a two-rank job.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required
import yaml

from helpers import REPO
from test_apiserver import custom_api  # noqa: F401 - the real API server's fixture (crd: tests/shared_ray.py)
from videojob.api import InvalidVideoJob, VideoJob, parse_videojob
from videojob.api.uris import uri_problem
from videojob.settings import RunSettings

require_module("torch")

from videojob_runtime.errors import JobFailure  # noqa: E402
from videojob_runtime.locations import resolve  # noqa: E402

URI_FIELDS = {"spec.output.uri": "output", "spec.image": "input", "spec.faceImage": "input",
              "spec.model.source": "source"}
CLAIMS = {"output": "videos", "input": "inputs", "source": "models"}


def _path_cases(claim: str) -> list[tuple[str, str]]:
    """Hostile pvc:// and local:// uris, the same for every kind (the claim differs)."""
    return [
        ("empty-segment-after-claim", f"pvc://{claim}//tmp/x"),  # the example: /tmp/x on the actor
        ("absolute-local", "local:///etc"),
        ("absolute-pvc", "pvc:///etc/passwd"),
        ("dotdot-first", "local://../etc"),
        ("dotdot-climbs", f"pvc://{claim}/a/../../other-claim/x"),
        ("dotdot-last", f"pvc://{claim}/.."),
        ("dot-segment", "local://a/./b"),
        ("dot-only", "local://."),
        ("empty-segment", "local://a//b"),
        ("backslash", "local://a\\..\\..\\etc"),
        ("backslash-drive", "local://C:\\Windows"),
        ("newline", "local://a/b\n../../etc"),
        ("carriage-return", "local://a/b\r"),
        ("tab", "local://a/\tb"),
        ("nul", f"pvc://{claim}/a\x00/../../etc"),
        ("escape", "local://a/\x1b[2Jb"),
        ("del", "local://a/b\x7f"),
        ("c1-next-line", "local://a/b\x85c"),
        ("line-separator", "local://a/b\u2028c"),
        ("encoded-dotdot", "local://a/%2e%2e/%2e%2e/etc"),
        ("encoded-dotdot-upper", f"pvc://{claim}/%2E%2E/x"),
        ("encoded-slash", "local://a%2f..%2f..%2fetc"),
        ("encoded-backslash", "local://a/..%5c..%5cetc"),
        ("encoded-nul", "local://a/b%00.png"),
        ("double-encoded", "local://a/%252e%252e/etc"),
        ("fullwidth-dots", "local://a/\uff0e\uff0e/etc"),
        ("one-dot-leaders", "local://a/\u2024\u2024/etc"),
        ("two-dot-leader", "local://a/\u2025/etc"),
        ("fullwidth-solidus", "local://a\uff0f..\uff0fetc"),
        ("division-slash", "local://a\u2215..\u2215etc"),
        ("fullwidth-backslash", "local://a\uff3c..\uff3cetc"),
        ("zero-width-space", "local://a/.\u200b./etc"),
        ("bidi-override", "local://a/\u202egnp.exe"),
        ("no-break-space", "local://a/\u00a0/b"),
        ("bom", "local://\ufeffa/b"),
    ]


HOSTILE: list[tuple[str, str, str]] = [
    (field, case, value) for field, kind in URI_FIELDS.items() for case, value in _path_cases(CLAIMS[kind])
]
HOSTILE += [
    (field, case, value)
    for field in ("spec.image", "spec.faceImage")
    for case, value in [
        ("http", "http://example.com/face.png"),
        ("http-upper-case-host", "http://EXAMPLE.com/face.png"),
        ("userinfo", "https://user:secret@example.com/face.png"),
        ("userinfo-host-confusion", "https://example.com@evil.example/face.png"),
        ("https-backslash-host", "https://example.com\\@evil.example/face.png"),
        ("https-space", "https://example.com/my face.png"),
        ("https-newline", "https://example.com/face.png\nHost: evil"),
        ("https-no-host", "https:///etc/passwd"),
        ("file-scheme", "file:///etc/passwd"),
    ]
]
HOSTILE += [
    ("spec.model.source", case, value)
    for case, value in [
        ("hf-dotdot", "hf://../etc"),
        ("hf-extra-segments", "hf://THUDM/CogVideoX-5b/../../x"),
        ("hf-revision-path", "hf://THUDM/CogVideoX-5b@../../x"),
        ("hf-absolute", "hf:///etc"),
        ("https-source", "https://example.com/model"),
    ]
]
HOSTILE += [
    ("metadata.name", case, value)
    for case, value in [
        ("dotdot-path", "../x"),
        ("slash", "videos/x"),
        ("absolute", "/etc/passwd"),
        ("dot", "."),
        ("dotdot", ".."),
        ("upper-case", "My-Video"),
        ("leading-dash", "-video"),
        ("trailing-dot", "video."),
        ("empty-label", "a..b"),
        ("space", "my video"),
        ("newline", "video\nx"),
        ("nul", "video\x00"),
        ("backslash", "a\\b"),
        ("percent", "a%2fb"),
        ("non-ascii", "caf\u00e9"),
        ("fullwidth-dots", "\uff0e\uff0e"),
        ("too-long", "a" * 254),
    ]
]
# Values that stay valid: the table above must not be refusing everything.
VALID: list[tuple[str, str]] = [
    ("spec.output.uri", "pvc://videos/job-1"),
    ("spec.output.uri", "pvc://videos"),
    ("spec.output.uri", "local://videos/job-1/"),  # a single trailing '/': a directory, allowed
    ("spec.output.uri", "local://a/.hidden/...dots/b c"),  # '.x', '...' and spaces are names, not segments
    ("spec.image", "pvc://inputs/cat.png"),
    ("spec.image", "https://example.com/images/cat.png?size=large&x=%20y"),
    ("spec.faceImage", "https://127.0.0.1:8443/face.png"),
    ("spec.faceImage", "local://faces/caf\u00e9.png"),
    ("spec.model.source", "hf://THUDM/CogVideoX-5b@v1.0"),
    ("spec.model.source", "local://models/cogvideox-5b"),
    ("metadata.name", "job-1.v2"),
    ("metadata.name", "a" * 253),
]


def _document(field: str, value: str) -> dict:
    """A VideoJob that is valid except for ``value`` in ``field``."""
    spec: dict = {"model": {"name": "cogvideox-5b"}, "prompt": "a cat"}
    metadata = {"name": "hostile"}
    if field == "spec.output.uri":
        spec["output"] = {"uri": value}
    elif field == "spec.image":
        spec.update(model={"name": "cogvideox-5b-i2v"}, task="i2v", image=value)
    elif field == "spec.faceImage":
        spec.update(model={"name": "consisid"}, task="identity", faceImage=value)
    elif field == "spec.model.source":
        spec["model"]["source"] = value
    elif field == "metadata.name":
        metadata["name"] = value
    else:
        raise ValueError(f"no document for {field}")
    return {"apiVersion": "videojob.io/v1alpha1", "kind": "VideoJob", "metadata": metadata, "spec": spec}


def _ids(rows):
    return [f"{row[0]}-{row[1]}" if len(row) == 3 else f"{row[0]}-{i}" for i, row in enumerate(rows)]


def test_the_table_covers_every_field_and_kind_of_attack():
    per_field = Counter(field for field, _, _ in HOSTILE)
    assert set(per_field) == {*URI_FIELDS, "metadata.name"}
    assert min(per_field.values()) >= 15, per_field
    assert len(set(_ids(HOSTILE))) == len(HOSTILE), "every row has its own id"


# -- videojob validate / parse_videojob ------------------------------------------


@pytest.mark.parametrize("field,case,value", HOSTILE, ids=_ids(HOSTILE))
def test_parse_refuses_naming_the_field(field, case, value):
    with pytest.raises(InvalidVideoJob) as exc:
        parse_videojob(_document(field, value))
    assert {p.field for p in exc.value.problems} == {field}, exc.value.problems


@pytest.mark.parametrize("field,value", VALID, ids=_ids(VALID))
def test_parse_accepts_the_valid_values(field, value):
    assert parse_videojob(_document(field, value))


def test_generate_name_must_start_a_dns1123_name():
    doc = _document("spec.output.uri", "pvc://videos/x")
    doc["metadata"] = {"generateName": "../"}
    with pytest.raises(InvalidVideoJob) as exc:
        parse_videojob(doc)
    assert [p.field for p in exc.value.problems] == ["metadata.generateName"]
    doc["metadata"] = {"generateName": "video-"}
    assert parse_videojob(doc).name == ""


def test_videojob_validate_refuses_the_whole_table(tmp_path):
    """One `videojob validate` over every hostile document (one YAML stream): one line each, naming the field."""
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump_all([_document(f, v) for f, _, v in HOSTILE]))
    result = subprocess.run([sys.executable, "-m", "videojob.cli", "validate", str(path)],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    for i, (field, case, _) in enumerate(HOSTILE):
        assert f"{path}[{i}]: {field}: " in result.stdout, (case, result.stdout[-2000:])


# -- the runtime on its own -------------------------------------------------------


@pytest.mark.parametrize("field,case,value", [r for r in HOSTILE if r[0] in URI_FIELDS],
                         ids=_ids([r for r in HOSTILE if r[0] in URI_FIELDS]))
def test_runtime_resolver_refuses_naming_the_field(field, case, value, tmp_path, monkeypatch):
    """The resolver runs the API's rules again: the roots exist and hold the
    targets, so only the check stands between the uri and the file."""
    kind = URI_FIELDS[field]
    for env in ("VIDEOJOB_OUTPUT_ROOT", "VIDEOJOB_DATA_ROOT", "VIDEOJOB_MODEL_ROOT", "VIDEOJOB_VOLUMES_ROOT"):
        monkeypatch.setenv(env, str(tmp_path / env.lower()))
    problem = uri_problem(value, kind)
    assert problem is not None
    with pytest.raises(JobFailure) as exc:
        resolve(value, kind, field)
    assert exc.value.message == f"{field}: {value!r} {problem}"
    assert exc.value.details["field"] == field
    assert exc.value.stage == {"output": "write", "input": "inputs", "source": "load"}[kind]


@pytest.mark.parametrize("field,case,value", [r for r in HOSTILE if r[0] in ("spec.image", "spec.faceImage")],
                         ids=_ids([r for r in HOSTILE if r[0] in ("spec.image", "spec.faceImage")]))
def test_the_fetcher_refuses_before_connecting(field, case, value, tmp_path):
    from videojob_runtime.inputs import fetch_https

    with pytest.raises(JobFailure) as exc:
        fetch_https(value, tmp_path / "copy", field, RunSettings(input_fetch_timeout_s=0.1))
    assert exc.value.message.startswith(f"{field}: {value!r} ") and exc.value.stage == "inputs"
    assert not (tmp_path / "copy").exists()


@pytest.mark.parametrize("value", [v for f, _, v in HOSTILE if f == "spec.model.source"])
def test_model_loader_refuses_a_hostile_source(value):
    from videojob_runtime.pipelines import resolve_source

    with pytest.raises(JobFailure) as exc:
        resolve_source("cogvideox-5b", value)
    assert exc.value.message.startswith("spec.model.source: ") and exc.value.stage == "load"


@pytest.mark.parametrize("value", [v for f, _, v in HOSTILE if f == "metadata.name"])
def test_runtime_refuses_a_hostile_name_where_it_becomes_a_file(value, tmp_path):
    from videojob_runtime.local import output_name
    from videojob_runtime.output import write_failure
    from videojob_runtime.request import JobRequest

    with pytest.raises(ValueError, match=r"output_name \(metadata.name\)"):
        JobRequest(job_id="x", model_id="tiny-cogvideox", task="t2v", prompt="p", width=64, height=64, frames=9,
                   fps=8, steps=1, guidance=1.0, output_name=value)
    with pytest.raises(JobFailure) as exc:
        write_failure(tmp_path / "out", value, {"ok": False})
    assert exc.value.details["field"] == "metadata.name" and exc.value.stage == "write"
    assert not (tmp_path / "out").exists(), "nothing is written for a refused name"
    # A VideoJob built without parse_videojob (the way a caller of the library could) is refused too.
    job = VideoJob.model_validate({"metadata": {"name": value}, "spec": {"model": {"name": "tiny-cogvideox"},
                                                                          "prompt": "p"}})
    with pytest.raises(JobFailure, match="^metadata.name "):
        output_name(job)


def test_runtime_accepts_the_valid_values(tmp_path, monkeypatch):
    monkeypatch.setenv("VIDEOJOB_VOLUMES_ROOT", str(tmp_path / "volumes"))
    monkeypatch.setenv("VIDEOJOB_DATA_ROOT", str(tmp_path / "data"))
    base = tmp_path.resolve()
    assert resolve("pvc://videos/job-1/", "output", "spec.output.uri") == base / "volumes/videos/job-1"
    assert resolve("local://faces/caf\u00e9.png", "input", "spec.faceImage") == base / "data/faces/caf\u00e9.png"


# -- the real API server -----------------------------------------------------------


@pytest.fixture(scope="module")
def hostile_namespace(crd):
    """One namespace for the table (every create is a dry run: nothing is stored)."""
    import secrets

    name = f"vj-containment-{secrets.token_hex(4)}"
    crd.kubectl("create", "namespace", name)
    yield name
    crd.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


def _server_verdict(custom_api, namespace: str, doc: dict) -> str:
    """The API server's error body for creating ``doc`` (dry run), or "" when it accepts it."""
    from kubernetes.client.exceptions import ApiException

    try:
        custom_api.create_namespaced_custom_object("videojob.io", "v1alpha1", namespace, "videojobs", doc,
                                                   dry_run="All")
    except ApiException as exc:
        return json.loads(exc.body)["message"] if exc.body else str(exc)
    return ""


@pytest.mark.cluster
@pytest.mark.parametrize("field,case,value", HOSTILE, ids=_ids(HOSTILE))
def test_api_server_refuses_naming_the_field(custom_api, hostile_namespace, field, case, value):
    verdict = _server_verdict(custom_api, hostile_namespace, _document(field, value))
    assert f"{field}:" in verdict, verdict or "the server accepted it"


@pytest.mark.cluster
@pytest.mark.parametrize("field,value", VALID, ids=_ids(VALID))
def test_api_server_accepts_the_valid_values(custom_api, hostile_namespace, field, value):
    assert _server_verdict(custom_api, hostile_namespace, _document(field, value)) == ""


# -- symbolic links: only the actor's filesystem can tell -------------------------


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """Every root with a link inside pointing out of it, to a directory holding a 'secret'."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(b"not yours")
    (outside / "secret.png.npz").write_bytes(b"not yours either")
    paths = {"output": tmp_path / "outputs", "input": tmp_path / "inputs", "source": tmp_path / "models",
             "claim": tmp_path / "volumes" / "claim"}
    for env, key in (("VIDEOJOB_OUTPUT_ROOT", "output"), ("VIDEOJOB_DATA_ROOT", "input"),
                     ("VIDEOJOB_MODEL_ROOT", "source")):
        monkeypatch.setenv(env, str(paths[key]))
    monkeypatch.setenv("VIDEOJOB_VOLUMES_ROOT", str(tmp_path / "volumes"))
    for root in paths.values():
        root.mkdir(parents=True)
        (root / "out").symlink_to(outside)  # a directory link leaving the root
        (root / "inside").mkdir()
        (root / "alias").symlink_to(root / "inside")  # a link that stays inside
    return {**paths, "outside": outside}


@pytest.mark.parametrize("kind,field,uri", [
    ("output", "spec.output.uri", "local://out/job"),
    ("output", "spec.output.uri", "pvc://claim/out"),
    ("input", "spec.image", "local://out/secret.png"),
    ("input", "spec.faceImage", "pvc://claim/out/secret.png"),
    ("source", "spec.model.source", "local://out"),
    ("source", "spec.model.source", "pvc://claim/out/model"),
])
def test_a_link_inside_the_root_pointing_out_is_refused(roots, kind, field, uri):
    with pytest.raises(JobFailure) as exc:
        resolve(uri, kind, field)
    assert exc.value.message.startswith(f"{field}: {uri!r} resolves to {roots['outside'].resolve()}")
    assert "outside its root" in exc.value.message and exc.value.details["field"] == field


def test_links_that_stay_inside_and_missing_tails_are_fine(roots):
    assert resolve("local://alias/job", "output", "spec.output.uri") == roots["output"].resolve() / "inside/job"
    assert resolve("pvc://claim/alias/a.png", "input", "spec.image") == roots["claim"].resolve() / "inside/a.png"
    assert resolve("local://new/dirs/job", "output", "spec.output.uri") == roots["output"].resolve() / "new/dirs/job"


def test_a_claim_mounted_through_a_link_is_its_own_root(roots, tmp_path):
    """Volumes are often mounted through links: the claim's directory is the root, wherever it really is."""
    real = tmp_path / "real-mount"
    (real / "videos").mkdir(parents=True)
    (roots["claim"].parent / "linked-claim").symlink_to(real)
    assert resolve("pvc://linked-claim/videos", "output", "spec.output.uri") == real.resolve() / "videos"


def test_a_file_link_and_an_embeddings_link_pointing_out_are_refused(roots):
    from videojob_runtime.inputs import load_face_embeddings, load_image

    (roots["input"] / "face.png").symlink_to(roots["outside"] / "secret.png")
    with pytest.raises(JobFailure, match=r"^spec.faceImage: 'local://face.png' resolves to .* outside its root"):
        load_image("local://face.png", 64, 64, "spec.faceImage")
    # The image is a real file inside; only its .npz beside it leaves the root.
    (roots["input"] / "inside" / "face.png").write_bytes(b"png")
    (roots["input"] / "inside" / "face.png.npz").symlink_to(roots["outside"] / "secret.png.npz")
    with pytest.raises(JobFailure, match=r"^spec.faceImage: 'local://inside/face.png.npz' resolves to"):
        load_face_embeddings("local://inside/face.png", "float32", "spec.faceImage")


def test_a_link_loop_is_refused_cleanly(roots):
    (roots["input"] / "loop").symlink_to(roots["input"] / "loop")
    with pytest.raises(JobFailure, match="^spec.image: 'local://loop/a.png' "):
        resolve("local://loop/a.png", "input", "spec.image")


def test_plain_paths_only_inside_the_directory_the_caller_names(roots, tmp_path):
    base = roots["input"].resolve()
    assert resolve(str(base / "inside" / "a.png"), "input", "spec.image", local_dir=base) == base / "inside/a.png"
    assert resolve("inside/a.png", "input", "spec.image", local_dir=base) == base / "inside/a.png"
    for plain in ("/etc/passwd", "../outputs/x", str(base / "out" / "secret.png")):
        with pytest.raises(JobFailure, match="outside its root"):
            resolve(plain, "input", "spec.image", local_dir=base)
    with pytest.raises(JobFailure, match="has no scheme"):
        resolve(str(base / "inside" / "a.png"), "input", "spec.image")


def test_a_rank_refuses_an_input_behind_a_link(roots):
    """The worker's own path: the job fails in inputs, naming spec.image, and reads nothing."""
    from videojob_runtime.request import JobRequest
    from videojob_runtime.worker import RankWorker

    out = RankWorker(0, 1).run(JobRequest(
        job_id="link", model_id="tiny-cogvideox-i2v", task="i2v", prompt="a cat", width=64, height=64, frames=9,
        fps=8, steps=1, guidance=6.0, image="local://out/secret.png", frames_dtype="float32"))
    assert not out["ok"] and out["error"]["stage"] == "inputs", out
    assert out["error"]["field"] == "spec.image" and "outside its root" in out["error"]["message"]


def test_videojob_run_refuses_an_output_behind_a_link_exit_1(roots, tmp_path):
    job = tmp_path / "job.yaml"
    doc = _document("spec.output.uri", "local://out/job")
    doc["spec"].update(model={"name": "tiny-cogvideox", "dtype": "float32"}, video={"width": 64, "height": 64,
                                                                                   "frames": 9})
    job.write_text(yaml.safe_dump(doc))
    result = subprocess.run([sys.executable, "-m", "videojob.cli", "run", str(job), "--quiet"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert "spec.output.uri: 'local://out/job' resolves to" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in roots["outside"].iterdir()) == ["secret.png", "secret.png.npz"], "nothing written"


# -- https inputs: a real local HTTPS server ----------------------------------------

LIMIT = 100_000
SLOW_S = 3.0


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a client that gave up (timeout tests) is expected
        pass


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        server = self.server
        with server.lock:
            server.counts[self.path] += 1
        routes = server.routes
        if self.path == "/slow.png":
            time.sleep(SLOW_S)
        if self.path.startswith("/to-"):
            scheme = "http" if self.path == "/to-http.png" else "https"
            self.send_response(302)
            self.send_header("Location", f"{scheme}://127.0.0.1:{server.server_address[1]}/face.png")
            self.end_headers()
            return
        if self.path == "/big.png":  # no Content-Length: only counting while streaming can stop it
            self.send_response(200)
            self.end_headers()
            for _ in range(2 * LIMIT // 10_000):
                self.wfile.write(b"x" * 10_000)
            return
        if self.path == "/big-declared.png":
            self.send_response(200)
            self.send_header("Content-Length", str(10 * LIMIT))
            self.end_headers()
            self.wfile.write(b"x" * 1000)
            return
        if self.path not in routes:
            self.send_error(404)
            return
        body = routes[self.path]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def https_server(tmp_path_factory, face_inputs):
    """A threaded HTTPS server on 127.0.0.1 with a self-signed certificate (openssl),
    counting requests per path; ``ca`` is the certificate to trust."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command is needed to make the test server's certificate")
    pki = tmp_path_factory.mktemp("pki")
    cert, key = pki / "cert.pem", pki / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = _Server(("127.0.0.1", 0), _Handler)
    # The handshake happens in the handler's thread, not in the accept loop.
    server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    server.lock = threading.Lock()
    server.counts = Counter()
    png = face_inputs.read_bytes()
    npz = Path(f"{face_inputs}.npz").read_bytes()
    server.routes = {"/face.png": png, "/face.png.npz": npz, "/no-embeddings.png": png}
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    server.url = f"https://127.0.0.1:{server.server_address[1]}"
    server.ca = str(cert)
    with pytest.MonkeyPatch.context() as mp:  # never through a proxy the environment may name
        mp.setenv("no_proxy", "127.0.0.1,localhost")
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.fixture
def fetch_settings(https_server, tmp_path):
    return RunSettings(input_ca_bundle=https_server.ca, input_fetch_timeout_s=0.5, input_fetch_deadline_s=20,
                       input_max_bytes=LIMIT, input_staging_root=str(tmp_path / "staging"),
                       input_allow_private_hosts=True)  # the test server is on loopback


def test_fetch_success(https_server, fetch_settings, tmp_path):
    from videojob_runtime.inputs import fetch_https

    written = fetch_https(f"{https_server.url}/face.png", tmp_path / "copy", "spec.image", fetch_settings)
    assert (tmp_path / "copy").read_bytes() == https_server.routes["/face.png"] and written > 0


@pytest.mark.parametrize("path,expected", [
    ("/missing.png", "answered 404"),
    ("/big.png", f"larger than {LIMIT} bytes"),
    ("/big-declared.png", f"larger than {LIMIT} bytes"),
    ("/to-http.png", "refused: it http:// is refused: use https://"),
])
def test_fetch_failures_name_the_field_and_leave_no_file(https_server, fetch_settings, tmp_path, path, expected):
    from videojob_runtime.inputs import fetch_https

    uri = f"{https_server.url}{path}"
    with pytest.raises(JobFailure) as exc:
        fetch_https(uri, tmp_path / "copy", "spec.faceImage", fetch_settings)
    assert exc.value.message.startswith(f"spec.faceImage: {uri} ") and expected in exc.value.message
    assert exc.value.stage == "inputs" and not (tmp_path / "copy").exists()


def test_fetch_follows_an_https_redirect(https_server, fetch_settings, tmp_path):
    from videojob_runtime.inputs import fetch_https

    fetch_https(f"{https_server.url}/to-https.png", tmp_path / "copy", "spec.image", fetch_settings)
    assert (tmp_path / "copy").read_bytes() == https_server.routes["/face.png"]


def test_fetch_times_out(https_server, fetch_settings, tmp_path):
    from videojob_runtime.inputs import fetch_https

    started = time.monotonic()
    with pytest.raises(JobFailure, match=r"no answer within 0.5 s \(VIDEOJOB_INPUT_FETCH_TIMEOUT_S\)"):
        fetch_https(f"{https_server.url}/slow.png", tmp_path / "copy", "spec.image", fetch_settings)
    assert time.monotonic() - started < SLOW_S, "the timeout, not the server, ended the wait"


def test_fetch_checks_the_certificate(https_server, tmp_path):
    """Without the test CA the same server is refused: verification is on."""
    from videojob_runtime.inputs import fetch_https

    with pytest.raises(JobFailure, match="certificate could not be verified"):
        fetch_https(f"{https_server.url}/face.png", tmp_path / "copy", "spec.image",
                    RunSettings(input_fetch_timeout_s=5, input_allow_private_hosts=True))


def _request(**overrides):
    from videojob_runtime.request import JobRequest

    base = dict(job_id="fetch", model_id="tiny-consisid", task="identity", prompt="a face", width=64, height=64,
                frames=9, fps=8, steps=2, guidance=6.0)
    return JobRequest(**{**base, **overrides})


def test_staged_inputs_are_local_copies_removed_afterwards(https_server, fetch_settings):
    from videojob_runtime.inputs import staged_inputs

    staging = Path(fetch_settings.input_staging_root)
    request = _request(face_image=f"{https_server.url}/face.png")
    with staged_inputs(request, fetch_settings) as staged:
        directory = Path(staged.local_inputs_dir)
        assert directory.parent == staging
        assert Path(staged.face_image).read_bytes() == https_server.routes["/face.png"]
        assert Path(f"{staged.face_image}.npz").read_bytes() == https_server.routes["/face.png.npz"]
        assert request.face_image.startswith("https://"), "the driver's own request is left as it was"
    assert not directory.exists() and list(staging.iterdir()) == []
    # Removed when the job fails too, and when a fetch fails half-way (the face is there, its .npz is not).
    with pytest.raises(RuntimeError, match="the job failed"):
        with staged_inputs(request, fetch_settings) as staged:
            raise RuntimeError("the job failed")
    assert list(staging.iterdir()) == []
    with pytest.raises(JobFailure, match=r"^spec.faceImage: .*/no-embeddings.png.npz answered 404"):
        with staged_inputs(_request(face_image=f"{https_server.url}/no-embeddings.png"), fetch_settings):
            pytest.fail("a failed fetch must not run the job")
    assert list(staging.iterdir()) == []


def test_a_request_without_https_inputs_is_not_staged(fetch_settings):
    from videojob_runtime.inputs import staged_inputs

    request = _request(face_image="pvc://inputs/face.png")
    with staged_inputs(request, fetch_settings) as staged:
        assert staged is request
    assert not Path(fetch_settings.input_staging_root).exists()


def test_a_rank_never_fetches():
    from videojob_runtime.inputs import resolve_input

    with pytest.raises(JobFailure, match="^spec.image: https://example.com/a.png was not fetched by the job's driver"):
        resolve_input("https://example.com/a.png", "spec.image")


def test_a_two_rank_job_fetches_its_face_once(ray_session, https_server, fetch_settings, tmp_path):
    """The whole `videojob run` path on two ranks (Ulysses 2): one GET for the
    face and one for its embeddings, whatever the number of ranks; nothing staged is left."""
    from videojob_runtime.local import run_local

    before = Counter(https_server.counts)
    doc = {"apiVersion": "videojob.io/v1alpha1", "kind": "VideoJob", "metadata": {"name": "fetch-once"},
           "spec": {"model": {"name": "tiny-consisid", "dtype": "float32"}, "task": "identity",
                    "prompt": "a face", "seed": 1, "video": {"width": 64, "height": 64, "frames": 9, "fps": 8},
                    "sampling": {"steps": 2}, "cache": {"policy": "off"}, "resources": {"maxGPUs": 2},
                    "parallel": {"ulysses": 2}, "faceImage": f"{https_server.url}/face.png"}}
    settings = fetch_settings.model_copy(update={"cpus_per_rank": 0.5, "input_fetch_timeout_s": 10.0,
                                                 "job_timeout_s": 300.0, "placement_timeout_s": 120.0})
    result = run_local(parse_videojob(doc), out_dir=tmp_path / "out", settings=settings)
    assert result["ok"], result.get("error")
    assert result["plan"]["ulysses"] == 2 and len(result["collectives_per_rank"]) == 2
    fetched = https_server.counts - before
    assert fetched == Counter({"/face.png": 1, "/face.png.npz": 1}), fetched
    assert list(Path(settings.input_staging_root).iterdir()) == []
    assert (tmp_path / "out" / "fetch-once.mp4").stat().st_size > 0



@pytest.mark.parametrize("host", ["127.0.0.1", "169.254.169.254", "10.0.0.1", "[::1]", "localhost"])
def test_inputs_are_not_fetched_from_non_public_addresses(host, tmp_path):
    """A hostile spec must not make the runtime read cluster services or cloud metadata."""
    from videojob_runtime.inputs import fetch_https

    with pytest.raises(JobFailure, match="not a public address"):
        fetch_https(f"https://{host}/a.png", tmp_path / "copy", "spec.image", RunSettings())
    assert not (tmp_path / "copy").exists()


def test_an_npz_that_unpacks_too_large_is_refused(tmp_path):
    import zipfile

    from videojob_runtime.inputs import load_face_embeddings

    face = tmp_path / "face.png"
    face.write_bytes(b"")
    with zipfile.ZipFile(str(face) + ".npz", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("id_cond.npy", b"\0" * (300 * 2**20))  # 300 MiB of zeros, a few hundred KiB zipped
    with pytest.raises(JobFailure, match="would unpack to"):
        load_face_embeddings(str(face), None, local_dir=str(tmp_path))
