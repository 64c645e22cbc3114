"""Sharded tokenization (`lumenbridge tokenize --out DIR`): the plan's samples
are decoded in DataLoader worker processes (or read there and decoded on the
GPU), tokenized in batches, and streamed into shards, with every stage
overlapping the others:

    workers  --(uint8 batches, pinned)-->  H2D copy stream  -->  model (compute stream)
       |                                                            |
       +-- or JPEG bytes --> GPU decode thread (own stream)         +--> D2H copy stream --> pinned buffers
                                                                                                  |
                                                                     --open-shards writer threads, a shard each
                                                                     in turn: rows to its file, then fsync + rename

Host memory stays bounded: a few batches in flight between the stages and a
few pinned token buffers, whatever the number of images (a shard's tokens go
to disk as they are made, never held whole, and the plan is read from files
mapped into memory: plan.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import re
import signal
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from tqdm import tqdm

from . import planning, shards
from .distributed import Group
from .images import (
    DEFAULT_MAX_PIXELS,
    IMAGE_READ_ERRORS,
    WHITE,
    decode_opened,
    exif_orientation,
    image_loader,
    open_image,
    preprocess,
)
from .plan import Plan
from .sources import Sample, read_sample_bytes

KILL_ENV = "LUMENBRIDGE_TEST_KILL"  # tests only: "point:shard", see _maybe_kill


def _maybe_kill(point: str, shard: int | str) -> None:
    """Kill this process with SIGKILL at a named point (tests of resuming after kill -9)."""
    if os.environ.get(KILL_ENV) == f"{point}:{shard}":
        os.kill(os.getpid(), signal.SIGKILL)


# --- reading and decoding in DataLoader workers ---------------------------------------------


class Item(NamedTuple):
    index: int  # into the plan
    pixels: torch.Tensor | None  # uint8 [3, S, S], decoded on the CPU
    encoded: torch.Tensor | None  # JPEG bytes for the GPU, 1-D uint8
    orientation: int
    size: tuple[int, int] | None  # the image's (width, height) as stored
    error: str | None
    seconds: float  # reading and decoding time in the worker


class Batch(NamedTuple):
    """A batch of plan samples from one shard, in plan order. Tensors are
    joined (one shared-memory segment each on the way out of a worker, not
    one per image)."""

    indices: list[int]
    items: list[Item]  # without their tensors
    pixels: torch.Tensor | None  # the CPU-decoded items' pixels, stacked in order
    encoded: torch.Tensor | None  # the JPEG bytes for the GPU, concatenated
    spans: dict[int, tuple[int, int]]  # plan index -> its bytes in `encoded`
    seconds: float


class SampleDataset(torch.utils.data.Dataset):
    """Plan samples read and decoded like ImageFileDataset does (Pillow, the
    pixel limit, EXIF orientation, transparency onto the background, resize and
    crop). With gpu=True, JPEGs the GPU can take come back as their bytes and
    everything else is decoded here."""

    def __init__(
        self,
        plan: Sequence[Sample],
        image_size: int,
        resize: int,
        *,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        background: tuple[int, int, int] = WHITE,
        gpu: bool = False,
    ):
        self.plan = plan
        self.image_size = image_size
        self.resize = resize
        self.max_pixels = max_pixels
        self.background = background
        self.gpu = gpu

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, index: int) -> Item:
        started = time.perf_counter()
        sample = self.plan[index]
        if sample.error is not None:
            return Item(index, None, None, 1, None, sample.error, 0.0)
        try:
            data = read_sample_bytes(sample)
            with open_image(io.BytesIO(data)) as image:
                size = image.size
                if self.gpu and self._for_gpu(image):
                    orientation = exif_orientation(image)
                    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                    return Item(index, None, encoded, orientation, size, None, time.perf_counter() - started)
                rgb = decode_opened(image, self.resize, max_pixels=self.max_pixels, background=self.background)
            pixels = preprocess(rgb, self.image_size, self.resize)
        except IMAGE_READ_ERRORS as error:
            return Item(index, None, None, 1, None, describe(error, sample), time.perf_counter() - started)
        return Item(index, pixels, None, 1, size, None, time.perf_counter() - started)

    def _for_gpu(self, image) -> bool:
        from .gpu_decode import GPU_MAX_PIXELS, GPU_MAX_SIDE

        width, height = image.size
        return (
            image.format == "JPEG"
            and image.mode in ("RGB", "L")
            and max(width, height) <= GPU_MAX_SIDE
            and width * height <= min(self.max_pixels, GPU_MAX_PIXELS)
        )


_IN_MEMORY = re.compile(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


def describe(error: BaseException, sample: Sample) -> str:
    """The reason a sample was skipped, the same on every run (Pillow names an
    in-memory file by its address; the sample's key stands in for it)."""
    name = repr(sample.key)
    # A function, not a template: re would read the backslashes of repr's escapes.
    return _IN_MEMORY.sub(lambda _: name, f"{type(error).__name__}: {error}")


def collate(items: Sequence[Item]) -> Batch:
    decoded = [item.pixels for item in items if item.pixels is not None]
    pixels = torch.stack(decoded) if decoded else None
    jpegs = [item.encoded for item in items if item.encoded is not None]
    encoded = torch.cat(jpegs) if jpegs else None
    spans, start = {}, 0
    for item in items:
        if item.encoded is not None:
            spans[item.index] = (start, start + len(item.encoded))
            start += len(item.encoded)
    light = [item._replace(pixels=None, encoded=None) for item in items]
    return Batch([item.index for item in items], light, pixels, encoded, spans, sum(item.seconds for item in items))


def _warm_up_decoder(device: torch.device) -> None:
    from PIL import Image

    from .gpu_decode import decode_jpegs

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (90, 120, 200)).save(buffer, "JPEG")
    decode_jpegs([torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)] * 2, device)


