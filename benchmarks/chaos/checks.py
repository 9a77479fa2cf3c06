"""The checks after the soak, from what the Observer kept and what Ray and the
operator hold at the end. Each returns (figures, problems): problems are
sentences that name the job, the submission or the group."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from .world import TERMINAL, wait

# A deleted job's driver may take this long to stop (Ray's SIGTERM-to-SIGKILL wait,
# RAY_JOB_STOP_WAIT_TIME_S=10, plus the teardown) once the job is gone.
LINGER_S = 45.0
GAUGE = re.compile(r'^(videojob_gpus_(?:allocated|idle|free))\{gpu_class="([^"]+)"\} ([0-9.e+-]+)$', re.M)


def outcomes(jobs: dict, names: list[str], deleted: dict, outputs: Path) -> tuple[dict, list[str]]:
    """Every job not deleted Succeeded, with its mp4 and result JSON (lost otherwise);
    ``outputs``: the output root's directory of the soak's namespace."""
    by_name = {j["name"]: j for j in jobs.values()}
    deleted_names = {d["name"] for d in deleted.values()}
    problems, lost = [], []
    for name in names:
        if name in deleted_names:
            continue
        job = by_name.get(name) or {}
        status = job.get("status") or {}
        directory = outputs / "videos" / name
        why = None
        if job.get("phase") != "Succeeded":
            why = f"phase {job.get('phase')}: {status.get('message', '')[:300]}"
        elif not (directory / f"{name}.mp4").is_file() or (directory / f"{name}.mp4").stat().st_size == 0:
            why = f"Succeeded but no mp4 in {directory}"
        else:
            try:
                json.loads((directory / f"{name}.json").read_text())
            except (OSError, ValueError) as exc:
                why = f"Succeeded but no readable result JSON: {exc}"
        if why:
            lost.append(name)
            attempts = [(a.get("result"), a.get("reason")) for a in status.get("attempts") or []]
            problems.append(f"lost {name}: {why} (attempts {attempts})")
    return {"lost": len(lost), "lostJobs": lost}, problems


def _interval(sub: dict, now: float) -> tuple[float, float] | None:
    """When a driver certainly ran: start .. end (or the last time it was seen live)."""
    if not sub.get("start"):
        return None
    end = sub.get("end") or sub.get("lastSeenLive") or sub.get("lastSeen") or now
    return sub["start"], end


def drivers(submissions: dict, jobs: dict, deleted: dict) -> tuple[dict, list[str]]:
    """No two drivers of one job overlapped; every submission is in its job's attempts;
    no driver of a deleted job started after its delete or is still running."""
    now = time.time()
    problems, duplicated, unrecorded = [], set(), []
    by_uid: dict[str, list[tuple[str, dict]]] = {}
    for sid, sub in submissions.items():
        if sub.get("uid"):
            by_uid.setdefault(sub["uid"], []).append((sid, sub))
    for uid, subs in by_uid.items():
        name = (jobs.get(uid) or {}).get("name") or subs[0][1].get("name")
        spans = sorted((span, sid) for sid, sub in subs if (span := _interval(sub, now)))
        for (a, sid_a), (b, sid_b) in zip(spans, spans[1:]):
            if b[0] < a[1]:
                duplicated.add(uid)
                problems.append(f"duplicated {name}: driver {sid_b} started {a[1] - b[0]:.1f}s before {sid_a} "
                                f"ended (statuses {submissions[sid_a]['statuses']} / {submissions[sid_b]['statuses']})")
        recorded = (jobs.get(uid) or {}).get("attempts", set())
        for sid, _ in subs:
            if sid not in recorded:
                unrecorded.append(sid)
                problems.append(f"unrecorded submission {sid} of {name}: not in status.attempts "
                                f"({sorted(recorded)})")
    late = []
    for uid, d in deleted.items():
        gone = (jobs.get(uid) or {}).get("goneAt")
        for sid, sub in by_uid.get(uid, []):
            if gone and (sub.get("start") or sub["firstSeen"]) > gone:
                late.append(sid)
                problems.append(f"left running: driver {sid} of deleted {d['name']} started "
                                f"{(sub.get('start') or sub['firstSeen']) - gone:.1f}s after the job was gone")
            elif gone and sub.get("lastSeenLive", 0) > gone + LINGER_S:
                late.append(sid)
                problems.append(f"left running: driver {sid} of deleted {d['name']} was still running "
                                f"{sub['lastSeenLive'] - gone:.0f}s after the job was gone")
    return {"duplicated": len(duplicated), "duplicatedJobs": sorted(jobs.get(u, {}).get("name", u)
                                                                    for u in duplicated),
            "unrecordedSubmissions": len(unrecorded), "driversLeftAfterDelete": len(late)}, problems


def ray_drivers_alive(ray) -> list[str]:
    """Drivers (job or teardown) Ray still runs."""
    return [j.submission_id for j in ray.jobs() if j.status not in TERMINAL]


def held_by_ray(ray) -> dict[str, int]:
    """Live vj- placement groups -> bundles (GPUs or CPU ranks) each holds."""
    reply = ray._json("GET", "/api/v0/placement_groups", query={"limit": 10000, "detail": "true"})
    rows = ((reply or {}).get("data", {}).get("result", {}) or {}).get("result", [])
    return {r["name"]: len(r.get("bundles") or []) for r in rows
            if str(r.get("name") or "").startswith("vj-") and r.get("state") != "REMOVED"}


def books(metrics_text: str) -> dict[str, dict[str, float]]:
    """The operator's gauges per class: {"allocated": {class: n}, "idle": ..., "free": ...}."""
    out: dict[str, dict[str, float]] = {"allocated": {}, "idle": {}, "free": {}}
    for gauge, gpu_class, value in GAUGE.findall(metrics_text):
        out[gauge.rsplit("_", 1)[1]][gpu_class] = float(value)
    return out


