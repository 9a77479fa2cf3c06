"""The operator's own calls to the Kubernetes API (kopf does the watching).

Status is written on the status subresource, with merge-patch semantics. A
job's own writes carry its uid (``StatusBook``): the API server ignores a uid
in a merge patch, so those are JSON patches whose first op tests
/metadata/uid, and a job deleted and made again under its name is never
written by the old job's thread (``Gone``). A patch can carry the
resourceVersion it was computed from (``expect``): the API server then
refuses it if the object changed meanwhile, and the caller re-reads and
recomputes. Used where a lost update would duplicate work (the submission id
written before a driver is submitted).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Callable, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

from ..api.common import API_GROUP, API_VERSION, PLURAL

log = logging.getLogger("videojob.controller.kube")


class Conflict(RuntimeError):
    """The object changed since it was read (HTTP 409)."""


class Gone(RuntimeError):
    """The object no longer exists (HTTP 404)."""


T = TypeVar("T")
# Answers that mean "later": throttled, or the server busy or restarting.
RETRY_STATUSES = {429, 500, 502, 503, 504}
LIST_PAGE_SIZE = 500  # VideoJobs per list request (the sweep and the rebuild page through them)


DEFAULT_API_TIMEOUT_S = 30.0  # OperatorSettings.kube_api_timeout_s's default
CONNECT_TIMEOUT_S = 10.0
TIMEOUT_ATTEMPTS = 3  # tries of a call the API server did not answer in time (each waits its timeout)


def request_timeout(read_s: float) -> tuple[float, float]:
    """(connect, read) seconds for a call whose answer may take ``read_s``."""
    return (min(CONNECT_TIMEOUT_S, read_s), read_s)


class TimedApiClient(k8s.ApiClient):
    """An ApiClient whose every call has a client-side timeout unless the call gives its own
    (a watch: longer than its server-side timeout). Without one, a connection dropped
    silently (a NAT or load balancer forgetting it, an API server hung) wedged the calling
    thread for ever: a job's thread, the sweeper, the Workload watch (issue 36)."""

    timeout_s: float = DEFAULT_API_TIMEOUT_S

    def call_api(self, method, url, header_params=None, body=None, post_params=None, _request_timeout=None):
        return super().call_api(method, url, header_params, body, post_params,
                                _request_timeout if _request_timeout is not None else request_timeout(self.timeout_s))


def api_client(pool_size: int = 64, timeout_s: float = DEFAULT_API_TIMEOUT_S,
               configuration: k8s.Configuration | None = None) -> k8s.ApiClient:
    """In a pod: its ServiceAccount; elsewhere: $KUBECONFIG (what kopf uses too), unless
    ``configuration`` is given. ``pool_size`` connections are kept: every job's thread
    shares this client (the default, 5 x cores, makes busy threads open and drop
    connections). Every call gives up after ``timeout_s`` without an answer."""
    if configuration is None:
        configuration = k8s.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
        except k8s_config.ConfigException:
            k8s_config.load_kube_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = pool_size
    # A read that timed out is not tried again underneath (urllib3's default tried it 3 more
    # times: 4 timeouts a call); with_retries decides. Refused connections still are.
    configuration.retries = urllib3.util.Retry(total=2, read=0, redirect=0, status=0, other=0)
    api = TimedApiClient(configuration)
    api.timeout_s = timeout_s
    # More threads than connections wait for one, instead of opening (a TLS
    # handshake on both sides) and then discarding an extra connection each.
    api.rest_client.pool_manager.connection_pool_kw["block"] = True
    return api


