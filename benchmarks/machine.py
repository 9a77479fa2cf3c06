"""Describe the machine a benchmark ran on (recorded next to every result)."""

from __future__ import annotations

import os
import platform
import sys
from datetime import datetime, timezone


def describe() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
            mem_gib = round(kib / 1024**2, 1)
    except (OSError, StopIteration):
        pass
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memoryGiB": mem_gib,
        "python": sys.version.split()[0],
        "gpu": None,
    }
