"""Making a sharded run's plan on disk, with every rank of a torchrun job.

Rank 0 expands the inputs one at a time into a file (the inputs, in order)
and digests their files' stamps as it goes; every rank lists its share of
the tars (tar t goes to rank t mod world) into a plan of its own; rank 0
then writes the run's plan, each input in order (an image file's sample, or
a tar's samples from the listing of the rank that scanned it), and digests
it. All of this lives in one staging folder inside DIR (shared by the ranks,
as the shards are), which rank 0 holds for the whole run: a run that is
killed leaves only that folder, which the next run removes, and a run that
ends removes it. Only names, counts and digests go through the process group.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from tqdm import tqdm

from .distributed import Group
from .plan import TEXT_ENCODING, Plan, PlanWriter, Sample
from .shards import OutputError
from .sources import Input, forget_open_tars, map_ahead, plan_digest, scan_tar, stamps_digest

FOLDER_PURPOSE = "plan-"  # in the staging folder's name, so that it tells what it holds
INPUTS = "inputs"
PLAN = "plan"
_LISTING = "listing-{}"  # a rank's tars' samples
_KINDS = {"file": "f", "tar": "t"}  # an input's kind, as its first character in INPUTS


class Planned(NamedTuple):
    """What rank 0 tells every rank of the expanded inputs."""

    folder: str  # the staging folder's name in DIR
    inputs: int
    tars: int
    stamps: str  # stamps_digest of the inputs' files


def progress(description: str, enabled: bool, total: int | None = None, unit: str = "input") -> tqdm:
    """A bar for one step of planning (a run of millions of inputs plans for minutes), gone once it ends."""
    return tqdm(
        total=total, desc=description, unit=unit, unit_scale=True, file=sys.stderr, disable=not enabled, leave=False
    )


def _counted(items: Iterable, bar: tqdm) -> Iterator:
    for item in items:
        bar.update()
        yield item


def write_inputs(folder: str, inputs: Iterable[Input], shown: bool = False) -> Planned:
    """Writes the inputs, in order, to the file INPUTS in `folder` (each its
    kind's letter, its path and a NUL, which no path holds) and digests their
    files' stamps on the way; `shown`: with a bar counting them."""
    count = tars = 0
    with open(os.path.join(folder, INPUTS), "wb") as file, progress("planning: inputs listed", shown) as bar:

        def written() -> Iterator[str]:
            nonlocal count, tars
            for item in inputs:
                file.write(f"{_KINDS[item.kind]}{item.path}\0".encode(*TEXT_ENCODING))
                count += 1
                tars += item.kind == "tar"
                bar.update()
                yield item.path

        stamps = stamps_digest(written())
    return Planned(os.path.basename(folder), count, tars, stamps)


def read_inputs(folder: str) -> Iterator[Input]:
    """The inputs that write_inputs wrote, read a block at a time."""
    kinds = {letter: kind for kind, letter in _KINDS.items()}
    with open(os.path.join(folder, INPUTS), "rb") as file:
        rest = b""
        while block := file.read(1 << 16):
            *entries, rest = (rest + block).split(b"\0")
            for entry in entries:
                text = entry.decode(*TEXT_ENCODING)
                yield Input(kinds[text[0]], text[1:])


def plan_folder(out: str, planned: Planned) -> str:
    return os.path.join(out, planned.folder, PLAN)


def make_plan(
    out: str, planned: Planned, group: Group, threads: int = 8, shown: bool = False
) -> tuple[Plan | None, int, str]:
    """Every rank: lists its tars, then rank 0 writes the plan. Returns the
    plan on rank 0 (None on the others, which map it once they are known to
    see DIR), its number of samples and its digest. `shown`: rank 0 shows
    bars of its steps (its own share of the tars)."""
    shown = shown and group.main
    forget_open_tars()  # tars read by an earlier run in this process may have been written again since
    folder = os.path.join(out, planned.folder)
    if planned.tars:
        sees = True
        if group.rank < planned.tars:
            tars = (item.path for item in read_inputs(folder) if item.kind == "tar")
            mine = -(-(planned.tars - group.rank) // group.world)
            try:
                with (
                    PlanWriter(os.path.join(folder, _LISTING.format(group.rank))) as listing,
                    progress("planning: tars listed", shown, mine, "tar") as bar,
                ):
                    for samples in map_ahead(scan_tar, itertools.islice(tars, group.rank, None, group.world), threads):
                        listing.extend(samples)
                        bar.update()
            except OSError:  # the folder is not there: DIR is another folder on this rank's machine
                sees = False
        check_seen_by_every_rank(out, sees, group)
    plan = None

    def write() -> tuple[int, str]:  # on rank 0, whose errors from_main raises on every rank
        nonlocal plan
        with progress("planning: inputs planned", shown, planned.inputs) as bar:
            plan = _assemble(folder, group.world, bar.update)
        with progress("planning: samples digested", shown, len(plan), "sample") as bar:
            return len(plan), plan_digest(_counted(plan, bar))

    samples, digest = group.from_main(write)
    return plan, samples, digest


class _Listing:
    """A rank's listing, taken one tar at a time."""

    def __init__(self, path: str) -> None:
        self.plan = Plan(path)
        self.taken = 0

    def samples_of(self, tar: str) -> Iterator[Sample]:
        """The next samples, those of the tar `tar` (every sample of a tar names
        it as its source, and no two tars of the inputs share a path)."""
        while self.taken < len(self.plan) and (sample := self.plan[self.taken]).source == tar:
            self.taken += 1
            yield sample


def _assemble(folder: str, world: int, planned_one: Callable[[], object]) -> Plan:
    """Writes the plan from INPUTS and the ranks' listings, each read in order
    (planned_one() after each input), then removes those."""
    listings: dict[int, _Listing] = {}
    tars = 0
    with PlanWriter(os.path.join(folder, PLAN)) as writer:
        for item in read_inputs(folder):
            planned_one()
            if item.kind == "file":
                writer.append(Sample(item.path, item.path))
                continue
            rank, tars = tars % world, tars + 1
            if rank not in listings:
                listings[rank] = _Listing(os.path.join(folder, _LISTING.format(rank)))
            writer.extend(listings[rank].samples_of(item.path))
    for rank, listing in listings.items():
        if listing.taken != len(listing.plan):
            raise RuntimeError(f"rank {rank} listed samples of no tar of the inputs")
        listing.plan.close()
        shutil.rmtree(listing.plan.path)
    os.unlink(os.path.join(folder, INPUTS))
    return Plan(os.path.join(folder, PLAN))


def check_seen_by_every_rank(out: str, sees: bool, group: Group) -> None:
    """Fails every rank, before any work, unless each sees (in `sees`) what
    rank 0 left in DIR: on machines that do not share DIR (or resolve a
    relative --out in other working folders) the shards would be scattered
    between folders."""
    blind = [rank for rank, seen in enumerate(group.all_gather(sees)) if not seen]
    if blind:
        raise OutputError(
            f"--out {out} is not the same folder for every rank (not seeing the run that rank 0 prepared there: "
            f"rank {', '.join(map(str, blind))}); on several machines DIR must be on a file system that all of "
            "them see, at the same path"
        )


__all__ = ["Planned", "check_seen_by_every_rank", "make_plan", "plan_folder", "read_inputs", "write_inputs"]
