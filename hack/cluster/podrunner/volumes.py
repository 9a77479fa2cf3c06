"""Pod volumes as host directories under the runner's state dir, bind-mounted into the
containers by containerinit.

emptyDir (medium Memory under /dev/shm), configMap, secret, downwardAPI and projected
(serviceAccountToken via the TokenRequest API bound to the pod, configMap, secret,
downwardAPI: the kube-api-access-* volume admission injects) are written the kubelet's
way, as `..data` -> `..<timestamp>` with one symlink per top-level entry, so an update
(a refreshed token) replaces every file at once. hostPath is the host's path;
persistentVolumeClaim is its PV's hostPath when bound to one, else one directory per
claim under <state>/pvcs/<namespace>/<claim>, shared by every pod that mounts it."""
from __future__ import annotations

import base64
import os
import secrets
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .env import ConfigError, container_resource, field_value
from .kube import ApiError
from .util import debug, parse_rfc3339


class VolumeError(Exception):
    """A volume cannot be set up yet (the kubelet retries: the pod stays ContainerCreating)."""


class ClusterReader(Protocol):
    def get_object(self, kind: str, namespace: str, name: str) -> dict | None: ...
    def request_token(self, namespace: str, service_account: str, pod: dict, audience: str | None,
                      seconds: int) -> tuple[str, float]: ...
    def allocatable(self, node: str) -> dict: ...


@dataclass
class Mountable:
    """A volume ready to bind-mount: host path, whether it must stay read-only, rbind."""
    path: Path
    read_only: bool = False
    recursive: bool = False


def _decode(b64: str) -> bytes:
    return base64.b64decode(b64)


