"""The command line never destroys data, fails before the work when it
cannot write, leaves no temporary files behind, and behaves at the edges
(pipes, Ctrl-C, --version, bad options) as a command line should."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from PIL import Image

from lumenbridge import TokenizerConfig, VisualTokenizer, atomic, cli
from lumenbridge.images import _quiet_when_main_is_gone, image_loader

SMALL = "lumenbridge-small"
FAST = ["--preset", SMALL, "--image-size", "32", "--workers", "0", "--device", "cpu"]
COMMAND = [sys.executable, "-m", "lumenbridge"]


def save_image(path, color=(200, 30, 30), mode="RGB", size=(40, 30)):
    Image.new(mode, size, color).save(path)
    return str(path)


def read_tokens(path):
    with safetensors.safe_open(str(path), framework="pt") as file:
        return file.get_tensor("tokens"), file.metadata()


def tokenize(*arguments):
    return cli.main(["tokenize", *map(str, arguments), *FAST])


def environment(**overrides):
    env = {**os.environ, **overrides}
    env.pop("LUMENBRIDGE_BACKEND", None)
    return env


@pytest.fixture
def two_pngs(tmp_path):
    return save_image(tmp_path / "a.png"), save_image(tmp_path / "b.png", color=(1, 2, 3))


# --- item 7: --out never destroys data ------------------------------------------------------


def test_out_before_a_shell_glob_never_replaces_an_image(tmp_path, two_pngs, capsys):
    # `tokenize --out *.png` in a folder of a.png and b.png: the shell makes --out a.png.
    a, b = two_pngs
    before = Path(a).read_bytes()
    assert cli.main(["tokenize", "--out", a, b, *FAST]) == 2
    assert "is not a LumenBridge tokens file; choose another path, or pass --overwrite" in capsys.readouterr().err
    assert Path(a).read_bytes() == before


@pytest.mark.parametrize("through_symlink", [False, True])
def test_out_that_is_an_input_is_refused_even_with_overwrite(tmp_path, two_pngs, capsys, through_symlink):
    a, _ = two_pngs
    out = tmp_path / "link.safetensors" if through_symlink else Path(a)
    if through_symlink:
        out.symlink_to(a)
    before = Path(a).read_bytes()
    assert tokenize(a, "--out", out, "--overwrite") == 2
    assert "is one of the inputs" in capsys.readouterr().err
    assert Path(a).read_bytes() == before


def test_out_that_is_a_file_list_is_refused_and_a_missing_entry_is_no_obstacle(tmp_path, two_pngs, capsys):
    a, _ = two_pngs
    listed = tmp_path / "list.txt"
    listed.write_text(f"{a}\n{tmp_path / 'missing.png'}\n")
    before = listed.read_bytes()
    assert tokenize(listed, "--out", listed, "--overwrite") == 2
    assert "is one of the inputs" in capsys.readouterr().err
    assert listed.read_bytes() == before
    out = tmp_path / "tokens.safetensors"
    assert tokenize(a, "--out", out) == 0
    assert tokenize(listed, "--out", out) == 1  # replaces its own tokens file; the missing entry is skipped
    assert read_tokens(out)[0].shape[0] == 1


def test_overwrite_replaces_another_file_and_keeps_its_permissions(tmp_path, two_pngs):
    out = tmp_path / "notes.bin"
    out.write_bytes(b"not tokens")
    out.chmod(0o640)
    assert tokenize(*two_pngs, "--out", out) == 2
    assert out.read_bytes() == b"not tokens"
    assert tokenize(*two_pngs, "--out", out, "--overwrite") == 0
    assert read_tokens(out)[0].shape[0] == 2
    assert stat.S_IMODE(out.stat().st_mode) == 0o640


def test_replacing_a_tokens_file_keeps_its_permissions(tmp_path, two_pngs):
    out = tmp_path / "tokens.safetensors"
    assert tokenize(two_pngs[0], "--out", out) == 0
    out.chmod(0o600)
    assert tokenize(*two_pngs, "--out", out) == 0
    assert read_tokens(out)[0].shape[0] == 2
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_a_symlinked_out_is_followed_and_stays_a_link(tmp_path, two_pngs):
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "tokens.safetensors"
    link = tmp_path / "latest.safetensors"
    link.symlink_to(target)
    assert tokenize(*two_pngs, "--out", link) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert read_tokens(target)[0].shape[0] == 2


def test_out_that_is_not_a_regular_file_is_refused(two_pngs, capsys):
    assert tokenize(*two_pngs, "--out", os.devnull, "--overwrite") == 2
    assert "is not a regular file" in capsys.readouterr().err


# --- item 8: an unwritable location fails before any work --------------------------------


@pytest.fixture
def unwritable_folder(tmp_path):
    """A folder where no file can be created, even by root (through the immutable attribute)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    try:
        subprocess.run(["chattr", "+i", str(folder)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("running as root and chattr +i is not available here")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_an_unwritable_output_folder_fails_before_any_image_is_decoded(
    unwritable_folder, two_pngs, monkeypatch, capsys
):
    def decode_nothing(*args, **kwargs):
        raise AssertionError("images were decoded before the output location was checked")

    monkeypatch.setattr(cli, "load_model", decode_nothing)
    monkeypatch.setattr(cli, "tokenize_files", decode_nothing)
    assert tokenize(*two_pngs, "--out", unwritable_folder / "tokens.safetensors") == 2
    assert f"cannot write in {unwritable_folder}" in capsys.readouterr().err


# --- item 9: a killed write leaves nothing that a later run does not remove ----------------

# Writes a large tokens file the way `tokenize` does, so that the write takes long enough to be killed.
SLOW_WRITE = """
import sys, torch
from lumenbridge.cli import save_tokens_atomically
save_tokens_atomically(sys.argv[1], {"tokens": torch.zeros(200_000_000)}, {"paths": "[]", "config": "{}"})
"""


def test_a_write_killed_midway_is_cleaned_up_by_the_next_run(tmp_path, two_pngs):
    out = tmp_path / "tokens.safetensors"
    writer = subprocess.Popen([sys.executable, "-c", SLOW_WRITE, str(out)], env=environment())

    def safetensors_temporary():
        return [p for p in tmp_path.glob(atomic.STAGING_PREFIX + "*/.tmp*")]

    deadline = time.monotonic() + 120
    while not safetensors_temporary():
        assert writer.poll() is None, "the write finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    writer.kill()
    writer.wait()
    # Everything the killed writer made, safetensors' own temporary file included, is in one staging folder.
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("a.png", "b.png"))
    assert len(leftovers) == 1 and leftovers[0].startswith(atomic.STAGING_PREFIX)

    assert tokenize(*two_pngs, "--out", out) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "b.png", "tokens.safetensors"]


