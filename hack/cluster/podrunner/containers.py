"""One container instance as processes:

    ip netns exec <netns> python -I containerinit.py SPEC   (the shim: records the exit code)
        └─ containerinit as pid 1 of a new PID/mount/UTS namespace ─exec─> the command (pid 1)

`ip netns exec` puts the pod's /etc/netns/<netns>/{hosts,resolv.conf} over /etc; the
container's own mount namespace gets a private /tmp, the pod's /dev/shm and its volume
mounts. Signals go to the host pid of the container's pid 1: a pid 1 without a SIGTERM
handler ignores SIGTERM, as in a real container, and SIGKILL of pid 1 ends every
process of the container."""
from __future__ import annotations

import grp
import json
import os
import pwd
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .env import ConfigError, expand
from .images import Image
from .volumes import Mountable, VolumeError

CONTAINERINIT = Path(__file__).with_name("containerinit.py")
NOFILE = 1048576  # what container runtimes give (the host's hard limit may be lower)


def identity(pod: dict, container: dict, image: Image) -> tuple[int, int, list[int]]:
    """(uid, gid, supplementary groups): container securityContext over the pod's over the
    image's USER; fsGroup and supplementalGroups join the groups. runAsNonRoot with uid 0
    is refused as the kubelet does."""
    psc = pod["spec"].get("securityContext") or {}
    csc = container.get("securityContext") or {}
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    gid = csc.get("runAsGroup", psc.get("runAsGroup"))
    if uid is None:
        uid = image.uid
        if gid is None:
            gid = image.gid
    if gid is None:
        try:
            gid = pwd.getpwuid(uid).pw_gid
        except KeyError:
            gid = 0
    if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) and uid == 0:
        raise ConfigError(f'container has runAsNonRoot and image will run as root (pod: '
                          f'"{pod["metadata"]["name"]}_{pod["metadata"]["namespace"]}", container: {container["name"]})')
    groups = [gid]
    if psc.get("fsGroup") is not None:
        groups.append(psc["fsGroup"])
    groups += list(psc.get("supplementalGroups") or [])
    try:
        user = pwd.getpwuid(uid).pw_name
        groups += [g.gr_gid for g in grp.getgrall() if user in g.gr_mem]
    except KeyError:
        pass
    return uid, gid, list(dict.fromkeys(int(g) for g in groups))


def _covers(parent: str, child: str) -> bool:
    p, c = PurePosixPath(parent), PurePosixPath(child)
    return c == p or p in c.parents


def plan_mounts(pod: dict, container: dict, volumes: dict[str, Mountable], ctr_tmp: Path,
                pod_shm: Path, profile: Path | None, env: dict[str, str]) -> list[dict]:
    """The bind mounts of one container, parents before children."""
    vmounts = []
    for vm in container.get("volumeMounts") or []:
        vol = volumes.get(vm["name"])
        if vol is None:
            raise ConfigError(f"container {container['name']}: volumeMount {vm['name']!r} names no volume of the pod")
        source = vol.path
        sub = vm.get("subPath") or (expand(vm["subPathExpr"], env) if vm.get("subPathExpr") else "")
        if sub:
            if sub.startswith("/") or ".." in PurePosixPath(sub).parts:
                raise ConfigError(f"container {container['name']}: volumeMount {vm['name']}: subPath {sub!r} "
                                  f"must be a relative path without '..'")
            source = vol.path / sub
            if not source.exists() and not source.is_symlink():
                source.mkdir(parents=True, exist_ok=True)
                os.chmod(source, 0o777 if not vol.read_only else 0o755)
            real = Path(os.path.realpath(source))
            if real != Path(os.path.realpath(vol.path)) and Path(os.path.realpath(vol.path)) not in real.parents:
                raise VolumeError(f"subPath {sub!r} of volume {vm['name']} leaves the volume")
            source = real
        vmounts.append({"source": str(source), "target": str(PurePosixPath(vm["mountPath"])),
                        "readOnly": bool(vm.get("readOnly")) or vol.read_only, "recursive": vol.recursive,
                        "file": source.is_file() or source.is_char_device() or source.is_socket()})
    mounts = []
    targets = [m["target"] for m in vmounts]
    if not any(_covers(t, "/tmp") for t in targets):
        mounts.append({"source": str(ctr_tmp), "target": "/tmp", "readOnly": False})
    if not any(_covers(t, "/dev/shm") for t in targets):
        mounts.append({"source": str(pod_shm), "target": "/dev/shm", "readOnly": False})
    if profile is not None and "/etc/profile" not in targets:
        mounts.append({"source": str(profile), "target": "/etc/profile", "readOnly": True, "file": True})
    mounts += sorted(vmounts, key=lambda m: len(PurePosixPath(m["target"]).parts))
    return mounts


