"""Local processes: start one in its own session, tell whether a recorded pid
still runs the same binary, stop it, poll until something is ready, pick free
loopback ports."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from .common import ClusterError, log


def pid_alive(pid: int, exe: str | None = None) -> bool:
    """True if pid runs (not a zombie) and, when exe is given, runs that binary."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    # state is the field after the parenthesised comm, which may contain spaces
    if stat[stat.rfind(")") + 2 :].startswith(("Z", "X")):
        return False
    if exe:
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode()
        except OSError:
            return False
        if os.path.basename(argv0) != os.path.basename(exe):
            return False
    return True


def stop_pid(pid: int, exe: str | None, name: str, grace: float = 15.0) -> None:
    if not pid_alive(pid, exe):
        return
    log(f"stopping {name} (pid {pid})")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap if it is our child
        if not pid_alive(pid, exe):
            return
        time.sleep(0.1)
    log(f"{name} (pid {pid}) ignored SIGTERM for {grace:.0f}s; sending SIGKILL")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and pid_alive(pid, exe):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)


def start_process(name: str, argv: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as fh:
        fh.write(f"\n===== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
        fh.flush()
        # New session: the process outlives this script and is not hit by the
        # terminal's Ctrl-C; `down` stops it by pid.
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(log_path.parent),
        )
    log(f"started {name} (pid {proc.pid}), log: {log_path}")
    return proc


def tail(path: Path, lines: int = 30) -> str:
    try:
        data = path.read_bytes()[-32768:].decode(errors="replace").splitlines()
    except FileNotFoundError:
        return f"(no log at {path})"
    return "\n".join(data[-lines:])


def wait_until(what: str, check, timeout: float, proc: subprocess.Popen | None = None,
               log_path: Path | None = None, interval: float = 0.25):
    """Poll check() until it returns a truthy value; fail with what we waited for."""
    deadline = time.monotonic() + timeout
    last_err = None
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # noqa: BLE001 - reported below
            last_err = exc
        if proc is not None and proc.poll() is not None:
            raise ClusterError(
                f"{what}: the process exited with code {proc.returncode} while we waited"
                + (f"\n--- last lines of {log_path} ---\n{tail(log_path)}" if log_path else "")
            )
        if time.monotonic() > deadline:
            raise ClusterError(
                f"timed out after {timeout:.0f}s waiting for {what}"
                + (f" (last error: {last_err})" if last_err else "")
                + (f"\n--- last lines of {log_path} ---\n{tail(log_path)}" if log_path else "")
            )
        time.sleep(interval)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)
