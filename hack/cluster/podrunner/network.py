"""Pod networking: one bridge per runner, one network namespace + veth pair per pod.

    host:  bridge <prefix>br  (gateway = first address of --pod-cidr)
             └─ veth <prefix>v<n>  ──  eth0 in netns <prefix>-<uid>-<pod> (pod IP, default via gateway)

The host reaches every pod address through the bridge; pods reach each other on it.
Inside each pod's namespace the apiserver's ClusterIP sits on `lo` and the runner
listens there (proxy.py), so in-cluster clients work without touching any address
outside the namespaces: two runners on one machine never collide.

Every name carries the runner's prefix (util.state_prefix), and every file a namespace
gets (/etc/netns/<netns>/hosts, resolv.conf) is removed with it."""
from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from .util import debug, info, warn

NETNS_ETC = Path("/etc/netns")
RUN_NETNS = Path("/run/netns")


class NetworkError(Exception):
    pass


def ip(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *args]
    res = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=60)
    if check and res.returncode != 0:
        raise NetworkError(f"`{' '.join(argv)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def list_netns(prefix: str) -> list[str]:
    try:
        names = os.listdir(RUN_NETNS)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix + "-"))


def list_links(prefix: str) -> list[str]:
    res = ip("-j", "link", "show", check=False)
    try:
        links = json.loads(res.stdout or "[]")
    except ValueError:
        return []
    return sorted(l["ifname"] for l in links if l.get("ifname", "").startswith(prefix))


def netns_pids(netns: str) -> list[int]:
    res = ip("netns", "pids", netns, check=False)
    return [int(x) for x in res.stdout.split() if x.isdigit()]


def kill_netns_processes(netns: str, timeout: float = 10.0) -> None:
    """SIGKILL everything still inside a network namespace, until nothing is left."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in netns_pids(netns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise NetworkError(f"processes {pids} in netns {netns} survived SIGKILL for {timeout:.0f}s")
        time.sleep(0.05)


def delete_netns(netns: str) -> None:
    kill_netns_processes(netns)
    if (RUN_NETNS / netns).exists():
        ip("netns", "delete", netns, check=False)
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)


def check_cidr_free(cidr: ipaddress.IPv4Network, own_links: set[str]) -> None:
    """Refuse a pod CIDR that overlaps a route of this host (other than our own bridge's)."""
    res = ip("-j", "-4", "route", "show", "table", "all", check=False)
    try:
        routes = json.loads(res.stdout or "[]")
    except ValueError:
        routes = []
    for r in routes:
        dst = r.get("dst")
        if not dst or dst == "default" or r.get("dev") in own_links or r.get("type") in ("local", "broadcast"):
            continue
        try:
            net = ipaddress.ip_network(dst, strict=False)
        except ValueError:
            continue
        if net.version == 4 and net.overlaps(cidr):
            raise NetworkError(f"--pod-cidr {cidr} overlaps the route `{dst} dev {r.get('dev')}` on this host; "
                               f"pick an unused range (e.g. a different 10.x.0.0/24)")


class Network:
    """The runner's bridge and pod address pool."""

    def __init__(self, prefix: str, cidr: str):
        self.prefix = prefix
        try:
            self.cidr = ipaddress.IPv4Network(cidr, strict=True)
        except ValueError as exc:
            raise NetworkError(f"--pod-cidr {cidr!r}: {exc} (want e.g. 10.123.0.0/24)") from exc
        if self.cidr.num_addresses < 8:
            raise NetworkError(f"--pod-cidr {cidr}: too small (at least a /29)")
        self.bridge = f"{prefix}br"
        self.gateway = str(self.cidr.network_address + 1)
        self._lock = threading.Lock()
        self._used: set[int] = set()
        self._next = 2

    # ---- bridge
    def setup(self, reuse: bool = False) -> None:
        if reuse and self.bridge in list_links(self.prefix):
            info("bridge reused", bridge=self.bridge)
            return
        check_cidr_free(self.cidr, set(list_links(self.prefix)))
        ip("link", "add", "name", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/{self.cidr.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        info("bridge up", bridge=self.bridge, gateway=self.gateway, cidr=str(self.cidr))

    def teardown(self) -> None:
        ip("link", "delete", self.bridge, check=False)

    # ---- addresses
    def allocate(self, want: str | None = None) -> str:
        with self._lock:
            size = self.cidr.num_addresses
            if want:
                off = int(ipaddress.IPv4Address(want)) - int(self.cidr.network_address)
                if 2 <= off < size - 1 and off not in self._used:
                    self._used.add(off)
                    return want
            for _ in range(size):
                off = self._next
                self._next = self._next + 1 if self._next + 1 < size - 1 else 2
                if off not in self._used:
                    self._used.add(off)
                    return str(self.cidr.network_address + off)
        raise NetworkError(f"no free address left in --pod-cidr {self.cidr}")

    def reserve(self, addr: str) -> None:
        with self._lock:
            self._used.add(int(ipaddress.IPv4Address(addr)) - int(self.cidr.network_address))

    def release(self, addr: str) -> None:
        with self._lock:
            self._used.discard(int(ipaddress.IPv4Address(addr)) - int(self.cidr.network_address))

    def veth_name(self, addr: str) -> str:
        off = int(ipaddress.IPv4Address(addr)) - int(self.cidr.network_address)
        return f"{self.prefix}v{off:x}"

    # ---- pod sandboxes
    def create_sandbox(self, netns: str, addr: str, extra_lo_addrs: list[str]) -> str:
        """A network namespace with eth0 = addr, lo up (with extra_lo_addrs), default route
        via the gateway. Returns the host-side veth name."""
        veth = self.veth_name(addr)
        ip("link", "delete", veth, check=False)
        ip("netns", "add", netns)
        try:
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
            ip("link", "set", veth, "master", self.bridge, "up")
            cmds = [f"addr add {addr}/{self.cidr.prefixlen} dev eth0", "link set eth0 up", "link set lo up",
                    f"route add default via {self.gateway}"]
            cmds += [f"addr add {a}/32 dev lo" for a in extra_lo_addrs]
            ip("-n", netns, "-b", "-", input="\n".join(cmds) + "\n")
        except BaseException:
            self.delete_sandbox(netns, veth)
            raise
        debug("sandbox network ready", netns=netns, ip=addr, veth=veth)
        return veth

    def delete_sandbox(self, netns: str, veth: str | None) -> None:
        delete_netns(netns)
        if veth:
            ip("link", "delete", veth, check=False)


def cleanup_prefix(prefix: str, keep_netns: set[str] = frozenset(), keep_links: set[str] = frozenset()) -> list[str]:
    """Remove every netns (killing what runs in it), link and /etc/netns dir of a prefix,
    except the ones kept (a restarted runner adopting its pods)."""
    removed = []
    for ns in list_netns(prefix):
        if ns in keep_netns:
            continue
        try:
            delete_netns(ns)
            removed.append(f"netns {ns}")
        except NetworkError as exc:
            warn("could not remove netns", netns=ns, error=str(exc))
    links = [l for l in list_links(prefix) if l not in keep_links]
    for link in sorted(links, key=lambda l: l.endswith("br")):   # veths first, the bridge last
        ip("link", "delete", link, check=False)
        removed.append(f"link {link}")
    if NETNS_ETC.exists():
        for d in NETNS_ETC.iterdir():
            if d.name.startswith(prefix + "-") and d.name not in keep_netns:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(f"dir {d}")
    return removed
