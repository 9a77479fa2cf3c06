"""Kueue on the loopback cluster: its CRDs and its real controller manager, with
its webhooks served to the kube-apiserver.

tools/kueue pins sigs.k8s.io/kueue; build-gotool.sh builds kueue-manager from it
and the CRDs and webhook manifests applied are that module's (found with `go mod
download -json`). The manager runs as the admin, without leader election or
internal cert management, every port on loopback: the webhook server with a
serving cert for 127.0.0.1 signed by the cluster CA, health and metrics on free
ports, the visibility API server (VisibilityOnDemand, its own port) off. Only
batch/job is integrated and only labelled Jobs are managed.

The webhook configurations keep only the kueue.x-k8s.io webhooks of the module's
manifests, each pointing at `https://127.0.0.1:<port><path>`. They are named
videojob-test-kueue-* and labelled with the holder pid: `stop` deletes them (a
stale one with failurePolicy Fail would refuse every Kueue object), and `start`
deletes those of a holder that is gone, refusing to start beside a live one.

Kueue reads its metrics certificate from the fixed path /etc/kueue/metrics/certs
when internal cert management is off, so the manager runs in its own mount
namespace (unshare; a user namespace too when not root) where /etc is overlaid
with a tmpfs holding that certificate; nothing outside the process changes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .binaries import go_module_dir, resolve_tool_bin_dir
from .client import api, http_ok, kubectl
from .kuberay import crd_established
from .common import ClusterError, Paths, log
from .pki import b64file, openssl
from .procs import free_ports, pid_alive, start_process, stop_pid, wait_until

KUEUE_MODULE = "sigs.k8s.io/kueue"
KUEUE_NAMESPACE = "kueue-system"
GROUP = "kueue.x-k8s.io"
API = f"/apis/{GROUP}/v1beta2"  # the version the v0.17 CRDs store
WEBHOOK_NAME = "videojob-test-kueue"
HOLDER_LABEL = "videojob.test/kueue-holder"
KINDS = {"MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
         "ValidatingWebhookConfiguration": "validatingwebhookconfigurations"}
ADMISSION = "/apis/admissionregistration.k8s.io/v1"
# /etc overlaid in the manager's mount namespace (see the module docstring).
ETC_OVERLAY = """set -e
mnt="$1"; certs="$2"; shift 2
mount -t tmpfs -o size=1m,mode=0700 videojob-kueue "$mnt"
mkdir -p "$mnt/upper/kueue/metrics/certs" "$mnt/work"
cp "$certs/tls.crt" "$certs/tls.key" "$mnt/upper/kueue/metrics/certs/"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$mnt/upper,workdir=$mnt/work" /etc
exec "$@"
"""


def kueue_module() -> tuple[Path, str]:
    """The module folder (CRDs, webhook manifests, source) and version tools/kueue pins."""
    return go_module_dir(KUEUE_MODULE, "kueue")


def kueue_bin_dir(build: bool) -> Path:
    """tools/kueue's bin dir (build-gotool.sh; VIDEOJOB_KUEUE_BIN_DIR overrides)."""
    return resolve_tool_bin_dir("kueue", "kueue-manager", "VIDEOJOB_KUEUE_BIN_DIR", build)


def apply_crds(state: dict, paths: Paths, module_dir: Path) -> list[str]:
    """Server-side apply of the module's CRDs; waits until every one is Established."""
    crd_dir = module_dir / "config" / "components" / "crd" / "bases"
    files = sorted(crd_dir.glob("*.yaml"))
    if not files:
        raise ClusterError(f"no CRDs in {crd_dir}")
    kubectl(state, "apply", "--server-side", "--force-conflicts",
            "--field-manager=videojob-localcluster", "-f", str(crd_dir))
    names = [f"{f.stem.split('_', 1)[1]}.{f.stem.split('_', 1)[0]}" for f in files]
    wait_until(f"Kueue CRDs {', '.join(names)} to be Established",
               lambda: all(crd_established(state, paths, n) for n in names), 60, interval=0.5)
    return names


