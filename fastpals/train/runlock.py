"""One run per output folder: :class:`RunLock` holds ``<out>/.lock``, an ``fcntl.flock`` taken without
waiting that the kernel releases when its holder dies (never stale). The file records ``pid host``; a run that finds
it filled in but free takes over, and says so."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from fastpals.train.errors import ConfigError

__all__ = ["LOCK_NAME", "RunLock", "writable_folder_error"]

LOCK_NAME = ".lock"
_HELD = (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN)  # flock's errors for a lock another process holds


def writable_folder_error(out: Path, err: OSError) -> ConfigError:
    """The one-line error for an ``--out`` that cannot be created or written (read-only, permissions)."""
    cause = err.strerror or type(err).__name__
    where = err.filename or out
    return ConfigError(
        f"--out {out}: cannot write {where} ({cause}): choose an --out in a folder you can write to"
    )


class RunLock:
    """The lock of ``out`` (created when missing). :meth:`acquire` raises :class:`ConfigError` naming the run that
    holds it; ``taken_over`` is then the ``(pid, host)`` of an earlier run that died holding it, else None."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.path = self.out / LOCK_NAME
        self.fd: int | None = None
        self.taken_over: tuple[str, str] | None = None

    def check_free(self) -> None:
        """Raise the :meth:`acquire` error when a live run holds the lock now, changing nothing in ``out``: checked
        before the slow set-up, taken later with :meth:`acquire`."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return  # no lock file (or unreadable: acquire reports it)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in _HELD:
                raise self._busy(_read(fd)) from None
        finally:
            os.close(fd)

    def _busy(self, holder: tuple[str, str] | None) -> ConfigError:
        pid, host = holder or ("?", "?")
        return ConfigError(
            f"--out {self.out} is in use by the run with pid {pid} on host {host} (lock {self.path}): wait "
            f"for it to end, stop it, or choose another --out"
        )

    def acquire(self) -> RunLock:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise writable_folder_error(self.out, err) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read(fd)
            os.close(fd)
            if err.errno not in _HELD:
                raise writable_folder_error(self.out, err) from None
            raise self._busy(holder) from None
        earlier = _read(fd)
        if earlier is not None and earlier[0] != str(os.getpid()):
            self.taken_over = earlier
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
            os.fsync(fd)
        except OSError as err:
            os.close(fd)
            raise writable_folder_error(self.out, err) from None
        self.fd = fd
        return self

    def release(self) -> None:
        """Empty the file and release the lock; the file stays (removing it would let a third run lock a new file
        while a second waits on the old one)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)  # closing releases the flock


def _read(fd: int) -> tuple[str, str] | None:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").split()
    except OSError:
        text = []
    return (text[0], text[1] if len(text) > 1 else "?") if text else None
