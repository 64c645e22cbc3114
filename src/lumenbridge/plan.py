"""The plan of a sharded run held compactly: every rank keeps all of it, and
so does every DataLoader worker it forks, so a list of Sample tuples (about
290 bytes an image) bounded how many images one run could take. A Plan keeps
the same samples in flat arrays and one buffer of text (about 45 bytes a tar
sample) and makes each Sample when asked for it; arrays, unlike tuples of
objects, are not touched by reference counting, so the forked workers share
their pages instead of copying them.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import NamedTuple

_SAME = -1  # a source index meaning "the source is the key" (an image file)
_ENCODING = ("utf-8", "surrogatepass")  # any str, names read with surrogateescape included


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


class Plan(Sequence[Sample]):
    """The samples of a plan, in order, appended one at a time: plan[i] is the
    Sample appended i-th. Sources are kept once each, errors (rare) by index."""

    def __init__(self, samples: Iterable[Sample] = ()) -> None:
        self._sources: list[str] = []
        self._source_numbers: dict[str, int] = {}
        self._source = array("i")  # index into _sources, or _SAME
        self._offset = array("q")
        self._size = array("q")
        self._text = bytearray()  # each sample's _text, encoded
        self._ends = array("q")  # where each sample's text ends in _text
        self._errors: dict[int, str] = {}
        self.extend(samples)

    def _number(self, source: str) -> int:
        """The index of a source in _sources, added there if new."""
        number = self._source_numbers.setdefault(source, len(self._sources))
        if number == len(self._sources):
            self._sources.append(source)
        return number

    def append(self, sample: Sample) -> None:
        source = _SAME if sample.source == sample.key else self._number(sample.source)
        if sample.error is not None:
            self._errors[len(self)] = sample.error
        self._text += _text(sample).encode(*_ENCODING)
        self._ends.append(len(self._text))
        self._source.append(source)
        self._offset.append(sample.offset)
        self._size.append(sample.size)

    def extend(self, samples: Iterable[Sample]) -> None:
        if isinstance(samples, Plan):
            self._extend_arrays(samples)
            return
        for sample in samples:
            self.append(sample)

    def _extend_arrays(self, other: Plan) -> None:
        """Appends another plan's samples from its arrays, without making them."""
        numbers = [self._number(source) for source in other._sources]
        self._errors.update({len(self) + index: error for index, error in other._errors.items()})
        start = len(self._text)
        self._text += other._text
        self._ends.extend(array("q", (start + end for end in other._ends)))
        self._source.extend(array("i", (_SAME if number == _SAME else numbers[number] for number in other._source)))
        self._offset.extend(other._offset)
        self._size.extend(other._size)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int) -> Sample:
        index = range(len(self))[index]  # IndexError, and negative indices, as a list has them
        start = self._ends[index - 1] if index else 0
        key, member = _key_and_member(self._text[start : self._ends[index]].decode(*_ENCODING))
        source = self._source[index]
        return Sample(
            key,
            key if source == _SAME else self._sources[source],
            member,
            self._offset[index],
            self._size[index],
            self._errors.get(index),
        )

    @property
    def nbytes(self) -> int:
        """The memory it holds, but for the few error texts."""
        arrays = (self._source, self._offset, self._size, self._text, self._ends, self._sources, self._source_numbers)
        return sum(sys.getsizeof(each) for each in arrays) + sum(sys.getsizeof(each) for each in self._sources)


__all__ = ["Plan", "Sample"]
