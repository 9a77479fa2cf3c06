"""The per-container shim and the container's first program (stdlib only).

    ip netns exec <netns> python -I containerinit.py SPEC.json

The shim (this process, inside the pod's network namespace, where `ip netns exec` has
bind-mounted the pod's hosts and resolv.conf over /etc) makes a new PID and UTS
namespace and forks. The child is pid 1 there: it makes its own mount namespace,
mounts its own /proc, sets the
container up and execs the container's command, which so becomes pid 1 (signals
without a handler are ignored, as in a container; when it dies the kernel ends every
other process of the container). The shim writes the child's host pid, waits for it
and records its exit code (128+n for signal n) in the exit file -- also when the
runner that started it is gone -- and exits with that code. If the shim is killed,
the container gets SIGKILL (parent-death signal).

SPEC: hostname; unmask [{path, upper, work}] (overlays that make host dirs on the way to
the image's install traversable for a non-root user); mounts [{source, target,
readOnly, recursive, file}] applied in order
(bind mounts in the container's own mount namespace); nofile (RLIMIT_NOFILE, raised
while still root; only to the hard limit where root lacks CAP_SYS_RESOURCE); uid, gid,
groups; cwd; argv; env; files: pid (the child's host pid), started (written just
before exec), error (the reason when setup or exec fails, exit code 128), exit."""
import ctypes
import json
import os
import resource
import signal
import socket
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWPID = 0x00020000, 0x04000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags):
    _check(_libc.mount(source.encode() if source else None, target.encode(),
                       fstype.encode() if fstype else None, flags, None), f"mount {source} -> {target}")


def mount_bind(source, target, recursive, read_only):
    _mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    if read_only:
        _mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | (MS_REC if recursive else 0))


def ensure_target(target, is_file):
    if is_file:
        os.makedirs(os.path.dirname(target) or "/", exist_ok=True)
        if not os.path.exists(target):
            open(target, "a").close()
    else:
        os.makedirs(target, exist_ok=True)


def init(spec, err_fd, started_fd):
    """pid 1 of the new PID namespace: set the container up, then exec its command."""
    def fail(message, code=128):
        os.write(err_fd, message.encode(errors="replace"))
        os._exit(code)

    try:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        # Its own mount namespace: the shim keeps seeing the state dir (mounts over /tmp).
        _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        socket.sethostname(spec["hostname"])
        for u in spec.get("unmask") or []:
            # A host dir the container's user could not enter (e.g. /root on the way to the
            # interpreter): an overlay whose fresh upper dir carries a traversable mode.
            opts = f"lowerdir={u['path']},upperdir={u['upper']},workdir={u['work']}"
            try:
                _check(_libc.mount(b"overlay", u["path"].encode(), b"overlay", 0, opts.encode()),
                       f"overlay on {u['path']}")
            except OSError as exc:
                sys.stderr.write(f"podrunner: {exc}: {u['path']} stays closed to uid {spec['uid']}\n")
        # Every source is opened before any mount: a mount over /tmp would hide a state dir in /tmp.
        sources = [os.open(m["source"], os.O_PATH | os.O_CLOEXEC) for m in spec["mounts"]]
        for m, fd in zip(spec["mounts"], sources):
            ensure_target(m["target"], m.get("file", False))
            mount_bind(f"/proc/self/fd/{fd}", m["target"], m.get("recursive", False), m.get("readOnly", False))
        for fd in sources:
            os.close(fd)
        nofile = spec.get("nofile")
        if nofile:
            try:
                with open("/proc/sys/fs/nr_open") as fh:
                    nofile = min(nofile, int(fh.read()))
            except OSError:
                pass
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
            except (ValueError, OSError):
                hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except OSError as exc:
        fail(f"container setup failed: {exc}")
    try:
        os.setgroups(spec.get("groups") or [])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
    except OSError as exc:
        fail(f"setting uid {spec['uid']} gid {spec['gid']} groups {spec.get('groups')}: {exc}")
    try:
        os.chdir(spec.get("cwd") or "/")
    except OSError as exc:
        fail(f"chdir to working directory {spec.get('cwd')!r}: {exc}")
    argv, env = spec["argv"], spec["env"]
    if not argv:
        fail("no command specified (the container has no command/args and its image map entry "
             "gives no entrypoint/cmd)")
    # Python ignores SIGPIPE and SIGXFSZ, and an ignored signal stays ignored across exec.
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    os.write(started_fd, b"ok")
    try:
        os.execvpe(argv[0], argv, env)
    except FileNotFoundError:
        fail(f'exec: "{argv[0]}": executable file not found in $PATH' if "/" not in argv[0]
             else f'exec: "{argv[0]}": no such file or directory')
    except OSError as exc:
        fail(f'exec: "{argv[0]}": {exc.strerror}')


def main():
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    files = spec["files"]
    err_fd = os.open(files["error"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    started_fd = os.open(files["started"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    # The shim outlives nothing it should not: terminal signals do not stop it, the runner
    # signals the container's pid 1 itself.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    try:
        _check(_libc.unshare(CLONE_NEWPID | CLONE_NEWUTS), "unshare")
    except OSError as exc:
        os.write(err_fd, f"container setup failed: {exc}".encode())
        sys.exit(128)
    pid = os.fork()
    if pid == 0:
        try:
            init(spec, err_fd, started_fd)
        finally:
            os._exit(128)
    os.close(started_fd)
    tmp = files["pid"] + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(str(pid))
    os.replace(tmp, files["pid"])
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            status = 137 << 8
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    code = 128 - code if code < 0 else code
    tmp = files["exit"] + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(str(code))
    os.replace(tmp, files["exit"])
    sys.exit(code)


if __name__ == "__main__":
    main()
