"""Where the images of a sharded run come from: image files, folders, globs,
brace patterns, WebDataset tar shards, and text or parquet file lists,
expanded one at a time into the ordered samples of the plan (planning.py
writes it).

Every sample has a key (an image file's absolute path, or a tar sample's
WebDataset key), its source (the file or the tar) and, in a tar, the byte
range of its image member, so that a DataLoader worker reads just those
bytes. The plan is a pure function of the inputs: every resumed run, with
any number of ranks, computes the same one, and its digest, with
stamps_digest of the input files' sizes and modification times, is what
tells a resumed run that it continues the same work on the same files.

Problems found while planning that belong to a sample (a tar sample with no
image member, a member cut off by a truncated tar, a tar whose headers stop
being readable) become error samples in the plan: they are skipped and named
in the errors file like an unreadable image, in the shard they fall in.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import posixpath
import re
import sqlite3
import tarfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from .images import IMAGE_EXTENSIONS, check_byte_count, images_in_folder, is_image_file
from .plan import TEXT_ENCODING, Sample

TAR_SUFFIXES = (".tar",)
COMPRESSED_TAR_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")
TEXT_LIST_SUFFIXES = (".txt", ".lst")
PARQUET_SUFFIXES = (".parquet",)
PARQUET_PATH_COLUMN = "path"
# The member that holds a WebDataset sample's image: the first of these extensions it has.
IMAGE_MEMBER_EXTENSIONS = ("jpg", "jpeg", "png", "webp")

_GLOB_CHARACTERS = frozenset("*?[")
_BRACE = re.compile(r"\{([^{}]*)\}")
_NUMBER_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?")
_LETTER_RANGE = re.compile(r"([a-zA-Z])\.\.([a-zA-Z])(?:\.\.(-?\d+))?")


class Input(NamedTuple):
    """One expanded input: an image file or a tar shard, by absolute path."""

    kind: str  # "file" or "tar"
    path: str


def has_braces(pattern: str) -> bool:
    return any(_brace_values(match.group(1)) is not None for match in _BRACE.finditer(pattern))


def _zero_padded(bound: str) -> bool:
    """A range bound written with a leading zero (05, -01; not 0 itself), which
    makes every value as wide as the wider bound."""
    digits = bound.lstrip("-")
    return len(digits) > 1 and digits.startswith("0")


def _brace_values(body: str) -> list[str] | None:
    """What a brace body expands to, as bash expands it; None for a body that is
    neither a range nor alternatives (it stays as it is). A range runs from its
    first bound to its last, both included, by its step's size (1 if none or 0;
    the bounds give the direction): `{8..10}`, `{000..010..2}` (a bound with a
    leading zero pads every value to the wider bound's width), `{a..e}`."""
    numbers = _NUMBER_RANGE.fullmatch(body)
    letters = _LETTER_RANGE.fullmatch(body)
    if numbers or letters:
        first, last, step = (numbers or letters).groups()
        start, stop = (int(first), int(last)) if numbers else (ord(first), ord(last))
        size = abs(int(step or 1)) or 1
        values = range(start, stop + 1, size) if stop >= start else range(start, stop - 1, -size)
        if letters:
            return [chr(value) for value in values]
        width = max(len(first), len(last)) if _zero_padded(first) or _zero_padded(last) else 0
        return [f"{value:0{width}d}" for value in values]
    return body.split(",") if "," in body else None


def expand_braces(pattern: str) -> list[str]:
    """Brace expansion as WebDataset and the shell do it: `a-{000..002}.tar`
    gives a-000.tar, a-001.tar, a-002.tar, and `{x,y}` gives each alternative
    (see _brace_values). Braces holding neither stay as they are."""
    for match in _BRACE.finditer(pattern):
        values = _brace_values(match.group(1))
        if values is None:
            continue
        head, tail = pattern[: match.start()], pattern[match.end() :]
        return [expanded for value in values for expanded in expand_braces(head + value + tail)]
    return [pattern]


def _suffix(path: str) -> str:
    name = os.path.basename(path).lower()
    for suffix in COMPRESSED_TAR_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    dot = name.rfind(".")  # as Path(name).suffix, without making a Path of each of millions of names
    return name[dot:] if 0 < dot < len(name) - 1 else ""


def _classify(path: str) -> str:
    """What a named file is: "tar", "list", "parquet" or "file" (an image, whatever its extension)."""
    suffix = _suffix(path)
    if suffix in COMPRESSED_TAR_SUFFIXES:
        raise ValueError(
            f"{path}: compressed tar shards are not supported (their members cannot be read without "
            "decompressing everything before them); WebDataset shards are plain .tar files"
        )
    if suffix in TAR_SUFFIXES:
        return "tar"
    if suffix in TEXT_LIST_SUFFIXES:
        return "list"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "file"


def read_text_list(path: str) -> Iterator[str]:
    """The entries of a text file list, read as they are needed: one path a
    line; blank lines and lines starting with # are skipped; relative paths
    are taken from the list's folder."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        with open(path, encoding="utf-8-sig") as file:  # -sig: a byte-order mark is not part of the first path
            for line in file:
                line = line.strip()
                if line and not line.startswith("#"):
                    yield os.path.join(folder, line)
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: a file list must be UTF-8 text ({error})") from error
    except OSError as error:
        raise ValueError(f"cannot read file list {path}: {error.strerror}") from error


def read_parquet_list(path: str) -> Iterator[str]:
    """The entries of a parquet file list: its column "path" (relative paths
    from the file's folder), read a batch of rows at a time."""
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError as error:
        raise ValueError(f"{path}: reading a parquet file list needs pyarrow (pip install pyarrow)") from error
    import pyarrow

    try:
        schema = pq.read_schema(path)
        if PARQUET_PATH_COLUMN not in schema.names:
            raise ValueError(f"it has no column {PARQUET_PATH_COLUMN!r} (its columns: {schema.names})")
        kind = schema.field(PARQUET_PATH_COLUMN).type
        values = kind.value_type if pyarrow.types.is_dictionary(kind) else kind  # a categorical column
        strings = (
            pyarrow.types.is_string,
            pyarrow.types.is_large_string,
            getattr(pyarrow.types, "is_string_view", None),
        )
        if not any(test is not None and test(values) for test in strings):
            raise ValueError(f"its column {PARQUET_PATH_COLUMN!r} must hold strings, not {kind}")
        folder = os.path.dirname(os.path.abspath(path))
        for batch in pq.ParquetFile(path).iter_batches(columns=[PARQUET_PATH_COLUMN]):
            yield from (os.path.join(folder, entry) for entry in batch.column(0).to_pylist() if entry)
    except (pyarrow.ArrowException, ValueError, OSError) as error:
        raise ValueError(f"{path}: cannot read it as a parquet file list: {error}") from error


def _list_entries(path: str, kind: str) -> Iterator[Input]:
    entries = read_text_list(path) if kind == "list" else read_parquet_list(path)
    for entry in entries:
        # Entries are not checked here (a list can name millions of files): one
        # that is missing fails when it is read, and is named in the errors file.
        yield Input("tar" if _classify(entry) == "tar" else "file", os.path.abspath(entry))


_KNOWN_FOLDERS = 1 << 16  # real paths of folders remembered at most, a few MB


def _real_path(path: str, known: dict[str, str]) -> str:
    """os.path.realpath(path), with each folder's remembered in `known` (a
    glob's or a folder's files share few folders): a file costs one lstat,
    not one a component."""
    folder, name = os.path.split(path)
    if folder not in known:
        if len(known) >= _KNOWN_FOLDERS:
            known.clear()
        known[folder] = os.path.realpath(folder)
    resolved = os.path.join(known[folder], name)
    return os.path.realpath(resolved) if os.path.islink(resolved) else resolved


def _scratch_database(table: str) -> sqlite3.Connection:
    """A private temporary database of one table (sqlite keeps a few MB of it
    in memory and the rest in a file of the temporary folder, removed when
    it closes): for what grows with a run's images."""
    database = sqlite3.connect("")
    database.execute(f"CREATE TABLE {table} WITHOUT ROWID")
    return database


# Of the paths to one file, keeps the least by (parts, path): the first of
# fewest parts in sorted order. parts() (_parts) runs only where a file is
# reached again: a Path of every match would take longer than its row's insert.
_KEEP_SHORTER = (
    "INSERT INTO shortest VALUES (?, ?) ON CONFLICT (real) DO UPDATE SET path = excluded.path "
    "WHERE (parts(excluded.path), excluded.path) < (parts(shortest.path), shortest.path)"
)


def _parts(path: bytes) -> int:
    return len(Path(path.decode(*TEXT_ENCODING)).parts)


def _shortest_path_to_each(paths: Iterable[str], known: dict[str, str]) -> Iterator[str]:
    """Sorted paths, one to each file or folder: a recursive glob follows
    links to folders, up the tree too, and reaches the same file by ever
    longer paths; the one of fewest parts is kept (of as many, the first in
    sorted order). They are kept and sorted in a _scratch_database, not in
    memory (a glob may match millions), in TEXT_ENCODING: UTF-8's bytes sort
    as their code points do, lone surrogates (names that are not UTF-8)
    included, so sqlite's ORDER BY gives str's order."""
    database = _scratch_database("shortest (real BLOB PRIMARY KEY, path BLOB)")
    try:
        database.create_function("parts", 1, _parts)
        rows = (
            (os.path.normcase(_real_path(path, known)).encode(*TEXT_ENCODING), path.encode(*TEXT_ENCODING))
            for path in paths
        )
        database.executemany(_KEEP_SHORTER, rows)
        for (path,) in database.execute("SELECT path FROM shortest ORDER BY path"):
            yield path.decode(*TEXT_ENCODING)
    finally:
        database.close()


def _expand_one(path: str, known: dict[str, str]) -> Iterator[Input]:
    if os.path.isfile(path):
        kind = _classify(path)
        if kind in ("list", "parquet"):
            yield from _list_entries(path, kind)
        else:
            yield Input(kind, os.path.abspath(path))
    elif os.path.isdir(path):
        yield from (Input("file", os.path.abspath(image)) for image in images_in_folder(path))
    elif has_braces(path):
        for each in expand_braces(path):
            found = 0
            for found, match in enumerate(_expand_one(each, known), 1):
                yield match
            if not found:
                problem = (
                    "has no image files"
                    if os.path.exists(each)
                    else "matches nothing"
                    if _GLOB_CHARACTERS.intersection(each)
                    else "does not exist"
                )
                raise FileNotFoundError(f"{each!r} (from {path!r}) {problem}")
    elif _GLOB_CHARACTERS.intersection(path):
        for match in _shortest_path_to_each(glob.iglob(path, recursive=True), known):
            if os.path.isdir(match):
                yield from (Input("file", os.path.abspath(image)) for image in images_in_folder(match))
            elif is_image_file(match):
                yield Input("file", os.path.abspath(match))
            elif _suffix(match) in TAR_SUFFIXES:
                yield Input("tar", os.path.abspath(match))


class _Seen:
    """The names of the inputs met so far, in a _scratch_database: a set of
    every path of a run would grow with its images."""

    def __init__(self) -> None:
        self.database = _scratch_database("seen (name BLOB PRIMARY KEY)")

    def add(self, names: Iterable[tuple[str, str]]) -> bool:
        """Adds the names (kind, path); whether none of them was there before."""
        new = True
        for kind, path in names:
            name = f"{kind}\0{path}".encode(*TEXT_ENCODING)
            new &= self.database.execute("INSERT OR IGNORE INTO seen VALUES (?)", (name,)).rowcount == 1
        return new

    def close(self) -> None:
        self.database.close()


def expand_inputs(paths: Sequence[str]) -> Iterator[Input]:
    """Expands the command line's paths into image files and tar shards, in the
    order given, dropping repeats, one at a time (a folder, a glob or a list
    may name millions): a file reached again, by the same path or through
    links (a recursive glob follows links to folders, up the tree too), is
    kept once, where first found. A file list's entries are known by their
    path alone (resolving links would cost each of millions of entries
    system calls): one is a repeat where its path was met before, as a path
    or as what a path resolved to. Raises FileNotFoundError naming the first
    path that yields nothing (a missing list file included), ValueError for
    a list or tar that cannot be used."""
    seen = _Seen()
    known: dict[str, str] = {}  # real paths of folders
    try:
        for path in paths:
            path = os.fspath(path)
            listed = os.path.isfile(path) and _classify(path) in ("list", "parquet")
            matches = 0
            for matches, match in enumerate(_expand_one(path, known), 1):
                names = {(match.kind, os.path.normcase(match.path))}
                if not listed:
                    names.add((match.kind, os.path.normcase(_real_path(match.path, known))))
                if seen.add(names):
                    yield match
            if not matches:
                raise FileNotFoundError(f"no image files found for {path!r}")
    finally:
        seen.close()


def split_member_name(name: str) -> tuple[str, str]:
    """(key, extension) of a tar member, as WebDataset splits them: the key is
    the path up to the first dot of the file name."""
    folder, base = posixpath.split(name)
    stem, _, extension = base.partition(".")
    return (posixpath.join(folder, stem) if folder else stem), extension.lower()


class _Member(NamedTuple):
    """A tar member as part of a sample: where its bytes are (a hard link's are
    its target's), or why they cannot be read."""

    name: str
    offset: int = -1
    size: int = -1
    problem: str | None = None


def _member(info: tarfile.TarInfo, files: dict[str, _Member]) -> _Member:
    """What a sample can read of a member. `files` holds the earlier members
    whose bytes can be read, by normalized name: a hard link (GNU tar stores a
    file's second copy as one) names one of them."""
    if info.islnk():
        target = files.get(posixpath.normpath(info.linkname))
        if target is None:
            return _Member(
                info.name, problem=f"is a hard link to {info.linkname!r}, which is no earlier file of the tar"
            )
        return target._replace(name=info.name)
    if info.issym():
        return _Member(info.name, problem=f"is a symbolic link to {info.linkname!r}; links in a tar are not followed")
    if info.sparse is not None:
        return _Member(info.name, problem="is a sparse file, whose bytes are not stored in one piece")
    if not info.isfile():
        return _Member(info.name, problem=f"is not a file but a special entry (tar type {info.type!r})")
    return _Member(info.name, info.offset_data, info.size)


def _image_member(members: dict[str, _Member]) -> _Member | None:
    """A sample's image member (members by extension, in member order): the
    first of IMAGE_MEMBER_EXTENSIONS it has; failing that, a member whose
    multi-part extension ends in one of them (left.jpg, 000.png), in that
    order of extensions, then in member order."""
    for extension in IMAGE_MEMBER_EXTENSIONS:
        if extension in members:
            return members[extension]
    for extension in IMAGE_MEMBER_EXTENSIONS:
        for name, member in members.items():
            if name.rpartition(".")[2] == extension:
                return member
    return None


def _sample_of(tar_path: str, key: str, members: dict[str, _Member], tar_size: int) -> Sample:
    """A sample from its members: its image member is _image_member's among
    those that can be read (as WebDataset, which reads only files); failing
    that, one that cannot be read makes the sample an error naming it."""
    member = _image_member({extension: each for extension, each in members.items() if each.problem is None})
    if member is not None:
        if member.offset + member.size > tar_size:
            return Sample(key, tar_path, member.name, error="the tar ends inside this member (truncated tar)")
        return Sample(key, tar_path, member.name, member.offset, member.size)
    unreadable = _image_member(members)
    if unreadable is not None:
        return Sample(key, tar_path, unreadable.name, error=f"the image member {unreadable.problem}")
    have = ", ".join(sorted(members)) or "nothing"
    return Sample(
        key, tar_path, error=f"no image member ({'/'.join(IMAGE_MEMBER_EXTENSIONS)}) in the sample; it has {have}"
    )


def _first_data_block(file, start: int) -> int | None:
    """Where the first 512-byte block from `start` (a block boundary) on that
    holds a byte other than zero begins; None if none does."""
    file.seek(start)
    position = start
    while chunk := file.read(1 << 16):
        zeros = len(chunk) - len(chunk.lstrip(b"\0"))
        if zeros < len(chunk):
            return position + zeros - zeros % tarfile.BLOCKSIZE
        position += len(chunk)
    return None


def scan_tar(path: str) -> list[Sample]:
    """The samples of one WebDataset tar, in member order, reading only the
    member headers. A sample is the run of consecutive members sharing a key;
    its image member is _sample_of's. Hidden members (._name) and folders are
    ignored. A tar that cannot be read, whose headers stop being readable
    part-way, that ends without its end-of-archive blocks (cut between
    members), or that holds data after them (tars joined with cat, which
    tar reads only with --ignore-zeros), adds one error sample (key: the
    tar's path and the byte offset) for what could not be listed."""
    samples: list[Sample] = []
    key, members, size = None, {}, 0
    files: dict[str, _Member] = {}  # the members whose bytes can be read, for hard links
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as raw, tarfile.open(fileobj=raw, mode="r:") as tar:
            for info in tar:
                if info.isdir():
                    continue
                member = _member(info, files)
                if member.problem is None:
                    files[posixpath.normpath(info.name)] = member
                if posixpath.basename(info.name).startswith("."):
                    continue
                member_key, extension = split_member_name(info.name)
                if member_key != key:
                    if key is not None:
                        samples.append(_sample_of(path, key, members, size))
                    key, members = member_key, {}
                members.setdefault(extension, member)
            if key is not None:
                samples.append(_sample_of(path, key, members, size))
                key = None
            # tarfile stops quietly at a damaged header, at the end of a file
            # cut between members, and at the first end block: what follows
            # must be the end blocks, then nothing but zeros.
            end = tar.offset
            data = _first_data_block(raw, end)
            if data == end:
                reason = f"unreadable tar header at byte {end}; the rest of the tar is skipped"
                samples.append(Sample(f"{path}@{end}", path, error=reason))
            elif size - end < tarfile.BLOCKSIZE:
                reason = f"the tar ends at byte {end} without its end-of-archive blocks: it was cut short there"
                samples.append(Sample(f"{path}@{end}", path, error=reason))
            elif data is not None:
                reason = (
                    f"data follows the end-of-archive blocks (at byte {end}) from byte {data}, and is skipped: "
                    "were tars joined with cat? Name each tar instead"
                )
                samples.append(Sample(f"{path}@{data}", path, error=reason))
    except (OSError, tarfile.TarError, EOFError) as error:
        if key is not None:  # the sample being listed when the tar ended
            samples.append(_sample_of(path, key, members, size))
            if samples[-1].error is not None and "truncated" in samples[-1].error:
                return samples
        samples.append(Sample(path, path, error=f"cannot read the tar: {type(error).__name__}: {error}"))
    return samples


def plan_digest(plan: Iterable[Sample]) -> str:
    """A digest of the plan: the same inputs, in the same order, with the same bytes where."""
    digest = hashlib.sha256()
    encode = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps makes an encoder a call
    samples = iter(plan)
    while lines := [encode(list(sample)) + "\n" for sample in itertools.islice(samples, 4096)]:
        digest.update("".join(lines).encode())
    return digest.hexdigest()


def _stamp(path: str) -> tuple[int, int] | None:
    """A file's size and modification time in nanoseconds; None where it cannot
    be found (a listed file that is missing, which is read, and named in the
    errors file, in its turn)."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_size, status.st_mtime_ns


def map_ahead(function: Callable, items: Iterable, threads: int) -> Iterator:
    """function(item) of each item, in order, by `threads` threads, computed at
    most 2 x threads items ahead of the caller (there may be millions)."""
    pending: deque = deque()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for item in items:
            pending.append(pool.submit(function, item))
            if len(pending) > 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _stamps(paths: list[str]) -> bytes:
    return "".join(f"{_stamp(path)}\n" for path in paths).encode()


def stamps_digest(paths: Iterable[str], threads: int = 16, chunk: int = 1024) -> str:
    """A digest of every input file's size and modification time (a tar's own,
    not its members'), or of its absence: the plan's digest covers names and
    byte ranges, not contents, so this is what tells a resumed run that the
    files changed since the run began. Several stats at a time: on a network
    file system each waits for the server."""
    paths = iter(paths)
    chunks = iter(lambda: list(itertools.islice(paths, chunk)), [])
    digest = hashlib.sha256()
    for stamps in map_ahead(_stamps, chunks, threads):
        digest.update(stamps)
    return digest.hexdigest()


# Descriptors of the tars this process has read from, by path: a DataLoader
# worker reads many samples of a tar, so each is opened once.
_open_tars: dict[str, int] = {}


def forget_open_tars() -> None:
    """Closes the tars read so far (planning does, so that a tar written
    again under its path since an earlier run in this process is read anew)."""
    for descriptor in _open_tars.values():
        os.close(descriptor)
    _open_tars.clear()


def read_sample_bytes(sample: Sample) -> bytes:
    """The encoded image of a sample: the whole file, or its tar member's bytes.
    Raises ImageTooLarge, before reading, for one over MAX_IMAGE_BYTES."""
    if sample.member is None:
        with open(sample.source, "rb") as file:
            check_byte_count(os.fstat(file.fileno()).st_size)
            return file.read()
    check_byte_count(sample.size)
    descriptor = _open_tars.get(sample.source)
    if descriptor is None:
        if len(_open_tars) >= 64:
            forget_open_tars()
        descriptor = _open_tars[sample.source] = os.open(sample.source, os.O_RDONLY)
    data = os.pread(descriptor, sample.size, sample.offset)
    if len(data) != sample.size:
        raise OSError(f"{sample.source}: the tar ends inside member {sample.member}")
    return data


__all__ = [
    "IMAGE_EXTENSIONS",
    "Input",
    "Sample",
    "expand_braces",
    "expand_inputs",
    "map_ahead",
    "plan_digest",
    "read_sample_bytes",
    "scan_tar",
    "stamps_digest",
]