class DecoderWarmUp(threading.Thread):
    """nvJPEG's set-up on its first call (a second or so), begun as soon as the
    device is known (the inputs are listed by then) so that it overlaps the
    model's loading and the rest of the planning; finished before the
    DataLoader forks its workers, which must not copy the process in the
    middle of it. It decodes on a stream of its own, as the decoding thread
    does (see gpu_decode's note on nvJPEG), not on the one the model's dry run
    uses."""

    def __init__(self, device: torch.device):
        super().__init__(daemon=True, name="lumenbridge-decoder-warm-up")
        self.device = device
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        with timed(self, "seconds", "decoder_warm_up"):
            try:
                cuda = self.device.type == "cuda"
                with torch.cuda.stream(torch.cuda.Stream(self.device)) if cuda else contextlib.nullcontext():
                    _warm_up_decoder(self.device)
            except BaseException as error:  # noqa: BLE001 - raised by finish, in the run's thread
                self.error = error

    def finish(self, stats: Stats) -> None:
        self.join()
        stats.gpu_warmup = self.seconds
        if self.error is not None:
            raise self.error


@contextlib.contextmanager
def decoder_warm_up(device: torch.device) -> Iterator[DecoderWarmUp]:
    """A DecoderWarmUp begun now and joined on the way out, whatever ended the
    block: no thread of the run is left running past it."""
    warm_up = DecoderWarmUp(device)
    try:
        yield warm_up
    finally:
        warm_up.join()


def decode_on_cpu(data: bytes, image_size: int, resize: int, max_pixels: int, background) -> torch.Tensor:
    """The CPU path for one image the GPU could not decode."""
    with open_image(io.BytesIO(data)) as image:
        rgb = decode_opened(image, resize, max_pixels=max_pixels, background=background)
    return preprocess(rgb, image_size, resize)


# --- the run ------------------------------------------------------------------------------


@dataclass
class Options:
    out: str
    shard_size: int
    batch_size: int
    workers: int
    decode: str  # "cpu" or "gpu"
    image_size: int
    resize: int
    max_pixels: int
    background: tuple[int, int, int]
    dtype: torch.dtype
    device: torch.device
    backend: str  # the kernels that run the model (dispatch.py's name)
    open_shards: int  # shards a process writes at once, each by its own thread
    grid: list[int] = field(default_factory=list)  # the token grid of every image: [rows, columns]
    progress: bool = True
    on_failure: Callable[[str, str], None] | None = None


@dataclass
class Stats:
    images: int = 0
    skipped: int = 0
    shards: int = 0
    decode: float = 0.0  # CPU reading and decoding, summed over the workers
    gpu_decode: float = 0.0  # GPU decoding, orientation, resize and crop (the decoding thread's time)
    gpu_jpeg: float = 0.0  # of which in nvJPEG's batched decode call
    gpu_warmup: float = 0.0  # nvJPEG's set-up on its first call (a second or so), beside loading and planning
    gpu_resize: float = 0.0  # of which in the resize and crop (issuing it, and waiting for it before the next batch)
    transfer: float = 0.0  # host-to-device images and device-to-host tokens
    tokenize: float = 0.0  # the model
    write: float = 0.0  # writing shards: rows, fsync, renames
    input_wait: float = 0.0  # the model's thread waiting for decoded images
    read_wait: float = 0.0  # with --decode gpu: the decoding thread waiting for the workers' bytes
    first_batch: float = 0.0  # from the start to the first batch ready for the model (the workers' start included)
    last_writes: float = 0.0  # from the last batch's hand-over to the writers' end (the last rows and commits)
    wall: float = 0.0

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


