"""The plan in files (lumenbridge.plan.Plan): the samples and digest of the
list it replaced, memory-mapped, and planning whose memory does not grow
with the number of images."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import textwrap

import pytest
from conftest import plan_of

from lumenbridge.pipeline import HASH_CHUNK, RepeatedKeys, Scheduled, repeated_keys, shard_batches, shard_schedule
from lumenbridge.plan import Plan, PlanWriter, Sample, write_plan
from lumenbridge.sources import plan_digest


def tar_samples(count: int, tars: int = 10) -> list[Sample]:
    """WebDataset samples as scan_tar lists them: keys of ten digits, a .jpg member each."""
    per_tar = count // tars
    return [
        Sample(
            f"{number:010d}",
            f"/data/shards/part-{number // per_tar:06d}.tar",
            f"{number:010d}.jpg",
            1536 + 512 * number,
            9000,
        )
        for number in range(count)
    ]


def test_the_plan_gives_back_every_kind_of_sample_and_the_same_digest(tmp_path):
    samples = [
        Sample("/images/a.jpg", "/images/a.jpg"),
        Sample("000001", "/shards/0.tar", "000001.jpg", 1536, 20000),
        Sample("dir/000002", "/shards/0.tar", "dir/000002.left.png", 1 << 40, 3),
        Sample("a/b", "/shards/1.tar", "a//b.jpg", 512, 2),  # a member that does not start with its key
        Sample("same", "/shards/1.tar", "same", 1024, 5),
        Sample("empty", "/shards/1.tar", "", 1024, 5),
        Sample("nokey", "/shards/1.tar", error="no image member (jpg/jpeg/png/webp) in the sample; it has txt"),
        Sample("/shards/1.tar@4096", "/shards/1.tar", error="unreadable tar header at byte 4096"),
        Sample("/shards/2.tar", "/shards/2.tar", error="cannot read the tar: OSError: gone"),
        Sample("é\udcff", "/shards/\udcfe.tar", "é\udcff.webp", 2048, 7),  # names that are not UTF-8
        Sample("/images/b.jpg", "/images/b.jpg"),
        Sample("again", "/shards/0.tar", "again.jpg", 0, 1),  # a source met before, not just before
    ]
    plan = write_plan(tmp_path / "plan", samples)
    assert len(plan) == len(samples)
    assert list(plan) == samples
    assert [plan[index] for index in range(-len(samples), 0)] == samples
    assert plan_digest(plan) == plan_digest(samples)
    assert list(pickle.loads(pickle.dumps(plan))) == samples  # as a worker started by forkserver gets it
    assert list(Plan(tmp_path / "plan")) == samples
    assert list(write_plan(tmp_path / "empty", [])) == []
    with pytest.raises(IndexError):
        plan[len(samples)]
    with pytest.raises(ValueError, match="NUL"):
        write_plan(tmp_path / "nul", [Sample("a\0b", "/shards/0.tar", "a.jpg", 0, 1)])


def test_a_pickled_plan_is_its_path_whatever_its_size(tmp_path):
    small = write_plan(tmp_path / "small", tar_samples(100))
    large = write_plan(tmp_path / "large", tar_samples(100_000))
    assert len(pickle.dumps(large)) == len(pickle.dumps(small)) < 200
    assert pickle.loads(pickle.dumps(large))[99_999] == large[99_999]


def test_a_plan_being_written_is_not_under_its_name(tmp_path):
    """A plan folder under its own name is complete: one killed while it is written is never read as one."""
    with pytest.raises(RuntimeError), PlanWriter(tmp_path / "plan") as writer:
        writer.extend(tar_samples(10))
        raise RuntimeError("killed")
    assert not (tmp_path / "plan").exists() and (tmp_path / "plan.partial").is_dir()


PLANNING = """
import os, sys, tarfile, tempfile, time, tracemalloc
from lumenbridge import planning
from lumenbridge.distributed import Group
from lumenbridge.sources import expand_inputs

count, folder = int(sys.argv[1]), sys.argv[2]
tars = [os.path.join(folder, f"shard-{shard:04d}.tar") for shard in range(count // 400)]
for shard, path in enumerate(tars):  # of 100 samples: a tar's listing is held while it is written
    with tarfile.open(path, "w") as tar:
        for n in range(shard * 100, shard * 100 + 100):
            tar.addfile(tarfile.TarInfo(f"{n:010d}.jpg"))
listing = os.path.join(folder, "list.txt")
with open(listing, "w") as file:  # planning reads a list's entries, not its files
    file.writelines(f"images/folder-{n // 1000:05d}/image-{n:08d}.jpg\\n" for n in range(count))
    file.writelines(f"{path}\\n" for path in tars)
started = time.perf_counter()
tracemalloc.start()
staging = tempfile.mkdtemp(dir=folder)
planned = planning.write_inputs(staging, expand_inputs([listing]))
plan, samples, digest = planning.make_plan(folder, planned, Group())
assert samples == len(plan) == count + 100 * len(tars), samples
assert plan[count - 1].key.endswith(f"image-{count - 1:08d}.jpg") and plan[count].key == f"{0:010d}"
assert plan[-1].source == tars[-1]
with open("/proc/self/status") as status:
    anonymous = next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))