def image_path_mounts(mounts: list[dict], paths: list[str]) -> list[dict]:
    """Read-only bind mounts that show the image's own files (``paths``: its install on this
    host) again where a container mount hides them: a checkout under /tmp stays visible
    behind the container's private /tmp, as an image's /opt/venv would be."""
    out = []
    for path in paths:
        if any(_covers(m["target"], path) and m["target"] != path for m in mounts):
            out.append({"source": path, "target": path, "readOnly": True, "recursive": True})
    return out


_SYSTEM_BIN = {"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"}


def install_paths(env: dict[str, str], cwd: str) -> list[str]:
    """Host paths a container needs to reach to run its image's install: the PATH dirs
    (and where their symlinks lead, outside the system dirs), VIRTUAL_ENV and its
    interpreter's home (pyvenv.cfg), the working dir."""
    paths = [cwd]
    for d in (env.get("PATH") or "").split(":"):
        if not d:
            continue
        paths.append(d)
        if d not in _SYSTEM_BIN and os.path.isdir(d):
            try:
                for entry in os.scandir(d):
                    if entry.is_symlink():
                        paths.append(os.path.dirname(os.path.realpath(entry.path)))
            except OSError:
                pass
    venv = env.get("VIRTUAL_ENV")
    if venv:
        paths.append(venv)
        try:
            for line in Path(venv, "pyvenv.cfg").read_text().splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "home":
                    paths.append(value.strip())
        except OSError:
            pass
    return list(dict.fromkeys(paths))


def blocked_dirs(paths: list[str], uid: int, gid: int, groups: list[int]) -> list[str]:
    """Host dirs on the way to `paths` that uid (with gid/groups) may not enter, parents first."""
    if uid == 0:
        return []
    ids = {gid, *groups}
    out: list[str] = []
    for p in paths:
        real = Path(os.path.realpath(p))
        for d in [*reversed(real.parents), real]:
            try:
                st = os.stat(d)
            except OSError:
                break
            if not stat.S_ISDIR(st.st_mode):
                break
            bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid in ids else 0o001
            if not st.st_mode & bit and str(d) not in out:
                out.append(str(d))
    return sorted(out, key=lambda d: d.count("/"))


def unmask_specs(blocked: list[str], ctr_dir: Path) -> list[dict]:
    """Overlay dirs for containerinit: each upper dir has the lower's mode plus x for all."""
    specs = []
    for i, d in enumerate(blocked):
        base = ctr_dir / "unmask" / str(i)
        upper, work = base / "upper", base / "work"
        for x in (upper, work):
            x.mkdir(parents=True, exist_ok=True)
        st = os.stat(d)
        os.chown(upper, st.st_uid, st.st_gid)
        os.chmod(upper, stat.S_IMODE(st.st_mode) | 0o111)
        specs.append({"path": d, "upper": str(upper), "work": str(work)})
    return specs


def workdir_mount(mounts: list[dict], cwd: str, scratch: Path, uid: int, gid: int) -> list[dict]:
    """A working dir the host lacks is the image's dir, owned by its user: a per-container
    scratch dir mounted there, so what the container writes into it stays off the host."""
    if os.path.exists(cwd) or any(_covers(m["target"], cwd) for m in mounts):
        return []
    scratch.mkdir(parents=True, exist_ok=True)
    os.chown(scratch, uid, gid)
    return [{"source": str(scratch), "target": cwd, "readOnly": False}]


def host_paths_to_create(mounts: list[dict]) -> list[tuple[str, bool]]:
    """Mount points that would have to be made on the host itself (not inside /tmp,
    /dev/shm or another mount of the container): (path, is_file)."""
    out = []
    for i, m in enumerate(mounts):
        inside = any(_covers(o["target"], m["target"]) and o["target"] != m["target"] for o in mounts[:i])
        if not inside:
            out.append((m["target"], bool(m.get("file"))))
    return out


