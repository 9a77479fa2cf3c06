"""A small Kubernetes API client over http.client: kubeconfig, JSON calls, informers
(list, then watch from the list's resourceVersion; bookmarks; relist on 410 Gone)."""
from __future__ import annotations

import base64
import http.client
import json
import os
import ssl
import tempfile
import threading
import urllib.parse
from pathlib import Path
from typing import Callable, Iterator

import yaml

from .util import debug, warn


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, body: str):
        self.status = status
        try:
            self.body = json.loads(body)
        except ValueError:
            self.body = {"message": body}
        self.reason = self.body.get("reason", "")
        super().__init__(f"{method} {path}: HTTP {status}: {self.body.get('message', body)[:500]}")


class KubeConfig:
    def __init__(self, path: Path, key_dir: Path):
        doc = yaml.safe_load(Path(path).read_text())
        ctx_name = doc.get("current-context")
        ctx = next(c["context"] for c in doc["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == ctx["cluster"])
        user = next((u["user"] for u in doc.get("users", []) if u["name"] == ctx.get("user")), {})
        self.server = cluster["server"].rstrip("/")
        url = urllib.parse.urlsplit(self.server)
        if url.scheme != "https":
            raise ValueError(f"kubeconfig {path}: only https servers are supported (got {self.server})")
        self.host, self.port = url.hostname, url.port or 443
        base = Path(path).parent

        def material(section: dict, key: str) -> str | None:
            """A file path for key (`<key>-data` is written under key_dir, 0600)."""
            if section.get(key + "-data"):
                key_dir.mkdir(parents=True, exist_ok=True)
                fd, name = tempfile.mkstemp(prefix=key + ".", dir=key_dir)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(base64.b64decode(section[key + "-data"]))
                return name
            return str(base / section[key]) if section.get(key) else None

        self.ca_file = material(cluster, "certificate-authority")
        cert, key = material(user, "client-certificate"), material(user, "client-key")
        ctx_ssl = ssl.create_default_context(cafile=self.ca_file)
        if cluster.get("insecure-skip-tls-verify"):
            ctx_ssl.check_hostname = False
            ctx_ssl.verify_mode = ssl.CERT_NONE
        if cert and key:
            ctx_ssl.load_cert_chain(cert, key)
        self.ssl = ctx_ssl
        self.headers = {}
        token = user.get("token") or (Path(user["tokenFile"]).read_text().strip() if user.get("tokenFile") else None)
        if token:
            self.headers["Authorization"] = f"Bearer {token}"


class Api:
    """JSON requests; one keep-alive connection per thread."""

    def __init__(self, cfg: KubeConfig, timeout: float = 30.0):
        self.cfg = cfg
        self.timeout = timeout
        self._local = threading.local()

    def _conn(self, timeout: float | None = None) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.cfg.host, self.cfg.port, context=self.cfg.ssl,
                                           timeout=timeout or self.timeout)

    @staticmethod
    def _url(path: str, params: dict | None) -> str:
        if params:
            path += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        return path

    def request(self, method: str, path: str, body=None, params: dict | None = None,
                content_type: str = "application/json") -> dict | None:
        url = self._url(path, params)
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Accept": "application/json", **self.cfg.headers}
        if data is not None:
            headers["Content-Type"] = content_type
        for attempt in (1, 2):
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = self._conn()
            try:
                conn.request(method, url, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
                continue
            if resp.status >= 400:
                raise ApiError(resp.status, method, url, raw.decode(errors="replace"))
            return json.loads(raw) if raw else None
        return None

    def get(self, path: str, **params) -> dict:
        return self.request("GET", path, params=params or None)

    def get_or_none(self, path: str) -> dict | None:
        try:
            return self.get(path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def post(self, path: str, body: dict, **params) -> dict:
        return self.request("POST", path, body, params=params or None)

    def put(self, path: str, body: dict) -> dict:
        return self.request("PUT", path, body)

    def patch(self, path: str, body: dict, kind: str = "merge") -> dict:
        ctype = {"merge": "application/merge-patch+json",
                 "strategic": "application/strategic-merge-patch+json",
                 "json": "application/json-patch+json"}[kind]
        return self.request("PATCH", path, body, content_type=ctype)

    def delete(self, path: str, body: dict | None = None) -> dict | None:
        return self.request("DELETE", path, body)

    def watch(self, path: str, params: dict, timeout: float) -> Iterator[dict]:
        """Watch events (dicts) until the server ends the stream."""
        conn = self._conn(timeout=timeout)
        try:
            conn.request("GET", self._url(path, {**params, "watch": "1"}),
                         headers={"Accept": "application/json", **self.cfg.headers})
            resp = conn.getresponse()
            if resp.status >= 400:
                raise ApiError(resp.status, "WATCH", path, resp.read().decode(errors="replace"))
            while True:
                line = resp.readline()
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()


def key_of(obj: dict) -> str:
    m = obj["metadata"]
    return f"{m.get('namespace', '')}/{m['name']}"


class Informer(threading.Thread):
    """Keeps a store of a resource's objects and calls handler(event, old, new) with event
    ADDED / MODIFIED / DELETED (old is None for ADDED, new is None for DELETED)."""

    WATCH_SECONDS = 240

    def __init__(self, api: Api, path: str, handler: Callable[[str, dict | None, dict | None], None],
                 stop: threading.Event, field_selector: str | None = None, name: str = ""):
        super().__init__(name=f"informer {name or path}", daemon=True)
        self.api, self.path, self.handler, self.stop = api, path, handler, stop
        self.field_selector = field_selector
        self.store: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.synced = threading.Event()
        self.watching = threading.Event()

    def items(self) -> list[dict]:
        with self.lock:
            return list(self.store.values())

    def get(self, key: str) -> dict | None:
        with self.lock:
            return self.store.get(key)

    def _emit(self, event: str, old, new) -> None:
        try:
            self.handler(event, old, new)
        except Exception:  # noqa: BLE001 - a handler bug must not stop the informer
            from .util import error
            error("informer handler failed", exc_info=True, informer=self.name)

    def _list(self) -> str:
        items, cont, rv = [], None, ""
        while True:
            out = self.api.get(self.path, fieldSelector=self.field_selector, limit=500,
                               **({"continue": cont} if cont else {}))
            items.extend(out.get("items") or [])
            rv = out["metadata"]["resourceVersion"]
            cont = out["metadata"].get("continue")
            if not cont:
                break
        kind = out.get("kind", "List").removesuffix("List")
        fresh = {}
        for it in items:
            it.setdefault("kind", kind)
            it.setdefault("apiVersion", out.get("apiVersion"))
            fresh[key_of(it)] = it
        with self.lock:
            old = self.store
            self.store = fresh
        for k, obj in fresh.items():
            prev = old.get(k)
            if prev is None:
                self._emit("ADDED", None, obj)
            elif prev["metadata"].get("resourceVersion") != obj["metadata"].get("resourceVersion"):
                self._emit("MODIFIED", prev, obj)
        for k, prev in old.items():
            if k not in fresh:
                self._emit("DELETED", prev, None)
        return rv

    def run(self) -> None:
        rv = None
        backoff = 0.5
        while not self.stop.is_set():
            try:
                if rv is None:
                    rv = self._list()
                    self.synced.set()
                params = {"resourceVersion": rv, "allowWatchBookmarks": "true",
                          "timeoutSeconds": str(self.WATCH_SECONDS), "fieldSelector": self.field_selector}
                self.watching.set()
                for ev in self.api.watch(self.path, params, timeout=self.WATCH_SECONDS + 30):
                    if self.stop.is_set():
                        return
                    etype, obj = ev.get("type"), ev.get("object") or {}
                    if etype == "ERROR":
                        if obj.get("code") == 410:
                            debug("watch expired; relisting", informer=self.name)
                            rv = None
                            break
                        raise ApiError(obj.get("code", 500), "WATCH", self.path, json.dumps(obj))
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if etype == "BOOKMARK":
                        continue
                    k = key_of(obj)
                    with self.lock:
                        prev = self.store.get(k)
                        if etype == "DELETED":
                            self.store.pop(k, None)
                        else:
                            self.store[k] = obj
                    self._emit(etype if etype != "ADDED" or prev is None else "MODIFIED", prev,
                               None if etype == "DELETED" else obj)
                backoff = 0.5
            except ApiError as exc:
                if exc.status == 410:
                    rv = None
                    continue
                warn("watch failed; retrying", informer=self.name, error=str(exc)[:300])
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 10)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                if self.stop.is_set():
                    return
                warn("watch connection lost; retrying", informer=self.name, error=str(exc)[:200])
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 10)
