"""TierDir: a folder of the disk tier, opened once; every path under it is opened relative to
its descriptor (``openat``), never through a symbolic link.

The directory named by ``kv_offloading_dir`` (``--kv-offloading-dir``) is the operator's and
may be reached through symbolic links; it must be a directory owned by this user that no one
else may write into. Everything under it (a model's folder, a rank's tier file, its key, the
weight hashes' cache) is opened with ``O_NOFOLLOW`` relative to its folder's descriptor and
checked on that descriptor (no window between the check and the use): a folder must be a
directory of this user that only this user may write, a file a regular file of this user with
one link. A symlink, FIFO, device, directory or hard link planted where a tier path goes is
refused with an error naming the flag and the path, never followed, truncated or written.
A failed start removes what it created (``remove_created``) and nothing else.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

FLAG = "--kv-offloading-dir"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO never blocks


class TierPathError(ValueError):
    """A tier path that cannot be used safely (a bad setting: the operator's to fix)."""


class TierDir:
    """An open directory of the disk tier (see the module docstring). ``path`` is for
    messages only; every operation goes through ``fd``."""

    def __init__(self, fd: int, path: str, parent: TierDir | None = None) -> None:
        self.fd = fd
        self.path = path
        self._root = parent._root if parent is not None else self
        if parent is None:
            self._created: list[tuple[TierDir | None, str, bool]] = []  # (folder, name, is_dir)

    # ---- opening ----------------------------------------------------------------------------
    @classmethod
    def open_root(cls, path: str | os.PathLike) -> TierDir:
        """Opens (creating it and its missing parents, mode 0700) the operator's directory."""
        path = os.fspath(path)
        if not path or "\0" in path:
            raise TierPathError(f"{FLAG} {path!r}: not a usable directory path")
        created = _make_dirs(path)
        try:
            fd = os.open(path, _DIR_FLAGS)
        except OSError as e:
            _remove_dirs(created)
            raise TierPathError(f"{FLAG} {path}: {_why(e, 'a directory')}") from None
        root = cls(fd, path)
        root._created = [(None, p, True) for p in created]
        try:
            _check_private(os.fstat(fd), path, is_dir=True)
        except TierPathError:
            root.remove_created()
            root.close()
            raise
        return root

    def subdir(self, name: str) -> TierDir:
        """The folder ``name`` in this one, created (0700) if missing; never a symlink."""
        _check_name(name)
        path = os.path.join(self.path, name)
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
            self._root._created.append((self, name, True))
        except FileExistsError:
            pass
        except OSError as e:
            raise TierPathError(f"{FLAG}: cannot create {path}: {_why(e, 'a directory')}") from None
        try:
            fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd)
        except OSError as e:
            why = self._what_is(name) or _why(e, "a directory")
            raise TierPathError(f"{FLAG}: {path}: {why}") from None
        try:
            _check_private(os.fstat(fd), path, is_dir=True)
        except TierPathError:
            os.close(fd)
            raise
        return TierDir(fd, path, self)

    def open_file(self, name: str, *, create: bool = True) -> int:
        """A read-write descriptor of the regular file ``name`` (created 0600 if missing and
        ``create``); FileNotFoundError if missing and not ``create``."""
        _check_name(name)
        path = os.path.join(self.path, name)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO never blocks
        fd = -1
        if create:
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=self.fd)
                self._root._created.append((self, name, False))
            except FileExistsError:
                pass
            except OSError as e:
                raise TierPathError(f"{FLAG}: {path}: {_why(e, 'a regular file')}") from None
        if fd < 0:
            try:
                fd = os.open(name, flags, dir_fd=self.fd)
            except FileNotFoundError:
                if create:  # removed between the two opens: someone is playing with it
                    raise TierPathError(f"{FLAG}: {path} vanished while it was opened") from None
                raise
            except OSError as e:
                why = self._what_is(name) or _why(e, "a regular file")
                raise TierPathError(f"{FLAG}: {path}: {why}") from None
        try:
            _check_private(os.fstat(fd), path, is_dir=False)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_file(self, name: str, max_bytes: int) -> bytes | None:
        """The bytes of the small file ``name``, or None if it is missing, too large or not a
        private regular file (a cache: never trusted more than a miss)."""
        try:
            fd = self.open_file(name, create=False)
        except (FileNotFoundError, TierPathError):
            return None
        try:
            if os.fstat(fd).st_size > max_bytes:
                return None
            return os.pread(fd, max_bytes, 0)
        finally:
            os.close(fd)

    def replace_file(self, name: str, data: bytes) -> None:
        """Writes ``name`` whole, atomically (a private temporary file renamed over it; a
        symlink there is replaced, never followed)."""
        _check_name(name)
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            self._root._created.append((self, name, False))  # a failed start removes it
        tmp = f".{name}.{os.getpid()}.tmp"
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=self.fd,
        )
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            _unlink(self.fd, tmp)
            raise

    def _what_is(self, name: str) -> str | None:
        """Why ``name`` cannot be opened, when it is a symbolic link (never followed)."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            return "is a symbolic link: refusing to follow it"
        return None

    # ---- clean-up ---------------------------------------------------------------------------
    def remove_created(self) -> None:
        """A failed start: removes every file and folder this start created under the root
        (newest first), leaving what was there before."""
        root = self._root
        for folder, name, is_dir in reversed(root._created):
            try:
                if folder is None:
                    os.rmdir(name)  # a missing parent of the root, by its path
                elif is_dir:
                    os.rmdir(name, dir_fd=folder.fd)
                else:
                    os.unlink(name, dir_fd=folder.fd)
            except OSError:
                pass
        root._created = []

    def forget_created(self) -> None:
        """The start succeeded: what it created stays."""
        self._root._created = []

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _check_name(name: str) -> None:
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"TierDir: {name!r} is not a plain file name")


def _check_private(st: os.stat_result, path: str, *, is_dir: bool) -> None:
    """A directory (or regular file) of this user that no one else may write; a file has one
    link (a hard link would let a write reach another name)."""
    kind = "a directory" if is_dir else "a regular file"
    if is_dir and not stat.S_ISDIR(st.st_mode):
        raise TierPathError(f"{FLAG}: {path} is not a directory")
    if not is_dir and not stat.S_ISREG(st.st_mode):
        raise TierPathError(f"{FLAG}: {path} is {_kind(st.st_mode)}, not {kind}: refusing it")
    if st.st_uid != os.geteuid():
        raise TierPathError(
            f"{FLAG}: {path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()}): "
            "the disk tier keeps its files only in folders of its own user"
        )
    if st.st_mode & 0o022:
        raise TierPathError(
            f"{FLAG}: {path} may be written by its group or by others (mode "
            f"{stat.S_IMODE(st.st_mode):o}): the disk tier needs a folder only its user can "
            f"write (chmod go-w {path})"
        )
    if not is_dir and st.st_nlink != 1:
        raise TierPathError(
            f"{FLAG}: {path} has {st.st_nlink} hard links: refusing a tier file that is also "
            "another file"
        )


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _why(e: OSError, expected: str) -> str:
    if e.errno == errno.ELOOP:
        return f"is a symbolic link: refusing to follow it (the tier needs {expected} there)"
    if e.errno == errno.ENOTDIR:
        return f"is not a directory (or a path through a file): the tier needs {expected} there"
    if e.errno == errno.EISDIR:
        return f"is a directory: the tier needs {expected} there"
    return e.strerror or str(e)


def _make_dirs(path: str) -> list[str]:
    """Creates the missing directories of ``path`` (0700), returning them, deepest last."""
    missing = []
    head = os.path.abspath(path)
    while not os.path.lexists(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    created = []
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        except OSError as e:
            _remove_dirs(created)
            raise TierPathError(
                f"{FLAG} {path}: cannot create {d}: {_why(e, 'a directory')}"
            ) from None
        created.append(d)
    return created


def _remove_dirs(created: list[str]) -> None:
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            pass


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