def test_a_staging_folder_in_use_is_not_removed(tmp_path):
    with atomic.staging_folder(tmp_path) as folder:
        atomic.remove_abandoned(tmp_path)
        assert folder.is_dir()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a worker")
def test_a_forked_worker_does_not_keep_a_killed_writers_staging_folder(tmp_path):
    """A DataLoader worker forked while a run holds a staging folder (its plan's)
    outlives a kill -9 of the run for a while: the next run must still find the
    folder abandoned, or it stays in DIR after that run."""
    out = tmp_path / "out"
    out.mkdir()
    # The worker names itself once it runs (past the fork hooks), and only
    # then is the writer killed: killed earlier, the lock would be checked
    # while a worker not yet scheduled still holds its copy.
    script = (
        "import os, signal, sys, time\n"
        "from lumenbridge import atomic\n"
        "with atomic.staging_folder(sys.argv[1]):\n"
        "    worker = os.fork()\n"
        "    if worker == 0:\n"
        "        open(sys.argv[2] + '.part', 'w').write(str(os.getpid()))\n"
        "        os.replace(sys.argv[2] + '.part', sys.argv[2])\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    while not os.path.exists(sys.argv[2]):\n"
        "        time.sleep(0.001)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    pid_file = tmp_path / "worker.pid"
    writer = subprocess.run([sys.executable, "-c", script, out, pid_file], timeout=60, check=False)
    try:
        assert writer.returncode == -signal.SIGKILL
        atomic.remove_abandoned(out)
        assert list(out.iterdir()) == []
    finally:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


# --- items 11 and 12: --background and --max-pixels -------------------------------------


@pytest.mark.parametrize(
    ("background", "color"), [("black", (0, 0, 0)), ("#123456", (18, 52, 86)), ("mean", (124, 116, 104))]
)
def test_transparent_pixels_take_the_background_colour(tmp_path, background, color):
    hidden = save_image(tmp_path / "hidden-red.png", color=(255, 0, 0, 0), mode="RGBA")
    plain = save_image(tmp_path / "plain.png", color=color)
    out = tmp_path / "tokens.safetensors"
    assert tokenize(hidden, plain, "--out", out, "--background", background) == 0
    tokens, metadata = read_tokens(out)
    assert torch.equal(tokens[0], tokens[1])
    assert json.loads(metadata["preprocess"])["background"] == list(color)


def test_a_bad_background_is_a_usage_error(tmp_path, two_pngs, capsys):
    assert tokenize(*two_pngs, "--out", tmp_path / "t.safetensors", "--background", "nocolour") == 2
    assert "--background 'nocolour'" in capsys.readouterr().err


def test_images_over_max_pixels_are_skipped_and_named(tmp_path, capsys):
    small = save_image(tmp_path / "small.png", size=(40, 30))
    large = save_image(tmp_path / "large.png", size=(100, 60))
    out = tmp_path / "tokens.safetensors"
    assert tokenize(small, large, "--out", out, "--max-pixels", "5000") == 1
    assert f"skipped {large}: ImageTooLarge: 100 x 60 = 6,000 pixels, over the limit of 5,000 pixels" in (
        capsys.readouterr().err
    )
    assert json.loads(read_tokens(out)[1]["paths"]) == [small]


def test_a_skipped_name_is_shown_on_one_line_without_control_sequences(tmp_path, capsys):
    good = save_image(tmp_path / "good.png", size=(40, 30))
    hostile = tmp_path / "x\x1b]0;owned\x07\nfake.jpg"
    hostile.write_bytes(b"not an image")
    assert tokenize(good, hostile, "--out", tmp_path / "tokens.safetensors") == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if "fake.jpg" in line]
    assert len(lines) == 1 and lines[0].startswith(f"skipped {repr(str(hostile))[1:-1]}: ")
    assert "\x1b" not in lines[0]


