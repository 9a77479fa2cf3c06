"""The control plane: etcd, kube-apiserver, kube-controller-manager (every
cluster) and kube-scheduler (full mode), all on 127.0.0.1 with free ports.

- etcd: one member, data in <cluster dir>/etcd, no fsync (test data).
- kube-apiserver: TLS with pki/, client-cert and ServiceAccount-token authn,
  Node,RBAC authz, the default admission plugins plus NodeRestriction (plus
  what the started steps ask for, e.g. ExtendedResourceToleration in full mode).
- kube-controller-manager: all default controllers, its own ServiceAccount
  credentials, signs CSRs with the cluster CA; ready once it has made
  ServiceAccount default/default.
- kube-scheduler: as system:kube-scheduler (the bootstrap RBAC role), with a
  client cert made on first use and scheduler.kubeconfig.
"""
from __future__ import annotations

import os
import ssl
import subprocess
import time
from pathlib import Path

from .binaries import etcd_binary
from .client import admin_ssl_context, api, http_ok, insecure_ctx
from .common import ISSUER, SERVICE_CIDR, ClusterError, Paths, log
from .pki import cert_user, make_client_cert, write_kubeconfig
from .procs import wait_until
from .steps import Process, Run, start_and_wait


class Etcd(Process):
    name = "etcd"
    ports = ("etcd_client", "etcd_peer")

    def record(self, run: Run) -> None:
        run.state["exes"][self.name] = etcd_binary(run.bin_dir)

    def argv(self, run: Run) -> list[str]:
        ports, paths = run.state["ports"], run.paths
        peer = f"http://127.0.0.1:{ports['etcd_peer']}"
        client = f"http://127.0.0.1:{ports['etcd_client']}"
        return [
            run.state["exes"][self.name],
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
        ]

    def health_url(self, state: dict, paths: Paths) -> tuple[str, None]:
        return f"http://127.0.0.1:{state['ports']['etcd_client']}/health", None

    def start(self, run: Run) -> subprocess.Popen:
        run.paths.etcd_data.mkdir(mode=0o700, exist_ok=True)
        url, _ = self.health_url(run.state, run.paths)
        return start_and_wait(run, self.name, self.argv(run), url, None, 30,
                              what=f"etcd to report healthy at {url}",
                              ready=lambda: '"true"' in http_ok(url, None)[1])

    def check(self, state: dict, paths: Paths) -> tuple[bool, str]:
        ok, body = http_ok(self.health_url(state, paths)[0], None)
        return ok and '"true"' in body, body.strip()[:200]


class KubeApiserver(Process):
    name = "kube-apiserver"
    ports = ("apiserver",)
    interval = 0.5

    def record(self, run: Run) -> None:
        run.state["server"] = f"https://127.0.0.1:{run.state['ports']['apiserver']}"
        run.state["exes"][self.name] = str(run.bin_dir / "kube-apiserver")

    def argv(self, run: Run) -> list[str]:
        pki = run.paths.pki
        etcd_client = f"http://127.0.0.1:{run.state['ports']['etcd_client']}"
        plugins = ["NodeRestriction"]
        for step in run.steps:
            plugins += [p for p in step.admission_plugins if p not in plugins]
        return [
            run.state["exes"][self.name],
            f"--etcd-servers={etcd_client}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={run.state['ports']['apiserver']}",
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
            "--enable-admission-plugins=" + ",".join(plugins),
            "--allow-privileged=true",
            # 127.0.0.1 is not a valid Endpoints address; no reconciler needed here
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--v=1",
        ]

    def health_url(self, state: dict, paths: Paths) -> tuple[str, ssl.SSLContext]:
        return state["server"] + "/readyz", admin_ssl_context(paths.pki)

    def timeout(self, run: Run) -> float:
        return run.timeout

    def start(self, run: Run) -> subprocess.Popen:
        proc = super().start(run)
        log(f"kube-apiserver ready after {time.monotonic() - run.t0:.1f}s")
        pki = run.paths.pki
        write_kubeconfig(run.paths.kubeconfig, run.state["server"], pki / "ca.crt",
                         cert_user(pki, "admin"), "videojob-admin")
        return proc

    def check(self, state: dict, paths: Paths) -> tuple[bool, str]:
        try:
            return super().check(state, paths)
        except (OSError, ssl.SSLError) as exc:
            return False, f"cannot load client cert: {exc}"


