"""The image map: which local install stands in for a container image.

A YAML file:

    images:
      - image: ghcr.io/example/videojob-runtime   # repository (alias: match); tag/digest ignored; globs allowed
        env: {PATH: /work/main/.venv/bin:/usr/local/bin:/usr/bin:/bin, PYTHONUNBUFFERED: "1"}
        entrypoint: []         # the image's ENTRYPOINT
        cmd: [python]          # the image's CMD
        user: "1000:100"       # the image's USER (uid[:gid], names resolved on this host)
        workingDir: /          # the image's WORKDIR
        profile: |             # optional (alias: etcProfile): bind-mounted over /etc/profile
          ...
        paths: [/work/main]    # optional: host dirs that are the image's own files (its install);
                               # a container mount that would hide one (its private /tmp, a volume)
                               # gets it bind-mounted back, read-only, at the same path

A repository matches with or without `docker.io/` and `docker.io/library/`."""
from __future__ import annotations

import fnmatch
import grp
import hashlib
import pwd
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ImageMapError(Exception):
    pass


@dataclass
class Image:
    pattern: str
    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    uid: int = 0
    gid: int = 0
    working_dir: str = "/"
    profile: str | None = None
    paths: list[str] = field(default_factory=list)

    def get(self, key, default=None):  # used by env.command_line
        return {"entrypoint": self.entrypoint, "cmd": self.cmd}.get(key, default)

    @property
    def digest(self) -> str:
        text = repr((self.pattern, sorted(self.env.items()), self.entrypoint, self.cmd, self.uid,
                     self.gid, self.working_dir, self.profile, self.paths))
        return hashlib.sha256(text.encode()).hexdigest()


def repository(image: str) -> str:
    """`reg/repo:tag@sha256:...` -> `reg/repo`, without docker.io/ and library/."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)
    if ":" in last[-1]:
        name = name[: len(name) - len(last[-1]) + last[-1].index(":")]
    for pre in ("docker.io/", "index.docker.io/"):
        if name.startswith(pre):
            name = name[len(pre):]
    if name.startswith("library/"):
        name = name[len("library/"):]
    return name


def _user(text: str | int | None, where: str) -> tuple[int, int]:
    if text in (None, ""):
        return 0, 0
    user, _, group = str(text).partition(":")
    try:
        uid = int(user) if user.isdigit() else pwd.getpwnam(user).pw_uid
        if group:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        else:
            gid = pwd.getpwuid(uid).pw_gid if not user.isdigit() else 0
    except KeyError as exc:
        raise ImageMapError(f"{where}: user {text!r}: no such user or group on this host") from exc
    return uid, gid


class ImageMap:
    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            doc = yaml.safe_load(self.path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ImageMapError(f"image map {self.path}: {exc}") from exc
        entries = doc.get("images") if isinstance(doc, dict) else doc
        if not isinstance(entries, list):
            raise ImageMapError(f"image map {self.path}: expected a top-level `images:` list")
        self.images: list[Image] = []
        for i, e in enumerate(entries):
            where = f"image map {self.path}: images[{i}]"
            if isinstance(e, dict):
                e = dict(e)
                for alias, key in (("match", "image"), ("etcProfile", "profile")):
                    if alias in e:
                        if key in e:
                            raise ImageMapError(f"{where}: give `{key}` or `{alias}`, not both")
                        e[key] = e.pop(alias)
            if not isinstance(e, dict) or not e.get("image"):
                raise ImageMapError(f"{where}: each entry needs `image: <repository>` (or `match:`)")
            unknown = set(e) - {"image", "env", "entrypoint", "cmd", "user", "workingDir", "profile", "paths"}
            if unknown:
                raise ImageMapError(f"{where}: unknown keys {sorted(unknown)}")
            for key in ("entrypoint", "cmd"):
                if not isinstance(e.get(key, []), list):
                    raise ImageMapError(f"{where}: `{key}` must be a list of strings (exec form)")
            paths = e.get("paths") or []
            if not isinstance(paths, list) or not all(isinstance(x, str) and x.startswith("/") for x in paths):
                raise ImageMapError(f"{where}: `paths` must be a list of absolute host paths")
            uid, gid = _user(e.get("user"), where)
            self.images.append(Image(
                pattern=repository(str(e["image"])),
                env={str(k): str(v) for k, v in (e.get("env") or {}).items()},
                entrypoint=[str(x) for x in e.get("entrypoint") or []],
                cmd=[str(x) for x in e.get("cmd") or []],
                uid=uid, gid=gid, working_dir=str(e.get("workingDir") or "/"),
                profile=e.get("profile"), paths=[str(x).rstrip("/") or "/" for x in paths]))

    def lookup(self, image: str) -> Image | None:
        repo = repository(image)
        for entry in self.images:
            if entry.pattern == repo or fnmatch.fnmatchcase(repo, entry.pattern):
                return entry
        return None