@dataclass
class Instance:
    """A started container instance."""
    wrapper: subprocess.Popen | None
    pid1: int | None
    pid1_start: str | None
    exit_file: Path
    error_file: Path
    started_at: float
    adopted: bool = False
    exit_code: int | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def alive(self) -> bool:
        return not self.done.is_set()

    def signal(self, sig: int) -> None:
        if self.pid1 is None or self.done.is_set():
            return
        if self.pid1_start and proc_start_time(self.pid1) != self.pid1_start:
            return  # pid 1 is gone (maybe reused)
        try:
            os.kill(self.pid1, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None) -> int | None:
        self.done.wait(timeout)
        return self.exit_code


def proc_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def start(netns: str | None, spec: dict, ctr_dir: Path, log_path: Path,
          on_exit=lambda: None) -> Instance:
    """Start one container instance (spec as containerinit reads it). Returns once
    containerinit has exec'd the command or failed."""
    ctr_dir.mkdir(parents=True, exist_ok=True)
    spec_path = ctr_dir / "spec.json"
    files = {k: str(ctr_dir / k) for k in ("pid", "started", "error", "exit")}
    for f in files.values():
        Path(f).unlink(missing_ok=True)
    spec_path.write_text(json.dumps({**spec, "files": files}))
    os.chmod(spec_path, 0o600)
    shim = [sys.executable, "-I", str(CONTAINERINIT), str(spec_path)]
    argv = ["ip", "netns", "exec", netns, *shim] if netns else shim
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
    log = open(log_path, "ab", buffering=0)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True, close_fds=True)
    finally:
        log.close()
    inst = Instance(wrapper=proc, pid1=None, pid1_start=None, exit_file=Path(files["exit"]),
                    error_file=Path(files["error"]), started_at=time.time())
    pid_file, started = Path(files["pid"]), Path(files["started"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if inst.pid1 is None and pid_file.exists():
            inst.pid1 = int(pid_file.read_text())
            inst.pid1_start = proc_start_time(inst.pid1)
        if inst.pid1 is not None and started.exists():
            break
        time.sleep(0.005)
    else:
        if proc.poll() is None:   # the shim hangs: end it (its child dies with it)
            proc.kill()
    inst.started_at = time.time()
    threading.Thread(target=_reap, args=(inst, on_exit), name="reap", daemon=True).start()
    return inst


def _reap(inst: Instance, on_exit) -> None:
    rc = inst.wrapper.wait()
    inst.exit_code = rc if rc >= 0 else 128 - rc
    inst.done.set()
    on_exit()


def adopt(pid1: int, pid1_start: str, ctr_dir: Path, started_at: float, on_exit=lambda: None) -> Instance:
    """Watch an instance a previous runner started (no longer our child): poll its pid 1,
    then read the exit code its wrapper recorded."""
    inst = Instance(wrapper=None, pid1=pid1, pid1_start=pid1_start, exit_file=ctr_dir / "exit",
                    error_file=ctr_dir / "error", started_at=started_at, adopted=True)

    def poll():
        while proc_start_time(pid1) == pid1_start:
            time.sleep(0.5)
        deadline = time.monotonic() + 5
        code = None
        while time.monotonic() < deadline:
            try:
                text = inst.exit_file.read_text().strip()
                if text:
                    code = int(text)
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        inst.exit_code = code if code is not None else 137
        inst.done.set()
        on_exit()

    threading.Thread(target=poll, name="adopted-reap", daemon=True).start()
    return inst


def stop(inst: Instance, grace: float) -> int | None:
    """SIGTERM to pid 1, SIGKILL after grace seconds; the exit code."""
    if inst.done.is_set():
        return inst.exit_code
    inst.signal(signal.SIGTERM)
    if inst.wait(max(0.0, grace)) is None and not inst.done.is_set():
        inst.signal(signal.SIGKILL)
        if not inst.done.wait(10) and inst.wrapper is not None:
            inst.wrapper.kill()   # pid 1 unknown: end the shim (its child gets SIGKILL with it)
            inst.done.wait(10)
    return inst.exit_code
