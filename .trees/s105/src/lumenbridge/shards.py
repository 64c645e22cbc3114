"""Sharded token output: a folder of safetensors shards with a JSON-lines index,
written so that a run can be killed at any moment and resumed to a
byte-identical result, and read back lazily.

Layout of an output folder DIR:

    lumenbridge.json                   what the run is: its inputs' digests, settings, model (written first)
    tokens-00000-of-00012.safetensors  the tokens of shard 0: "tokens" [rows, T, D]
    parts/tokens-00000-of-00012.index.jsonl    that shard's index lines
    parts/tokens-00000-of-00012.errors.jsonl   that shard's skipped samples
    index.jsonl                        every shard's index lines, in order (written last: the run is complete)
    errors.jsonl                       every skipped sample with the reason
    .lumenbridge-partial-plan-*/       while the run runs: its plan, which every rank maps (planning.py)

Shard s holds the readable images among plan samples [s * shard_size, (s + 1) * shard_size),
in plan order; a shard's content depends only on the plan and the settings,
never on which rank made it or how often the run was interrupted. A shard is
written in a staging folder (.lumenbridge-partial-*, as for single files),
its tokens streamed into place batch by batch, then flushed to disk and
renamed: index part, errors part, shard last. A shard counts as done when
all three exist; anything else is redone from the start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from .atomic import STAGING_PREFIX, current_umask, folder_lock, remove_abandoned, staging_folder, write_atomically

MANIFEST = "lumenbridge.json"
INDEX = "index.jsonl"
ERRORS = "errors.jsonl"
PARTS = "parts"
FORMAT = "lumenbridge-token-shards"
FORMAT_VERSION = 2  # 2: the inputs record their files' stamps

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class OutputError(Exception):
    """DIR cannot be used for this run; the message says why and what to do."""


def shard_name(index: int, count: int) -> str:
    width = max(5, len(str(count)))
    return f"tokens-{index:0{width}d}-of-{count:0{width}d}.safetensors"


def shard_count(images: int, shard_size: int) -> int:
    return max(1, -(-images // shard_size))


def dumps(record: dict) -> str:
    """One JSON line, the same bytes for the same record on every run. A name
    that is not valid UTF-8 (Python keeps its bytes as surrogate escapes) has
    no UTF-8 text, so a record holding one is written with \\u escapes, which
    json.loads reads back as the same str (and os.fsencode turns into the
    same bytes)."""
    line = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    try:
        line.encode()
    except UnicodeEncodeError:
        return json.dumps(record, separators=(",", ":"))
    return line


def fsync_directory(path: str | os.PathLike) -> None:
    with contextlib.suppress(OSError):  # not every file system can
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


# --- the output folder -------------------------------------------------------------------


def is_output_dir(path: str | os.PathLike) -> bool:
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as file:
            return json.load(file).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_manifest(path: str | os.PathLike) -> dict:
    with open(os.path.join(path, MANIFEST), encoding="utf-8") as file:
        return json.load(file)


# The names of a shard (shard_name) and of its parts (part_paths).
SHARD_NAME = re.compile(r"tokens-\d{5,}-of-\d{5,}\.safetensors")
PART_NAME = re.compile(r"tokens-\d{5,}-of-\d{5,}\.(index|errors)\.jsonl")


def _kind(directory: str, name: str) -> int:
    """The file type bits of DIR's entry itself (a symlink is not followed), 0 if it is gone."""
    try:
        return stat.S_IFMT(os.lstat(os.path.join(directory, name)).st_mode)
    except FileNotFoundError:
        return 0


def _staging(directory: str, name: str) -> bool:
    return name.startswith(STAGING_PREFIX) and _kind(directory, name) == stat.S_IFDIR


def ours(directory: str, name: str) -> bool:
    """Whether DIR's entry `name` is one that a run writes (and --overwrite may
    remove): the manifest, the index, the error list or a shard as a regular
    file, a staging folder, or the parts folder while it holds nothing but
    shards' parts. Judged by name and type, never through a symlink: a link or
    a folder under a run's name is the user's, and a run would write through
    it or remove what it holds."""
    if name == PARTS:
        parts = os.path.join(directory, PARTS)
        return _kind(directory, name) == stat.S_IFDIR and all(
            (PART_NAME.fullmatch(entry) and _kind(parts, entry) == stat.S_IFREG) or _staging(parts, entry)
            for entry in os.listdir(parts)
        )
    if name in (MANIFEST, INDEX, ERRORS) or SHARD_NAME.fullmatch(name):
        return _kind(directory, name) == stat.S_IFREG
    return _staging(directory, name)


