"""A client's state folder, resolved once and held open: its ledgers, its privacy state, its kept
replies and inputs, its prepared data (docs/architecture.md, clients/README.md).

Why a descriptor and not a path: a path is looked up again at every use, so a link on the way
(made in advance by another user in a folder every user can write to, such as /tmp) could be
re-pointed between a check and the use that follows it, and a ledger charged in another user's
folder while the round is released from the owner's. Here the path is walked once, one folder at
a time from `/`, each opened relative to the one above with O_NOFOLLOW: a link anywhere on the
way is refused, with the resolved path to pass instead. The folder is then held as a directory
descriptor, and every file under it is reached through that descriptor, never through its path
again: `open_file` and the helpers below open each folder and the file itself with O_NOFOLLOW,
and `via` (/proc/self/fd/N/...) lets code that takes a path (a cache folder) go through the same
descriptor.

`StateFolder.open(path, private=True)` is the owner's folder (a node with its own data): every
folder on the way must belong to the user or root and be writable by no one else (a folder with
the sticky bit, such as /tmp, is allowed above it, as others cannot rename or remove what is the
owner's there), and the folder itself is the user's, made 0700 if it is missing. Refusals raise
StateFolderError naming the folder and why.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from contextlib import contextmanager
from pathlib import Path

from fedsd.errors import ConfigError

DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
PROC_FD = Path("/proc/self/fd")


class StateFolderError(ConfigError):
    """A state folder that is not its owner's alone; the message names the folder and why."""