def serving_cert(pki: Path, out: Path) -> None:
    """out/tls.crt and tls.key: a serving cert for 127.0.0.1 and localhost, by the cluster CA."""
    out.mkdir(parents=True, exist_ok=True)
    key, csr, ext = out / "tls.key", out / "tls.csr", out / "tls.ext"
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(key))
    os.chmod(key, 0o600)
    ext.write_text("basicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature,keyEncipherment\n"
                   "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("req", "-new", "-key", str(key), "-subj", "/CN=videojob-test-kueue-webhook", "-out", str(csr))
    openssl("x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
            "-CAserial", str(out / "ca.srl"), "-CAcreateserial", "-days", "30", "-sha256",
            "-extfile", str(ext), "-out", str(out / "tls.crt"))
    for f in (csr, ext, out / "ca.srl"):
        f.unlink(missing_ok=True)


def configuration(ports: dict[str, int], cert_dir: Path) -> dict:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2); JSON is valid YAML."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "manageJobsWithoutQueueName": False,
        "webhook": {"host": "127.0.0.1", "port": ports["webhook"], "certDir": str(cert_dir)},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['health']}"},
        "metrics": {"bindAddress": f"127.0.0.1:{ports['metrics']}"},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": ["batch/job"]},  # the others need CRDs that are absent
        "featureGates": {"VisibilityOnDemand": False},  # its API server would bind 0.0.0.0:8082
        "clientConnection": {"qps": 50, "burst": 100},
    }


def webhook_configurations(state: dict, module_dir: Path, port: int, ca: Path) -> list[dict]:
    """The module's webhook configurations, cut to the kueue.x-k8s.io webhooks, each
    calling https://127.0.0.1:<port><path> with the cluster CA as caBundle."""
    manifest = module_dir / "config" / "components" / "webhook" / "manifests.yaml"
    text = kubectl(state, "create", "--dry-run=client", "-o", "json", "-f", str(manifest))
    docs, dec, i = [], json.JSONDecoder(), 0
    while i < len(text):  # a stream of JSON objects, one per YAML document
        if text[i].isspace():
            i += 1
            continue
        doc, i = dec.raw_decode(text, i)
        docs.append(doc)
    out = []
    for doc in (d for d in docs if d.get("kind") in KINDS):
        hooks = [h for h in doc.get("webhooks", [])
                 if any(GROUP in r.get("apiGroups", []) for r in h.get("rules", []))]
        for h in hooks:
            path = h["clientConfig"]["service"].get("path", "/")
            h["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": b64file(ca)}
            h["timeoutSeconds"] = 30  # a loaded 2-core machine
        kind = "mutating" if doc["kind"].startswith("Mutating") else "validating"
        out.append({"apiVersion": "admissionregistration.k8s.io/v1", "kind": doc["kind"],
                    "metadata": {"name": f"{WEBHOOK_NAME}-{kind}",
                                 "labels": {HOLDER_LABEL: str(os.getpid())}},
                    "webhooks": hooks})
    if not out or not all(c["webhooks"] for c in out):
        raise ClusterError(f"no {GROUP} webhooks found in {manifest}")
    return out


def delete_webhook_configurations(state: dict, paths: Paths, *, only_stale: bool) -> None:
    """Deletes the test's webhook configurations; with only_stale, those of dead
    holders, refusing (ClusterError) when a live holder's are there."""
    for resource in KINDS.values():
        status, obj = api(state, paths, "GET", f"{ADMISSION}/{resource}?labelSelector={HOLDER_LABEL}")
        if status != 200:
            raise ClusterError(f"listing {resource}: HTTP {status}: {obj}")
        for item in obj.get("items", []):
            holder = item["metadata"].get("labels", {}).get(HOLDER_LABEL, "")
            if only_stale and holder.isdigit() and int(holder) != os.getpid() and pid_alive(int(holder)):
                raise ClusterError(f"another test session (pid {holder}) runs Kueue against this "
                                   f"cluster ({resource}/{item['metadata']['name']})")
            status, out = api(state, paths, "DELETE", f"{ADMISSION}/{resource}/{item['metadata']['name']}")
            if status not in (200, 202, 404):
                raise ClusterError(f"deleting {resource}/{item['metadata']['name']}: HTTP {status}: {out}")


def probe_workload(invalid: bool) -> dict:
    """A Workload for the server-side dry run; the invalid one requests `pods`, which
    only Kueue's webhook refuses (the CRD schema allows it)."""
    requests = {"cpu": "1", **({"pods": "1"} if invalid else {})}
    container = {"name": "c", "image": "none", "resources": {"requests": requests}}
    return {"apiVersion": f"{GROUP}/v1beta2", "kind": "Workload",
            "metadata": {"generateName": "videojob-webhook-probe-"},
            "spec": {"podSets": [{"name": "main", "count": 1,
                                  "template": {"spec": {"containers": [container]}}}]}}


def webhook_serving(state: dict, paths: Paths) -> bool:
    """True once the API server sends Workloads through Kueue's webhooks: a valid
    one passes a dry-run create and an invalid one is refused by vworkload.kb.io."""
    url = f"{API}/namespaces/{KUEUE_NAMESPACE}/workloads?dryRun=All"
    ok, body = api(state, paths, "POST", url, probe_workload(False))
    if ok != 201:
        raise ClusterError(f"dry-run create of a valid Workload: HTTP {ok}: {body}")
    status, body = api(state, paths, "POST", url, probe_workload(True))
    return status in (400, 403, 422) and "vworkload.kb.io" in json.dumps(body)


