"""The file under the ``file`` exporter: whole lines appended, bounded by size-based rotation, created private.

- **Whole lines only.** Each line goes out in one ``write`` on an ``O_APPEND`` descriptor. A write that fails
  part-way (disk full) is cut back to where it began; where that cannot be done (another process appended
  meanwhile, or the cut itself failed) the next line starts on a new line, as it does when the file was left
  ending mid-line by a process killed during a write. A reader may meet such a fragment as one unparseable line,
  never a good line glued to it.
- **Bounded.** When the next line would take the file past ``max_bytes``, the file is renamed ``<path>.1`` (the
  previous ``.1`` becomes ``.2``... up to ``.<backups>``, the oldest deleted), as ``logging.handlers.
  RotatingFileHandler`` does: ``.1`` is the newest. ``max_bytes=0`` never rotates.
- **Rotated by someone else** (logrotate, ``mv``, ``rm``): the path is checked per line, as logging's
  ``WatchedFileHandler`` does, and a new file started there.
- **Private.** The directory is created 0700 and the file 0600. With ``follow_symlinks=False`` (the default path,
  which anyone can predict, in a working directory others may share) neither a symlink at the path nor a
  symlinked directory is written through, the directory must be this user's and writable by no one else, and a
  file found there must be this user's regular file with one link (made 0600 if it was readable by others).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

__all__ = ["TraceFile", "rotated_paths"]


def rotated_paths(path: str | os.PathLike[str], backups: int) -> list[str]:
    """``path`` and its rotated files, newest first: ``path``, ``path.1``, ... ``path.<backups>``."""
    base = os.fspath(path)
    return [base, *(f"{base}.{index}" for index in range(1, backups + 1))]


class TraceFile:
    """Appends whole lines to ``path``. Not thread-safe: its owner serializes the calls."""

    def __init__(
        self, path: str | os.PathLike[str], max_bytes: int = 0, backups: int = 5, follow_symlinks: bool = True
    ) -> None:
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.follow_symlinks = follow_symlinks
        self.rotations = 0
        self._fd: int | None = None
        self._new_line_first = False  # the file ends mid-line: the next line starts with "\n"

    def make_directory(self) -> None:
        """Checks the path and creates its directory (0700, parents too): raises OSError for a path with a NUL byte
        or naming a directory, a directory that cannot be made or written (a read-only filesystem), and where
        symlinks are refused, for a directory or file that is not this user's own and private (module docstring)."""
        if "\0" in self.path:
            raise OSError(errno.EINVAL, "the path contains a NUL byte", self.path.replace("\0", "\\0"))
        if os.path.isdir(self.path):
            raise OSError(errno.EISDIR, "the path is a directory", self.path)
        directory = self._make_directory()
        if not os.access(directory, os.W_OK):
            raise OSError(errno.EROFS if _read_only(directory) else errno.EACCES, "not writable", directory)
        if not self.follow_symlinks:
            try:
                found = os.lstat(self.path)
            except FileNotFoundError:
                return
            _check_own_file(found, self.path)

    def _make_directory(self) -> str:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not self.follow_symlinks:
            found = os.lstat(directory)
            if stat.S_ISLNK(found.st_mode):
                raise OSError(errno.ELOOP, "the trace directory is a symlink; not written through", directory)
            if found.st_uid != os.geteuid():
                raise OSError(errno.EPERM, "the trace directory belongs to another user", directory)
            if found.st_mode & 0o022:
                raise OSError(errno.EPERM, "the trace directory is writable by others", directory)
        return directory

    def append(self, line: bytes) -> None:
        """Writes one line (ending in ``\\n``); raises OSError, leaving the file with whole lines only."""
        fd = self._open()
        size = os.fstat(fd).st_size
        if self.max_bytes and size > 0 and size + len(line) > self.max_bytes and self._is_regular(fd):
            self._rotate()
            fd = self._open()
            size = os.fstat(fd).st_size
        data = b"\n" + line if self._new_line_first else line
        written = 0
        try:
            while written < len(data):
                count = os.write(fd, data[written:])
                if count == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
                written += count
        except OSError:
            self._take_back(fd, size, written)
            raise
        self._new_line_first = False

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    # -- internals -------------------------------------------------------------------------------------------------

    def _open(self) -> int:
        if self._fd is not None and not self._moved(self._fd):
            return self._fd
        self.close()
        self._make_directory()
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        if not self.follow_symlinks:
            flags |= os.O_NOFOLLOW  # ELOOP on a planted symlink
        fd = os.open(self.path, flags, 0o600)
        try:
            if not self.follow_symlinks:
                opened = os.fstat(fd)
                _check_own_file(opened, self.path)
                if opened.st_mode & 0o077:
                    os.fchmod(fd, 0o600)  # this user's file, readable by others: made private
            size = os.fstat(fd).st_size
            self._new_line_first = size > 0 and self._is_regular(fd) and os.pread(fd, 1, size - 1) != b"\n"
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        return fd

    def _moved(self, fd: int) -> bool:
        """Whether the path no longer names the open file (rotated away, deleted, replaced)."""
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return True
        opened = os.fstat(fd)
        return (on_disk.st_dev, on_disk.st_ino) != (opened.st_dev, opened.st_ino)

    @staticmethod
    def _is_regular(fd: int) -> bool:
        return stat.S_ISREG(os.fstat(fd).st_mode)  # a FIFO or /dev/stdout is neither rotated nor cut back

    def _rotate(self) -> None:
        self.close()
        names = rotated_paths(self.path, self.backups)
        moves = zip(reversed(names[1:]), reversed(names[:-1]))  # (.N, .N-1) ... (.1, path): oldest first
        for older, newer in moves:
            # a missing name: a gap in the set, or another process rotating the same file at the same moment
            with contextlib.suppress(FileNotFoundError):
                os.replace(newer, older)  # renames a link itself, never its target
        if self.backups == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.rotations += 1

    def _take_back(self, fd: int, size: int, written: int) -> None:
        """After a failed write: cut the partial line off, or else make the next line start on a new one."""
        if written == 0:
            return
        try:
            if os.fstat(fd).st_size == size + written and self._is_regular(fd):
                os.ftruncate(fd, size)  # shrinking needs no space
                return
        except OSError:
            pass
        self._new_line_first = True


def _check_own_file(found: os.stat_result, path: str) -> None:
    """OSError unless ``found`` is a regular file of this user with one link: a file another user planted at a
    predictable path (or a symlink, a FIFO, a hard link to another file) is not written to."""
    if stat.S_ISLNK(found.st_mode):
        raise OSError(errno.ELOOP, "the trace file is a symlink; not written through", path)
    if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
        raise OSError(errno.EPERM, "the trace file is not a regular file of one link", path)
    if found.st_uid != os.geteuid():
        raise OSError(errno.EPERM, "the trace file belongs to another user", path)


def _read_only(directory: str) -> bool:
    return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
