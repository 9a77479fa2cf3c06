"""A pod's sandbox: its network namespace and address, its /etc/netns files (hosts,
resolv.conf), the apiserver listener inside it, its directories (state dir, /dev/shm)
and its volumes. Logs stay after the pod goes (<state>/logs)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from .hosts import render_hosts, render_resolv_conf
from .network import NETNS_ETC, RUN_NETNS, NetworkError
from .proxy import listen_in_netns
from .util import debug, short_uid, warn, write_in_place
from .volumes import PodVolumes

if TYPE_CHECKING:
    from .runner import Runner


class Sandbox:
    def __init__(self, runner: "Runner", pod: dict):
        meta = pod["metadata"]
        self.runner = runner
        self.uid = meta["uid"]
        self.host_network = bool(pod["spec"].get("hostNetwork"))
        self.netns = None if self.host_network else f"{runner.prefix}-{short_uid(self.uid)}"
        self.dir = runner.state_dir / "pods" / self.uid
        self.shm_root = runner.shm_root / self.uid
        self.logs = runner.state_dir / "logs" / f"{meta['namespace']}_{meta['name']}_{self.uid}"
        self.ip: str | None = None
        self.veth: str | None = None
        self.listener = None
        self.volumes = PodVolumes(runner, pod, self.dir, self.shm_root, runner.state_dir / "pvcs",
                                  runner.cfg.token_refresh_fraction)
        self.ready = False

    @property
    def etc_dir(self) -> Path | None:
        return NETNS_ETC / self.netns if self.netns else None

    @property
    def pod_shm(self) -> Path:
        return self.shm_root / "shm"

    def create(self, pod: dict, want_ip: str | None = None, reuse: bool = False) -> None:
        """Directories, address, network namespace, name files, apiserver listener."""
        for d in (self.dir, self.logs, self.shm_root):
            d.mkdir(parents=True, exist_ok=True)
        self.pod_shm.mkdir(exist_ok=True)
        os.chmod(self.pod_shm, 0o1777)
        net = self.runner.network
        if self.host_network:
            self.ip = net.gateway
        else:
            if reuse and want_ip:
                net.reserve(want_ip)
                self.ip = want_ip
            else:
                self.ip = net.allocate()
            self.etc_dir.mkdir(parents=True, exist_ok=True)
            write_in_place(self.etc_dir / "hosts", render_hosts(pod, self.ip, self.runner.host_records()))
            write_in_place(self.etc_dir / "resolv.conf", render_resolv_conf(pod))
            if reuse and (RUN_NETNS / self.netns).exists():
                self.veth = net.veth_name(self.ip)
            else:
                extra = [self.runner.api_service[0]] if self.runner.api_service else []
                self.veth = net.create_sandbox(self.netns, self.ip, extra)
            if self.runner.api_service:
                host, port = self.runner.api_service
                try:
                    self.listener = listen_in_netns(str(RUN_NETNS / self.netns), host, port)
                    self.runner.proxy.add(f"{pod['metadata']['namespace']}/{pod['metadata']['name']}", self.listener)
                except OSError as exc:
                    raise NetworkError(f"cannot serve the apiserver's ClusterIP {host}:{port} in netns "
                                       f"{self.netns}: {exc}") from exc
        self.ready = True
        debug("sandbox created", pod=pod["metadata"]["name"], netns=self.netns, ip=self.ip)

    def refresh_hosts(self, pod: dict) -> None:
        if self.etc_dir is None or not self.ready or self.ip is None:
            return
        try:
            write_in_place(self.etc_dir / "hosts", render_hosts(pod, self.ip, self.runner.host_records()))
        except OSError as exc:
            warn("hosts file update failed", netns=self.netns, error=str(exc))

    def teardown(self, keep_ip_record: bool = False) -> None:
        """Everything but the logs, PVC and hostPath data."""
        if self.listener is not None:
            self.runner.proxy.remove(self.listener)
            self.listener = None
        if self.netns:
            try:
                self.runner.network.delete_sandbox(self.netns, self.veth)
            except NetworkError as exc:
                warn("sandbox network teardown failed", netns=self.netns, error=str(exc))
        if self.ip and not self.host_network:
            self.runner.network.release(self.ip)
        self.volumes.teardown()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.shm_root, ignore_errors=True)
        self.ready = False