def decisive_model(model: dict) -> dict:
    """A manifest's model section less how --weights was spelled: weights_digest
    says which weights they are. What both the resume check and a shard's run
    id compare."""
    return {key: value for key, value in model.items() if key != "weights"}


def inputs_difference(old: dict, now: dict) -> str:
    """How the inputs DIR's run recorded differ from this command's: their
    plans (samples, digest) or, the plans the same, their files' stamps."""
    if {**old, "stamps": now["stamps"]} == now:
        return (
            f"inputs: the same {now['samples']} samples as DIR's run, but an input file changed since it began "
            "(its size or modification time differs)"
        )
    return (
        f"inputs: DIR holds a run over {old.get('samples')} samples (image files and tar samples, readable or not; "
        f"digest {str(old.get('digest'))[:12]}), this command names {now['samples']} (digest {now['digest'][:12]})"
    )


def compare_manifests(stored: dict, new: dict, allow_mixed: bool) -> list[str]:
    """What differs between the run that made DIR and this one; [] if it may continue.
    The inputs and every setting that decides the tokens must match; the execution
    settings (batch size, device type, backend) may differ with allow_mixed."""
    differences = []
    if stored.get("version") != new["version"]:
        differences.append(f"format version {stored.get('version')} (this LumenBridge writes {new['version']})")
    if stored.get("inputs") != new["inputs"]:
        differences.append(inputs_difference(stored.get("inputs") or {}, new["inputs"]))
    for section in ("settings", "model") + (() if allow_mixed else ("execution",)):
        old, now = stored.get(section) or {}, new[section]
        if section == "model":
            old, now = decisive_model(old), decisive_model(now)
        for name in sorted(set(old) | set(now)):
            if old.get(name) != now.get(name):
                differences.append(f"{name}: DIR has {old.get(name)!r}, this command {now.get(name)!r}")
    return differences