def test_max_pixels_must_be_positive(tmp_path, two_pngs):
    assert tokenize(*two_pngs, "--out", tmp_path / "t.safetensors", "--max-pixels", "0") == 2


# --- item 13: the small things ------------------------------------------------------------


@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "unbuffered"])
def test_output_into_a_closed_pipe_exits_141_quietly(unbuffered):
    # Like `lumenbridge info | head -1`, with the reader gone before the first write.
    read_end, write_end = os.pipe()
    os.close(read_end)
    run = subprocess.run(
        [*COMMAND, "info"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        env=environment(PYTHONUNBUFFERED=unbuffered),
        text=True,
        timeout=300,
        check=False,
    )
    os.close(write_end)
    assert run.returncode == 141, run.stderr
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr
    assert "no output was written" not in run.stderr


def default_signals():
    """Runs in a child before exec: a test run started in the background or
    under nohup ignores SIGINT or SIGHUP, and children would inherit that."""
    for number in (signal.SIGINT, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)


def start_job(command):
    # A session of its own, interrupted like a terminal interrupts a job: the whole group.
    return subprocess.Popen(
        command,
        env=environment(),
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=default_signals,  # noqa: PLW1509 - no threads here
    )


def interrupt(process):
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=120)
    return err.decode()


def test_ctrl_c_during_a_run_prints_one_line_and_exits_130(tmp_path):
    for index in range(1000):
        save_image(tmp_path / f"{index:04}.png", color=(index % 256, 0, 0))
    out = tmp_path / "tokens.safetensors"
    process = start_job(
        [*COMMAND, "tokenize", str(tmp_path), "--out", str(out), *FAST, "--workers", "2", "--batch-size", "4"]
    )
    progress = b""
    while not re.search(rb" [1-9][0-9]*/1000 ", progress):  # the progress bar has moved: images are being tokenized
        chunk = os.read(process.stderr.fileno(), 4096)
        assert chunk, progress.decode()
        progress += chunk
    err = interrupt(process)
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1] == "lumenbridge: interrupted", err
    assert "Traceback" not in err
    assert not out.exists()


