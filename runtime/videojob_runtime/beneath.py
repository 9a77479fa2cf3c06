"""Writing inside a checked directory without following links made after the check.

A job's output directory is resolved and contained once, by its driver
(``locations.resolve``); the ranks write the mp4 and the checkpoints minutes
later. Meanwhile anyone who can write the same volume (another tenant's pod
that mounts the claim) could swap a directory on the way for a symbolic link
to another namespace's files, and a write by path would follow it (issue 36).

So a write opens its directory again from the trusted root, one component at
a time with ``O_DIRECTORY | O_NOFOLLOW`` (what openat2's
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` does in one call, which Python does
not wrap), and does every file operation relative to that descriptor: new
files with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under unguessable names, renames
and unlinks by ``dir_fd``. A link met on the way, or a file where a directory
belongs, is refused with a JobFailure naming the spec field. The root itself
is the admin's (a kind root or a claim's mount, with the namespace's own
directory under it, both checked by ``locations``) and is opened as it is.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path, PurePosixPath

from .errors import JobFailure

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class Beneath:
    """A directory opened from ``root`` through ``relative`` without following links.

    ``create``: make missing directories on the way (mode 0o777 less the umask).
    ``field``/``stage``: what a refusal names (the spec field the location came from)."""

    def __init__(self, root: str | Path, relative: str | Path = ".", *, create: bool = False,
                 field: str = "spec.output.uri", stage: str = "write"):
        self.root, self.field, self.stage = Path(root), field, stage
        parts = [p for p in PurePosixPath(relative).parts if p not in ("", ".")]
        if PurePosixPath(relative).is_absolute() or ".." in parts:
            raise ValueError(f"Beneath: {relative!r} must be a relative path without '..'")
        self.relative = PurePosixPath(*parts) if parts else PurePosixPath(".")
        self.fd = -1  # (set first: __del__ must never close a number some other file now has)
        self.fd = self._open_root(create)
        try:
            for part in parts:
                child = self._step(self.fd, part, create)
                os.close(self.fd)
                self.fd = child
        except BaseException:
            self.close()
            raise

    @classmethod
    def at(cls, directory: str | Path, root: str | Path | None, **kwargs) -> Beneath:
        """``directory`` opened beneath ``root`` (None: the directory itself is the root, a
        caller's own location with no tenant to fear: `videojob run`, tests)."""
        directory = Path(directory)
        if root is None:
            if kwargs.get("create"):
                directory.mkdir(parents=True, exist_ok=True)
            return cls(directory, ".", **kwargs)
        try:
            relative = directory.relative_to(root)
        except ValueError:
            raise JobFailure(f"{kwargs.get('field', 'spec.output.uri')}: {directory} is not under its checked "
                             f"directory {root}", stage=kwargs.get("stage", "write"),
                             field=kwargs.get("field", "spec.output.uri")) from None
        return cls(root, relative, **kwargs)

    @property
    def path(self) -> Path:
        """The directory's name (for messages and results; never opened again by it)."""
        return self.root / self.relative

    def _refuse(self, why: str) -> JobFailure:
        return JobFailure(f"{self.field}: {self.path}: {why}; nothing was written through it (a directory on the "
                          "way was replaced after the job's location was checked)", stage=self.stage,
                          field=self.field, root=str(self.root))

    def _open_root(self, create: bool) -> int:
        try:
            if create:
                self.root.mkdir(parents=True, exist_ok=True)
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:  # nothing there yet: the caller's to decide (no checkpoints, say)
            raise
        except OSError as exc:
            raise JobFailure(f"{self.field}: its directory {self.root} cannot be opened ({exc.strerror})",
                             stage=self.stage, field=self.field) from None

    def _step(self, fd: int, part: str, create: bool) -> int:
        """``part`` in the directory ``fd``, opened (made first when missing and ``create``)."""
        for _ in range(2):
            try:
                return os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:  # made meanwhile (another rank): open it again
                    pass
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise self._refuse(f"{part!r} on the way is a symbolic link or not a directory") from None
                raise
        raise self._refuse(f"{part!r} on the way could not be made")

    # -- the directory's files, all relative to self.fd --------------------------------------

    def new_file(self, final_name: str, mode: int = 0o666) -> tuple[str, int]:
        """A new empty file beside ``final_name`` under an unguessable name, opened for writing
        (O_EXCL | O_NOFOLLOW: nothing placed there beforehand is written through); ``mode``
        less the umask."""
        _plain(final_name)
        for _ in range(8):
            name = f".{final_name}.{secrets.token_hex(8)}.partial"
            try:
                return name, os.open(name, _NEW_FILE_FLAGS, mode, dir_fd=self.fd)
            except FileExistsError:
                continue
        raise self._refuse(f"no new file name for {final_name} could be made")

    def write_new(self, final_name: str, data: bytes, *, fsync: bool = False, mode: int = 0o666) -> str:
        """``data`` into a new partial file (``new_file``); returns its name (rename it into place)."""
        name, fd = self.new_file(final_name, mode)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            self.unlink(name)
            raise
        return name

    def replace(self, name: str, final_name: str) -> None:
        """Rename ``name`` over ``final_name`` in this directory (a link at ``final_name`` is replaced, not followed)."""
        os.replace(_plain(name), _plain(final_name), src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        try:
            os.unlink(_plain(name), dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def read(self, name: str) -> bytes:
        """A regular file's bytes (a link or anything else is refused: OSError)."""
        fd = os.open(_plain(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise OSError(f"{name} is not a regular file")
            return f.read()

    def rmtree(self, name: str) -> None:
        """Remove a directory in this one and what it holds, links not followed."""
        import shutil

        shutil.rmtree(_plain(name), dir_fd=self.fd, ignore_errors=True)

    def rmdir(self, name: str) -> bool:
        try:
            os.rmdir(_plain(name), dir_fd=self.fd)
            return True
        except OSError:
            return False

    def fsync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Beneath:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _plain(name: str) -> str:
    """A single path component: what every dir_fd operation here takes."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"Beneath: {name!r} is not a plain file name")
    return name

