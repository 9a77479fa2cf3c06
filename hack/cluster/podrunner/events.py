"""Events about pods, posted the way the kubelet reports them (source component
`kubelet`, reporting controller `podrunner`), repeated ones counted in one Event."""
from __future__ import annotations

import secrets
import threading
import time

from .kube import Api, ApiError
from .util import debug, now_rfc3339


class Recorder:
    def __init__(self, api: Api, host: str):
        self.api = api
        self.host = host
        self._lock = threading.Lock()
        self._seen: dict[tuple, tuple[str, int, float]] = {}   # key -> (event name, count, first ts)

    def pod_event(self, pod: dict, etype: str, reason: str, message: str, field_path: str = "") -> None:
        meta = pod["metadata"]
        ns = meta["namespace"]
        key = (meta["uid"], reason, message, field_path)
        now = now_rfc3339()
        with self._lock:
            seen = self._seen.get(key)
        try:
            if seen and time.time() - seen[2] < 600:
                name, count, first = seen
                self.api.patch(f"/api/v1/namespaces/{ns}/events/{name}",
                               {"count": count + 1, "lastTimestamp": now}, kind="merge")
                with self._lock:
                    self._seen[key] = (name, count + 1, first)
                return
            involved = {"kind": "Pod", "namespace": ns, "name": meta["name"], "uid": meta["uid"],
                        "apiVersion": "v1", "resourceVersion": meta.get("resourceVersion")}
            if field_path:
                involved["fieldPath"] = field_path
            name = f"{meta['name']}.{secrets.token_hex(8)}"
            self.api.post(f"/api/v1/namespaces/{ns}/events", {
                "metadata": {"name": name, "namespace": ns}, "involvedObject": involved,
                "reason": reason, "message": message[:1024], "type": etype, "count": 1,
                "firstTimestamp": now, "lastTimestamp": now,
                "source": {"component": "kubelet", "host": self.host},
                "reportingComponent": "kubelet", "reportingInstance": self.host})
            with self._lock:
                self._seen[key] = (name, 1, time.time())
                if len(self._seen) > 5000:
                    self._seen.clear()
        except (ApiError, OSError) as exc:
            debug("event not recorded", reason=reason, pod=f"{ns}/{meta['name']}", error=str(exc)[:200])