class StateFolder:
    """A state folder held open as a directory descriptor (`fd`); `path` is the resolved path it
    was opened at (for messages and the owner's log only: nothing is opened through it again)."""

    def __init__(self, path: Path, fd: int, private: bool):
        self.path, self.fd, self.private = path, fd, private

    @classmethod
    def open(cls, path: str | os.PathLike, private: bool = True) -> "StateFolder":
        """The folder at `path` (absolute, or taken from the working directory), made where it is
        missing, walked from `/` without following a link. `private`: the owner's checks above."""
        named = Path(os.path.abspath(os.path.expanduser(path)))
        fd = os.open("/", DIRECTORY)
        above = os.fstat(fd)
        where = Path("/")
        try:
            if private:
                _check_owned(above, where, named, sticky_ok=True)
            for i, name in enumerate(named.parts[1:]):
                last = i == len(named.parts) - 2
                child = _open_or_make(fd, name, named, where, above, private)
                st = os.fstat(child)
                os.close(fd)
                fd, where, above = child, where / name, st
                if private:
                    _check_owned(st, where, named, sticky_ok=not last)
            if private and stat.S_IMODE(above.st_mode) & 0o077:  # readable by others: closed
                os.fchmod(fd, 0o700)
        except BaseException:
            os.close(fd)
            raise
        return cls(named, fd, private)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        return f"StateFolder({str(self.path)!r}, fd={self.fd})"

    @property
    def via(self) -> Path:
        """The folder as a path through its descriptor (/proc/self/fd/N), for code that takes a
        path: the kernel resolves it to the folder held open, whatever its name now leads to.
        Valid in this process only."""
        return PROC_FD / str(self.fd)

    def same_as_named(self) -> bool:
        """Whether `path` still names the folder held open (a folder deleted and made again is
        another)."""
        try:
            named, held = os.stat(self.path, follow_symlinks=False), os.fstat(self.fd)
        except OSError:
            return False
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    # -- folders and files under it ------------------------------------------------------------
    def folder_fd(self, *parts: str) -> int:
        """A descriptor of the folder `parts` under this one (each made 0700 where missing, none
        a link; a private folder's each checked as the user's); the caller closes it."""
        fd = os.dup(self.fd)
        where = self.path
        try:
            for part in parts:
                if part in ("", ".", "..") or "/" in part:
                    raise StateFolderError(f"{part!r} is not a folder name under the state folder {self.path}")
                child = _open_or_make(fd, part, self.path / Path(*parts), where, os.fstat(fd), self.private)
                os.close(fd)
                fd, where = child, where / part
                if self.private:
                    st = os.fstat(fd)
                    _check_owned(st, where, where, sticky_ok=False)
                    if stat.S_IMODE(st.st_mode) & 0o077:
                        os.fchmod(fd, 0o700)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def folder(self, *parts: str) -> Path:
        """The folder `parts` under this one (made and checked as folder_fd does), as a path
        through this folder's descriptor (`via`)."""
        os.close(self.folder_fd(*parts))
        return self.via.joinpath(*parts)

    def open_file(self, name: str, flags: int, mode: int = 0o600) -> int:
        """A descriptor of the file `name` ('a/b/file': its folders made as `folder_fd` makes
        them) opened with `flags` relative to this folder's descriptor, never following a link
        (OSError ELOOP where one is). The caller closes it."""
        *parts, leaf = name.split("/")
        folder = self.folder_fd(*parts)
        try:
            return os.open(leaf, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=folder)
        finally:
            os.close(folder)

    def read_bytes(self, name: str) -> bytes | None:
        """The file's content, or None where there is none."""
        try:
            fd = self.open_file(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def read_json(self, name: str):
        raw = self.read_bytes(name)
        return None if raw is None else json.loads(raw)

    def exists(self, name: str) -> bool:
        *parts, leaf = name.split("/")
        try:
            folder = self.folder_fd(*parts)
        except FileNotFoundError:
            return False
        try:
            os.stat(leaf, dir_fd=folder, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False
        finally:
            os.close(folder)

    def write_atomic(self, name: str, data: bytes) -> None:
        """`name` replaced whole by `data` (0600): written to a new file beside it, flushed to the
        disk, renamed over it and the folder flushed, all relative to the descriptor."""
        *parts, leaf = name.split("/")
        folder = self.folder_fd(*parts)
        tmp = f".{leaf}.tmp-{os.getpid()}"
        try:
            try:
                os.unlink(tmp, dir_fd=folder)
            except FileNotFoundError:
                pass
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, leaf, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=folder)
                except FileNotFoundError:
                    pass
                raise
            os.fsync(folder)
        finally:
            os.close(folder)

    def write_json(self, name: str, obj) -> None:
        self.write_atomic(name, (json.dumps(obj, indent=2) + "\n").encode())

    @contextmanager
    def lock(self, name: str):
        """An exclusive lock (flock) on the file `name`, held for the block."""
        fd = self.open_file(name, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # and the lock with it

    def hold(self, name: str, what: str) -> int:
        """An exclusive lock on `name` taken now or refused (StateFolderError saying who holds
        it, `what` naming the holder), kept for as long as the returned descriptor is open."""
        fd = self.open_file(name, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StateFolderError(f"state-dir={self.path}: {what} already uses this state folder ({holder}); "
                                   f"two on one folder would share its privacy state and replies") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        return fd


def _open_or_make(parent: int, name: str, named: Path, where: Path, parent_st: os.stat_result, private: bool) -> int:
    """parent/name as a directory descriptor, made (0700) where missing; a link is refused."""
    flags = DIRECTORY if private else DIRECTORY & ~os.O_NOFOLLOW  # a simulation's folder: links followed
    for _ in range(2):
        try:
            return os.open(name, flags, dir_fd=parent)
        except FileNotFoundError:
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
            except FileExistsError:
                pass  # made meanwhile: opened (and judged) as found
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            path = where / name
            if not stat.S_ISLNK(st.st_mode):
                raise StateFolderError(f"state-dir={named}: {path} is not a folder") from None
            shared = parent_st.st_mode & stat.S_ISVTX and parent_st.st_mode & 0o002
            if shared:  # where it leads is the other user's to choose: no path of it is suggested
                raise StateFolderError(
                    f"state-dir={named}: {path} is a symbolic link in {where}, a folder every user can write to, where "
                    f"another user (uid {st.st_uid}) could have made it and could re-point it at any moment; pass a "
                    f"folder of your own, without a link on its way") from None
            raise StateFolderError(
                f"state-dir={named}: {path} is a symbolic link; pass the folder's resolved path "
                f"({os.path.realpath(named)}) if it is yours, so that no link is looked up again"
                + ("" if not private else ", or choose a folder under folders only you can write")) from None
    return os.open(name, flags, dir_fd=parent)


def _check_owned(st: os.stat_result, path: Path, named: Path, sticky_ok: bool) -> None:
    me = os.geteuid()
    if st.st_uid not in (0, me) or (not sticky_ok and st.st_uid != me):
        raise StateFolderError(f"state-dir={named}: {path} belongs to another user (uid {st.st_uid}), who could "
                               f"replace this client's ledger; choose a state folder under folders only you or "
                               f"root own")
    if st.st_mode & 0o022 and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        raise StateFolderError(f"state-dir={named}: {path} can be written by other users (mode "
                               f"{stat.S_IMODE(st.st_mode):o}), who could replace this client's ledger; choose a "
                               f"state folder under folders only you can write")


# One StateFolder a folder a process: opened on first use; `pin` (the owner's service, at its
# start) keeps it whatever the path names later. An unpinned one is opened again when its path
# names another folder (one deleted and made again between two runs of a process).
_OPEN: dict[tuple[str, bool], tuple[StateFolder, bool]] = {}


def state_folder(path: str | os.PathLike, private: bool = True, pin: bool = False) -> StateFolder:
    """The process's StateFolder for `path` (StateFolder.open on first use)."""
    key = (str(Path(os.path.abspath(os.path.expanduser(path)))), private)
    held = _OPEN.get(key)
    if held is not None and (held[1] or held[0].same_as_named()):
        if pin and not held[1]:
            _OPEN[key] = (held[0], True)
        return held[0]
    folder = StateFolder.open(key[0], private)  # a replaced one stays open: a path through its descriptor
    _OPEN[key] = (folder, pin)                   # handed out earlier must never come to name another folder
    return folder


def read_nofollow(path: str | os.PathLike) -> bytes | None:
    """The content of the file at `path` (a path through a StateFolder's `via`, say), or None
    where there is none; a link at `path` itself is not followed (OSError ELOOP)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()