def with_retries(call: Callable[[], T], what: str, attempts: int = 6, first_delay_s: float = 0.5) -> T:
    """``call()``, again after a backoff (or the server's Retry-After) while the API
    server answers 429 or 5xx, or does not answer within the client's timeout: a busy
    server slows the operator down, never fails a job."""
    delay = first_delay_s
    for attempt in range(attempts):
        try:
            return call()
        except urllib3.exceptions.HTTPError as exc:  # no answer in time, or the connection dropped
            if attempt >= min(attempts, TIMEOUT_ATTEMPTS) - 1:
                raise
            log.info("%s: no answer from the API server (%s); again in %.1f s", what, type(exc).__name__, delay)
            time.sleep(delay * (1 + 0.2 * random.random()))
            delay = min(30.0, delay * 2)
        except ApiException as exc:
            if exc.status not in RETRY_STATUSES or attempt == attempts - 1:
                raise
            retry_after = (exc.headers or {}).get("Retry-After") if hasattr(exc, "headers") else None
            try:
                wait = float(retry_after) if retry_after else delay
            except ValueError:
                wait = delay
            log.info("%s: API server answered %s; again in %.1f s", what, exc.status, wait)
            time.sleep(min(30.0, wait) * (1 + 0.2 * random.random()))
            delay = min(30.0, delay * 2)
    raise AssertionError("unreachable")  # the loop returns or raises


def _pointer(key: str) -> str:
    return "/status/" + key.replace("~", "~0").replace("/", "~1")


def status_json_patch(changes: dict[str, Any], known: dict[str, Any] | None, uid: str,
                      expect: str | None = None) -> list[dict[str, Any]]:
    """A JSON patch (RFC 6902) that writes ``changes`` onto the status ``known`` the way a merge
    patch would (each changed top-level key set to its merged value; None removes it), and only to
    the object ``uid`` (a test op first; another object of the name fails the whole patch), and with
    ``expect`` only at that resourceVersion. ``known``: the status as last read ({}: the object had
    none, so it is added whole; None: not read, each key is added, which fails while the object has
    no status at all: ``VideoJobs`` then adds it whole)."""
    from .status import merged

    ops: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/uid", "value": uid}]
    if expect is not None:
        ops.append({"op": "test", "path": "/metadata/resourceVersion", "value": expect})
    target = merged(known or {}, changes)
    if known == {}:
        return [*ops, {"op": "add", "path": "/status", "value": target}]
    for key, value in changes.items():
        if value is None:
            if known is not None and key in known:  # (removing a key that is not there fails; merge ignores it)
                ops.append({"op": "remove", "path": _pointer(key)})
        else:
            ops.append({"op": "add", "path": _pointer(key), "value": target[key]})
    return ops