def books_match(operator, ray, timeout: float) -> tuple[dict, list[str]]:
    """Once nothing runs: the books' GPUs allocated equal the bundles of the groups Ray
    holds, and all of them are idle (warm) ones. Polled: the sweeper may be mid-way."""
    seen: dict = {}

    def equal() -> bool:
        seen["books"] = books(operator.metrics())
        seen["ray"] = held_by_ray(ray)
        allocated = sum(seen["books"]["allocated"].values())
        return allocated == sum(seen["ray"].values()) and allocated == sum(seen["books"]["idle"].values())

    try:
        wait("the operator's books to equal what Ray holds", equal, timeout, interval=2)
        return {"booksMatch": True, "booksAtRest": seen["books"], "rayHeldAtRest": seen["ray"]}, []
    except TimeoutError as exc:
        return ({"booksMatch": False, "booksAtRest": seen.get("books"), "rayHeldAtRest": seen.get("ray")},
                [f"books differ from Ray: {exc}; books {seen.get('books')}, Ray holds {seen.get('ray')}"])


def nothing_left(operator, ray, timeout: float) -> tuple[dict, list[str]]:
    """After warm groups expire: no vj- actor, placement group or live driver in Ray, and the books hold none."""
    seen: dict = {}

    def empty() -> bool:
        seen["actors"] = sorted(a["name"] for a in ray.actors("vj-"))
        seen["groups"] = sorted(held_by_ray(ray))
        seen["drivers"] = ray_drivers_alive(ray)
        seen["allocated"] = sum(books(operator.metrics())["allocated"].values())
        return not (seen["actors"] or seen["groups"] or seen["drivers"] or seen["allocated"])

    try:
        wait("no actor, placement group or driver left and the books at 0", empty, timeout, interval=2)
        return {"leftOver": 0, "leftOverDetail": {}}, []
    except TimeoutError:
        left = len(seen.get("actors", [])) + len(seen.get("groups", [])) + len(seen.get("drivers", []))
        detail = {k: seen.get(k) for k in ("actors", "groups", "drivers", "allocated")}
        return ({"leftOver": left + (1 if seen.get("allocated") else 0), "leftOverDetail": detail},
                [f"left over after {timeout:.0f}s (warm TTL past): {detail}"])
