"""Finding a run's inputs (lumenbridge.sources): files, folders, globs, brace
patterns, links and file lists, and reading a tar member's bytes."""

from __future__ import annotations

import glob
import io
import json
import os
import re
import tarfile
import tracemalloc
from pathlib import Path

import pytest
from conftest import import_or_skip, plan_of, save_image

from lumenbridge import sources
from lumenbridge.images import MAX_IMAGE_BYTES, ImageTooLarge
from lumenbridge.sources import expand_inputs, read_sample_bytes


def found(*paths) -> list[str]:
    return [item.path for item in expand_inputs([str(path) for path in paths])]


def test_explicit_files_keep_the_given_order_without_repeats(tmp_path):
    b = save_image(tmp_path / "b.png")
    a = save_image(tmp_path / "a.png")
    assert found(b, a, b) == [b, a]


def test_folder_is_searched_recursively_in_sorted_order_for_image_extensions(tmp_path):
    expected = [
        save_image(tmp_path / "A.JPG"),
        save_image(tmp_path / "b.png"),
        save_image(tmp_path / "sub" / "c.webp"),
        save_image(tmp_path / "sub" / "deeper" / "d.jpeg"),
        save_image(tmp_path / "sub-folder" / "e.png"),  # after sub/..., as a path's parts sort
    ]
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "sub" / "e.gif").write_bytes(b"GIF89a")
    (tmp_path / "._A.JPG").write_bytes(b"macOS metadata, not an image")
    save_image(tmp_path / ".cache" / "thumb.png")
    assert found(tmp_path) == expected


def test_glob_patterns_expand_recursively_and_repeats_are_dropped(tmp_path):
    top = save_image(tmp_path / "top.png")
    nested = save_image(tmp_path / "x" / "y" / "nested.png")
    save_image(tmp_path / "x" / "skip.jpg")
    assert found(nested, tmp_path / "**" / "*.png") == [nested, top]


def test_a_glob_matching_a_folder_takes_its_images(tmp_path):
    inside = save_image(tmp_path / "set1" / "one.png")
    assert found(tmp_path / "set*") == [inside]


def test_a_path_that_matches_nothing_is_an_error_naming_it(tmp_path):
    good = save_image(tmp_path / "good.png")
    missing = str(tmp_path / "missing.png")
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        found(good, missing)
    empty_glob = str(tmp_path / "*.webp")
    with pytest.raises(FileNotFoundError, match=re.escape(empty_glob)):
        found(empty_glob)


def test_a_link_back_up_the_tree_gives_each_image_once(tmp_path):
    top = save_image(tmp_path / "loop" / "img.jpg")
    inner = save_image(tmp_path / "loop" / "sub" / "x.jpg")
    os.symlink("..", tmp_path / "loop" / "sub" / "up")
    assert found(tmp_path / "loop" / "**" / "*.jpg") == [top, inner]
    assert found(tmp_path / "loop") == [top, inner]


def test_a_folder_follows_links_to_folders_as_a_glob_does(tmp_path):
    own = save_image(tmp_path / "top" / "t.jpg")
    save_image(tmp_path / "real" / "r.jpg")
    os.symlink(tmp_path / "real", tmp_path / "top" / "linked")
    linked = str(tmp_path / "top" / "linked" / "r.jpg")
    assert found(tmp_path / "top") == [linked, own]
    assert found(tmp_path / "top" / "**" / "*.jpg") == [linked, own]
    assert found(tmp_path / "top", tmp_path / "real") == [linked, own]  # the same file, reached again


def shortest_path_to_each_in_memory(paths, known) -> list[str]:
    """How a glob's matches were chosen and ordered while they were held in
    memory: the order makes the plan's digest, which output folders record."""
    shortest: dict[str, str] = {}
    for path in sorted(paths):
        real = os.path.normcase(sources._real_path(path, known))
        if real not in shortest or len(Path(path).parts) < len(Path(shortest[real]).parts):
            shortest[real] = path
    return sorted(shortest.values())


def touch(path) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY))


