"""Writing a file so that its path only ever holds a complete version.

A write happens in a staging folder named .lumenbridge-partial-XXXX beside
the target, locked with flock() for as long as the writer lives, and the
finished file is renamed onto the target in one step. Everything a writer
makes, including temporary files of its own (safetensors' writer creates
one), stays in that folder. A writer that is killed leaves only that folder,
and the next write to the same folder finds it unlocked and removes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: staging folders are never locked, so none is ever judged abandoned
    fcntl = None

STAGING_PREFIX = ".lumenbridge-partial-"

_held_locks: set[int] = set()  # descriptors of the flock()s this process holds


def _close_in_child() -> None:
    # A forked child (a DataLoader worker) must not keep a lock alive after the
    # process that took it is killed: it closes its copies of the descriptors.
    for descriptor in list(_held_locks):
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _held_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def remove_abandoned(directory: str | os.PathLike) -> None:
    """Remove the staging folders in `directory` whose writer is gone (their lock is free)."""
    for entry in os.scandir(directory):
        if not (entry.name.startswith(STAGING_PREFIX) and entry.is_dir(follow_symlinks=False)):
            continue
        with contextlib.suppress(FileNotFoundError), folder_lock(entry.path, wait=False) as locked:
            if locked:
                shutil.rmtree(entry.path, ignore_errors=True)


@contextlib.contextmanager
def folder_lock(folder: str, wait: bool) -> Iterator[bool | None]:
    """Hold an exclusive flock() on a folder; yields False if another process
    holds it and wait is False, None where there are no locks (Windows). The
    kernel drops the lock when its holder dies, and a forked child does not
    keep it (_close_in_child)."""
    if fcntl is None:
        yield None
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            locked = True
            _held_locks.add(descriptor)
        except BlockingIOError:
            locked = False
        yield locked
    finally:
        _held_locks.discard(descriptor)
        os.close(descriptor)


@contextlib.contextmanager
def staging_folder(directory: str | os.PathLike, purpose: str = "") -> Iterator[Path]:
    """A new, locked staging folder in `directory` (its name has `purpose`
    after the prefix), removed with whatever is left in it on exit.
    Creating it is also the check that files can be written there."""
    folder = tempfile.mkdtemp(prefix=STAGING_PREFIX + purpose, dir=directory)
    try:
        with folder_lock(folder, wait=True):
            yield Path(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def current_umask() -> int:
    """This process's umask. Linux reports it in /proc; elsewhere it is read by
    setting it and back, which a thread creating a file meanwhile could see."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _mode_for(path: str, staged: str) -> int:
    """The permissions for the new file: those of the file it replaces, else
    those of a newly created file (0666 less the umask, learnt by creating
    `staged`; some writers, safetensors among them, create files owner-only)."""
    with contextlib.suppress(FileNotFoundError):
        return stat.S_IMODE(os.stat(path).st_mode)
    descriptor = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    os.close(descriptor)
    return stat.S_IMODE(os.stat(staged).st_mode)


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call write(temporary_path), then move the result onto `path`.

    A symlink at `path` is followed: the file it points to is replaced and
    the link stays. The new file keeps the permissions of the one it
    replaces, and is flushed to disk before it replaces `path` in one step.
    An existing file at `path` survives any failure before that."""
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    remove_abandoned(directory)
    with staging_folder(directory) as folder:
        staged = str(folder / os.path.basename(target))
        mode = _mode_for(target, staged)
        write(staged)
        os.chmod(staged, mode)
        with open(staged, "r+b") as file:
            os.fsync(file.fileno())
        os.replace(staged, target)