class InterruptHandlerProbe(torch.utils.data.Dataset):
    """One item: whether the process that loads it ignores SIGINT, and
    whether its uncaught exceptions go to the quiet hook."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> tuple[bool, bool]:
        return signal.getsignal(signal.SIGINT) == signal.SIG_IGN, sys.excepthook is _quiet_when_main_is_gone


def test_loader_workers_leave_ctrl_c_to_the_main_process():
    assert list(image_loader(InterruptHandlerProbe(), batch_size=None, num_workers=1)) == [[True, True]]
    assert signal.getsignal(signal.SIGINT) != signal.SIG_IGN
    assert sys.excepthook is not _quiet_when_main_is_gone


@pytest.mark.parametrize("error, printed", [(EOFError, False), (ConnectionResetError, False), (ValueError, True)])
def test_worker_hook_is_quiet_only_about_the_lost_main_process(error, printed, capsys):
    """A worker's thread that loses its connection to the interrupted main
    process prints nothing; other failures still print their traceback."""
    try:
        raise error("lost")
    except error:
        _quiet_when_main_is_gone(*sys.exc_info())
    assert ("Traceback" in capsys.readouterr().err) == printed


def wait_until_importing_torch(pid: int, timeout: float = 60.0) -> None:
    """Returns once the process has mapped torch's library: it is past the
    interpreter's own start-up and inside the command line's import of torch
    (a fixed sleep is too short on a loaded machine)."""
    maps = Path(f"/proc/{pid}/maps")
    if not maps.exists():
        time.sleep(2.0)  # no /proc: the import takes seconds, so this lands inside it
        return
    deadline = time.monotonic() + timeout
    while "libtorch" not in maps.read_text():
        assert time.monotonic() < deadline, "the command never started importing torch"
        time.sleep(0.01)


def test_ctrl_c_while_starting_up_prints_one_line_and_exits_130():
    process = start_job([*COMMAND, "info"])
    wait_until_importing_torch(process.pid)
    err = interrupt(process)
    assert process.returncode == 130, err
    assert err.strip() == "lumenbridge: interrupted"


def test_version(capsys):
    import lumenbridge

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"lumenbridge {lumenbridge.__version__}"


def test_a_bad_image_size_names_the_command_line_flag(tmp_path, two_pngs, capsys):
    assert (
        cli.main(["tokenize", *two_pngs, "--out", str(tmp_path / "t.safetensors"), *FAST, "--image-size", "100"]) == 2
    )
    err = capsys.readouterr().err
    assert (
        "--image-size 100: must be a positive multiple of the model's total stride 16; try --image-size 96 or 112"
        in err
    )
    assert "dynamic_pad" not in err


def test_paths_are_stored_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_image(tmp_path / "a.png")
    assert tokenize("a.png", "--out", "tokens.safetensors") == 0
    tokens, metadata = read_tokens(tmp_path / "tokens.safetensors")
    assert json.loads(metadata["paths"]) == [str(tmp_path / "a.png")]
    model = VisualTokenizer(TokenizerConfig.preset(SMALL), seed=0)
    assert tokens.shape == (1, 4, model.embed_dim)


def test_a_bad_backend_from_the_environment_is_named_as_such(tmp_path, two_pngs, monkeypatch, capsys):
    monkeypatch.setenv("LUMENBRIDGE_BACKEND", "fast")
    assert tokenize(*two_pngs, "--out", tmp_path / "t.safetensors") == 2
    err = capsys.readouterr().err
    assert "unknown backend 'fast' (from LUMENBRIDGE_BACKEND=fast)" in err and "--backend" not in err


@pytest.mark.skipif(sys.platform == "win32", reason="no flock on Windows: a run takes no lock there")
def test_a_second_run_in_a_held_output_folder_is_refused(tmp_path):
    from lumenbridge import shards

    with (
        shards.run_lock(str(tmp_path)),
        pytest.raises(shards.OutputError, match="being written by another lumenbridge run"),
        shards.run_lock(str(tmp_path)),
    ):
        pass
    with shards.run_lock(str(tmp_path)):  # free again once the first run let it go
        pass
