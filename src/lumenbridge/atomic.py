"""Writing a file so that its path only ever holds a complete version."""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: str | Path, write: Callable[[str], None]) -> None:
    """Call write(temporary_path), then move the result onto `path`.

    The temporary file sits in the same directory (so the final rename stays
    on one filesystem), gets the permissions a normally created file would
    have (some writers, safetensors among them, create files owner-only), and
    is flushed to disk before it replaces `path` in one step. An existing file
    at `path` survives any failure before that."""
    directory, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    # Learn the usual mode (0666 less the umask) from a file created the ordinary way.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    mode = stat.S_IMODE(os.fstat(descriptor).st_mode)
    os.close(descriptor)
    try:
        write(temporary)
        os.chmod(temporary, mode)
        with open(temporary, "r+b") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