def test_a_glob_keeps_the_paths_and_order_of_its_matches_held_in_memory(tmp_path):
    """Links to a folder (of equal parts: the first path in sorted order is
    kept), to a file, and up the tree (a shorter path to each file sorts
    later), and names whose order differs between str and UTF-16 (U+E000 and
    U+1F600) or surrogate-escaped bytes (U+00E9 and b"\\x80")."""
    tree = tmp_path / "tree"
    for name in ("a.jpg", "z.jpg", "\xe9.jpg", "\ue000.jpg", "\U0001f600.jpg", "other/o.jpg", "sub/s.jpg"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        touch(tree / name)
    for link, target in {"b-link": "other", "a-link": "other", "sub/up": "..", "zz.jpg": "sub/s.jpg"}.items():
        os.symlink(target, tree / link)
    raw = os.fsencode(tree)
    try:
        os.mkdir(os.path.join(raw, b"d\xff"))
        for name in (b"\x80.jpg", b"caf\xe9.jpg", b"d\xff/i.jpg"):
            touch(os.path.join(raw, name))
        os.symlink(b"d\xff", os.path.join(raw, b"\xe9-link"))
    except (OSError, UnicodeError):
        pass  # a file system that refuses names that are not UTF-8: the rest is compared
    for pattern in ("*", "*/*.jpg", "**/", "**", "**/*.jpg"):
        pattern = os.path.join(tree, pattern)
        kept = list(sources._shortest_path_to_each(glob.iglob(pattern, recursive=True), {}))
        assert kept == shortest_path_to_each_in_memory(glob.glob(pattern, recursive=True), {}), pattern
    kept = {os.path.relpath(path, tree) for path in kept}  # of **/*.jpg
    assert {"z.jpg", "zz.jpg", "a-link/o.jpg"} <= kept and not {"sub/s.jpg", "b-link/o.jpg", "sub/up/z.jpg"} & kept


def kept_and_traced_peak(pattern: str) -> tuple[int, int]:
    """The paths kept of a glob's matches, and Python's memory at its peak meanwhile."""
    tracemalloc.start()
    try:
        kept = sum(1 for _ in sources._shortest_path_to_each(glob.iglob(pattern, recursive=True), {}))
        return kept, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_globs_memory_does_not_grow_with_its_matches(tmp_path):
    """The matches of a glob of 20,000 files and of one of 80,000: Python's
    memory at its peak stays within a small bound, where the matches held in
    a list and a dict took about 280 bytes a file (17 MB more here). Glob
    lists a folder at a time: these hold a thousand files each."""
    for number in range(80_000):
        if number % 1000 == 0:
            (folder := tmp_path / f"{number // 1000:03d}").mkdir()
        touch(folder / f"image-{number:08d}.jpg")
    small, small_peak = kept_and_traced_peak(f"{tmp_path}/0[01]?/**/*.jpg")
    large, large_peak = kept_and_traced_peak(f"{tmp_path}/*/**/*.jpg")
    assert (small, large) == (20_000, 80_000)
    assert large_peak - small_peak < 1 << 20, json.dumps({"small": small_peak, "large": large_peak})


def test_a_brace_alternative_says_what_is_wrong_with_it(tmp_path):
    save_image(tmp_path / "a" / "a.jpg")
    (tmp_path / "b").mkdir()
    with pytest.raises(FileNotFoundError, match="/b' .* has no image files"):
        found(str(tmp_path) + "/{a,b}")
    with pytest.raises(FileNotFoundError, match="/c' .* does not exist"):
        found(str(tmp_path) + "/{a,c}")
    with pytest.raises(FileNotFoundError, match=r"\*\.png'.* matches nothing"):
        found(str(tmp_path) + "/{a,b}/*.png")


def test_a_text_list_may_start_with_a_byte_order_mark(tmp_path):
    image = save_image(tmp_path / "imgs" / "b.jpg")
    (tmp_path / "list.txt").write_bytes(b"\xef\xbb\xbfimgs/b.jpg\n")
    assert found(tmp_path / "list.txt") == [image]


def test_an_unreadable_list_is_named_in_its_error(tmp_path):
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9.jpg\n")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "latin.txt")) + ".*UTF-8"):
        found(tmp_path / "latin.txt")


def test_a_list_that_cannot_be_opened_is_named_in_its_error(tmp_path, monkeypatch):
    """(As root the permission bits do not stop a read, so the refusal is
    simulated where the list is opened.)"""
    listing = tmp_path / "files.txt"
    listing.write_text("a.png\n")
    real_open = open

    def refusing(path, *args, **kwargs):
        if os.fspath(path) == str(listing):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refusing)
    with pytest.raises(ValueError, match=r"cannot read file list .*files.txt: Permission denied"):
        list(expand_inputs([str(listing)]))