print(tracemalloc.get_traced_memory()[1], anonymous, time.perf_counter() - started)
"""


def planning_peak(tmp_path, count: int) -> int:
    folder = tmp_path / str(count)
    folder.mkdir()
    command = [sys.executable, "-c", textwrap.dedent(PLANNING), str(count), str(folder)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    peak, _, _ = done.stdout.split()
    return int(peak)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_planning_memory_does_not_grow_with_the_images(tmp_path):
    """Planning a list of image files and tars, four times as many: the
    Python memory at its peak stays within a small bound, where the inputs
    as a list, the set of their paths and the plan in flat arrays held
    about 400 bytes an image (35 MB more here)."""
    small, large = planning_peak(tmp_path, 25_000), planning_peak(tmp_path, 100_000)
    assert large - small < 1 << 20, json.dumps({"small": small, "large": large})
    assert large < 4 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_planning_unmaps_a_tar_listing_before_removing_it(tmp_path, monkeypatch):
    """On a network file system a file removed while it is mapped is only
    renamed (.nfs...), so its folder cannot be removed and the plan fails."""
    tar = tmp_path / "a.tar"
    with tarfile.open(tar, "w") as archive:
        for name in ("0.jpg", "1.jpg"):
            archive.addfile(tarfile.TarInfo(name))
    rmtree, mapped = shutil.rmtree, []

    def removing(path, *arguments, **options):
        with open("/proc/self/maps") as maps:
            mapped.extend(line.split()[-1] for line in maps if f"{path}{os.sep}" in line)
        rmtree(path, *arguments, **options)

    monkeypatch.setattr(shutil, "rmtree", removing)
    assert len(plan_of(tmp_path, tar)) == 2
    assert mapped == []


def test_a_batch_of_a_shard_is_a_range_of_plan_indices():
    batches = shard_batches([0, 2, 5], plan_size=25, shard_size=10, batch_size=4)
    assert batches == [
        (0, range(4)),
        (0, range(4, 8)),
        (0, range(8, 10)),
        (2, range(20, 24)),
        (2, range(24, 25)),
        (5, range(0)),  # past the plan's end: written empty
    ]


def test_open_shards_take_batches_in_turn_and_each_keeps_plan_order():
    schedule = shard_schedule([0, 2, 5], plan_size=25, shard_size=10, batch_size=4, open_shards=2)
    assert schedule == [
        Scheduled(0, 0, range(4), False),
        Scheduled(1, 2, range(20, 24), False),
        Scheduled(0, 0, range(4, 8), False),
        Scheduled(1, 2, range(24, 25), True),
        Scheduled(0, 0, range(8, 10), True),
        Scheduled(1, 5, range(0), True),  # the writer done first takes the next shard
    ]


@pytest.mark.parametrize("open_shards", [1, 3, 8])
def test_every_batch_is_scheduled_once_whatever_the_open_shards(open_shards):
    shards = [1, 3, 4, 6, 7]
    batches = shard_batches(shards, plan_size=75, shard_size=10, batch_size=3)
    schedule = shard_schedule(shards, plan_size=75, shard_size=10, batch_size=3, open_shards=open_shards)
    assert sorted((item.shard, item.indices.start) for item in schedule) == [(s, i.start) for s, i in batches]
    for shard in shards:
        own = [item for item in schedule if item.shard == shard]
        assert [item.indices for item in own] == [indices for s, indices in batches if s == shard]
        assert [item.last for item in own] == [False] * (len(own) - 1) + [True]
        assert len({item.writer for item in own}) == 1
    assert {item.writer for item in schedule} == set(range(min(open_shards, len(shards))))
    if open_shards == 1:
        assert [(item.shard, item.indices) for item in schedule] == batches


def test_the_plan_digest_is_the_one_earlier_versions_recorded():
    """Existing output folders record it in their manifest: a changed digest would refuse to resume them."""
    samples = [
        Sample("/data/a.jpg", "/data/a.jpg"),
        Sample("000001", "/data/part-0.tar", "000001.jpg", 1536, 2048),
        Sample("000002", "/data/part-0.tar", "000002.png", 4096, 100, "truncated"),
        Sample("/data/é.jpg", "/data/é.jpg"),
    ]
    assert plan_digest(samples) == "e39faee3bc95bcd7a7575b5da33e9c12e87b9ab82be83de19a739d0fe8a92959"


@pytest.mark.parametrize("chunk", [HASH_CHUNK, 64], ids=["one-bucket", "16-buckets"])
def test_repeated_keys_are_counted_by_their_hashes_with_the_first_and_its_sources(tmp_path, chunk):
    samples = tar_samples(1000)
    samples[700] = samples[700]._replace(key=samples[3].key)
    samples[900] = samples[900]._replace(key=samples[3].key)
    samples[950] = samples[950]._replace(key=samples[10].key)
    expected = {
        samples[3].key: [samples[3].source, samples[700].source, samples[900].source],
        samples[10].key: [samples[10].source, samples[950].source],
    }
    found = repeated_keys(write_plan(tmp_path / "repeated", samples), chunk)
    assert found == RepeatedKeys(2, (samples[3].key, expected[samples[3].key]))
    assert repeated_keys(write_plan(tmp_path / "unique", tar_samples(1000)), chunk) == RepeatedKeys(0, None)
    assert repeated_keys(write_plan(tmp_path / "empty", []), chunk) == RepeatedKeys(0, None)


def test_two_keys_of_one_hash_are_not_given_as_an_example(tmp_path, monkeypatch):
    """A hash collision counts (the count is by hashes) but is no example: the keys themselves decide."""
    from lumenbridge import pipeline

    colliding = ("0000000001", "0000000002")
    monkeypatch.setattr(pipeline, "hash", lambda key: -1 if key in colliding else int(key), raising=False)
    found = repeated_keys(write_plan(tmp_path / "collide", tar_samples(100)))
    assert found == RepeatedKeys(1, None)
