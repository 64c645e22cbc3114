"""The compact plan (lumenbridge.plan.Plan): the samples and digest of the
list it replaced, in a few tens of bytes a sample."""

from __future__ import annotations

import pickle

import pytest

from lumenbridge.pipeline import repeated_keys, shard_batches
from lumenbridge.plan import Plan, Sample
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


def test_the_plan_gives_back_every_kind_of_sample_and_the_same_digest():
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
    ]
    plan = Plan(samples)
    assert len(plan) == len(samples)
    assert list(plan) == samples
    assert [plan[index] for index in range(-len(samples), 0)] == samples
    assert plan_digest(plan) == plan_digest(samples)
    assert list(pickle.loads(pickle.dumps(plan))) == samples  # as the ranks exchange tar listings
    joined = Plan(samples[:4])
    joined.extend(Plan(samples[4:]))  # from the arrays, one source shared
    assert list(joined) == samples
    with pytest.raises(IndexError):
        plan[len(samples)]
    with pytest.raises(ValueError, match="NUL"):
        Plan([Sample("a\0b", "/shards/0.tar", "a.jpg", 0, 1)])


def test_the_plan_holds_under_fifty_bytes_a_tar_sample_and_its_path_and_forty_an_image_file():
    count = 100_000
    assert Plan(tar_samples(count)).nbytes / count < 50  # a list of Sample tuples held about 290
    paths = [f"/data/images/folder-{number // 1000:05d}/image-{number:08d}.jpg" for number in range(count)]
    assert Plan(Sample(path, path) for path in paths).nbytes / count < len(paths[0]) + 40


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


def test_repeated_keys_are_found_by_their_hashes_with_their_sources_in_plan_order():
    samples = tar_samples(1000)
    samples[700] = samples[700]._replace(key=samples[3].key)
    samples[900] = samples[900]._replace(key=samples[3].key)
    samples[950] = samples[950]._replace(key=samples[10].key)
    expected = {
        samples[3].key: [samples[3].source, samples[700].source, samples[900].source],
        samples[10].key: [samples[10].source, samples[950].source],
    }
    assert list(repeated_keys(Plan(samples)).items()) == list(expected.items())
    assert repeated_keys(Plan(tar_samples(1000))) == {}
    assert repeated_keys(Plan()) == {}