class KubeControllerManager(Process):
    name = "kube-controller-manager"
    ports = ("kcm",)

    def record(self, run: Run) -> None:
        run.state["exes"][self.name] = str(run.bin_dir / "kube-controller-manager")

    def argv(self, run: Run) -> list[str]:
        paths, pki = run.paths, run.paths.pki
        kcm_cfg = str(paths.kcm_kubeconfig)
        return [
            run.state["exes"][self.name],
            f"--kubeconfig={kcm_cfg}",
            f"--authentication-kubeconfig={kcm_cfg}",
            f"--authorization-kubeconfig={kcm_cfg}",
            "--bind-address=127.0.0.1",
            f"--secure-port={run.state['ports']['kcm']}",
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
            # Nodes here are kept by a Python heartbeat on a shared 2-core machine; a 50 s
            # stall there (the default grace) is load, not a lost node, and NotReady would
            # mark every pod on it unready (CI saw this once).
            "--node-monitor-grace-period=180s",
            "--profiling=false",
            "--v=1",
        ]

    def health_url(self, state: dict, paths: Paths) -> tuple[str, ssl.SSLContext]:
        return f"https://127.0.0.1:{state['ports']['kcm']}/healthz", insecure_ctx()

    def start(self, run: Run) -> subprocess.Popen:
        paths, pki = run.paths, run.paths.pki
        write_kubeconfig(paths.kcm_kubeconfig, run.state["server"], pki / "ca.crt",
                         cert_user(pki, "controller-manager"), "system:kube-controller-manager")
        proc = super().start(run)
        # Its controllers run once the serviceaccount controller has made the
        # `default` ServiceAccount in the `default` namespace.
        wait_until("kube-controller-manager to create ServiceAccount default/default",
                   lambda: api(run.state, paths, "GET",
                               "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
                   60, proc, paths.log(self.name), interval=0.5)
        return proc


class KubeScheduler(Process):
    """Full mode: binds pods to the (fake) nodes."""
    name = "kube-scheduler"
    ports = ("scheduler",)

    def preflight(self, bin_dir, args) -> None:
        scheduler = bin_dir / "kube-scheduler"
        if not os.access(scheduler, os.X_OK):
            raise ClusterError(f"missing executable {scheduler} (an older build of tools/? "
                               f"run hack/cluster/build-tools.sh)")

    def record(self, run: Run) -> None:
        run.state["exes"][self.name] = str(run.bin_dir / "kube-scheduler")
        run.state["scheduler_kubeconfig"] = str(run.paths.scheduler_kubeconfig)

    def argv(self, run: Run) -> list[str]:
        cfg = str(run.paths.scheduler_kubeconfig)
        return [
            run.state["exes"][self.name],
            f"--kubeconfig={cfg}",
            f"--authentication-kubeconfig={cfg}",
            f"--authorization-kubeconfig={cfg}",
            "--bind-address=127.0.0.1",
            f"--secure-port={run.state['ports']['scheduler']}",
            f"--cert-dir={run.paths.root / 'scheduler-certs'}",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ]

    def health_url(self, state: dict, paths: Paths) -> tuple[str, ssl.SSLContext]:
        return f"https://127.0.0.1:{state['ports'].get('scheduler')}/healthz", insecure_ctx()

    def start(self, run: Run) -> subprocess.Popen:
        # as system:kube-scheduler (the bootstrap RBAC role)
        pki = run.paths.pki
        make_client_cert(pki, "scheduler", "/CN=system:kube-scheduler")
        write_kubeconfig(run.paths.scheduler_kubeconfig, run.state["server"], pki / "ca.crt",
                         cert_user(pki, "scheduler"), "system:kube-scheduler")
        return super().start(run)

    def summary(self, run: Run) -> str:
        return "scheduler"


ETCD = Etcd()
APISERVER = KubeApiserver()
CONTROLLER_MANAGER = KubeControllerManager()
SCHEDULER = KubeScheduler()


def restart_apiserver(paths: Paths, state: dict, steps: tuple, timeout: float = 180) -> int:
    """Stop kube-apiserver and start it again with the same flags and port (etcd
    and its data are untouched): an API server outage, for the chaos soak. The
    new pid is recorded in the state; ``steps`` are the cluster's (its admission
    plugins). Returns the new pid."""
    run = Run(paths=paths, state=state, bin_dir=Path(state["bin_dir"]), timeout=timeout, steps=steps, tools={})
    APISERVER.stop(state)
    return APISERVER.start(run).pid
