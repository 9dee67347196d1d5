"""Where stored objects live: a local directory, or anything ``fsspec`` opens.

A back end moves bytes by relative path ("v1/blocks/ab/kvblock-ab....safetensors") and
promises one thing beyond that: ``write_atomic`` publishes an object whole or not at all,
so a reader (or a crash) never leaves half an object under a real name.

* ``LocalDirBackend`` - a directory on a local or shared file system (NFS, Lustre): the
  data goes to a uniquely named temporary file beside the target, is fsynced, and
  ``os.replace`` renames it into place (atomic on POSIX). Two writers of one block each
  rename a complete file; the last one wins, and both wrote the same content.
* ``FsspecBackend`` - any other URL. Object stores (s3, gs, az, memory) publish a PUT
  whole, so the object is written directly; file-like ones get the temp + rename dance.

A temporary file left by a writer that died is named ``*.tmp-*`` and skipped by listings;
``maintenance.gc`` removes old ones.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

TMP_MARK = ".tmp-"  # in the name of a write in progress (or of one that died)
_RENAMING = ("file", "local")  # fsspec protocols where a write is not atomic by itself


@dataclass(frozen=True, slots=True)
class Entry:
    path: str  # relative to the store's root, "/"-separated
    size: int  # bytes
    mtime: float  # unix time of the last write


def _tmp_name(path: str) -> str:
    return f"{path}{TMP_MARK}{uuid.uuid4().hex}"


class LocalDirBackend:
    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = f"file://{self.root}"

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/"))

    def read(self, path: str, length: int | None = None) -> bytes | None:
        """The object's bytes (its first ``length`` bytes), or None when it does not exist."""
        try:
            with open(self._abs(path), "rb") as f:
                return f.read() if length is None else f.read(length)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_atomic(self, path: str, data: bytes) -> None:
        target = self._abs(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = _tmp_name(target)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # the rename must not publish a file whose bytes are still in flight
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(Exception):  # cleanup must not hide the write's own error
                os.unlink(tmp)
            raise

    def exists(self, path: str) -> bool:
        return os.path.isfile(self._abs(path))

    def delete(self, path: str) -> bool:
        try:
            os.unlink(self._abs(path))
            return True
        except FileNotFoundError:
            return False

    def touch(self, path: str) -> None:
        """Create an empty object, or set its mtime to now."""
        target = self._abs(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "ab"):
            pass
        os.utime(target)

    def walk(self, prefix: str) -> Iterator[Entry]:
        top = self._abs(prefix)
        for dirpath, _, files in os.walk(top):
            for name in files:
                full = os.path.join(dirpath, name)
                try:
                    st = os.stat(full)
                except FileNotFoundError:  # deleted meanwhile
                    continue
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                yield Entry(rel, st.st_size, st.st_mtime)


def _mtime(info: dict) -> float:
    """Last-write time from an fsspec info dict (keys differ per file system)."""
    for k in ("mtime", "LastModified", "last_modified", "updated", "created", "time", "ctime"):
        v = info.get(k)
        if v is None:
            continue
        if isinstance(v, datetime.datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
        try:
            return datetime.datetime.fromisoformat(str(v).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
    return 0.0


class FsspecBackend:
    def __init__(self, url: str, **storage_options):
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        self.url = url
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self._renaming = any(p in _RENAMING for p in protocols)

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}"

    def read(self, path: str, length: int | None = None) -> bytes | None:
        try:
            if length is None:
                return self.fs.cat_file(self._abs(path))
            return self.fs.cat_file(self._abs(path), start=0, end=length)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_atomic(self, path: str, data: bytes) -> None:
        target = self._abs(path)
        if not self._renaming:  # an object store: one PUT appears whole or not at all
            self.fs.pipe_file(target, data)
            return
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        tmp = _tmp_name(target)
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, target)
        except BaseException:
            with contextlib.suppress(Exception):  # cleanup must not hide the write's own error
                self.fs.rm_file(tmp)
            raise

    def exists(self, path: str) -> bool:
        return self.fs.isfile(self._abs(path))

    def delete(self, path: str) -> bool:
        try:
            self.fs.rm_file(self._abs(path))
            return True
        except FileNotFoundError:
            return False

    def touch(self, path: str) -> None:
        target = self._abs(path)
        if self._renaming:
            self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(target, b"")  # a rewrite: every file system gives it a new mtime

    def walk(self, prefix: str) -> Iterator[Entry]:
        top = self._abs(prefix)
        try:
            found = self.fs.find(top, detail=True)
        except FileNotFoundError:
            return
        for name, info in sorted(found.items()):
            if info.get("type", "file") != "file":
                continue
            rel = name.removeprefix(self.root.lstrip("/") if not name.startswith("/") else self.root).lstrip("/")
            yield Entry(rel, int(info.get("size") or 0), _mtime(info))


def open_backend(url: str, **storage_options):
    """``LocalDirBackend`` for a plain path or ``file://``, else ``FsspecBackend``."""
    url = str(url)
    if "://" not in url:
        return LocalDirBackend(url)
    scheme, rest = url.split("://", 1)
    if scheme == "file" and not storage_options:
        return LocalDirBackend(rest or "/")
    return FsspecBackend(url, **storage_options)