def _dir_payload_changed(target: Path, payload: dict[str, tuple[bytes, int]]) -> bool:
    data = target / "..data"
    if not data.is_symlink():
        return True
    base = target / os.readlink(data)
    have = {}
    for root, _, files in os.walk(base):
        for f in files:
            p = Path(root) / f
            have[str(p.relative_to(base))] = (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
    want = {k: (v[0], v[1]) for k, v in payload.items()}
    return have != want


def write_atomic(target: Path, payload: dict[str, tuple[bytes, int]], fs_group: int | None,
                 file_owner: int | None = None) -> bool:
    """Publish payload {relative path: (bytes, mode)} in target the kubelet's way; False if unchanged."""
    target.mkdir(parents=True, exist_ok=True)
    os.chmod(target, 0o755 if fs_group is None else 0o2755)
    gid = fs_group if fs_group is not None else -1
    if fs_group is not None:
        os.chown(target, -1, fs_group)
    # modes as they end up after the fsGroup adjustment, so the comparison is exact
    final = {rel: (data, mode | (0o440 if fs_group is not None else 0)) for rel, (data, mode) in payload.items()}
    if not _dir_payload_changed(target, final):
        return False
    ts = target / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{secrets.token_hex(4)}"
    ts.mkdir(mode=0o755)
    if fs_group is not None:
        os.chown(ts, -1, gid)
        os.chmod(ts, 0o2755)
    for rel, (data, mode) in final.items():
        p = ts / rel
        if p.parent != ts:
            p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.chown(p, file_owner if file_owner is not None else -1, gid)
        os.chmod(p, mode)
    old = (target / os.readlink(target / "..data")) if (target / "..data").is_symlink() else None
    tmp = target / "..data_tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(ts.name, tmp)
    os.replace(tmp, target / "..data")
    tops = {rel.split("/", 1)[0] for rel in final}
    for top in tops:
        link = target / top
        if not link.is_symlink():
            os.symlink(f"..data/{top}", link)
    for entry in target.iterdir():
        if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in tops:
            entry.unlink()
    if old and old != ts:
        shutil.rmtree(old, ignore_errors=True)
    return True


def _items(data: dict[str, bytes], items: list | None, default_mode: int, optional: bool,
           what: str) -> dict[str, tuple[bytes, int]]:
    if not items:
        return {k: (v, default_mode) for k, v in data.items()}
    out = {}
    for it in items:
        if it["key"] not in data:
            if optional:
                continue
            raise VolumeError(f"configmap/secret {what}: key {it['key']!r} not found (items)")
        out[it["path"]] = (data[it["key"]], it.get("mode", default_mode))
    return out


TOKEN_REFRESH_FRACTION = 0.8   # the kubelet renews a projected token at 80% of its life


class PodVolumes:
    """The volumes of one pod: set up before the first container, resynced while it runs."""

    RESYNC_SECONDS = 30.0   # ConfigMap/Secret changes reach the files within this (kubelet: ~1 min)

    def __init__(self, cluster: ClusterReader, pod: dict, pod_dir: Path, shm_root: Path, pvc_root: Path,
                 token_refresh_fraction: float = TOKEN_REFRESH_FRACTION):
        self.cluster = cluster
        self.token_refresh_fraction = token_refresh_fraction
        self.pod = pod
        self.dir = pod_dir / "volumes"
        self.shm_root = shm_root
        self.pvc_root = pvc_root
        sc = pod.get("spec", {}).get("securityContext") or {}
        self.fs_group: int | None = sc.get("fsGroup")
        self.mounts: dict[str, Mountable] = {}
        self._tokens: dict[str, float] = {}   # volume name -> time to refresh
        self._token_payload: dict[str, tuple[bytes, int]] = {}

    # ---- public
    def setup(self) -> float:
        """Materialise the volumes not set up yet; seconds until resync() is due."""
        for vol in self.pod["spec"].get("volumes") or []:
            if vol["name"] not in self.mounts:
                self.mounts[vol["name"]] = self._setup_one(vol)
        return self._next()

    def resync(self, pod: dict) -> float:
        """Re-render the API-backed volumes (new ConfigMap/Secret data, labels, tokens at 80%
        of their life); seconds until the next resync is due."""
        self.pod = pod
        now = time.time()
        for vol in self.pod["spec"].get("volumes") or []:
            if any(k in vol for k in ("configMap", "secret", "downwardAPI", "projected")):
                force = self._tokens.get(vol["name"], float("inf")) <= now
                try:
                    self._render(vol, refresh_tokens=force)
                except (VolumeError, ConfigError, ApiError, OSError) as exc:
                    debug("volume resync failed; keeping the old content", volume=vol["name"], error=str(exc))
        return self._next()

    def _next(self) -> float:
        now = time.time()
        return max(1.0, min(min(self._tokens.values(), default=now + 30.0) - now, self.RESYNC_SECONDS))

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- internals
    def _setup_one(self, vol: dict) -> Mountable:
        name = vol["name"]
        if "emptyDir" in vol:
            medium = (vol["emptyDir"] or {}).get("medium", "")
            path = (self.shm_root / "volumes" / name) if medium == "Memory" else (self.dir / name)
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o777)
            if self.fs_group is not None:
                os.chown(path, -1, self.fs_group)
                os.chmod(path, 0o2777)
            return Mountable(path)
        if "hostPath" in vol:
            return Mountable(self._host_path(vol["hostPath"], name), recursive=True)
        if "persistentVolumeClaim" in vol:
            src = vol["persistentVolumeClaim"]
            return Mountable(self._claim(src["claimName"]), read_only=bool(src.get("readOnly")))
        if "ephemeral" in vol:
            path = self.dir / name
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o777)
            return Mountable(path)
        if any(k in vol for k in ("configMap", "secret", "downwardAPI", "projected")):
            self._render(vol, refresh_tokens=True)
            return Mountable(self.dir / name, read_only=True)
        kinds = sorted(k for k in vol if k != "name")
        raise VolumeError(f"volume {name!r}: type {kinds} is not supported by the pod runner "
                          f"(supported: emptyDir, configMap, secret, downwardAPI, projected, hostPath, "
                          f"persistentVolumeClaim, ephemeral)")

    def _host_path(self, src: dict, name: str) -> Path:
        path = Path(src["path"])
        kind = src.get("type") or ""
        if kind == "DirectoryOrCreate":
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "FileOrCreate":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(exist_ok=True)
        checks = {"Directory": path.is_dir, "File": path.is_file, "Socket": path.is_socket,
                  "CharDevice": path.is_char_device, "BlockDevice": path.is_block_device}
        if kind in checks and not checks[kind]():
            raise VolumeError(f"volume {name!r}: hostPath type check failed: {path} is not a {kind}")
        if not path.exists():
            raise VolumeError(f"volume {name!r}: hostPath {path} does not exist (type {kind or 'unset'})")
        return path

    def _claim(self, claim: str) -> Path:
        ns = self.pod["metadata"]["namespace"]
        pvc = self.cluster.get_object("PersistentVolumeClaim", ns, claim)
        if pvc is None:
            raise VolumeError(f'persistentvolumeclaim "{claim}" not found')
        pv_name = (pvc.get("spec") or {}).get("volumeName")
        if pv_name:
            pv = self.cluster.get_object("PersistentVolume", "", pv_name)
            host = ((pv or {}).get("spec") or {}).get("hostPath")
            if host:
                path = Path(host["path"])
                path.mkdir(parents=True, exist_ok=True)
                return path
        path = self.pvc_root / ns / claim
        if not path.exists():
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o777)
        if self.fs_group is not None:
            os.chown(path, -1, self.fs_group)
            os.chmod(path, 0o2777)
        return path

    def _fs_user(self) -> int | None:
        """The kubelet gives the token file to the pod's one runAsUser when there is no fsGroup."""
        if self.fs_group is not None:
            return None
        spec = self.pod["spec"]
        pod_uid = (spec.get("securityContext") or {}).get("runAsUser")
        uids = {(c.get("securityContext") or {}).get("runAsUser", pod_uid)
                for c in [*spec.get("initContainers", []), *spec["containers"]]}
        return uids.pop() if len(uids) == 1 and None not in uids else None

    def _object(self, kind: str, name: str, optional: bool) -> dict[str, bytes] | None:
        obj = self.cluster.get_object(kind, self.pod["metadata"]["namespace"], name)
        if obj is None:
            if optional:
                return None
            raise VolumeError(f'{kind.lower()} "{name}" not found')
        if kind == "Secret":
            return {k: _decode(v) for k, v in (obj.get("data") or {}).items()}
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data.update({k: _decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return data

    def _downward(self, items: list, default_mode: int) -> dict[str, tuple[bytes, int]]:
        out = {}
        node = self.pod["spec"].get("nodeName", "")
        for it in items or []:
            if "fieldRef" in it:
                value = field_value(self.pod, it["fieldRef"]["fieldPath"])
            else:
                ref = it["resourceFieldRef"]
                value = container_resource(self.pod, ref.get("containerName", ""), ref["resource"],
                                           ref.get("divisor"), self.cluster.allocatable(node))
            out[it["path"]] = (value.encode(), it.get("mode", default_mode))
        return out

    def _render(self, vol: dict, refresh_tokens: bool) -> None:
        name = vol["name"]
        payload: dict[str, tuple[bytes, int]] = {}
        owner = None
        if "configMap" in vol or "secret" in vol:
            kind, src = (("ConfigMap", vol["configMap"]) if "configMap" in vol else ("Secret", vol["secret"]))
            obj_name = src.get("name") or src.get("secretName")
            data = self._object(kind, obj_name, bool(src.get("optional")))
            payload = _items(data or {}, src.get("items"), src.get("defaultMode", 0o644),
                             bool(src.get("optional")), obj_name)
        elif "downwardAPI" in vol:
            src = vol["downwardAPI"]
            payload = self._downward(src.get("items"), src.get("defaultMode", 0o644))
        else:
            src = vol["projected"]
            mode = src.get("defaultMode", 0o644)
            for s in src.get("sources") or []:
                if "configMap" in s or "secret" in s:
                    kind, ref = (("ConfigMap", s["configMap"]) if "configMap" in s else ("Secret", s["secret"]))
                    data = self._object(kind, ref["name"], bool(ref.get("optional")))
                    payload.update(_items(data or {}, ref.get("items"), mode, bool(ref.get("optional")), ref["name"]))
                elif "downwardAPI" in s:
                    payload.update(self._downward(s["downwardAPI"].get("items"), mode))
                elif "serviceAccountToken" in s:
                    payload.update(self._token(name, s["serviceAccountToken"], mode, refresh_tokens))
                    owner = self._fs_user()
                else:
                    raise VolumeError(f"volume {name!r}: projected source {sorted(s)} is not supported")
        write_atomic(self.dir / name, payload, self.fs_group, owner)

    def _token(self, vol: str, src: dict, mode: int, refresh: bool) -> dict[str, tuple[bytes, int]]:
        path = src["path"]
        key = f"{vol}/{path}"
        if not refresh and key in self._token_payload:
            return {path: self._token_payload[key]}
        meta, spec = self.pod["metadata"], self.pod["spec"]
        seconds = int(src.get("expirationSeconds") or 3600)
        token, expires = self.cluster.request_token(meta["namespace"], spec.get("serviceAccountName") or "default",
                                                    self.pod, src.get("audience"), seconds)
        issued = time.time()
        self._tokens[vol] = issued + self.token_refresh_fraction * max(1.0, expires - issued)
        if self._fs_user() is not None or self.fs_group is not None:
            mode = 0o600
        self._token_payload[key] = (token.encode(), mode)
        return {path: self._token_payload[key]}


def token_expiry(status: dict) -> float:
    return parse_rfc3339(status["expirationTimestamp"])
