"""`lumenbridge tokenize --out DIR`: sharded output, its index and errors file,
WebDataset tars and file lists, refusing a folder of another run, resuming
after SIGKILL to the same bytes, torchrun with gloo (on one node and on two), and
reading it back."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import import_or_skip, save_image
from PIL import Image

import lumenbridge
from lumenbridge import TokenizerConfig, VisualTokenizer, cli, pipeline, shards
from lumenbridge.images import load_image
from lumenbridge.sources import expand_braces, scan_tar
from lumenbridge.testing import TokenizeCase

SMALL = "lumenbridge-small"
FAST = ["--preset", SMALL, "--image-size", "32", "--workers", "0", "--device", "cpu"]
COMMAND = [sys.executable, "-m", "lumenbridge"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def environment(**overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **overrides}
    env.pop("LUMENBRIDGE_BACKEND", None)
    env.pop(pipeline.KILL_ENV, None)
    env.update(overrides)
    return env


def photo(seed: int, size: tuple[int, int]) -> Image.Image:
    """Smooth colours plus noise: compresses like a photo, not like flat colour."""
    rng = np.random.default_rng(seed)
    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * (seed % 7 + 1) + y * 3) % 256, (y * (seed % 5 + 2)) % 256, (x + y + 40 * seed) % 256], -1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def make_images(folder: Path, count: int, start: int = 0) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(start, start + count):
        size = (40 + index % 25, 36 + (index * 7) % 29)
        path = folder / (f"{index:04}.png" if index % 3 == 0 else f"{index:04}.jpg")
        photo(index, size).save(path)
        paths.append(str(path))
    return paths


def make_tar(path: Path, images: list[str], extra=()) -> list[str]:
    """A WebDataset tar: one sample per image (the image plus a caption); returns the keys."""
    keys = []
    with tarfile.open(path, "w") as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for index, image in enumerate(images):
            key = f"{path.stem}/{index:06}"
            add(f"{key}.txt", f"caption {index}".encode())
            add(f"{key}{Path(image).suffix}", Path(image).read_bytes())
            keys.append(key)
        for name, data in extra:
            add(name, data)
    return keys


def tokenize(*arguments) -> int:
    return cli.main(["tokenize", *map(str, arguments), *FAST])


def index_of(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "index.jsonl").read_text().splitlines()]


def errors_of(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "errors.jsonl").read_text().splitlines()]


def expected(paths, image_size=32, dtype=torch.float32):
    model = VisualTokenizer(TokenizerConfig.preset(SMALL), seed=0).to(dtype)
    with torch.inference_mode():
        return model(torch.stack([load_image(path, image_size) for path in paths]))


def tree(folder) -> dict[str, bytes]:
    """Every file below a folder (hidden ones too) with its bytes."""
    folder = Path(folder)
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture
def images(tmp_path):
    return make_images(tmp_path / "images", 12)


# --- sharded output and its index ------------------------------------------------------------


def test_shards_index_and_tokens(tmp_path, images, capsys):
    out = tmp_path / "out"
    assert tokenize(tmp_path / "images", "--out", out, "--shard-size", "5", "--batch-size", "2") == 0
    captured = capsys.readouterr().out
    assert "tokenized 12 images into 3 shards" in captured and "where the time went" in captured
    assert "gpu decode" not in captured and "nvJPEG" not in captured  # parts of --decode gpu only
    names = sorted(os.listdir(out))
    assert names == [
        "errors.jsonl",
        "index.jsonl",
        "lumenbridge.json",
        "parts",
        "tokens-00000-of-00003.safetensors",
        "tokens-00001-of-00003.safetensors",
        "tokens-00002-of-00003.safetensors",
    ]
    index = index_of(out)
    assert [entry["key"] for entry in index] == images
    assert [(entry["shard"][:12], entry["row"]) for entry in index] == [
        (f"tokens-0000{i // 5}", i % 5) for i in range(12)
    ]
    first = index[0]
    assert first["source"] == images[0] and first["member"] is None and first["grid"] == [2, 2]
    assert (first["width"], first["height"]) == Image.open(images[0]).size
    assert errors_of(out) == []
    reader = lumenbridge.read_tokens(out)
    assert len(reader) == 12
    rows = list(reader)
    want = expected(images)
    for (key, tokens, grid), path, tokens_expected in zip(rows, images, want, strict=True):
        assert key == path and grid == (2, 2)
        torch.testing.assert_close(tokens, tokens_expected)
    torch.testing.assert_close(reader[images[7]], want[7])
    assert images[3] in reader and "nope" not in reader
    with pytest.raises(KeyError):
        reader.get("nope")


def test_sharded_and_single_file_tokens_are_the_same(tmp_path, images):
    assert tokenize(*images, "--out", tmp_path / "one.safetensors") == 0
    assert tokenize(*images, "--out", tmp_path / "dir", "--shard-size", "4") == 0
    single = {key: tokens for key, tokens, _ in lumenbridge.read_tokens(tmp_path / "one.safetensors")}
    sharded = {key: tokens for key, tokens, _ in lumenbridge.read_tokens(tmp_path / "dir")}
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[key], sharded[key]) for key in single)


def test_bfloat16_shards_and_a_report(tmp_path, images):
    out, report = tmp_path / "out", tmp_path / "report.json"
    assert tokenize(*images, "--out", out, "--dtype", "bfloat16", "--report", report) == 0
    tokens = next(iter(lumenbridge.read_tokens(out))).tokens
    assert tokens.dtype == torch.bfloat16
    torch.testing.assert_close(tokens, expected(images, dtype=torch.bfloat16)[0])
    numbers = json.loads(report.read_text())
    assert numbers["images"] == 12 and numbers["shards"] == 1 and numbers["processes"] == 1
    assert set(numbers["seconds"]) == set(cli.TIME_PARTS)
    assert 0 < numbers["tokenize_share_of_wall"] < 1
    rank = numbers["per_rank"][0]
    assert (
        0 < rank["first_batch"] and 0 < rank["last_writes"] and rank["first_batch"] + rank["last_writes"] < rank["wall"]
    )


def test_the_batch_size_has_a_default_per_decode_mode_unless_given(tmp_path, images, monkeypatch):
    assert (cli.default_batch_size("gpu"), cli.default_batch_size("cpu")) == (256, 32)  # as --help says
    monkeypatch.setattr(cli, "default_batch_size", lambda decode: 5)
    batches = []
    tokenize_files = cli.tokenize_files
    monkeypatch.setattr(
        cli, "tokenize_files", lambda *a, **k: batches.append(k["batch_size"]) or tokenize_files(*a, **k)
    )
    for given, out in ([], "default"), (["--batch-size", "7"], "given"):
        assert tokenize(*images, "--out", tmp_path / out, *given) == 0
        assert tokenize(*images, "--out", tmp_path / f"{out}.safetensors", *given) == 0
    recorded = [json.loads((tmp_path / out / shards.MANIFEST).read_text()) for out in ("default", "given")]
    assert [manifest["execution"]["batch_size"] for manifest in recorded] == [5, 7]
    assert batches == [5, 7]


def test_the_delays_are_the_slowest_process_and_the_times_sums(tmp_path):
    """first_batch and last_writes happen within each process: the summary gives
    the slowest's, where the other parts add up over the processes."""
    from types import SimpleNamespace

    ranks = [
        pipeline.Stats(images=4, input_wait=0.5, first_batch=0.8, last_writes=0.1, wall=2.0).as_dict(),
        pipeline.Stats(images=4, input_wait=0.25, first_batch=0.5, last_writes=0.3, wall=2.0).as_dict(),
    ]
    result = SimpleNamespace(
        images=8, skipped=0, images_this_run=8, shards=2, shards_written=2, shards_before=0, world=2, wall=2.5,
        stats=ranks, row_shape=[4, 8],
    )  # fmt: skip
    numbers = cli.summary_numbers(result)
    assert numbers["delays"] == {"first_batch": 0.8, "last_writes": 0.3}
    assert numbers["seconds"]["input_wait"] == 0.75