class VideoJobs:
    """get / list / patch-status of VideoJobs."""

    def __init__(self, api: k8s.ApiClient | None = None):
        self.api = k8s.CustomObjectsApi(api or api_client())

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            return with_retries(lambda: self.api.get_namespaced_custom_object(
                API_GROUP, API_VERSION, namespace, PLURAL, name), f"get {namespace}/{name}")
        except ApiException as exc:
            if exc.status == 404:
                raise Gone(f"{namespace}/{name}") from None
            raise

    def list(self, namespaces: list[str], page_size: int = LIST_PAGE_SIZE,
             reduce: Callable[[dict[str, Any]], Any] | None = None) -> list[Any]:
        """Every VideoJob of ``namespaces`` (all when empty), read in pages of ``page_size``:
        one unpaginated list of tens of thousands of kept jobs is a response the API server
        builds in one go and that can pass its request timeout. ``reduce``: what to keep of
        each job (None: nothing), applied page by page, so that one page of whole objects is
        held at a time, not all of them (30,000 kept jobs are ~900 MiB as Python objects)."""
        items: list[Any] = []
        for namespace in namespaces or [None]:
            items += self._pages(namespace, page_size, reduce)
        return items

    def _pages(self, namespace: str | None, page_size: int,
               reduce: Callable[[dict[str, Any]], Any] | None = None) -> list[Any]:
        where = namespace or "all namespaces"
        for _ in range(3):  # a continue token that expired (410) means: list again from the start
            items: list[Any] = []
            token: str | None = None
            try:
                while True:
                    kwargs: dict[str, Any] = {"limit": page_size}
                    if token:
                        kwargs["_continue"] = token
                    if namespace is None:
                        page = with_retries(lambda kw=kwargs: self.api.list_cluster_custom_object(
                            API_GROUP, API_VERSION, PLURAL, **kw), f"list {where}")
                    else:
                        page = with_retries(lambda kw=kwargs: self.api.list_namespaced_custom_object(
                            API_GROUP, API_VERSION, namespace, PLURAL, **kw), f"list {where}")
                    found = page.get("items", [])
                    if reduce is not None:
                        found = [kept for kept in map(reduce, found) if kept is not None]
                    items += found
                    token = (page.get("metadata") or {}).get("continue")
                    if not token:
                        return items
            except ApiException as exc:
                if exc.status != 410:
                    raise
                log.warning("listing VideoJobs in %s: the continue token expired; listing again", where)
        raise RuntimeError(f"could not list the VideoJobs of {where}: continue tokens kept expiring")

    def delete(self, namespace: str, name: str, uid: str) -> bool:
        """Delete the job if it is still the one of ``uid`` (a precondition: a job of the
        same name made since is not touched); False when it is gone or another one."""
        options = k8s.V1DeleteOptions(preconditions=k8s.V1Preconditions(uid=uid), propagation_policy="Background")
        try:
            with_retries(lambda: self.api.delete_namespaced_custom_object(
                API_GROUP, API_VERSION, namespace, PLURAL, name, body=options), f"delete {namespace}/{name}")
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    def patch_status(self, namespace: str, name: str, status: dict[str, Any],
                     expect: str | None = None, uid: str | None = None,
                     known: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write ``status`` (merge-patch semantics: dicts merge, None removes); with ``expect`` (a
        resourceVersion) only if unchanged since. ``uid``: only to that object, never to one made
        again under the name (Gone). The API server ignores a uid in a merge patch (measured on
        kube-apiserver 1.34, 2026-12-07), so with a uid the write is a JSON patch whose first op
        tests /metadata/uid; ``known``: the status as the caller last read it, which the JSON
        patch's ops are built against (``status_json_patch``)."""
        if uid is not None:
            return self._json_patch_status(namespace, name, status, known, uid, expect)
        body: dict[str, Any] = {"status": status}
        if expect is not None:
            body["metadata"] = {"resourceVersion": expect}
        try:
            return with_retries(lambda: self.api.patch_namespaced_custom_object_status(
                API_GROUP, API_VERSION, namespace, PLURAL, name, body), f"patch {namespace}/{name} status")
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict(f"{namespace}/{name} changed since resourceVersion {expect}") from None
            if exc.status == 404:
                raise Gone(f"{namespace}/{name}") from None
            raise

    def _json_patch_status(self, namespace: str, name: str, status: dict[str, Any], known: dict[str, Any] | None,
                           uid: str, expect: str | None) -> dict[str, Any]:
        for attempt in range(2):
            ops = status_json_patch(status, known, uid, expect)
            try:
                return with_retries(lambda: self.api.patch_namespaced_custom_object_status(
                    API_GROUP, API_VERSION, namespace, PLURAL, name, ops,
                    _content_type="application/json-patch+json"), f"patch {namespace}/{name} status")
            except ApiException as exc:
                if exc.status == 404:
                    raise Gone(f"{namespace}/{name}") from None
                if exc.status not in (409, 422):  # 422: an op failed (a test, or a path that is not there)
                    raise
            now = self.get(namespace, name)  # which precondition failed (Gone when the object is)
            if now["metadata"].get("uid") != uid:
                raise Gone(f"{namespace}/{name} (uid {uid}): another object of that name now")
            if known is None and not now.get("status") and attempt == 0:
                known = {}  # no status yet: added whole
                continue
            break
        raise Conflict(f"{namespace}/{name} changed since resourceVersion {expect}"
                       if expect is not None else f"{namespace}/{name}: its status changed since it was read")
