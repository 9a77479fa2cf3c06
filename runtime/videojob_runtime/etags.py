"""What a cached S3 download is checked against before it is used (issue 36, 11).

A cached file is used only when its bytes are the object's as the store describes it:
its size, and its ETag, which is the MD5 of the bytes for an object uploaded in one
part and, for a multipart upload, "<MD5 of the parts' MD5s>-N": that one depends on the
part size the uploader chose, so the usual ones are tried (boto3's and the AWS CLI's
8 MiB, the size / N rounded up to a MiB, this runtime's own VIDEOJOB_S3_PART_BYTES,
other common tools' sizes), all in one read of the file, then the store's own answer
for part 1 (a HEAD with partNumber=1, where the store gives it). A file that matches
none is fetched again. Hashing a model of many GB takes seconds to minutes of one
core, so a verified file is remembered in this process (``_VERIFIED``), keyed by its
path and stat (inode, device, size, mtime, ctime): it is hashed once per process unless
it changes. A write to the file always moves its ctime (no one, a tenant included, can
set a ctime back), but only to the filesystem's clock tick: a file is remembered only
when its last change is more than SETTLED_S old when hashing starts, so a write after
the check cannot land in the same tick as the change the key saw (a file this process
just fetched is hashed at its next use, once). A model's directory holds nothing but its
listing's files: anything else found there (planted, or a killed download's) is removed.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import time
from pathlib import Path
from typing import Callable

CHUNK = 1024 * 1024

MIB = 2**20
COMMON_PART_BYTES = (8 * MIB, 5 * MIB, 10 * MIB, 15 * MIB, 16 * MIB, 50 * MIB, 64 * MIB, 100 * MIB)
SETTLED_S = 2.0
_VERIFIED: dict[tuple, str] = {}  # stat key -> the ETag the file's bytes were found to match
_VERIFIED_MAX = 65536
_MULTIPART = re.compile(r"^[0-9a-f]{32}-([1-9][0-9]{0,4})\Z")
_SINGLE = re.compile(r"^[0-9a-f]{32}\Z")


def _stat_key(path: Path, st: os.stat_result) -> tuple:
    return (str(path), st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def verified(path: Path, size: int, etag: str, part_bytes: int,
             store_part_size: Callable[[], int | None] | None = None) -> bool:
    """Whether the cached ``path`` holds the object of ``size`` and ``etag`` (the section above); a
    link, a missing file or one of another size is not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as handle:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode) or before.st_size != size:
            return False
        key, etag = _stat_key(path, before), etag.lower()
        if _VERIFIED.get(key) == etag:
            return True
        settled = time.time() - before.st_ctime_ns / 1e9 > SETTLED_S
        if _SINGLE.match(etag):
            found = _read_digests(handle, size, ()) == {0: etag}
        elif (multipart := _MULTIPART.match(etag)) is not None:
            parts = int(multipart.group(1))
            candidates = part_sizes(size, parts, part_bytes)
            found = bool(candidates) and etag in _read_digests(handle, size, candidates, parts).values()
            if not found and store_part_size is not None:
                told = store_part_size()
                if told and told not in candidates and -(-size // told) == parts:
                    handle.seek(0)
                    found = etag in _read_digests(handle, size, (told,), parts).values()
        else:
            return False  # not an MD5 form (an encrypted object's): nothing to check the bytes against
        if found and settled and _stat_key(path, os.fstat(fd)) == key:
            if len(_VERIFIED) >= _VERIFIED_MAX:
                _VERIFIED.clear()
            _VERIFIED[key] = etag
    return found


def part_sizes(size: int, parts: int, part_bytes: int) -> list[int]:
    """The part sizes that split ``size`` bytes into ``parts`` parts, of those an uploader
    likely chose (the section above), the likeliest first."""
    if parts == 1:
        return [max(size, 1)]  # one part: the same bytes whatever the size asked
    exact = -(-size // parts)
    chosen: list[int] = []
    for candidate in (8 * MIB, -(-exact // MIB) * MIB, part_bytes, *COMMON_PART_BYTES, exact):
        if candidate > 0 and -(-size // candidate) == parts and candidate not in chosen:
            chosen.append(candidate)
    return chosen


class _PartDigests:
    """The multipart ETag of bytes fed in order, cut into parts of ``part`` bytes."""

    def __init__(self, part: int) -> None:
        self.part, self.filled = part, 0
        self.of_parts, self.current = hashlib.md5(usedforsecurity=False), hashlib.md5(usedforsecurity=False)

    def update(self, data: memoryview) -> None:
        while data:
            take = min(len(data), self.part - self.filled)
            self.current.update(data[:take])
            self.filled, data = self.filled + take, data[take:]
            if self.filled == self.part:
                self.of_parts.update(self.current.digest())
                self.current, self.filled = hashlib.md5(usedforsecurity=False), 0

    def etag(self, parts: int) -> str:
        if self.filled:
            self.of_parts.update(self.current.digest())
        return f"{self.of_parts.hexdigest()}-{parts}"


def _read_digests(handle, size: int, part_bytes: tuple[int, ...] | list[int], parts: int = 0) -> dict[int, str]:
    """One read of ``handle``: its MD5 (key 0) when no part sizes are given, else the multipart
    ETag of ``parts`` parts for each part size."""
    whole = hashlib.md5(usedforsecurity=False) if not part_bytes else None
    cut = [_PartDigests(p) for p in part_bytes]
    read = 0
    for chunk in iter(lambda: handle.read(CHUNK), b""):
        read += len(chunk)
        view = memoryview(chunk)
        if whole is not None:
            whole.update(view)
        for digests in cut:
            digests.update(view)
    if read != size:
        return {}
    if whole is not None:
        return {0: whole.hexdigest()}
    return {digests.part: digests.etag(parts) for digests in cut}
