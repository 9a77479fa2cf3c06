"""The operator's one way to reach Ray: its Jobs and State HTTP APIs.

The operator image holds neither ray nor torch (DESIGN.md, "In a cluster"),
so everything it asks of Ray goes through the head's dashboard port:

  POST   /api/jobs/                 submit one driver per attempt (idempotent by submission id)
  GET    /api/jobs/{id}             status (404: never submitted)
  GET    /api/jobs/{id}/logs        the driver's output (its JSON progress and result lines), at its end
  GET    /api/v0/logs/file          the last lines of a running driver's output (its progress)
  POST   /api/jobs/{id}/stop        SIGTERM to the driver (it cancels and tears its group down)
  DELETE /api/jobs/{id}             forget a finished job
  GET    /api/version               reachability and auth check
  GET    /api/v0/actors, /api/v0/placement_groups   what exists (State API)

``RayClient`` is the interface the controller uses; ``HttpRayClient`` speaks
HTTP (bearer token, timeouts, retries with backoff on connection errors);
tests and the load benchmark can pass any object with the same methods.
"""

from __future__ import annotations

import json
import logging
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("videojob.raycluster")

TERMINAL = ("STOPPED", "SUCCEEDED", "FAILED")
DRIVER_LOG_FILE = "job-driver-{}.log"  # a Ray job's driver log in its node's log directory (Ray's naming)


class RayUnavailable(RuntimeError):
    """Ray could not be reached (after retries), or answered with a server error."""


class RayAuthError(RayUnavailable):
    """Ray refused the token (401/403): the token file is missing or wrong."""


class RayRefused(RuntimeError):
    """Ray (or what answers at its address) refused a request for good: a 4xx other
    than 401/403 (auth), 408 and 429 (later). Sending it again gets the same answer."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


# 4xx answers that mean "later", not "never".
RETRY_LATER = {408, 429}


@dataclass(frozen=True)
class RayJob:
    """One Ray job (a driver) as the Jobs API reports it."""

    submission_id: str
    status: str  # PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED
    message: str = ""
    error_type: str | None = None
    start_time_ms: int | None = None
    end_time_ms: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    # The Ray node the driver runs on (None while PENDING): where its entrypoint resources put it.
    driver_node_id: str | None = None
    # The entrypoint's exit status once it ended on its own (None: it did not, or this Ray does not say).
    driver_exit_code: int | None = None
    entrypoint: str = ""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RayJob":
        return cls(submission_id=data.get("submission_id") or data.get("job_id") or "",
                   status=str(data.get("status", "")), message=data.get("message") or "",
                   error_type=data.get("error_type"), start_time_ms=data.get("start_time"),
                   end_time_ms=data.get("end_time"), metadata=data.get("metadata") or {},
                   driver_node_id=data.get("driver_node_id") or None,
                   driver_exit_code=_int_or_none(data.get("driver_exit_code")),
                   entrypoint=data.get("entrypoint") or "")


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


class RayClient(Protocol):
    """What the controller needs of Ray."""

    def version(self) -> dict[str, Any]: ...

    def submit(self, submission_id: str, entrypoint: str, *, runtime_env: dict[str, Any] | None = None,
               metadata: dict[str, str] | None = None, entrypoint_num_cpus: float = 0,
               entrypoint_resources: dict[str, float] | None = None) -> bool: ...

    def job(self, submission_id: str) -> RayJob | None: ...

    def logs(self, submission_id: str) -> str: ...

    def jobs(self) -> list[RayJob]: ...

    def log_tail(self, submission_id: str, lines: int, node_id: str | None = None) -> str:
        """The last ``lines`` lines of the driver's log (progress while it runs; the whole
        log, ``logs``, is read once at its end); ``node_id``: the driver's node (its RayJob's)."""
        ...

    def stop(self, submission_id: str) -> bool: ...

    def delete(self, submission_id: str) -> bool: ...

    def actors(self, name_prefix: str = "", alive_only: bool = True,
               where: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Actors whose name starts with ``name_prefix``; ``where``: fields that must equal
        these values, filtered by Ray (one group's rows, not the cluster's)."""
        ...

    def placement_groups(self, name_prefix: str = "", live_only: bool = True,
                         where: dict[str, str] | None = None) -> list[dict[str, Any]]: ...