def test_the_decoder_warm_up_is_joined_whatever_ends_its_block(monkeypatch):
    """The warm-up begins as the block starts and has ended once the block is
    left, by an error too; finish() hands its time to the stats and raises its
    own error."""
    release = threading.Event()

    def warm_up(device):
        release.wait(5)
        raise RuntimeError("nvJPEG said no")

    monkeypatch.setattr(pipeline, "_warm_up_decoder", warm_up)
    timer = threading.Timer(0.3, release.set)  # only after the block has been left
    with pytest.raises(ValueError), pipeline.decoder_warm_up(torch.device("cpu")) as thread:
        timer.start()
        raise ValueError("the model did not load")
    assert release.is_set() and not thread.is_alive()
    stats = pipeline.Stats()
    with pytest.raises(RuntimeError, match="nvJPEG said no"):
        thread.finish(stats)
    assert stats.gpu_warmup > 0


def test_a_model_that_fails_to_load_leaves_no_warm_up_running(tmp_path, images, monkeypatch, capsys):
    """--decode gpu begins nvJPEG's set-up before the model loads; a bad
    --weights ends the command with the warm-up joined (here on the CPU, the
    GPU check and the decoder replaced)."""
    monkeypatch.setattr(cli, "check_gpu_decode", lambda device: None)
    monkeypatch.setattr(pipeline, "_warm_up_decoder", lambda device: time.sleep(0.5))
    code = cli.main(["tokenize", *map(str, images), "--out", str(tmp_path / "out"), "--decode", "gpu",
                     "--device", "cpu", "--weights", str(tmp_path / "missing")])  # fmt: skip
    assert code == cli.EXIT_USAGE and "cannot load --weights" in capsys.readouterr().err
    assert not [thread for thread in threading.enumerate() if thread.name == "lumenbridge-decoder-warm-up"]


@pytest.mark.skipif(not hasattr(os, "POSIX_FADV_DONTNEED"), reason="posix_fadvise is a Linux/POSIX call")
def test_rows_start_their_writeback_as_they_are_written(tmp_path, monkeypatch):
    """Each write asks the kernel to start writing back exactly the bytes it
    appended: the ranges tile the shard's data, and the shard reads back whole."""
    from safetensors.torch import load_file

    ranges = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: ranges.append((offset, length, advice)))
    name = shards.shard_name(0, 1)
    writer = shards.ShardWriter(str(tmp_path), name, 5, [2, 3], torch.float32, {"shard_index": "0"})
    rows = torch.randn(5, 2, 3)
    writer.write_rows(rows[:2])
    writer.write_rows(rows[2:])
    writer.next_row = 5
    writer.commit()
    start, row_bytes = writer.data_start, 2 * 3 * 4
    advice = os.POSIX_FADV_DONTNEED
    assert ranges == [(start, 2 * row_bytes, advice), (start + 2 * row_bytes, 3 * row_bytes, advice)]
    assert torch.equal(load_file(str(tmp_path / name))["tokens"], rows)


def test_unreadable_images_go_to_the_errors_file(tmp_path, images, capsys):
    folder = tmp_path / "images"
    (folder / "zz-bad.jpg").write_bytes(os.urandom(500))
    big = str(folder / "zz-huge.png")
    Image.new("RGB", (300, 200)).save(big)
    out = tmp_path / "out"
    assert tokenize(folder, "--out", out, "--max-pixels", "50000") == 1
    err = capsys.readouterr().err
    assert "zz-bad.jpg" in err and "listed in" in err
    errors = errors_of(out)
    assert [Path(entry["key"]).name for entry in errors] == ["zz-bad.jpg", "zz-huge.png"]
    assert errors[0]["error"].startswith("UnidentifiedImageError") and "0x" not in errors[0]["error"]
    assert errors[1]["error"].startswith("ImageTooLarge: 300 x 200")
    assert [entry["key"] for entry in index_of(out)] == images