def test_a_bad_parquet_list_is_named_in_its_error(tmp_path):
    pyarrow = import_or_skip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "broken.parquet"))):
        found(tmp_path / "broken.parquet")
    pq.write_table(pyarrow.table({"path": [b"a.jpg"]}), tmp_path / "binary.parquet")
    with pytest.raises(ValueError, match="binary.parquet.*must hold strings"):
        found(tmp_path / "binary.parquet")
    pq.write_table(pyarrow.table({"file": ["a.jpg"]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match=r"other.parquet.*no column 'path' \(its columns: \['file'\]\)"):
        found(tmp_path / "other.parquet")


def write_tar(path, data: bytes) -> None:
    info = tarfile.TarInfo("sample.jpg")
    info.size = len(data)
    temporary = path.with_suffix(".partial")
    with tarfile.open(temporary, "w") as tar:
        tar.addfile(info, io.BytesIO(data))
    os.replace(temporary, path)


def test_a_tar_written_again_is_read_anew_by_a_later_plan(tmp_path):
    """A later run in the same process plans again, and reads the tar now at
    the path, not the one opened before (nor through a forked worker's copy
    of the open descriptors)."""
    path = tmp_path / "shard.tar"
    write_tar(path, b"A" * 100)
    [sample] = plan_of(tmp_path, path)
    assert read_sample_bytes(sample) == b"A" * 100
    write_tar(path, b"B" * 100)
    [sample] = plan_of(tmp_path, path)
    assert read_sample_bytes(sample) == b"B" * 100


def test_a_listed_file_named_again_is_read_once(tmp_path):
    image = save_image(tmp_path / "real" / "a.jpg")
    os.symlink(tmp_path / "real", tmp_path / "link")
    (tmp_path / "list.txt").write_text("link/a.jpg\n")
    linked = str(tmp_path / "link" / "a.jpg")
    assert found(linked, tmp_path / "list.txt") == [linked]
    assert found(tmp_path / "list.txt", linked) == [linked]
    assert found(tmp_path / "link", tmp_path / "list.txt", image) == [linked]


def test_a_parquet_list_may_hold_a_categorical_or_string_view_column(tmp_path):
    pyarrow = import_or_skip("pyarrow")
    import pyarrow.parquet as pq

    image = save_image(tmp_path / "imgs" / "a.jpg")
    columns = [pyarrow.array(["imgs/a.jpg"]).dictionary_encode()]
    if hasattr(pyarrow, "string_view"):
        columns.append(pyarrow.array(["imgs/a.jpg"], type=pyarrow.string_view()))
    for number, column in enumerate(columns):
        pq.write_table(pyarrow.table({"path": column}), tmp_path / f"list{number}.parquet")
        assert found(tmp_path / f"list{number}.parquet") == [image]


def add_member(tar: tarfile.TarFile, name: str, data: bytes = b"", **fields) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for field, value in fields.items():
        setattr(info, field, value)
    tar.addfile(info, io.BytesIO(data))


def test_a_hard_link_member_reads_its_targets_bytes_and_a_symbolic_link_is_an_error(tmp_path):
    """GNU tar stores a file's second copy as a hard link to the first: it once
    made a sample with no image member. A symbolic link is not followed, and
    its sample, once left out of both index and errors, is an error."""
    path = tmp_path / "links.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        add_member(tar, "d/a.jpg", b"JPEG bytes")
        add_member(tar, "d/b.jpg", type=tarfile.LNKTYPE, linkname="d/a.jpg")
        add_member(tar, "d/c.jpg", type=tarfile.SYMTYPE, linkname="a.jpg")
        add_member(tar, "d/e.jpg", type=tarfile.LNKTYPE, linkname="d/later.jpg")
        add_member(tar, "d/f.jpg", type=tarfile.FIFOTYPE)
    a, b, c, e, f = plan_of(tmp_path, path)
    assert (b.key, b.member, b.error) == ("d/b", "d/b.jpg", None)
    assert read_sample_bytes(b) == read_sample_bytes(a) == b"JPEG bytes"
    assert (c.key, c.member, c.error) == (
        "d/c",
        "d/c.jpg",
        "the image member is a symbolic link to 'a.jpg'; links in a tar are not followed",
    )
    assert e.error == "the image member is a hard link to 'd/later.jpg', which is no earlier file of the tar"
    assert f.error == "the image member is not a file but a special entry (tar type b'6')"


def test_data_after_a_tars_end_is_an_error_naming_where(tmp_path):
    """`cat a.tar b.tar` makes a tar that readers stop reading at a.tar's end
    blocks: b.tar's samples were left out unsaid."""
    first, second = tmp_path / "a.tar", tmp_path / "b.tar"
    for path in (first, second):
        with tarfile.open(path, "w") as tar:
            add_member(tar, f"{path.stem}.jpg", b"bytes")
    joined = tmp_path / "joined.tar"
    joined.write_bytes(first.read_bytes() + second.read_bytes())
    a, after = plan_of(tmp_path, joined)
    assert a.key == "a" and a.error is None
    start = first.stat().st_size
    assert after.key == f"{joined}@{start}"
    assert f"data follows the end-of-archive blocks (at byte 1024) from byte {start}" in after.error


def test_a_file_or_member_over_the_byte_limit_is_refused_unread(tmp_path):
    """A multi-gigabyte file named .jpg was read whole into a worker's memory
    (and killed it again on every rerun). Both files here are sparse: no byte
    of them is on disk."""
    size = MAX_IMAGE_BYTES + 1
    huge = tmp_path / "huge.jpg"
    with open(huge, "wb") as file:
        file.truncate(size)
    header = tarfile.TarInfo("huge.jpg")
    header.size = size
    with open(tmp_path / "huge.tar", "wb") as file:
        file.write(header.tobuf())
        file.truncate(tarfile.BLOCKSIZE + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE + 2 * tarfile.BLOCKSIZE)
    plan = plan_of(tmp_path, huge, tmp_path / "huge.tar")
    assert [sample.error for sample in plan] == [None, None]
    for sample in plan:
        with pytest.raises(ImageTooLarge, match=f"^{size:,} bytes, over the limit of {MAX_IMAGE_BYTES:,}"):
            read_sample_bytes(sample)
