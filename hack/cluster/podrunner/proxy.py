"""The apiserver's ClusterIP inside every pod: a TCP proxy from <ClusterIP>:<port>, bound
inside each pod's network namespace, to the real apiserver address from the kubeconfig.

The listening socket is made by a short-lived thread that first joins the pod's network
namespace (setns affects only the calling thread), so the runner itself stays in the
host's namespace and accepts and relays every connection from there."""
from __future__ import annotations

import ctypes
import os
import selectors
import socket
import threading

from .util import debug, warn

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def listen_in_netns(netns_path: str, host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to host:port inside the network namespace at netns_path."""
    result: dict = {}

    def work():
        try:
            fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({netns_path}): {os.strerror(err)}")
            finally:
                os.close(fd)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.listen(128)
            s.setblocking(False)
            result["sock"] = s
        except BaseException as exc:  # reported to the caller
            result["error"] = exc

    t = threading.Thread(target=work, name="setns-listen", daemon=True)
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["sock"]


def pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends, then half-close ``dst``."""
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class ApiProxy:
    """Accepts on every registered listener and relays each connection to upstream."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="api-proxy", daemon=True)
        self._thread.start()

    def add(self, key: str, sock: socket.socket) -> None:
        with self._lock:
            self._sel.register(sock, selectors.EVENT_READ, key)
        os.write(self._wake_w, b"x")

    def remove(self, sock: socket.socket) -> None:
        with self._lock:
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass
        sock.close()
        os.write(self._wake_w, b"x")

    def close(self) -> None:
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(timeout=1.0):
                if key.data is None:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                try:
                    conn, _ = key.fileobj.accept()
                except (BlockingIOError, OSError):
                    continue
                threading.Thread(target=self._relay, args=(conn, key.data), name="api-relay",
                                 daemon=True).start()

    def _relay(self, conn: socket.socket, who: str) -> None:
        conn.setblocking(True)
        try:
            up = socket.create_connection(self.upstream, timeout=10)
        except OSError as exc:
            warn("apiserver proxy: upstream unreachable", pod=who, upstream=f"{self.upstream}", error=str(exc))
            conn.close()
            return
        up.settimeout(None)
        debug("apiserver proxy: connection", pod=who)
        t = threading.Thread(target=pump, args=(up, conn), daemon=True)
        t.start()
        pump(conn, up)
        t.join()
        conn.close()
        up.close()