def test_unreadable_samples_with_escaped_names_are_skipped(tmp_path, images):
    """The reason names the sample by repr(key), whose backslashes (a byte that
    is not UTF-8, a tab) once went into a regular expression's template and
    stopped the run at that sample, on every rerun."""
    folder = tmp_path / "images"
    try:
        with open(os.path.join(os.fsencode(folder), b"caf\xe9.jpg"), "wb"):
            pass
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses names that are not UTF-8")
    (folder / "tab\tname.jpg").write_bytes(b"")
    tar = tmp_path / "broken.tar"
    with tarfile.open(tar, "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as archive:
        member = tarfile.TarInfo("d\xe9j\xe0/001.jpg")
        member.size = 500
        archive.addfile(member, io.BytesIO(os.urandom(500)))
    out = tmp_path / "out"
    assert tokenize(folder, tar, "--out", out) == 1
    reasons = {entry["key"]: entry["error"] for entry in errors_of(out)}
    cafe, tab = str(folder / "caf\udce9.jpg"), str(folder / "tab\tname.jpg")
    assert set(reasons) == {cafe, tab, "d\udce9j\udce0/001"}
    assert repr(cafe) in reasons[cafe] and repr(tab) in reasons[tab] and "0x" not in reasons["d\udce9j\udce0/001"]
    assert [entry["key"] for entry in index_of(out)] == images


def test_names_that_are_not_utf8(tmp_path, images):
    """A file or tar member whose name is Latin-1, not UTF-8, is tokenized and
    indexed like any other, and its key gives back the name's bytes."""
    folder = tmp_path / "latin1"
    folder.mkdir()
    try:
        with open(os.path.join(os.fsencode(folder), b"caf\xe9.jpg"), "wb") as file:
            file.write(Path(images[1]).read_bytes())
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses names that are not UTF-8")
    latin1_tar = tmp_path / "latin1.tar"
    with tarfile.open(latin1_tar, "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tar:
        tar.add(images[2], arcname="d\xe9j\xe0/000.jpg")
    out = tmp_path / "out"
    assert tokenize(folder, latin1_tar, "--out", out) == 0
    keys = [entry["key"] for entry in index_of(out)]
    assert [os.fsencode(key) for key in keys] == [os.path.join(os.fsencode(folder), b"caf\xe9.jpg"), b"d\xe9j\xe0/000"]
    reader = lumenbridge.read_tokens(out)
    want = expected(images[1:3])
    torch.testing.assert_close(reader[keys[0]], want[0])
    torch.testing.assert_close(reader[keys[1]], want[1])


# --- inputs: tars, brace patterns, lists --------------------------------------------------------


def test_brace_expansion():
    assert expand_braces("d-{000..002}.tar") == ["d-000.tar", "d-001.tar", "d-002.tar"]
    assert expand_braces("d-{8..10}.tar") == ["d-8.tar", "d-9.tar", "d-10.tar"]
    assert expand_braces("{a,b}-{0..1}") == ["a-0", "a-1", "b-0", "b-1"]
    assert expand_braces("plain{x}.tar") == ["plain{x}.tar"]
    # As bash pads: a leading zero on either bound, to the wider bound's width ("0" alone is no padding).
    assert expand_braces("d-{1..010}") == [f"d-{value:03d}" for value in range(1, 11)]
    assert expand_braces("{0..10}") == [str(value) for value in range(11)]
    assert expand_braces("{-5..5}") == [str(value) for value in range(-5, 6)]
    assert expand_braces("{-1..01}") == ["-1", "00", "01"]


def test_brace_ranges_with_a_step_and_of_letters(tmp_path, images):
    """As bash expands them: a step's size (the bounds give the direction), and
    single letters; both once gave a pattern that named no file."""
    assert expand_braces("d-{00000..00010..4}.tar") == ["d-00000.tar", "d-00004.tar", "d-00008.tar"]
    assert expand_braces("{10..1..-3}") == ["10", "7", "4", "1"]
    assert expand_braces("{a..c}{e..a..2}") == ["ae", "ac", "aa", "be", "bc", "ba", "ce", "cc", "ca"]
    assert expand_braces("{a..5}") == ["{a..5}"]  # no range: bash leaves it too
    for letter, image in zip("abc", images[:3], strict=True):
        os.link(image, tmp_path / f"{letter}.jpg")
    assert tokenize(tmp_path / "{a..c..2}.jpg", "--out", tmp_path / "out") == 0
    assert [Path(entry["key"]).name for entry in index_of(tmp_path / "out")] == ["a.jpg", "c.jpg"]


def test_webdataset_tars_with_corrupt_samples(tmp_path, images, capsys):
    good = make_tar(tmp_path / "data-000.tar", images[:5])
    keys = make_tar(
        tmp_path / "data-001.tar",
        images[5:9],
        extra=[
            ("data-001/bad.jpg", b"\xff\xd8\xff\xe0 not really a jpeg"),  # corrupt image bytes
            ("data-001/caption-only.txt", b"no image here"),  # a sample without an image
            ("data-001/._hidden.jpg", b"macOS metadata"),  # hidden: ignored
        ],
    )
    # A tar cut off inside its last image, and one whose second header is garbage.
    make_tar(tmp_path / "cut.tar", images[9:11])
    data = (tmp_path / "cut.tar").read_bytes()
    last = scan_tar(str(tmp_path / "cut.tar"))[-1]
    (tmp_path / "cut.tar").write_bytes(data[: last.offset + last.size // 2])
    make_tar(tmp_path / "damaged.tar", images[11:12] * 3)
    damaged = bytearray((tmp_path / "damaged.tar").read_bytes())
    header = scan_tar(str(tmp_path / "damaged.tar"))[1].offset - 512  # the header of the second sample's image
    damaged[header : header + 100] = b"\x07" * 100
    (tmp_path / "damaged.tar").write_bytes(bytes(damaged))
    # And one cut just before a header: every member it holds is whole, but the end blocks are missing.
    make_tar(tmp_path / "short.tar", images[:2])
    with tarfile.open(tmp_path / "short.tar") as tar:
        cut_at = tar.getmembers()[2].offset  # the second sample's first header
    (tmp_path / "short.tar").write_bytes((tmp_path / "short.tar").read_bytes()[:cut_at])

    out = tmp_path / "out"
    pattern = str(tmp_path / "data-{000..001}.tar")
    tars = [tmp_path / name for name in ("cut.tar", "damaged.tar", "short.tar")]
    code = tokenize(pattern, *tars, "--out", out, "--shard-size", "4")
    assert code == 1
    index = index_of(out)
    tokenized = [entry["key"] for entry in index]
    assert tokenized[:9] == good + keys
    assert index[0]["member"] == "data-000/000000" + Path(images[0]).suffix
    assert index[0]["source"] == str(tmp_path / "data-000.tar")
    assert tokenized[9] == "cut/000000" and tokenized[10] == "damaged/000000"
    errors = {entry["key"]: entry["error"] for entry in errors_of(out)}
    assert errors["data-001/bad"].startswith(("UnidentifiedImageError", "OSError", "SyntaxError"))
    assert errors["data-001/caption-only"].startswith("no image member")
    assert "truncated" in errors["cut/000001"]
    damaged_key = next(key for key in errors if key.startswith(str(tmp_path / "damaged.tar")))
    assert "unreadable tar header" in errors[damaged_key]
    assert tokenized[11:] == ["short/000000"]
    assert "without its end-of-archive blocks" in errors[f"{tmp_path / 'short.tar'}@{cut_at}"]
    assert "data-001/._hidden" not in errors and "data-001/._hidden" not in tokenized
    # A tar sample's tokens are those of the same image as a file.
    reader = lumenbridge.read_tokens(out)
    torch.testing.assert_close(reader[good[2]], expected([images[2]])[0])


def test_a_key_in_two_tars_is_noted_and_read_by_its_source(tmp_path, images, capsys, monkeypatch):
    first, second = tmp_path / "a" / "part.tar", tmp_path / "b" / "part.tar"
    for path, chosen in ((first, images[:2]), (second, images[2:4])):
        path.parent.mkdir()
        make_tar(path, chosen)  # keys part/000000, part/000001 in both
    out = tmp_path / "out"
    assert tokenize(first, second, "--out", out) == 0
    assert "note: 2 keys name more than one image (such as 'part/000000'" in capsys.readouterr().err
    reader = lumenbridge.read_tokens(out)
    assert "part/000000" in reader and len(reader) == 4
    with pytest.raises(KeyError, match="names 2 images.*give source="):
        reader["part/000000"]
    want = expected([images[0], images[2]])
    torch.testing.assert_close(reader.get("part/000000", source=str(first)), want[0])
    torch.testing.assert_close(reader.get("part/000000", source=str(second)), want[1])
    with pytest.raises(KeyError, match="was not tokenized from"):
        reader.get("part/000000", source="elsewhere.tar")
    monkeypatch.chdir(tmp_path)  # the source as the command named it, relative to where it ran
    torch.testing.assert_close(reader.get("part/000000", source="b/part.tar"), want[1])


def test_a_key_a_tar_repeats_is_reached_by_iterating(tmp_path, images):
    """A tar may hold a key twice, apart (a.jpg, b.jpg, a.png): two samples,
    which source= cannot tell apart; the error says how to reach them."""
    tar_path = tmp_path / "repeat.tar"
    with tarfile.open(tar_path, "w") as tar:
        for name, image in (("a.jpg", images[1]), ("b.jpg", images[2]), ("a.png", images[0])):
            tar.add(image, arcname=name)
    out = tmp_path / "out"
    assert tokenize(tar_path, "--out", out) == 0
    reader = lumenbridge.read_tokens(out)
    with pytest.raises(KeyError, match="names 2 images in .* iterate over the reader"):
        reader.get("a", source=str(tar_path))
    by_key = [(key, tokens) for key, tokens, _ in reader]
    assert [key for key, _ in by_key] == ["a", "b", "a"]
    torch.testing.assert_close(by_key[2][1], expected([images[0]])[0])


def test_planning_shows_its_steps_on_bars(tmp_path, images, capsys):
    """Planning millions of inputs takes minutes: each step counts on a bar of its own."""
    tars = [tmp_path / f"data-{n:03d}.tar" for n in range(2)]
    for n, tar in enumerate(tars):
        make_tar(tar, images[3 * n : 3 * n + 3])
    assert tokenize(tmp_path / "images", *tars, "--out", tmp_path / "out") == 0
    err = capsys.readouterr().err
    for step in ("inputs listed", "tars listed", "inputs planned", "samples digested"):
        assert f"planning: {step}" in err, step


def test_inputs_of_empty_tars_are_a_usage_error(tmp_path, capsys):
    empty = tmp_path / "empty.tar"
    tarfile.open(empty, "w").close()
    assert tokenize(empty, "--out", tmp_path / "out") == 2
    assert "every tar named is empty" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_multi_part_image_extension_is_the_image_member(tmp_path, images):
    """WebDataset samples such as pairs (key.left.jpg, key.right.jpg) or
    numbered frames have no plain .jpg member: the first member whose
    extension ends in an image extension is the image."""
    path = tmp_path / "pairs.tar"
    with tarfile.open(path, "w") as tar:
        for name, image in (("pair.right.txt", None), ("pair.left.jpg", images[1]), ("pair.right.jpg", images[4])):
            data = b"caption" if image is None else Path(image).read_bytes()
            info = tarfile.TarInfo(f"pairs/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (sample,) = scan_tar(str(path))
    assert (sample.key, sample.member, sample.error) == ("pairs/pair", "pairs/pair.left.jpg", None)


def test_tar_inputs_need_a_folder_output(tmp_path, images, capsys):
    make_tar(tmp_path / "d.tar", images[:2])
    assert tokenize(tmp_path / "d.tar", "--out", tmp_path / "t.safetensors") == 2
    assert "need sharded output" in capsys.readouterr().err


def test_text_and_parquet_file_lists(tmp_path, images, capsys):
    listing = tmp_path / "list.txt"
    relative = [os.path.relpath(path, tmp_path) for path in images[:4]]
    listing.write_text("# images\n" + "\n".join([relative[0], relative[1], "missing.jpg", "", *relative[2:]]) + "\n")
    out = tmp_path / "out"
    assert tokenize(listing, "--out", out) == 1
    assert [entry["key"] for entry in index_of(out)] == images[:4]
    (error,) = errors_of(out)
    assert error["key"] == str(tmp_path / "missing.jpg") and error["error"].startswith("FileNotFoundError")

    pyarrow = import_or_skip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pyarrow.table({"path": images[4:8], "caption": ["x"] * 4}), tmp_path / "list.parquet")
    assert tokenize(tmp_path / "list.parquet", "--out", tmp_path / "out2") == 0
    assert [entry["key"] for entry in index_of(tmp_path / "out2")] == images[4:8]


def test_a_missing_list_file_is_a_usage_error(tmp_path, capsys):
    out = tmp_path / "out"
    assert tokenize(tmp_path / "nowhere.txt", "--out", out) == 2
    assert "nowhere.txt" in capsys.readouterr().err
    assert not out.exists() or os.listdir(out) == []


# --- the output folder: refusing, overwriting, continuing -------------------------------------


@pytest.mark.parametrize(
    "theirs",
    [("tokens-train.safetensors",), ("tokens-00001-of-00003.safetensors.bak",), ("parts/notes.md",)],
    ids=["named-like-tokens", "shard-name-and-more", "in-parts"],
)
def test_files_named_like_a_runs_are_not_taken_for_its_own(tmp_path, images, capsys, theirs):
    """Only a run's exact names are its own: a user's tokens-train.safetensors,
    or a note left in parts/, makes the folder foreign, even with --overwrite."""
    out = tmp_path / "out"
    for name in theirs:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("mine")
    assert tokenize(*images, "--out", out, "--overwrite") == 2
    assert "did not write" in capsys.readouterr().err
    assert all((out / name).read_text() == "mine" for name in theirs)


def test_a_link_or_a_folder_under_a_runs_name_is_not_its_own(tmp_path, images, capsys):
    """A run writes its files in place and removes its own: a symlink named
    errors.jsonl would have it write through the link (here, over an input),
    and a folder named index.jsonl would be deleted with what it holds."""
    out = tmp_path / "out"
    assert tokenize(*images, "--out", out) == 0
    victim = Path(images[0]).read_bytes()
    (out / "errors.jsonl").unlink()
    (out / "errors.jsonl").symlink_to(images[0])
    assert tokenize(*images, "--out", out) == 2
    assert "did not write (errors.jsonl)" in capsys.readouterr().err
    assert Path(images[0]).read_bytes() == victim
    other = tmp_path / "other"
    (other / "index.jsonl").mkdir(parents=True)
    (other / "index.jsonl" / "notes.txt").write_text("mine")
    assert tokenize(*images, "--out", other, "--overwrite") == 2
    assert "did not write (index.jsonl)" in capsys.readouterr().err
    assert (other / "index.jsonl" / "notes.txt").read_text() == "mine"


def test_a_folder_with_other_files_is_refused_and_left_alone(tmp_path, images, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert tokenize(*images, "--out", out, "--overwrite") == 2
    assert "did not write (notes.txt)" in capsys.readouterr().err
    assert os.listdir(out) == ["notes.txt"]
    # An input folder is such a folder too: nothing is written among the images.
    assert tokenize(tmp_path / "images", "--out", tmp_path / "images") == 2
    assert sorted(os.listdir(tmp_path / "images")) == sorted(os.path.basename(path) for path in images)


def test_a_folder_of_a_different_run_is_refused(tmp_path, images, capsys):
    out = tmp_path / "out"
    assert tokenize(*images[:6], "--out", out) == 0
    before = tree(out)
    assert tokenize(*images[:7], "--out", out) == 2
    err = capsys.readouterr().err
    assert "holds a different run" in err and "inputs: DIR holds a run over 6 samples" in err
    assert "--overwrite" in err
    assert (
        cli.main(
            [
                "tokenize",
                *images[:6],
                "--out",
                str(out),
                *FAST[:-4],
                "--image-size",
                "48",
                "--workers",
                "0",
                "--device",
                "cpu",
            ]
        )
        == 2
    )
    assert "image_size: DIR has 32, this command 48" in capsys.readouterr().err
    assert tree(out) == before
    # The same run again is complete already: nothing changes.
    assert tokenize(*images[:6], "--out", out) == 0
    assert "0 written now, 1 already done" in capsys.readouterr().out
    assert tree(out) == before
    # --overwrite starts afresh.
    assert tokenize(*images[:7], "--out", out, "--overwrite") == 0
    assert len(index_of(out)) == 7


def test_a_run_whose_files_changed_since_is_refused(tmp_path, images, capsys):
    """The plan names files, not their bytes: a run continued after an image
    was rewritten, or a listed file that was missing appeared, would mix old
    and new shards. Each file's size and modification time are recorded too."""
    listing, out = tmp_path / "list.txt", tmp_path / "out"
    listing.write_text(f"{images[0]}\n{images[1]}\nlater.jpg\n")
    assert tokenize(listing, "--out", out, "--shard-size", "2") == 1  # later.jpg is missing: skipped
    changed = "inputs: the same 3 samples as DIR's run, but an input file changed since it began"
    shutil.copy(images[2], tmp_path / "later.jpg")
    assert tokenize(listing, "--out", out, "--shard-size", "2") == 2
    assert changed in capsys.readouterr().err
    os.unlink(tmp_path / "later.jpg")
    assert tokenize(listing, "--out", out, "--shard-size", "2") == 1  # as it was
    assert "already done" in capsys.readouterr().out
    photo(99, (50, 40)).save(images[1])
    assert tokenize(listing, "--out", out, "--shard-size", "2") == 2
    assert changed in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "first", "second", "message"),
    [
        ("--batch-size", "4", "3", "batch_size: DIR has 4, this command 3"),
        # The reference and the native kernels differ in the last bits too.
        ("--backend", "reference", "native", "backend: DIR has 'reference', this command 'native'"),
    ],
)
def test_other_execution_settings_continue_only_with_allow_mixed(
    tmp_path, images, capsys, flag, first, second, message
):
    out = tmp_path / "out"
    assert tokenize(*images, "--out", out, flag, first) == 0
    assert tokenize(*images, "--out", out, flag, second) == 2
    err = capsys.readouterr().err
    assert message in err and "--allow-mixed" in err
    assert tokenize(*images, "--out", out, flag, second, "--allow-mixed") == 0


def test_another_dtype_is_named_as_the_only_difference(tmp_path, images, capsys):
    """The weights' digest is of the weights as loaded, so --dtype, recorded
    on its own, does not also make them look like other weights."""
    out = tmp_path / "out"
    assert tokenize(*images, "--out", out) == 0
    assert tokenize(*images, "--out", out, "--dtype", "bfloat16") == 2
    err = capsys.readouterr().err
    assert "dtype: DIR has 'float32', this command 'bfloat16'" in err and "weights_digest" not in err


def test_overwrite_retries_the_images_a_finished_run_skipped(tmp_path, images, capsys):
    """The same command continues a run and keeps its verdicts; once an image
    is fixed, its file changed and the run is refused; --overwrite starts it
    afresh, so the fixed image is read again."""
    broken = tmp_path / "images" / "zz-broken.png"
    broken.write_bytes(b"not an image")
    out = tmp_path / "out"
    assert tokenize(tmp_path / "images", "--out", out) == 1
    assert tokenize(tmp_path / "images", "--out", out) == 1
    assert [line["key"] for line in errors_of(out)] == [str(broken)]
    save_image(broken)
    assert tokenize(tmp_path / "images", "--out", out) == 2
    assert "an input file changed since it began" in capsys.readouterr().err
    assert tokenize(tmp_path / "images", "--out", out, "--overwrite") == 0
    assert errors_of(out) == [] and len(index_of(out)) == len(images) + 1


def test_another_cpu_thread_count_continues_only_with_allow_mixed(tmp_path, images, capsys):
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert tokenize(*images, "--out", out) == 0
        torch.set_num_threads(2)
        assert tokenize(*images, "--out", out) == 2
        assert "cpu_threads: DIR has 1, this command 2" in capsys.readouterr().err
        assert tokenize(*images, "--out", out, "--allow-mixed") == 0
    finally:
        torch.set_num_threads(threads)


def test_an_unwritable_folder_fails_before_any_work(tmp_path, images, monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_model", lambda *a: pytest.fail("the model was loaded before the output was checked"))
    monkeypatch.setattr(shards, "create_output_dir", lambda path: (_ for _ in ()).throw(shards.OutputError("no room")))
    assert tokenize(*images, "--out", tmp_path / "out") == 2
    assert "no room" in capsys.readouterr().err


def test_options_that_need_one_file_or_a_folder(tmp_path, images, monkeypatch, capsys):
    assert tokenize(*images, "--out", tmp_path / "out", "--max-tokens", "16", "--image-size", "32") == 2
    assert tokenize(*images, "--out", tmp_path / "t.safetensors", "--decode", "gpu") == 2
    assert "--decode gpu writes sharded output" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert tokenize(*images, "--out", tmp_path / "out", "--decode", "gpu") == 2
        assert "needs a CUDA device" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert tokenize(*images, "--out", tmp_path / "t.safetensors") == 2
    assert "under torchrun, --out must be a folder" in capsys.readouterr().err


def test_options_of_sharded_output_are_refused_with_one_file(tmp_path, images, capsys):
    options = (["--report", str(tmp_path / "r.json")], ["--shard-size", "5"], ["--open-shards", "2"], ["--allow-mixed"])
    for option in options:
        assert tokenize(*images, "--out", tmp_path / "t.safetensors", *option) == 2
        assert f"{option[0]} apply to sharded output" in capsys.readouterr().err
    assert not (tmp_path / "t.safetensors").exists()


def test_open_shards_must_be_positive(tmp_path, images, capsys):
    assert tokenize(*images, "--out", tmp_path / "out", "--open-shards", "0") == 2
    assert "--open-shards must be positive, got 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["missing folder", "inside DIR", "a folder"])
def test_a_bad_report_path_fails_before_any_work(tmp_path, images, monkeypatch, capsys, where):
    monkeypatch.setattr(cli, "load_model", lambda *a: pytest.fail("the model was loaded before --report was checked"))
    out = tmp_path / "out"
    report = {"missing folder": tmp_path / "nope" / "r.json", "inside DIR": out / "r.json", "a folder": tmp_path}[where]
    assert tokenize(*images, "--out", out, "--report", report) == 2
    assert f"--report {report}" in capsys.readouterr().err
    assert not out.exists()


def test_the_same_weights_named_another_way_continue_the_run(tmp_path, images, capsys, monkeypatch):
    """The manifest's weights are the checkpoint's digest, not how --weights
    was spelled: ckpt, ckpt/ and its absolute path are one run; other weights
    are another."""
    VisualTokenizer(TokenizerConfig.preset(SMALL), seed=3).save_pretrained(tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert cli.main(["tokenize", *map(str, images), "--out", str(out), "--weights", "ckpt", *FAST[2:]]) == 0
    capsys.readouterr()
    for spelling in ("ckpt/", str(tmp_path / "ckpt"), "./ckpt"):
        assert cli.main(["tokenize", *map(str, images), "--out", str(out), "--weights", spelling, *FAST[2:]]) == 0
        assert "1 already done" in capsys.readouterr().out
    # A shard's metadata names its run by what decides the tokens, not by the spelling either.
    again = tmp_path / "again"
    assert cli.main(["tokenize", *map(str, images), "--out", str(again), "--weights", "./ckpt/", *FAST[2:]]) == 0
    assert {name: data for name, data in tree(again).items() if name != shards.MANIFEST} == {
        name: data for name, data in tree(out).items() if name != shards.MANIFEST
    }
    VisualTokenizer(TokenizerConfig.preset(SMALL), seed=4).save_pretrained(tmp_path / "other")
    assert cli.main(["tokenize", *map(str, images), "--out", str(out), "--weights", "other", *FAST[2:]]) == 2
    assert "weights_digest" in capsys.readouterr().err


def test_a_report_never_replaces_an_input_and_another_file_only_with_overwrite(tmp_path, images, capsys):
    first = Path(images[0]).read_bytes()
    assert tokenize(*images, "--out", tmp_path / "out", "--report", images[0], "--overwrite") == 2
    assert "is one of the inputs" in capsys.readouterr().err
    assert Path(images[0]).read_bytes() == first
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert tokenize(*images, "--out", tmp_path / "out", "--report", notes) == 2
    err = capsys.readouterr().err
    assert "is not a LumenBridge report; choose another path, or pass --overwrite" in err
    assert "also deletes a run that --out" in err  # the flag's other effect, where a resumed run would lose shards
    assert notes.read_text() == "mine"
    assert tokenize(*images, "--out", tmp_path / "out", "--report", notes, "--overwrite") == 0
    assert json.loads(notes.read_text())["images"] == 12


def test_the_same_command_with_a_report_runs_twice(tmp_path, images):
    command = [*images, "--out", tmp_path / "out", "--report", tmp_path / "report.json"]
    assert tokenize(*command) == 0
    assert tokenize(*command) == 0
    assert json.loads((tmp_path / "report.json").read_text())["images"] == 12


def test_a_usage_error_leaves_no_new_folder(tmp_path, images, capsys):
    assert tokenize(*images, "--out", tmp_path / "out", "--background", "not-a-colour") == 2
    assert "not-a-colour" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_run_with_no_readable_image_exits_2_and_says_why(tmp_path, capsys):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "a.jpg").write_bytes(b"not an image")
    assert tokenize(folder, "--out", tmp_path / "out") == 2
    assert "none of the 1 images could be read" in capsys.readouterr().err
    assert [Path(entry["key"]).name for entry in errors_of(tmp_path / "out")] == ["a.jpg"]


def test_reading_an_incomplete_run_says_so(tmp_path, images):
    out = tmp_path / "out"
    assert tokenize(*images, "--out", out, "--shard-size", "5") == 0
    os.unlink(out / "index.jsonl")
    os.unlink(out / "tokens-00001-of-00003.safetensors")
    with pytest.raises(FileNotFoundError, match="2 of 3 shards"):
        lumenbridge.read_tokens(out)


# --- killed and resumed: the same bytes --------------------------------------------------------


def run_cli(arguments, **env):
    return subprocess.run(
        [*COMMAND, "tokenize", *map(str, arguments)],
        env=environment(**env),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture
def dataset(tmp_path):
    """Files and a tar, with one unreadable image: 39 samples, 8 shards of 5."""
    make_images(tmp_path / "images", 24)
    (tmp_path / "images" / "0010-bad.jpg").write_bytes(b"\xff\xd8\xff garbage")
    make_tar(tmp_path / "data.tar", make_images(tmp_path / "for-tar", 14, start=100))
    return [tmp_path / "images", tmp_path / "data.tar"]


def test_a_run_killed_at_any_point_resumes_to_the_same_bytes(tmp_path, dataset):
    common = [*dataset, *FAST[:-4], "--image-size", "32", "--device", "cpu", "--shard-size", "5", "--batch-size", "2"]
    reference = tmp_path / "reference"
    done = run_cli([*common, "--workers", "0", "--open-shards", "1", "--out", reference])
    assert done.returncode == 1, done.stderr  # the bad image is skipped
    expected_tree = tree(reference)
    assert len([name for name in expected_tree if name.endswith(".safetensors")]) == 8
    for point in ("plan:run", "decode:2", "write:3", "commit:1", "after:0", "index:run"):
        out = tmp_path / point.replace(":", "-")
        killed = run_cli([*common, "--workers", "2", "--out", out], **{pipeline.KILL_ENV: point})
        assert killed.returncode == -9, (point, killed.stderr)
        assert not (out / "index.jsonl").exists()
        # Killed while planning or inside a shard: its staging folder is left (the plan's, at least).
        assert any(name.startswith(".lumenbridge-partial-") for name in os.listdir(out)), point
        # Killed with two shards open (the default), resumed with three: the same bytes.
        resumed = run_cli([*common, "--workers", "1", "--open-shards", "3", "--out", out])
        assert resumed.returncode == 1, (point, resumed.stderr)
        assert "already done" in resumed.stdout
        assert tree(out) == expected_tree, point  # no partial folder, no missing or extra byte


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="limits the file size with setrlimit")
def test_a_plan_that_cannot_be_written_in_dir_is_an_error_not_a_crash(tmp_path):
    """The inputs are expanded into DIR: a full disk there (here a file-size
    limit, which Python turns into OSError) is told as a write error, as it
    is while the plan itself is written, and the new DIR is removed."""
    import resource

    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"images/image-{number:08d}.jpg\n" for number in range(5000)))
    limit = 100_000  # the expanded inputs take about 300 KB

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    command = [*COMMAND, "tokenize", listing, "--out", tmp_path / "out", *FAST]
    done = subprocess.run(
        command, env=environment(), capture_output=True, text=True, timeout=300, check=False, preexec_fn=limited
    )
    assert done.returncode == cli.EXIT_USAGE, done.stderr
    assert f"lumenbridge: error: cannot write {tmp_path / 'out'}: [Errno 27] File too large" in done.stderr
    assert not (tmp_path / "out").exists()


def shard_writers_made(monkeypatch) -> list[shards.ShardWriter]:
    """Every ShardWriter made from now on, kept alive (none is closed by being collected)."""
    made = []
    make = shards.ShardWriter.__init__

    def keep(self, *arguments, **keywords):
        make(self, *arguments, **keywords)
        made.append(self)

    monkeypatch.setattr(shards.ShardWriter, "__init__", keep)
    return made


def no_space() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def assert_every_shard_committed_or_aborted(made: list[shards.ShardWriter], out: Path) -> None:
    assert made and not [writer.name for writer in made if not writer.file.closed]
    assert not [name for name in os.listdir(out) if name.startswith(".lumenbridge-partial-")]


def test_a_shard_whose_commit_its_failed_writer_cannot_take_is_aborted(tmp_path, images, monkeypatch, capsys):
    """The writer fails committing shard 0 once shard 1's rows are queued
    behind it: shard 1, whose commit the main thread then cannot hand over,
    is aborted like every other shard the run opened."""
    made = shard_writers_made(monkeypatch)
    queued = threading.Event()
    commit, put = shards.ShardWriter.commit, pipeline.Writer.put

    def failing_commit(self, before_rename=None):
        if self.metadata["shard_index"] == "0":
            assert queued.wait(30)
            no_space()
        commit(self, before_rename)

    def late_put(self, task):
        if task[0] == "commit" and task[1].metadata["shard_index"] == "1":
            queued.set()
            deadline = time.monotonic() + 30
            while self.error is None and time.monotonic() < deadline:
                time.sleep(0.01)
        put(self, task)

    monkeypatch.setattr(shards.ShardWriter, "commit", failing_commit)
    monkeypatch.setattr(pipeline.Writer, "put", late_put)
    out = tmp_path / "out"
    arguments = ["--shard-size", "2", "--batch-size", "2", "--open-shards", "1"]
    assert tokenize(tmp_path / "images", "--out", out, *arguments) == cli.EXIT_USAGE
    assert "No space left on device" in capsys.readouterr().err
    assert [writer.name for writer in made][:2] == [shards.shard_name(0, 6), shards.shard_name(1, 6)]
    assert_every_shard_committed_or_aborted(made, out)


def test_a_write_error_ends_every_writer_before_the_run_does(tmp_path, images, monkeypatch, capsys):
    """Two shards written at once and one of them on a full disk: the run
    fails with that error only once neither writer thread runs any longer
    and every shard it opened is committed or aborted (the other writer's
    shard, whose commit is still queued, is aborted). The other writer was
    left running: it went on writing and committed its shard into DIR after
    the run had failed and let DIR go."""
    made = shard_writers_made(monkeypatch)
    write_rows = shards.ShardWriter.write_rows

    def failing_write(self, tokens):
        if self.metadata["shard_index"] == "1":
            no_space()
        time.sleep(0.05)  # the other writer is still at work when the error reaches the main thread
        write_rows(self, tokens)

    monkeypatch.setattr(shards.ShardWriter, "write_rows", failing_write)
    before = set(threading.enumerate())
    out = tmp_path / "out"
    assert tokenize(tmp_path / "images", "--out", out, "--shard-size", "2", "--batch-size", "1") == cli.EXIT_USAGE
    assert "No space left on device" in capsys.readouterr().err
    left = [thread.name for thread in set(threading.enumerate()) - before if thread.name.startswith("lumenbridge-")]
    assert not left
    assert_every_shard_committed_or_aborted(made, out)


# --- torchrun ----------------------------------------------------------------------------------

NODE_TIMEOUT = 120  # seconds: a hung rendezvous or end-of-run wait fails the test instead of blocking CI


@pytest.fixture
def job(tmp_path, dataset):
    """The arguments of a small sharded run (7 shards) and its output made by one process."""
    arguments = [*dataset, "--preset", SMALL, "--image-size", "32", "--device", "cpu"]
    arguments += ["--shard-size", "6", "--batch-size", "4", "--workers", "1"]
    single = run_cli([*arguments, "--out", tmp_path / "single"])
    assert single.returncode == 1, single.stderr  # the bad image is skipped
    return arguments, tmp_path / "single"


def torchrun_tokenize(launch: list[str], arguments) -> list[str]:
    return [*TORCHRUN, *launch, "-m", "lumenbridge", "tokenize", *map(str, arguments)]


def assert_same_output(out: Path, reference: Path) -> None:
    """The same index and the same tokens for every key (checked first, to say which differ), then every byte."""
    assert (out / "index.jsonl").read_bytes() == (reference / "index.jsonl").read_bytes()
    one, two = lumenbridge.read_tokens(reference), lumenbridge.read_tokens(out)
    for (key_one, tokens_one, _), (key_two, tokens_two, _) in zip(one, two, strict=True):
        assert key_one == key_two and torch.equal(tokens_one, tokens_two), key_one
    assert tree(out) == tree(reference)


def test_torchrun_two_processes_match_one(tmp_path, job):
    arguments, single = job
    run = subprocess.run(
        torchrun_tokenize(["--standalone", "--nproc_per_node=2"], [*arguments, "--out", tmp_path / "two"]),
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr  # under torchrun skipped images do not fail the job
    assert "2 on cpu" in run.stdout and run.stdout.count("tokenized ") == 1  # one summary, from rank 0
    assert_same_output(tmp_path / "two", single)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_nodes(commands: list[list[str]], homes: list[Path], **env) -> list[tuple[int, str, str]]:
    """Runs one command per node, all at once, each in its own folder with its own
    temporary folder (as separate machines would); (exit code, stdout, stderr) of each.
    Past NODE_TIMEOUT every node still running is stopped and the test fails."""
    processes = []
    for command, home in zip(commands, homes, strict=True):
        home.mkdir(exist_ok=True)
        with open(home / "stdout", "w") as stdout, open(home / "stderr", "w") as stderr:
            node_env = environment(TMPDIR=str(home), **env)
            processes.append(subprocess.Popen(command, cwd=home, env=node_env, stdout=stdout, stderr=stderr))
    deadline = time.monotonic() + NODE_TIMEOUT
    try:
        for process in processes:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for process in processes:
            process.terminate()  # torchrun stops its workers on SIGTERM
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        stderr = "\n".join((home / "stderr").read_text() for home in homes)
        pytest.fail(f"the torchrun nodes did not finish in {NODE_TIMEOUT} s:\n{stderr}")
    return [
        (process.returncode, (home / "stdout").read_text(), (home / "stderr").read_text())
        for process, home in zip(processes, homes, strict=True)
    ]


def test_torchrun_two_nodes_match_one(tmp_path, job):
    arguments, single = job
    # c10d rendezvous, as in the README: the node that binds the endpoint first hosts
    # the store, and ranks go by the rendezvous' order (--node-rank is read only by the
    # static rendezvous), so either node may be rank 0.
    launch = ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d"]
    launch += [f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=two-nodes"]
    report = tmp_path / "report.json"
    command = torchrun_tokenize(launch, [*arguments, "--out", tmp_path / "two", "--report", report])
    nodes = run_nodes([command, command], [tmp_path / "node0", tmp_path / "node1"])
    for code, _, stderr in nodes:
        assert code == 0, stderr
    summaries = [stdout for _, stdout, _ in nodes if "tokenized " in stdout]
    assert len(summaries) == 1 and "2 on cpu" in summaries[0]  # one summary, from the global rank 0
    # Each rank (LOCAL_RANK 0 on both nodes) wrote its own share of the 7 shards.
    assert sorted(stats["shards"] for stats in json.loads(report.read_text())["per_rank"]) == [3, 4]
    assert_same_output(tmp_path / "two", single)


def static_nodes(arguments) -> list[list[str]]:
    """The commands of two nodes under the static rendezvous: node 0 hosts the store and
    runs rank 0, node 1 runs rank 1 (the c10d rendezvous would order them by arrival)."""
    launch = ["--nnodes=2", "--nproc_per_node=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    return [torchrun_tokenize([*launch, f"--node-rank={node}"], arguments) for node in range(2)]


def test_a_dead_node_stops_the_other_and_the_same_command_resumes(tmp_path, job):
    arguments, single = job
    out, homes = tmp_path / "two", [tmp_path / "node0", tmp_path / "node1"]
    # Static, so that the rank that dies is never the store's host: rank 0 cannot learn of it from the store.
    commands = static_nodes([*arguments, "--out", out])
    (code0, _, stderr0), (code1, _, stderr1) = run_nodes(commands, homes, **{pipeline.KILL_ENV: "decode:1"})
    assert code1 != 0 and "SIGKILL" in stderr1  # rank 1 was killed as it began shard 1
    assert code0 != 0, stderr0  # rank 0 wrote its own shards, then failed instead of waiting for ever
    assert shards.pending_shards(str(out), 7) == [1, 3, 5] and not (out / "index.jsonl").exists()
    for code, _, stderr in run_nodes(commands, homes):
        assert code == 0, stderr
    assert_same_output(out, single)


def test_every_node_must_see_the_same_output_folder(tmp_path, images):
    homes = [tmp_path / "node0", tmp_path / "node1"]
    # A relative --out from two working folders: two folders, as a DIR on a disk of each machine would be.
    commands = static_nodes([tmp_path / "images", "--out", "out", *FAST, "--shard-size", "5"])
    (code0, _, stderr0), (code1, _, _) = run_nodes(commands, homes)
    assert code0 != 0 and code1 != 0
    assert "is not the same folder for every rank (not seeing the run that rank 0 prepared there: rank 1)" in stderr0
    assert os.listdir(homes[0] / "out") == ["lumenbridge.json"]  # refused before any shard was written
    assert not (homes[1] / "out").exists()


def test_a_rank_that_cannot_list_its_tars_in_dir_fails_every_rank(tmp_path, images):
    """With tars, every rank lists its share into DIR before the plan is made: one that does not see DIR says so."""
    homes = [tmp_path / "node0", tmp_path / "node1"]
    tars = [tmp_path / "a.tar", tmp_path / "b.tar"]
    for tar in tars:
        make_tar(tar, images[:2])
    commands = static_nodes([*tars, "--out", "out", *FAST, "--shard-size", "5"])
    (code0, _, stderr0), (code1, _, _) = run_nodes(commands, homes)
    assert code0 != 0 and code1 != 0
    assert "is not the same folder for every rank (not seeing the run that rank 0 prepared there: rank 1)" in stderr0
    assert not (homes[0] / "out").exists() and not (homes[1] / "out").exists()


def test_default_workers_share_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    group = type("Group", (), {"local_world": 2})()
    assert cli.default_workers(group) == 3


def test_ranks_on_different_backends_are_refused(tmp_path, job):
    """The manifest records rank 0's execution settings: a rank on another
    backend would write shards whose last bits differ, unrecorded."""
    arguments, _ = job
    commands = static_nodes([*arguments, "--out", tmp_path / "two"])
    commands = [commands[0] + ["--backend", "native"], commands[1] + ["--backend", "reference"]]
    (code0, _, stderr0), (code1, _, _) = run_nodes(commands, [tmp_path / "node0", tmp_path / "node1"])
    assert code0 != 0 and code1 != 0  # torchrun's own code for a failed worker
    assert "different execution settings" in stderr0 and "'backend': 'reference'" in stderr0
    assert not (tmp_path / "two").exists()  # refused before anything was written


def test_an_error_of_one_rank_is_printed_by_that_rank(tmp_path, job):
    """--weights found on node 0 only: node 1 says so itself, for no other rank sees it."""
    arguments, _ = job
    homes = [tmp_path / "node0", tmp_path / "node1"]
    VisualTokenizer(TokenizerConfig.preset(SMALL), seed=0).save_pretrained(homes[0] / "ckpt")
    own_weights = [argument for argument in arguments if argument not in ("--preset", SMALL)]
    commands = static_nodes([*own_weights, "--out", tmp_path / "two", "--weights", "ckpt"])
    (code0, _, _), (code1, _, stderr1) = run_nodes(commands, homes)
    assert code0 != 0 and code1 != 0
    assert "lumenbridge: error (rank 1): cannot load --weights ckpt" in stderr1, stderr1


# --- the GPU decode path (its logic on the CPU here; on CUDA in gpu_check) ---------------------


@pytest.fixture
def telling_weights(tmp_path) -> Path:
    """A small checkpoint whose tokens carry their image (the sample cases'
    scale-keeping weights; a default-initialized model gives nearly the same
    tokens for every image)."""
    folder = tmp_path / "weights"
    TokenizeCase("small", TokenizerConfig.preset(SMALL)).model().save_pretrained(folder)
    return folder


def assert_decoders_agree(gpu: dict, cpu: dict, paths: list[str]) -> None:
    """Another decoder and resampler: each image's tokens from the GPU path
    are closer to its own CPU-path tokens than to any other image's, and
    point the same way (cosine above 0.9)."""
    cpu_tokens = torch.stack([cpu[path].float().flatten() for path in paths])
    for i, path in enumerate(paths):
        tokens = gpu[path].float().flatten()
        assert torch.cdist(tokens[None], cpu_tokens)[0].argmin().item() == i, path
        assert torch.nn.functional.cosine_similarity(tokens, cpu_tokens[i], dim=0) > 0.9, path


def test_gpu_decode_path_logic_on_the_cpu(tmp_path, images, telling_weights, monkeypatch, capsys):
    import_or_skip("torchvision")
    (tmp_path / "images" / "zz-broken.jpg").write_bytes(Path(images[1]).read_bytes()[:200])  # header fine, data cut
    monkeypatch.setattr(cli, "check_gpu_decode", lambda device: None)
    out_gpu, out_cpu = tmp_path / "gpu", tmp_path / "cpu"
    common = ["--weights", str(telling_weights), "--image-size", "32", "--workers", "0", "--device", "cpu"]
    common += ["--batch-size", "5"]
    run = ["tokenize", str(tmp_path / "images")]
    report = tmp_path / "report.json"
    assert cli.main([*run, "--out", str(out_gpu), "--decode", "gpu", "--report", str(report), *common]) == 1
    assert "gpu decode" in capsys.readouterr().out  # in the summary of --decode gpu only
    assert cli.main([*run, "--out", str(out_cpu), *common]) == 1
    assert "gpu decode" not in capsys.readouterr().out
    seconds = json.loads(report.read_text())["seconds"]
    assert 0 < seconds["gpu_jpeg"] and 0 < seconds["gpu_resize"]  # the decoding thread's parts
    assert seconds["gpu_jpeg"] + seconds["gpu_resize"] < seconds["gpu_decode"]
    assert 0 < seconds["gpu_warmup"]  # before the decoding thread starts
    index_gpu, index_cpu = index_of(out_gpu), index_of(out_cpu)
    assert [entry["key"] for entry in index_gpu] == [entry["key"] for entry in index_cpu] == images
    assert [entry["key"] for entry in errors_of(out_gpu)] == [str(tmp_path / "images" / "zz-broken.jpg")]
    gpu, cpu = lumenbridge.read_tokens(out_gpu), lumenbridge.read_tokens(out_cpu)
    for path in images:
        if path.endswith(".png"):  # not a JPEG: decoded on the CPU either way
            assert torch.equal(gpu[path], cpu[path])
    assert_decoders_agree(gpu, cpu, images)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_gpu_end_to_end_on_cuda(tmp_path, images, telling_weights):
    import_or_skip("torchvision")
    out_gpu, out_cpu = tmp_path / "gpu", tmp_path / "cpu"
    common = ["--weights", str(telling_weights), "--image-size", "32", "--workers", "2", "--device", "cuda"]
    several = ["--shard-size", "5", "--batch-size", "2"]  # three shards, two written at once
    assert (
        cli.main(["tokenize", str(tmp_path / "images"), "--out", str(out_gpu), "--decode", "gpu", *common, *several])
        == 0
    )
    assert cli.main(["tokenize", str(tmp_path / "images"), "--out", str(out_cpu), *common]) == 0
    gpu, cpu = lumenbridge.read_tokens(out_gpu), lumenbridge.read_tokens(out_cpu)
    assert [key for key, _, _ in gpu] == images
    assert all(gpu[path].dtype == torch.bfloat16 for path in images)
    assert_decoders_agree(gpu, cpu, images)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_token_buffers_are_pinned_as_they_are_first_needed():
    pool = pipeline.BufferPool(2, (3, 4), torch.bfloat16)
    first, second = pool.take(), pool.take()
    assert pool.unmade == 0 and first.is_pinned() and second.is_pinned()
    assert first.data_ptr() != second.data_ptr() and first.shape == (3, 4) and first.dtype == torch.bfloat16
    pool.give(first)
    assert pool.take() is first  # reused, not made again