class Prepared(NamedTuple):
    """A batch ready for the model: the readable images' pixels in plan order."""

    batch: Batch
    good: list[Item]  # the readable items, in plan order
    failures: list[tuple[Item, str]]
    pixels: torch.Tensor | None  # uint8 [len(good), 3, S, S] on the model's device
    ready: torch.cuda.Event | None  # recorded where pixels are complete


class Timer:
    """CUDA event pairs whose elapsed times are added up once they are complete."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.lock = threading.Lock()

    def pair(self, name: str, stream: torch.cuda.Stream):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start, end, (lambda: self.add(name, start, end))

    def add(self, name, start, end) -> None:
        with self.lock:
            self.pending.append((name, start, end))

    def collect(self, stats: Stats, wait: bool = False) -> None:
        with self.lock:
            keep = []
            for name, start, end in self.pending:
                if wait:
                    end.synchronize()
                if end.query():
                    setattr(stats, name, getattr(stats, name) + start.elapsed_time(end) / 1000)
                else:
                    keep.append((name, start, end))
            self.pending = keep


@contextlib.contextmanager
def timed(holder, attribute: str, mark: str | None = None) -> Iterator[None]:
    """Adds the block's seconds to holder.<attribute>, and marks the block as
    lumenbridge.<mark or attribute> for torch.profiler, whose timeline of
    every thread (scripts/trace_pipeline.py) shows where each one waits."""
    with torch.profiler.record_function(f"lumenbridge.{mark or attribute}"):
        begun = time.perf_counter()
        try:
            yield
        finally:
            setattr(holder, attribute, getattr(holder, attribute) + time.perf_counter() - begun)


class Writer(threading.Thread):
    """Writes rows and commits shards in the order they are queued. Several
    run at once, each on its own shards: writes to one file do not run in
    parallel (they take its inode's lock), writes to two files do. Each
    counts its own seconds and shards, added to the run's stats at the end."""

    def __init__(self, number: int):
        super().__init__(daemon=True, name=f"lumenbridge-writer-{number}")
        # On the CPU the queue bounds the tokens waiting for this writer (on CUDA the pinned buffers do).
        self.tasks: queue.Queue = queue.Queue(maxsize=4)
        self.seconds = 0.0
        self.shards = 0
        self.error: BaseException | None = None
        self.stopped = False

    def run(self) -> None:
        while True:
            task = self.tasks.get()
            if task is None:
                return
            kind, writer, payload = task
            try:
                if self.error is not None or self.stopped:
                    # Drain: keep releasing buffers so the producer never blocks; a shard not committed is aborted.
                    if kind == "commit":
                        writer.abort()
                elif kind == "rows":
                    tokens, ready, _ = payload
                    if ready is not None:
                        with torch.profiler.record_function("lumenbridge.copy_wait"):
                            ready.synchronize()
                    with timed(self, "seconds", "write_rows"):
                        writer.write_rows(tokens)
                    _maybe_kill("write", writer.metadata["shard_index"])
                elif kind == "commit":
                    shard = writer.metadata["shard_index"]
                    with timed(self, "seconds", "commit"):
                        writer.commit(before_rename=lambda shard=shard: _maybe_kill("commit", shard))
                    self.shards += 1
                    _maybe_kill("after", shard)
            except BaseException as error:  # noqa: BLE001 - reported by the main thread
                self.error = error
                with contextlib.suppress(Exception):
                    writer.abort()
            finally:
                if kind == "rows" and payload[2] is not None:
                    payload[2]()

    def put(self, task) -> None:
        if self.error is not None:
            raise self.error
        self.tasks.put(task)

    def close(self) -> None:
        self.tasks.put(None)
        self.join()
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """Ends the thread, dropping what is still queued (the run failed)."""
        self.stopped = True
        self.tasks.put(None)
        self.join()


class BufferPool:
    """Pinned host buffers for device-to-host token copies, reused in turn;
    each made when first needed (pinning tens of MB takes tens of ms, which
    would otherwise all come before the first batch)."""

    def __init__(self, count: int, shape: Sequence[int], dtype: torch.dtype):
        self.free: queue.Queue = queue.Queue()
        self.unmade = count
        self.shape = tuple(shape)
        self.dtype = dtype

    def take(self) -> torch.Tensor:
        with contextlib.suppress(queue.Empty):
            return self.free.get_nowait()
        if self.unmade:
            self.unmade -= 1
            return torch.empty(self.shape, dtype=self.dtype, pin_memory=True)
        return self.free.get()

    def give(self, buffer: torch.Tensor) -> None:
        self.free.put(buffer)


def shard_batches(shard_indices: Sequence[int], plan_size: int, shard_size: int, batch_size: int):
    """(shard, plan indices) of every batch of the given shards, in order; a shard
    with no samples (an empty plan) still gets one empty batch, so it is written.
    A batch's indices are a range (the DataLoader's batch sampler takes any
    iterable of indices): lists of them cost 40 bytes an image of the rank's share."""
    batches = []
    for shard in shard_indices:
        start, stop = shard * shard_size, min(plan_size, (shard + 1) * shard_size)
        if start >= stop:
            batches.append((shard, range(0)))
        for first in range(start, stop, batch_size):
            batches.append((shard, range(first, min(stop, first + batch_size))))
    return batches


class Scheduled(NamedTuple):
    writer: int  # which of the open shards' writers takes its rows
    shard: int
    indices: range
    last: bool  # the shard's last batch: commit it after this one


def shard_schedule(
    shard_indices: Sequence[int], plan_size: int, shard_size: int, batch_size: int, open_shards: int
) -> list[Scheduled]:
    """The batches of the given shards in the order they are tokenized: up to
    `open_shards` shards at a time, a batch of each in turn, each writer
    taking its next shard when one is done. A shard's own batches stay in plan
    order, so its bytes do not depend on `open_shards`."""
    pending = iter(shard_indices)
    by_shard = {}
    for shard, indices in shard_batches(shard_indices, plan_size, shard_size, batch_size):
        by_shard.setdefault(shard, []).append(indices)
    slots = [None] * max(1, min(open_shards, len(shard_indices)))
    schedule = []
    while True:
        taken = False
        for writer, slot in enumerate(slots):
            if slot is None or slot[1] == len(by_shard[slot[0]]):
                shard = next(pending, None)
                slots[writer] = slot = None if shard is None else [shard, 0]
            if slot is None:
                continue
            shard, number = slot
            batches = by_shard[shard]
            schedule.append(Scheduled(writer, shard, batches[number], number == len(batches) - 1))
            slot[1] += 1
            taken = True
        if not taken:
            return schedule


def row_shape(model, image_size: int, device: torch.device) -> list[int]:
    """The shape of one image's tokens (one dry run, which also loads the kernels)."""
    with torch.inference_mode():
        return list(model(torch.zeros((1, 3, image_size, image_size), dtype=torch.uint8, device=device)).shape[1:])


def tokenize_shards(
    model,
    plan: Sequence[Sample],
    shard_indices: Sequence[int],
    shard_count: int,
    options: Options,
    metadata: dict[str, str],
    group: Group,
    progress_update: Callable[[int], None],
    warm_up: DecoderWarmUp | None,
) -> Stats:
    """Tokenizes the given shards of the plan into options.out; returns this rank's stats."""
    started = time.perf_counter()
    stats = Stats()
    device = options.device
    cuda = device.type == "cuda"
    gpu_decode = options.decode == "gpu"
    shape = row_shape(model, options.image_size, device)
    schedule = shard_schedule(shard_indices, len(plan), options.shard_size, options.batch_size, options.open_shards)
    dataset = SampleDataset(
        plan,
        options.image_size,
        options.resize,
        max_pixels=options.max_pixels,
        background=options.background,
        gpu=gpu_decode,
    )
    workers = options.workers if schedule else 0
    loader = image_loader(
        dataset,
        batch_sampler=[batch.indices for batch in schedule],
        num_workers=workers,
        collate_fn=collate,
        pin_memory=cuda and not gpu_decode,
        prefetch_factor=2 if workers else None,
    )
    if warm_up is not None:
        warm_up.finish(stats)
    batch_iterator = iter(loader)  # forks the workers while no thread of ours runs (the warm-up has ended)
    timer = Timer() if cuda else None
    writers = [Writer(number) for number in range(1 + max((batch.writer for batch in schedule), default=0))]
    for writer_thread in writers:
        writer_thread.start()
    compute = torch.cuda.current_stream(device) if cuda else None
    h2d = torch.cuda.Stream(device) if cuda else None
    d2h = torch.cuda.Stream(device) if cuda else None
    # Two buffers a writer (one written while the next is copied), two more for the copies in flight.
    pool = BufferPool(2 + 2 * len(writers), (options.batch_size, *shape), options.dtype) if cuda else None
    prepared_batches = _Prepare(batch_iterator, plan, options, stats, timer, h2d)
    unfinished: dict[int, shards.ShardWriter] = {}  # open shards not yet handed to their writer to commit
    try:
        with torch.inference_mode():
            for batch, prepared in zip(schedule, prepared_batches, strict=True):
                if not stats.first_batch:
                    stats.first_batch = time.perf_counter() - started
                shard_writer = unfinished.get(batch.shard)
                if shard_writer is None:
                    shard_writer = _open_shard(options, batch.shard, shard_count, len(plan), shape, metadata)
                    unfinished[batch.shard] = shard_writer
                    _maybe_kill("decode", batch.shard)
                writer_thread = writers[batch.writer]
                _record(shard_writer, prepared, plan, options, stats)
                if prepared.pixels is not None:
                    _tokenize(model, prepared, shard_writer, writer_thread, stats, timer, compute, d2h, pool)
                if batch.last:
                    writer_thread.put(("commit", shard_writer, None))
                    del unfinished[batch.shard]  # once its writer has it; until then the except below aborts it
                progress_update(len(prepared.batch.indices))
                if timer is not None:
                    timer.collect(stats)
        with timed(stats, "last_writes"):
            for writer_thread in writers:
                writer_thread.close()
    except BaseException:
        for writer_thread in writers:
            writer_thread.stop()  # first: no thread may write a shard once it is aborted, or DIR after the run
        for shard_writer in unfinished.values():
            shard_writer.abort()
        raise
    finally:
        prepared_batches.close()
    stats.write = sum(writer_thread.seconds for writer_thread in writers)
    stats.shards = sum(writer_thread.shards for writer_thread in writers)
    if timer is not None:
        torch.cuda.synchronize(device)
        timer.collect(stats, wait=True)
    stats.wall = time.perf_counter() - started
    return stats


def _open_shard(options, shard: int, count: int, plan_size: int, shape, metadata) -> shards.ShardWriter:
    planned = min(plan_size, (shard + 1) * options.shard_size) - shard * options.shard_size
    name = shards.shard_name(shard, count)
    shard_metadata = {**metadata, "shard": name, "shard_index": str(shard)}
    return shards.ShardWriter(options.out, name, max(0, planned), shape, options.dtype, shard_metadata)


def _record(writer: shards.ShardWriter, prepared: Prepared, plan, options: Options, stats: Stats) -> None:
    """The index and errors lines of a batch; rows are numbered in plan order."""
    for row, item in enumerate(prepared.good, start=writer.next_row):
        sample = plan[item.index]
        width, height = item.size
        writer.add_index(
            {
                "key": sample.key,
                "source": sample.source,
                "member": sample.member,
                "shard": writer.name,
                "row": row,
                "width": width,
                "height": height,
                "grid": options.grid,
            }
        )
    writer.next_row += len(prepared.good)
    for item, reason in prepared.failures:
        sample = plan[item.index]
        writer.add_error(
            {"key": sample.key, "source": sample.source, "member": sample.member, "shard": writer.name, "error": reason}
        )
        if options.on_failure is not None:
            options.on_failure(
                sample.key if sample.key == sample.source else f"{sample.key} in {sample.source}", reason
            )
    stats.images += len(prepared.good)
    stats.skipped += len(prepared.failures)


def _tokenize(model, prepared, writer, writer_thread, stats, timer, compute, d2h, pool) -> None:
    if compute is None:  # on the CPU
        with timed(stats, "tokenize"):
            tokens = model(prepared.pixels)
        writer_thread.put(("rows", writer, (tokens, None, None)))
        return
    if prepared.ready is not None:
        compute.wait_event(prepared.ready)
    _, end, done = timer.pair("tokenize", compute)
    tokens = model(prepared.pixels)
    end.record(compute)
    done()
    with torch.profiler.record_function("lumenbridge.buffer_wait"):
        buffer = pool.take()
    rows = buffer[: tokens.shape[0]]
    d2h.wait_stream(compute)
    with torch.cuda.stream(d2h):
        _, copy_end, copy_done = timer.pair("transfer", d2h)
        rows.copy_(tokens, non_blocking=True)
        copy_end.record(d2h)
        copy_done()
        ready = torch.cuda.Event()
        ready.record(d2h)
    tokens.record_stream(d2h)
    writer_thread.put(("rows", writer, (rows, ready, lambda: pool.give(buffer))))


class _Prepare:
    """Iterates Prepared batches: CPU-decoded batches copied to the device on
    their own stream, or, with --decode gpu, batches decoded on the GPU in a
    thread of their own (with its own stream) a few batches ahead."""

    def __init__(self, batches, plan, options: Options, stats: Stats, timer: Timer | None, h2d):
        self.batches = batches
        self.plan = plan
        self.options = options
        self.stats = stats
        self.timer = timer
        self.h2d = h2d
        self.thread = None
        self.stop = threading.Event()
        if options.decode == "gpu":
            self.ready: queue.Queue = queue.Queue(maxsize=3)
            self.thread = threading.Thread(target=self._decode_ahead, daemon=True, name="lumenbridge-decode")
            self.thread.start()

    def __iter__(self):
        if self.thread is None:
            for batch in self._timed(self.batches, "input_wait"):
                yield self._upload(batch)
            return
        while True:
            with timed(self.stats, "input_wait"):
                item = self.ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _timed(self, batches, wait: str):
        """batches, adding the time spent waiting for each to stats.<wait> and
        the workers' decode time to stats.decode."""
        iterator = iter(batches)
        while True:
            try:
                with timed(self.stats, wait):
                    batch = next(iterator)
            except StopIteration:
                return
            self.stats.decode += batch.seconds
            yield batch

    def _split(self, batch: Batch):
        good = [item for item in batch.items if item.error is None]  # CPU-decoded, in order
        failures = [(item, item.error) for item in batch.items if item.error is not None]
        return good, failures

    def _upload(self, batch: Batch) -> Prepared:
        good, failures = self._split(batch)
        pixels, ready = batch.pixels, None
        if pixels is not None and self.h2d is not None:
            device = self.options.device
            with torch.cuda.stream(self.h2d):
                _, end, done = self.timer.pair("transfer", self.h2d)
                pixels = pixels.to(device, non_blocking=True)
                end.record(self.h2d)
                done()
                ready = torch.cuda.Event()
                ready.record(self.h2d)
            pixels.record_stream(torch.cuda.current_stream(device))
        return Prepared(batch, good, failures, pixels, ready)

    def _decode_ahead(self) -> None:
        device = self.options.device
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        try:
            with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for batch in self._timed(self.batches, "read_wait"):
                    if self.stop.is_set():
                        return
                    with timed(self.stats, "gpu_decode"):
                        prepared = self._decode(batch, stream)
                    self._hand_over(prepared)
            self.ready.put(None)
        except BaseException as error:  # noqa: BLE001 - re-raised in the model's thread
            self.ready.put(error)

    def _hand_over(self, prepared: Prepared) -> None:
        """Queues a decoded batch for the model, unless the run stops first."""
        with torch.profiler.record_function("lumenbridge.hand_over"):
            while not self.stop.is_set():
                try:
                    self.ready.put(prepared, timeout=0.1)
                    return
                except queue.Full:
                    continue

    def _decode(self, batch: Batch, stream) -> Prepared:
        from .gpu_decode import _on, crop_resize, decode_jpegs, orient

        options = self.options
        device = options.device
        spans = batch.spans
        data = {index: batch.encoded[start:end] for index, (start, end) in spans.items()}
        if stream is not None:
            # The previous batch's resize may still run on this stream; decode_jpegs waits for it first,
            # so the wait is the resize's time, not nvJPEG's.
            with timed(self.stats, "gpu_resize", "resize_wait"):
                stream.synchronize()
        with timed(self.stats, "gpu_jpeg"):
            decoded = dict(zip(data, decode_jpegs(list(data.values()), device), strict=True))
        good, failures, on_gpu, on_cpu = [], [], [], []
        cpu_pixels = iter(batch.pixels) if batch.pixels is not None else iter(())
        for item in batch.items:
            if item.error is not None:
                failures.append((item, item.error))
            elif item.index not in spans:
                on_cpu.append((len(good), next(cpu_pixels)))
                good.append(item)
            elif decoded[item.index] is not None:
                on_gpu.append((len(good), orient(decoded[item.index], item.orientation)))
                good.append(item)
            else:  # nvJPEG refused it: the CPU decides
                try:
                    raw = data[item.index].numpy().tobytes()
                    pixels = decode_on_cpu(
                        raw, options.image_size, options.resize, options.max_pixels, options.background
                    )
                except IMAGE_READ_ERRORS as error:
                    failures.append((item, describe(error, self.plan[item.index])))
                    continue
                on_cpu.append((len(good), pixels))
                good.append(item)
        if not good:
            return Prepared(batch, good, failures, None, None)
        pixels = torch.empty((len(good), 3, options.image_size, options.image_size), dtype=torch.uint8, device=device)
        if on_gpu:
            with timed(self.stats, "gpu_resize"):
                resized = crop_resize([image for _, image in on_gpu], options.image_size, options.resize)
            pixels.index_copy_(0, _on(device, [p for p, _ in on_gpu], torch.int64), resized)
        if on_cpu:
            host = torch.stack([image for _, image in on_cpu])
            pixels.index_copy_(0, _on(device, [p for p, _ in on_cpu], torch.int64), host.to(device))
        ready = None
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record(stream)
            pixels.record_stream(torch.cuda.default_stream(device))
        return Prepared(batch, good, failures, pixels, ready)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            with contextlib.suppress(queue.Empty):
                while True:
                    self.ready.get_nowait()
            self.thread.join(timeout=10)


def progress_bar(total: int, initial: int, enabled: bool):
    return tqdm(total=total, initial=initial, unit="img", file=sys.stderr, disable=not enabled, dynamic_ncols=True)


# --- a whole run, on one process or every rank of a torchrun job --------------------------


@dataclass
class RunResult:
    images: int  # tokenized in the whole output (every shard)
    skipped: int  # named in errors.jsonl
    shards: int
    shards_written: int  # by this run
    shards_before: int  # already complete when it started
    images_this_run: int
    stats: list[dict]  # each rank's Stats.as_dict()
    wall: float
    world: int
    row_shape: list[int]
    repeated_keys: RepeatedKeys  # keys that name several images (in several tars)


class RepeatedKeys(NamedTuple):
    """How many keys of a plan name more than one image (WebDataset keys are
    often unique only in their tar), and one of them with its images' sources."""

    count: int = 0
    example: tuple[str, list[str]] | None = None


HASH_CHUNK = 1 << 23  # key hashes handled at once (64 MB)


def repeated_keys(plan: Plan, chunk: int = HASH_CHUNK) -> RepeatedKeys:
    """The plan's repeated keys, counted by their 64-bit hashes in memory
    bounded by `chunk` whatever the plan's size: the hashes go to a file next
    to the plan in plan order, then each of ceil(samples / chunk) buckets
    (hashes by remainder) is gathered from it and counted at once. A hash met
    more than once counts as a repeated key (two keys of one hash would count
    once too often: about one chance in 3,700 at 100 million keys); the
    example, the first such key in plan order, is checked against the keys
    themselves."""
    buckets = -(-len(plan) // chunk)
    count, first = 0, len(plan)  # the first sample, in plan order, whose hash repeats
    with tempfile.TemporaryFile(dir=os.path.dirname(plan.path)) as file:
        for start in range(0, len(plan), chunk):
            array("q", (hash(plan[index].key) for index in range(start, min(start + chunk, len(plan))))).tofile(file)
        for bucket in range(buckets):
            values, counts = torch.unique(
                torch.cat([hashes[hashes.remainder(buckets) == bucket] for hashes in _chunks_of(file, chunk)]),
                return_counts=True,
            )
            count += int((counts > 1).sum())
            first = min(first, _first_position(file, chunk, values[counts > 1]))
        if first == len(plan):
            return RepeatedKeys(count)
        key = plan[first].key
        samples = [plan[index] for index in _positions(file, chunk, hash(key))]
        sources = [sample.source for sample in samples if sample.key == key]
    return RepeatedKeys(count, (key, sources) if len(sources) > 1 else None)


def _chunks_of(file, chunk: int):
    """The int64s of `file`, `chunk` at a time."""
    file.seek(0)
    while data := file.read(8 * chunk):
        yield torch.frombuffer(bytearray(data), dtype=torch.int64)


def _first_position(file, chunk: int, wanted: torch.Tensor) -> int:
    """Where the first of the hashes `wanted` stands in `file` (its length if nowhere)."""
    end = 0
    for number, hashes in enumerate(_chunks_of(file, chunk)):
        found = torch.nonzero(torch.isin(hashes, wanted))
        if len(found):
            return number * chunk + int(found[0])
        end += len(hashes)
    return end


def _positions(file, chunk: int, hashed: int) -> list[int]:
    """Where the hash `hashed` stands in `file`, in order."""
    positions = []
    for number, hashes in enumerate(_chunks_of(file, chunk)):
        positions += (number * chunk + torch.nonzero(hashes == hashed).flatten()).tolist()
    return positions


def weights_digest(model) -> str:
    """A digest of the model's parameters and buffers, so a resumed run knows it has the same weights."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def execution_settings(options: Options) -> dict:
    """What may change the tokens' last bits without changing what they mean:
    the batch size, the device type, the backend and, on the CPU, the threads
    of its matrix products (torchrun starts each process with one)."""
    settings = {"batch_size": options.batch_size, "device": options.device.type, "backend": options.backend}
    if options.device.type == "cpu":
        settings["cpu_threads"] = torch.get_num_threads()
    return settings


def build_manifest(inputs: dict, count: int, options: Options, model, weights: str, digest: str):
    import json

    dtype = str(options.dtype).removeprefix("torch.")
    return {
        "format": shards.FORMAT,
        "version": shards.FORMAT_VERSION,
        "inputs": inputs,
        "shards": count,
        "settings": {
            "shard_size": options.shard_size,
            "image_size": options.image_size,
            "resize": options.resize,
            "background": list(options.background),
            "max_pixels": options.max_pixels,
            "dtype": dtype,
            "decode": options.decode,
        },
        "model": {"config": json.loads(model.config.to_json()), "weights": weights, "weights_digest": digest},
        "execution": execution_settings(options),
    }


def run(
    model,
    planned: planning.Planned,
    options: Options,
    *,
    weights: str,
    digest: str,
    overwrite: bool,
    allow_mixed: bool,
    group: Group,
    warm_up: DecoderWarmUp | None = None,
) -> RunResult:
    """Plans the inputs (that rank 0 expanded: `planned`), checks or starts DIR,
    tokenizes this rank's share of the missing shards and, on rank 0, waits
    for every rank and writes the index. `digest` is weights_digest of the
    weights as loaded, before the cast to options.dtype (which the manifest
    records apart). `warm_up`: with --decode gpu, nvJPEG's set-up that the
    caller began (decoder_warm_up); without it the first batch's decode does it."""
    import hashlib
    import json

    started = time.perf_counter()
    _maybe_kill("plan", "run")  # the inputs expanded into DIR, the plan not yet written
    plan, samples, plan_digest = planning.make_plan(options.out, planned, group, shown=options.progress)
    if not samples:  # files and folders always add samples: every input is an empty tar
        raise shards.OutputError("the inputs hold no sample: every tar named is empty")
    check_ranks_agree(execution_settings(options), allow_mixed, group)
    count = shards.shard_count(samples, options.shard_size)
    # The files' stamps as rank 0 sees them (it listed the inputs), the same on every rank.
    recorded = {"samples": samples, "digest": plan_digest, "stamps": planned.stamps}
    manifest = build_manifest(recorded, count, options, model, weights, digest)
    content = {key: manifest[key] for key in ("version", "inputs", "settings")}
    content["model"] = shards.decisive_model(manifest["model"])
    fingerprint = hashlib.sha256(shards.dumps(content).encode()).hexdigest()
    metadata = {"format": "lumenbridge-token-shard", "run": fingerprint, "config": model.config.to_json()}

    with contextlib.ExitStack() as held:

        def prepare() -> tuple[list[int], dict]:
            held.enter_context(shards.run_lock(options.out))
            shards.prepare_output_dir(options.out, manifest, overwrite=overwrite, allow_mixed=allow_mixed)
            return shards.pending_shards(options.out, count), shards.read_manifest(options.out)

        pending, stored = group.from_main(prepare)
        check_every_rank_sees(options.out, stored, group)
        if plan is None:  # the other ranks map rank 0's plan once they are known to see DIR
            plan = Plan(planning.plan_folder(options.out, planned))
        mine = pending[group.rank :: group.world]

        def images_in(shard: int) -> int:
            return max(0, min(len(plan), (shard + 1) * options.shard_size) - shard * options.shard_size)

        before = len(plan) - sum(images_in(shard) for shard in pending)
        bar = progress_bar(len(plan), before, options.progress and group.main)
        counter = {"local": 0, "pushed": 0, "at": 0.0}

        def sync_progress(force: bool = False) -> None:
            now = time.monotonic()
            if not force and now - counter["at"] < 0.5:
                return
            counter["at"] = now
            total = group.add("done", counter["local"] - counter["pushed"])
            counter["pushed"] = counter["local"]
            if group.main:
                bar.n = before + total
                bar.refresh()

        def update(images: int) -> None:
            counter["local"] += images
            if group.distributed:
                sync_progress()
            else:
                bar.update(images)

        try:
            stats = tokenize_shards(model, plan, mine, count, options, metadata, group, update, warm_up)
            if group.distributed:
                sync_progress(force=True)
            refresh = (lambda: sync_progress(force=True)) if group.main else (lambda: None)
            every = group.wait_for_all(stats.as_dict(), refresh)
        finally:
            bar.close()
        if not group.main:
            return RunResult(
                0,
                0,
                count,
                stats.shards,
                count - len(pending),
                stats.images,
                [stats.as_dict()],
                stats.wall,
                group.world,
                [],
                RepeatedKeys(),
            )
        _maybe_kill("index", "run")
        rows, errors = shards.finish_run(options.out, count)
        shape = json.loads(json.dumps(row_shape_of(options.out, count)))
    return RunResult(
        rows,
        errors,
        count,
        sum(item["shards"] for item in every),
        count - len(pending),
        sum(item["images"] for item in every),
        every,
        time.perf_counter() - started,
        group.world,
        shape,
        repeated_keys(plan),
    )


def check_ranks_agree(settings: dict, allow_mixed: bool, group: Group) -> None:
    """Fails every rank unless all tokenize with rank 0's execution settings
    (the manifest records rank 0's), or allow_mixed: a rank on another
    backend or device type, say, would change its shards' last bits."""
    every = group.all_gather(settings)
    others = [f"rank {rank} {theirs}" for rank, theirs in enumerate(every) if theirs != every[0]]
    if others and not allow_mixed:
        raise shards.OutputError(
            f"the ranks would tokenize with different execution settings (rank 0 {every[0]}; {'; '.join(others)}), "
            "which can change the last bits of their shards; pass --allow-mixed to run anyway"
        )


def check_every_rank_sees(out: str, stored: dict, group: Group) -> None:
    """Fails every rank, before any work, unless each finds in DIR the manifest that rank 0 left there."""

    def sees() -> bool:
        try:
            return shards.read_manifest(out) == stored
        except (OSError, ValueError):
            return False

    planning.check_seen_by_every_rank(out, sees(), group)


def row_shape_of(directory: str, count: int) -> list[int]:
    from safetensors import safe_open

    with safe_open(os.path.join(directory, shards.shard_name(0, count)), framework="pt") as file:
        return list(file.get_slice("tokens").get_shape()[1:])