class HttpRayClient:
    """``RayClient`` over HTTP. ``address`` is the dashboard URL (http://head:8265)."""

    def __init__(self, address: str, token: str | None = None, timeout_s: float = 10.0, retries: int = 4,
                 backoff_s: float = 0.5):
        if not address.startswith(("http://", "https://")):
            address = "http://" + address
        self.address = address.rstrip("/")
        self.token = token
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s

    # -- plumbing --------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any = None, query: dict[str, Any] | None = None,
                 ok_missing: bool = False) -> tuple[int, str]:
        """(status, text). Connection errors are retried with jittered backoff;
        4xx are answers, not retried; 401/403 raise RayAuthError."""
        url = self.address + path
        if query:
            url += "?" + urllib.parse.urlencode(query, doseq=True)
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(url, data=data, method=method, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - http(s) only
                    return response.status, response.read().decode(errors="replace")
            except urllib.error.HTTPError as exc:
                text = exc.read().decode(errors="replace")
                if exc.code in (401, 403):
                    raise RayAuthError(f"Ray at {self.address} refused the token ({exc.code}): check the "
                                       "token file (settings: VIDEOJOB_RAY_TOKEN_FILE)") from None
                if exc.code == 404 and ok_missing:
                    return 404, text
                if exc.code < 500:
                    return exc.code, text
                last = RayUnavailable(f"{method} {path}: Ray answered {exc.code}: {text[-300:]}")
                if exc.code == 500:  # an application error ("already exists" and the like): an answer
                    return exc.code, text
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
                last = exc
            if attempt < self.retries:
                time.sleep(self.backoff_s * (2**attempt) * (0.5 + random.random()))
        raise RayUnavailable(f"Ray at {self.address} is unreachable ({method} {path}): {last}") from None

    def _json(self, method: str, path: str, **kwargs) -> Any:
        status, text = self._request(method, path, **kwargs)
        if status >= 400:
            raise RayUnavailable(f"{method} {path}: Ray answered {status}: {text[-300:]}")
        return json.loads(text) if text else None

    # -- Jobs API --------------------------------------------------------------

    def version(self) -> dict[str, Any]:
        return self._json("GET", "/api/version")

    def submit(self, submission_id: str, entrypoint: str, *, runtime_env: dict[str, Any] | None = None,
               metadata: dict[str, str] | None = None, entrypoint_num_cpus: float = 0,
               entrypoint_resources: dict[str, float] | None = None) -> bool:
        """Submit a driver; True if this call created it, False if it already
        existed (a duplicate POST answers 500 "...already exists": adopt it)."""
        body: dict[str, Any] = {"entrypoint": entrypoint, "submission_id": submission_id,
                                "entrypoint_num_cpus": entrypoint_num_cpus}
        if runtime_env:
            body["runtime_env"] = runtime_env
        if metadata:
            body["metadata"] = metadata
        if entrypoint_resources:
            body["entrypoint_resources"] = entrypoint_resources
        status, text = self._request("POST", "/api/jobs/", body=body)
        if status == 200:
            return True
        if "already exists" in text:
            return False
        if 400 <= status < 500 and status not in RETRY_LATER:
            raise RayRefused(f"submitting {submission_id} to {self.address}: it answered {status}: "
                             f"{text.strip()[-400:] or '(no body)'}", status)
        raise RayUnavailable(f"submitting {submission_id}: Ray answered {status}: {text[-500:]}")

    def job(self, submission_id: str) -> RayJob | None:
        status, text = self._request("GET", f"/api/jobs/{urllib.parse.quote(submission_id)}", ok_missing=True)
        if status == 404:
            return None
        if status >= 400:
            raise RayUnavailable(f"job {submission_id}: Ray answered {status}: {text[-300:]}")
        return RayJob.from_json(json.loads(text))

    def logs(self, submission_id: str) -> str:
        status, text = self._request("GET", f"/api/jobs/{urllib.parse.quote(submission_id)}/logs", ok_missing=True)
        if status == 404:
            return ""
        if status >= 400:
            raise RayUnavailable(f"logs of {submission_id}: Ray answered {status}: {text[-300:]}")
        return json.loads(text).get("logs", "")

    def log_tail(self, submission_id: str, lines: int, node_id: str | None = None) -> str:
        """The last ``lines`` lines, read by the log agent of the driver's node from the
        end of the file (``GET /api/v0/logs/file?node_id=..&filename=job-driver-<id>.log&lines=..``):
        a poll costs the same at step 5 and at step 5,000. The file is named, not the
        submission id: for a submission id Ray 2.60 reads every job's record from the GCS
        on each request (``_resolve_job_filename``), so with 500 jobs a tail took 25 s
        (measured, ``benchmarks/ray_polling.py``). The name is Ray's own
        (``JOB_LOGS_PATH_TEMPLATE``). Without the node, or where Ray cannot serve it (no
        file yet), the tail of the whole log."""
        if node_id:
            status, text = self._request("GET", "/api/v0/logs/file", ok_missing=True,
                                         query={"node_id": node_id, "filename": DRIVER_LOG_FILE.format(submission_id),
                                                "lines": int(lines)})
            if status == 200:
                return text
        return "\n".join(self.logs(submission_id).splitlines()[-int(lines):])

    def jobs(self) -> list[RayJob]:
        """Every job (driver) Ray knows, with its metadata."""
        return [RayJob.from_json(item) for item in (self._json("GET", "/api/jobs/") or [])]

    def stop(self, submission_id: str) -> bool:
        status, _ = self._request("POST", f"/api/jobs/{urllib.parse.quote(submission_id)}/stop", ok_missing=True)
        return status == 200

    def delete(self, submission_id: str) -> bool:
        status, _ = self._request("DELETE", f"/api/jobs/{urllib.parse.quote(submission_id)}", ok_missing=True)
        return status == 200

    # -- State API -------------------------------------------------------------

    def _list(self, kind: str, filters: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
        query: dict[str, Any] = {"limit": 10000, "detail": "false",
                                 "filter_keys": [f[0] for f in filters],
                                 "filter_predicates": [f[1] for f in filters],
                                 "filter_values": [f[2] for f in filters]}
        reply = self._json("GET", f"/api/v0/{kind}", query=query)
        data = (reply or {}).get("data", {}).get("result", {})
        return list(data.get("result", [])) if isinstance(data, dict) else list(data or [])

    def actors(self, name_prefix: str = "", alive_only: bool = True,
               where: dict[str, str] | None = None) -> list[dict[str, Any]]:
        filters = [("state", "=", "ALIVE")] if alive_only else []
        rows = self._list("actors", filters + [(k, "=", v) for k, v in (where or {}).items()])
        return [r for r in rows if str(r.get("name") or "").startswith(name_prefix)]

    def placement_groups(self, name_prefix: str = "", live_only: bool = True,
                         where: dict[str, str] | None = None) -> list[dict[str, Any]]:
        rows = self._list("placement_groups", [(k, "=", v) for k, v in (where or {}).items()])
        if live_only:
            rows = [r for r in rows if r.get("state") != "REMOVED"]
        return [r for r in rows if str(r.get("name") or "").startswith(name_prefix)]
