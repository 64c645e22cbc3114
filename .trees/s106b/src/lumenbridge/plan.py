"""The plan of a sharded run, kept in files and memory-mapped: every rank
reads it, and so does every DataLoader worker it starts, so held in Python
objects it bounded how many images one run could take (a list of Sample
tuples held about 290 bytes an image, flat arrays still 45 bytes a tar
sample on every rank). In files, written as it is made and mapped read-only,
it costs each process only the pages it touches, which the kernel can drop
and read again: the memory of a run no longer grows with its images.

A plan is a folder of three files, arrays of the machine's int64 and bytes:

    records  five numbers a sample: its text, its source (or -1: the key is
             the source, an image file), offset, size, its error (or -1)
    strings  the texts, encoded one after the other
    ends     where each text ends in strings

Texts are numbered in the order they are written: a sample's key and member
(see _text), a source where it changes (a tar's samples share one), an error.
"""

from __future__ import annotations

import mmap
import os
from array import array
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Self

_NONE = -1  # a record's source (the key is the source) or error (none) that has no text
# How the plan, planning and sources encode every name: any str, those read with surrogateescape included.
TEXT_ENCODING = ("utf-8", "surrogatepass")
_FIELDS = 5  # numbers in a record
RECORDS, STRINGS, ENDS = "records", "strings", "ends"
_PARTIAL = ".partial"  # a plan folder's name while it is written


class Sample(NamedTuple):
    """One image of the plan. For a file, member is None and offset and size are -1;
    error is set for a sample already known to be unreadable."""

    key: str
    source: str
    member: str | None = None
    offset: int = -1
    size: int = -1
    error: str | None = None


def _text(sample: Sample) -> str:
    """A sample's key and member as one text: key, then for a member a NUL and
    the member, which is mostly the key and an extension, so only what follows
    the key is kept (a second NUL says the member is written in full)."""
    if "\0" in sample.key or (sample.member is not None and "\0" in sample.member):
        raise ValueError(f"a sample's key and member cannot hold NUL characters: {sample!r}")
    if sample.member is None:
        return sample.key
    if sample.member.startswith(sample.key):
        return f"{sample.key}\0{sample.member[len(sample.key) :]}"
    return f"{sample.key}\0\0{sample.member}"


def _key_and_member(text: str) -> tuple[str, str | None]:
    key, separator, rest = text.partition("\0")
    if not separator:
        return key, None
    return key, rest[1:] if rest.startswith("\0") else key + rest


class _Numbers:
    """int64s appended to a file, written a block at a time."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.buffer = array("q")

    def extend(self, numbers: Iterable[int]) -> None:
        self.buffer.extend(numbers)
        if len(self.buffer) >= 1 << 13:
            self.flush()

    def flush(self) -> None:
        self.buffer.tofile(self.file)
        del self.buffer[:]

    def close(self) -> None:
        self.flush()
        self.file.close()


class PlanWriter:
    """Writes a plan's samples, in order, to the folder `path` (as a context
    manager): in a folder named path + ".partial" until it is complete and
    renamed, so that a plan folder under its own name is always complete."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.partial = self.path + _PARTIAL
        os.mkdir(self.partial)  # not makedirs: a rank that does not see DIR must not make it
        self._records = _Numbers(os.path.join(self.partial, RECORDS))
        self._ends = _Numbers(os.path.join(self.partial, ENDS))
        self._strings = open(os.path.join(self.partial, STRINGS), "wb")  # noqa: SIM115 - closed in close()
        self._end = 0  # of the strings written
        self._texts = 0
        self._source = (None, _NONE)  # the last source written, and its number
        self.samples = 0

    def _write(self, text: str) -> int:
        """Writes a text; returns its number."""
        data = text.encode(*TEXT_ENCODING)
        self._strings.write(data)
        self._end += len(data)
        self._ends.extend((self._end,))
        self._texts += 1
        return self._texts - 1

    def _source_number(self, sample: Sample) -> int:
        if sample.source == sample.key:
            return _NONE
        if self._source[0] != sample.source:  # a tar's samples follow one another: written once for them all
            self._source = (sample.source, self._write(sample.source))
        return self._source[1]

    def append(self, sample: Sample) -> None:
        text = self._write(_text(sample))
        source = self._source_number(sample)
        error = _NONE if sample.error is None else self._write(sample.error)
        self._records.extend((text, source, sample.offset, sample.size, error))
        self.samples += 1

    def extend(self, samples: Iterable[Sample]) -> None:
        for sample in samples:
            self.append(sample)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        """Closes the files and, unless the writing failed, gives the folder its name."""
        for file in (self._records, self._ends, self._strings):
            file.close()
        if kind is None:
            os.replace(self.partial, self.path)


def write_plan(path: str | os.PathLike, samples: Iterable[Sample]) -> Plan:
    """The plan of `samples`, written to the folder `path`."""
    with PlanWriter(path) as writer:
        writer.extend(samples)
    return Plan(path)


def _map(path: str, format: str) -> memoryview:
    """A file's bytes, mapped read-only, as a memoryview of `format` items."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:  # an empty file cannot be mapped
            return memoryview(b"").cast(format)
        return memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)).cast(format)


class Plan(Sequence[Sample]):
    """The plan in the folder `path`, mapped: plan[i] is the Sample written
    i-th, made when asked for. A pickled Plan is its path: a process that
    unpickles it (a worker started by forkserver or spawn) maps the files anew."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(path)
        self._records = _map(os.path.join(self.path, RECORDS), "q")
        self._strings = _map(os.path.join(self.path, STRINGS), "B")
        self._ends = _map(os.path.join(self.path, ENDS), "q")

    def __reduce__(self):
        return Plan, (self.path,)

    def close(self) -> None:
        """Unmaps the files, before they are removed: on a network file system
        a file removed while mapped is only renamed (.nfs...), which keeps its
        folder from being removed."""
        for view in (self._records, self._strings, self._ends):
            view.release()

    def __len__(self) -> int:
        return len(self._records) // _FIELDS

    def _text(self, number: int) -> str:
        start = self._ends[number - 1] if number else 0
        return str(self._strings[start : self._ends[number]], *TEXT_ENCODING)

    def __getitem__(self, index: int) -> Sample:
        index = range(len(self))[index]  # IndexError, and negative indices, as a list has them
        text, source, offset, size, error = self._records[_FIELDS * index : _FIELDS * (index + 1)].tolist()
        key, member = _key_and_member(self._text(text))
        return Sample(
            key,
            key if source == _NONE else self._text(source),
            member,
            offset,
            size,
            None if error == _NONE else self._text(error),
        )


__all__ = ["Plan", "PlanWriter", "Sample", "write_plan"]