def _namespace_wrapper(mnt: Path, certs: Path) -> list[str]:
    """argv prefix running a command with /etc/kueue/metrics/certs overlaid (checked
    with `true` first, so a refused unshare fails here with its message)."""
    unshare = shutil.which("unshare")
    if not unshare:
        raise ClusterError("kueue-manager needs `unshare` (util-linux): Kueue reads its metrics "
                           "certificate from /etc/kueue/metrics/certs")
    opts = ["-m"] if os.geteuid() == 0 else ["-U", "-r", "-m"]
    argv = [unshare, *opts, "--propagation", "private", "sh", "-c", ETC_OVERLAY, "sh", str(mnt), str(certs)]
    res = subprocess.run([*argv, "true"], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise ClusterError(f"cannot give kueue-manager its own mount namespace (`unshare "
                           f"{' '.join(opts)}`): {res.stderr.strip()[-1000:]}")
    return argv


@dataclass
class Kueue:
    """A running Kueue manager: `stop()` it (idempotent)."""
    state: dict
    paths: Paths
    pid: int
    exe: str
    version: str
    ports: dict
    workdir: Path
    log_path: Path
    start_s: float   # from the process start until webhooks served

    def stop(self) -> None:
        delete_webhook_configurations(self.state, self.paths, only_stale=False)
        stop_pid(self.pid, self.exe, "kueue-manager")
        release_workload_finalizers(self.state)


def release_workload_finalizers(state: dict) -> None:
    """Workloads being deleted keep Kueue's finalizer once the manager is gone; drop it
    (else their namespaces never finish terminating)."""
    items = json.loads(kubectl(state, "get", f"workloads.v1beta2.{GROUP}", "-A", "-o", "json"))["items"]
    for wl in items:
        meta = wl["metadata"]
        if meta.get("deletionTimestamp") and meta.get("finalizers"):
            kubectl(state, "patch", f"workloads.v1beta2.{GROUP}", meta["name"], "-n", meta["namespace"],
                    "--type=merge", "-p", '{"metadata":{"finalizers":null}}')


def start(state: dict, workdir: Path, exe: Path, timeout: float = 180.0) -> Kueue:
    """Installs Kueue in the running cluster of ``state`` and starts its manager;
    returns once it is healthy and its webhooks take Workloads."""
    paths = Paths(Path(state["cluster_dir"]))
    module_dir, version = kueue_module()
    apply_crds(state, paths, module_dir)
    status, body = api(state, paths, "POST", "/api/v1/namespaces",
                       {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NAMESPACE}})
    if status not in (201, 409):
        raise ClusterError(f"creating namespace {KUEUE_NAMESPACE}: HTTP {status}: {body}")
    delete_webhook_configurations(state, paths, only_stale=True)

    workdir.mkdir(parents=True, exist_ok=True)
    certs, mnt = workdir / "certs", workdir / "etc-overlay"
    serving_cert(paths.pki, certs)
    mnt.mkdir(exist_ok=True)
    ports = dict(zip(("webhook", "health", "metrics"), free_ports(3)))
    config = workdir / "kueue-config.yaml"
    config.write_text(json.dumps(configuration(ports, certs), indent=2) + "\n")
    argv = [*_namespace_wrapper(mnt, certs), str(exe), f"--config={config}",
            f"--kubeconfig={state['kubeconfig']}", "--zap-log-level=info"]
    log_path = workdir / "kueue-manager.log"
    t0 = time.monotonic()
    proc = start_process("kueue-manager", argv, log_path)
    kueue = Kueue(state, paths, proc.pid, str(exe), version, ports, workdir, log_path, 0.0)
    try:
        ready = f"http://127.0.0.1:{ports['health']}/readyz"
        wait_until(f"kueue-manager to answer {ready}", lambda: http_ok(ready, None)[0],
                   timeout, proc=proc, log_path=log_path, interval=0.5)
        for cfg in webhook_configurations(state, module_dir, ports["webhook"], paths.pki / "ca.crt"):
            kubectl(state, "apply", "--server-side", "--force-conflicts",
                    "--field-manager=videojob-tests", "-f", "-", input=json.dumps(cfg))
        wait_until("the API server to send Workloads through Kueue's webhooks (dry-run creates)",
                   lambda: webhook_serving(state, paths), 60, proc=proc, log_path=log_path, interval=0.5)
    except BaseException:
        kueue.stop()
        raise
    kueue.start_s = time.monotonic() - t0
    log(f"Kueue {version} serving after {kueue.start_s:.1f}s (webhook 127.0.0.1:{ports['webhook']}, "
        f"log {log_path})")
    return kueue