def create_output_dir(path: str) -> None:
    """Makes DIR if needed (its parent must exist) and checks that files can be written in it."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputError(f"--out {path} exists and is not a folder")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise OutputError(f"--out {path}: folder {parent} does not exist")
    try:
        os.makedirs(path, exist_ok=True)
        with staging_folder(path):
            pass
    except OSError as error:
        raise OutputError(f"--out {path}: cannot write in {path}: {error.strerror}") from error


def check_output_dir(path: str) -> None:
    """Refuses, before any work, a DIR holding files that no LumenBridge run wrote."""
    foreign = sorted(name for name in os.listdir(path) if not ours(path, name))
    if foreign:
        raise OutputError(
            f"--out {path} holds files that a LumenBridge run did not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); choose a new or empty folder"
        )


def prepare_output_dir(path: str, manifest: dict, *, overwrite: bool, allow_mixed: bool) -> None:
    """Checks that DIR can hold this run and, for a new run, writes its manifest.

    A new or empty folder starts a new run. A folder holding a run with the same
    inputs (their files unchanged) and settings continues it, unless --overwrite
    asks to start afresh. A folder of another run is refused (with
    --overwrite its files are removed and the run starts afresh), and so is a
    folder with anything else in it, even with --overwrite: nothing LumenBridge
    did not write is ever removed. Staging folders of killed runs are removed."""
    check_output_dir(path)
    remove_abandoned(path)
    if is_output_dir(path):
        differences = compare_manifests(read_manifest(path), manifest, allow_mixed)
        if not differences and not overwrite:
            return
        if not overwrite:
            mixed = all(d.split(":")[0] in manifest["execution"] for d in differences)
            hint = (
                "pass --allow-mixed to continue with them"
                if mixed
                else "pass --overwrite to discard it and start again"
            )
            raise OutputError(
                f"--out {path} holds a different run:\n  "
                + "\n  ".join(differences)
                + f"\n{hint}, or choose another folder"
            )
    elif any(not _staging(path, name) for name in os.listdir(path)) and not overwrite:  # staging: in use
        raise OutputError(f"--out {path} holds shards but no {MANIFEST}; pass --overwrite to discard them")
    remove_run(path)
    write_atomically(os.path.join(path, MANIFEST), lambda staged: Path(staged).write_text(dumps(manifest) + "\n"))
    fsync_directory(path)


def remove_run(path: str) -> None:
    """Removes what a LumenBridge run wrote in DIR (and nothing else)."""
    remove_abandoned(path)
    for name in os.listdir(path):
        if not ours(path, name) or name.startswith(STAGING_PREFIX):
            continue
        target = os.path.join(path, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        else:
            os.unlink(target)


@contextlib.contextmanager
def run_lock(path: str) -> Iterator[None]:
    """Held by the run (rank 0) for its whole length: a second command writing
    to the same DIR is refused. The kernel drops it when the run dies (on
    Windows there is no lock)."""
    with folder_lock(path, wait=False) as locked:
        if locked is False:
            raise OutputError(f"--out {path} is being written by another lumenbridge run; wait for it to finish")
        yield


def part_paths(directory: str, name: str) -> tuple[str, str]:
    stem = name.removesuffix(".safetensors")
    parts = os.path.join(directory, PARTS)
    return os.path.join(parts, stem + ".index.jsonl"), os.path.join(parts, stem + ".errors.jsonl")


def shard_done(directory: str, name: str) -> bool:
    return os.path.isfile(os.path.join(directory, name)) and all(map(os.path.isfile, part_paths(directory, name)))


def pending_shards(directory: str, count: int) -> list[int]:
    return [index for index in range(count) if not shard_done(directory, shard_name(index, count))]


def finish_run(directory: str, count: int) -> tuple[int, int]:
    """Writes errors.jsonl and then index.jsonl from the shards' parts, each
    atomically; returns (rows, errors). index.jsonl exists only for a complete run."""
    names = [shard_name(index, count) for index in range(count)]
    missing = [name for name in names if not shard_done(directory, name)]
    if missing:
        raise OutputError(f"{len(missing)} of {count} shards are missing ({missing[0]}, ...)")
    for position, target in ((1, ERRORS), (0, INDEX)):

        def concatenate(staged: str, position=position) -> None:
            with open(staged, "wb") as out:
                for name in names:
                    with open(part_paths(directory, name)[position], "rb") as part:
                        shutil.copyfileobj(part, out, 1 << 20)

        write_atomically(os.path.join(directory, target), concatenate)
    fsync_directory(directory)
    return count_lines(os.path.join(directory, INDEX)), count_lines(os.path.join(directory, ERRORS))


def count_lines(path: str) -> int:
    lines = 0
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            lines += block.count(b"\n")
    return lines


# --- writing one shard -------------------------------------------------------------------


class ShardWriter:
    """Streams one shard's tokens into a safetensors file in a staging folder,
    then commits it with its index and errors parts.

    The header is written last, in room reserved for the planned number of rows
    (the format allows trailing spaces in the header), so rows go to disk as
    they are computed and no shard is ever held whole in memory."""

    def __init__(
        self,
        directory: str,
        name: str,
        planned_rows: int,
        row_shape: Sequence[int],
        dtype: torch.dtype,
        metadata: dict[str, str],
    ):
        self.directory = directory
        self.name = name
        self.row_shape = list(row_shape)
        self.dtype = dtype
        self.metadata = metadata
        self.row_bytes = torch.Size(row_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.rows = 0  # written
        self.next_row = 0  # numbered in the index (ahead of the writing)
        self.index_lines: list[str] = []
        self.error_lines: list[str] = []
        self._staging = staging_folder(directory)
        self.folder = self._staging.__enter__()
        self.header_room = len(self._header(planned_rows))
        self.header_room += -(8 + self.header_room) % 8  # the data starts 8-byte aligned
        self.data_start = 8 + self.header_room  # the header's length, then the header
        self.file = open(self.folder / name, "wb")  # noqa: SIM115 - closed in commit or abort
        self.file.seek(self.data_start)

    def _header(self, rows: int) -> bytes:
        header = {
            "__metadata__": self.metadata,
            "tokens": {
                "dtype": SAFETENSORS_DTYPES[self.dtype],
                "shape": [rows, *self.row_shape],
                "data_offsets": [0, rows * self.row_bytes],
            },
        }
        return json.dumps(header, separators=(",", ":")).encode()

    def write_rows(self, tokens: torch.Tensor) -> None:
        """Appends rows [n, *row_shape] (a CPU tensor in the shard's dtype)."""
        tokens = tokens.contiguous()
        start = self.data_start + self.rows * self.row_bytes
        self.file.write(memoryview(tokens.view(torch.uint8).numpy()))
        self.rows += tokens.shape[0]
        self._start_writeback(start, tokens.shape[0] * self.row_bytes)

    def _start_writeback(self, start: int, length: int) -> None:
        """Starts writing the rows just written to disk without waiting (on
        Linux, DONTNEED starts writeback of dirty pages and then drops them
        from the page cache once clean), so the disk works while the next
        rows are computed and the commit's fsync has little left to do; it
        also keeps the page cache from filling with tokens."""
        if hasattr(os, "posix_fadvise"):
            self.file.flush()
            os.posix_fadvise(self.file.fileno(), start, length, os.POSIX_FADV_DONTNEED)

    def add_index(self, record: dict) -> None:
        self.index_lines.append(dumps(record) + "\n")

    def add_error(self, record: dict) -> None:
        self.error_lines.append(dumps(record) + "\n")

    def commit(self, before_rename=None) -> None:
        if self.rows != self.next_row:
            raise RuntimeError(f"{self.name}: {self.rows} rows written but {self.next_row} indexed")
        header = self._header(self.rows)
        self.file.seek(0)
        self.file.write(struct.pack("<Q", self.header_room))
        self.file.write(header + b" " * (self.header_room - len(header)))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        index_path, errors_path = part_paths(self.directory, self.name)
        os.makedirs(os.path.dirname(index_path), exist_ok=True)
        staged = []
        for lines, target in ((self.index_lines, index_path), (self.error_lines, errors_path)):
            part = self.folder / os.path.basename(target)
            with open(part, "w", encoding="utf-8") as file:
                file.writelines(lines)
                file.flush()
                os.fsync(file.fileno())
            staged.append((part, target))
        for part, target in staged:
            os.chmod(part, 0o644 & ~current_umask())
            os.replace(part, target)
        fsync_directory(os.path.dirname(index_path))
        if before_rename is not None:
            before_rename()
        os.chmod(self.folder / self.name, 0o644 & ~current_umask())
        os.replace(self.folder / self.name, os.path.join(self.directory, self.name))
        fsync_directory(self.directory)
        self._staging.__exit__(None, None, None)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        self._staging.__exit__(None, None, None)


# --- reading the output back --------------------------------------------------------------


class TokenRecord(NamedTuple):
    key: str
    tokens: torch.Tensor
    grid: tuple[int, int]


class TokenReader:
    """The tokens of a finished `lumenbridge tokenize --out DIR` run.

    Iterating yields (key, tokens [T, D], grid (rows, columns)) in index
    order, reading one row at a time from memory-mapped shards; reader[key]
    (or reader.get(key)) returns one image's tokens, and reader.record(key)
    its index entry (a key that names images in several tars takes their
    source=). len(reader) is the number of images tokenized.

    A single file written with --out FILE.safetensors reads the same way,
    keyed by the images' paths."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._open: dict[str, object] = {}
        self._by_key: dict[str, list[dict]] | None = None
        if os.path.isdir(self.path):
            if not is_output_dir(self.path):
                raise FileNotFoundError(f"{self.path} is not a LumenBridge output folder (no {MANIFEST})")
            if not os.path.isfile(os.path.join(self.path, INDEX)):
                manifest = read_manifest(self.path)
                done = manifest["shards"] - len(pending_shards(self.path, manifest["shards"]))
                raise FileNotFoundError(
                    f"{self.path}: the run is not complete ({done} of {manifest['shards']} shards, no {INDEX}); "
                    "run the same command again to finish it"
                )
            self._records = None
        else:
            self._records = _single_file_records(self.path)

    def records(self) -> Iterator[dict]:
        """The index entries, in order, read lazily from index.jsonl."""
        if self._records is not None:
            yield from self._records
            return
        with open(os.path.join(self.path, INDEX), encoding="utf-8") as file:
            for line in file:
                yield json.loads(line)

    def __len__(self) -> int:
        if self._records is not None:
            return len(self._records)
        return count_lines(os.path.join(self.path, INDEX))

    def _shard(self, name: str):
        from safetensors import safe_open

        handle = self._open.get(name)
        if handle is None:
            if len(self._open) >= 8:
                self._open.clear()
            handle = self._open[name] = safe_open(os.path.join(self.path, name), framework="pt")
        return handle

    def _tokens(self, record: dict) -> torch.Tensor:
        if "tokens" in record:  # a single file's row, already sliced
            return record["tokens"]()
        return self._shard(record["shard"]).get_slice("tokens")[record["row"]]

    def __iter__(self) -> Iterator[TokenRecord]:
        for record in self.records():
            yield TokenRecord(record["key"], self._tokens(record), tuple(record["grid"]))

    def record(self, key: str, source: str | None = None) -> dict:
        """The index entry of one image. A key that names several images (the
        same WebDataset key in several tars) needs `source`, the tar's path as
        given to the run or absolute, to pick one; KeyError otherwise, naming
        the sources. (A tar that repeats a key among other samples holds
        several images under it: iterating reaches each.)"""
        wanted = None if source is None else os.path.abspath(source)
        found = [r for r in self._index()[key] if wanted is None or r["source"] == wanted]
        if len(found) == 1:
            return found[0]
        if not found:
            raise KeyError(f"{key!r} was not tokenized from {source!r}")
        if wanted is not None:
            raise KeyError(
                f"{key!r} names {len(found)} images in {source} (the tar repeats the key); "
                "iterate over the reader to reach each"
            )
        sources = ", ".join(sorted({r["source"] for r in found}))
        raise KeyError(f"{key!r} names {len(found)} images, from {sources}: give source= to pick one")

    def get(self, key: str, source: str | None = None) -> torch.Tensor:
        """One image's tokens by key (and source, where a key names several
        images); KeyError if it was not tokenized. The first call reads the
        whole index into a dict."""
        return self._tokens(self.record(key, source))

    __getitem__ = get

    def __contains__(self, key: str) -> bool:
        return key in self._index()

    def _index(self) -> dict[str, list[dict]]:
        """The index entries by key, read once."""
        if self._by_key is None:
            by_key: dict[str, list[dict]] = {}
            for record in self.records():
                by_key.setdefault(record["key"], []).append(record)
            self._by_key = by_key
        return self._by_key


def _single_file_records(path: str) -> list[dict]:
    from safetensors import safe_open

    from .config import TokenizerConfig
    from .shapes import grid_extent

    with safe_open(path, framework="pt") as file:
        metadata = file.metadata() or {}
        names = set(file.keys())
    if "tokens" not in names or "paths" not in metadata:
        raise ValueError(f"{path} is not a LumenBridge tokens file")
    paths = json.loads(metadata["paths"])
    handle = safe_open(path, framework="pt")
    if "grid_hw" in names:
        grid_hw = handle.get_tensor("grid_hw").tolist()
        starts = handle.get_tensor("cu_seqlens").tolist()
        return [
            {"key": key, "source": key, "grid": grid, "tokens": lambda a=a, b=b: handle.get_slice("tokens")[a:b]}
            for key, grid, a, b in zip(paths, grid_hw, starts, starts[1:], strict=False)
        ]
    config = TokenizerConfig.from_json(metadata["config"])
    size = json.loads(metadata.get("preprocess", "{}")).get("image_size", config.image_size)
    side = grid_extent(size, config.kernel_size, config.strides)
    return [
        {"key": key, "source": key, "grid": [side, side], "tokens": lambda row=row: handle.get_slice("tokens")[row]}
        for row, key in enumerate(paths)
    ]


def read_tokens(path: str | os.PathLike) -> TokenReader:
    """Opens the output of `lumenbridge tokenize`: a folder of shards (--out DIR)
    or one file (--out FILE.safetensors). See TokenReader."""
    return TokenReader(path)
