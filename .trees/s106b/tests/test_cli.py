"""The `lumenbridge` command line (lumenbridge.cli)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import safetensors
import safetensors.torch
import torch
from PIL import Image
from safetensors import safe_open

import lumenbridge
from lumenbridge import TokenizerConfig, VisualTokenizer, cli
from lumenbridge.images import load_image, sample_image_paths

SMALL = "lumenbridge-small"
# Small crops keep the model cheap; 32 is two tokens per side at stride 16.
SMALL_MODEL = ["--preset", SMALL, "--image-size", "32", "--workers", "0"]
# On CPU, like the expected tokens the tests compute, so results compare closely.
FAST = [*SMALL_MODEL, "--device", "cpu"]


def save_image(path, color, size=(40, 30)):
    Image.new("RGB", size, color).save(path)
    return str(path)


def write_previous_output(path):
    """A tokens file from an earlier run, which a new run may replace; returns its bytes."""
    metadata = {"paths": "[]", "config": "{}"}
    safetensors.torch.save_file({"tokens": torch.zeros(1, 4, 384)}, path, metadata=metadata)
    return path.read_bytes()


def read_output(path):
    with safe_open(path, framework="pt") as file:
        return file.get_tensor("tokens"), file.metadata()


def expected_tokens(model, paths, image_size, resize=None):
    batch = torch.stack([load_image(path, image_size, resize) for path in paths])
    with torch.inference_mode():
        return model(batch)


@pytest.fixture
def good_images(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    return [
        save_image(folder / "a.png", (250, 10, 10)),
        save_image(folder / "b.jpg", (10, 250, 10)),
        save_image(folder / "c.webp", (10, 10, 250)),
    ]


def test_samples_end_to_end(tmp_path, capsys):
    out = tmp_path / "samples.safetensors"
    code = cli.main(["tokenize", "--out", str(out), "--workers", "0", "--batch-size", "3", "--device", "cpu"])
    captured = capsys.readouterr()

    assert code == 0
    samples = sample_image_paths()
    tokens, metadata = read_output(out)
    assert tuple(tokens.shape) == (len(samples), 196, 768)
    assert tokens.dtype == torch.float32
    assert json.loads(metadata["paths"]) == samples
    assert metadata["weights"] == "seeded-init:0"
    config = TokenizerConfig.preset("lumenbridge-base")
    assert TokenizerConfig.from_json(metadata["config"]) == config
    torch.testing.assert_close(tokens, expected_tokens(VisualTokenizer(config, seed=0), samples, 224))
    assert "sample photos" in captured.err
    assert "random initialization" in captured.err
    assert f"tokenized {len(samples)} images" in captured.out
    assert str(out) in captured.out


def test_unreadable_images_are_named_and_skipped(tmp_path, good_images, capsys):
    folder = os.path.dirname(good_images[0])
    with open(os.path.join(folder, "bad.jpg"), "wb") as file:
        file.write(os.urandom(3000))
    noise = Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3))
    noise.save(os.path.join(folder, "broken.png"))
    with open(os.path.join(folder, "broken.png"), "r+b") as file:
        file.truncate(os.path.getsize(file.name) // 2)
    out = tmp_path / "tokens.safetensors"

    code = cli.main(["tokenize", folder, "--out", str(out), "--batch-size", "2", *FAST, "--workers", "2"])
    captured = capsys.readouterr()

    assert code == 1
    assert "bad.jpg" in captured.err and "UnidentifiedImageError" in captured.err
    assert "broken.png" in captured.err
    assert "skipped 2 of 5" in captured.err
    tokens, metadata = read_output(out)
    assert json.loads(metadata["paths"]) == good_images
    model = VisualTokenizer(TokenizerConfig.preset(SMALL), seed=0)
    torch.testing.assert_close(tokens, expected_tokens(model, good_images, 32))


def test_no_readable_image_exits_2_without_output(tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    out = tmp_path / "tokens.safetensors"
    assert cli.main(["tokenize", str(bad), "--out", str(out), *FAST]) == 2
    assert "no output written" in capsys.readouterr().err
    assert not out.exists()


def test_a_missing_path_is_a_usage_error_naming_it(tmp_path, good_images, capsys):
    out = tmp_path / "tokens.safetensors"
    missing = str(tmp_path / "nowhere" / "*.png")
    assert cli.main(["tokenize", good_images[0], missing, "--out", str(out), *FAST]) == 2
    assert missing in capsys.readouterr().err
    assert not out.exists()


def test_weights_from_a_checkpoint(tmp_path, good_images, capsys):
    model = VisualTokenizer(TokenizerConfig.preset(SMALL), seed=123)
    model.save_pretrained(tmp_path / "checkpoint")
    out = tmp_path / "tokens.safetensors"

    code = cli.main(
        [
            "tokenize",
            *good_images,
            "--out",
            str(out),
            "--weights",
            str(tmp_path / "checkpoint"),
            "--image-size",
            "48",
            "--workers",
            "0",
            "--device",
            "cpu",
        ]
    )

    assert code == 0
    assert "random initialization" not in capsys.readouterr().err
    tokens, metadata = read_output(out)
    assert metadata["weights"] == str(tmp_path / "checkpoint")
    torch.testing.assert_close(tokens, expected_tokens(model, good_images, 48))


@pytest.mark.parametrize("fmt", ["NCHW", "NHWC"])
def test_tokens_are_stored_as_sequences_whatever_the_checkpoints_format(tmp_path, good_images, fmt):
    config = dataclasses.replace(TokenizerConfig.preset(SMALL), output_fmt=fmt)
    VisualTokenizer(config, seed=5).save_pretrained(tmp_path / "checkpoint")
    out = tmp_path / "tokens.safetensors"
    weights = ["--weights", str(tmp_path / "checkpoint"), "--image-size", "32", "--workers", "0", "--device", "cpu"]
    assert cli.main(["tokenize", *good_images, "--out", str(out), *weights]) == 0
    tokens, _ = read_output(out)
    want = expected_tokens(VisualTokenizer(TokenizerConfig.preset(SMALL), seed=5), good_images, 32)
    assert tokens.shape == (3, 4, 384)
    torch.testing.assert_close(tokens, want)


def test_a_checkpoint_for_other_than_rgb_images_is_a_usage_error(tmp_path, good_images, capsys):
    config = dataclasses.replace(TokenizerConfig.preset(SMALL), in_chans=1, mean=(0.5,), std=(0.25,))
    VisualTokenizer(config, seed=0).save_pretrained(tmp_path / "checkpoint")
    out = tmp_path / "out"
    assert cli.main(["tokenize", *good_images, "--out", str(out), "--weights", str(tmp_path / "checkpoint")]) == 2
    assert "takes 1-channel images" in capsys.readouterr().err
    assert not out.exists()


def test_a_bad_checkpoint_is_a_usage_error(tmp_path, good_images, capsys):
    out = tmp_path / "tokens.safetensors"
    code = cli.main(["tokenize", *good_images, "--out", str(out), "--weights", str(tmp_path), "--workers", "0"])
    assert code == 2
    assert "config.json" in capsys.readouterr().err
    assert not out.exists()


def test_a_failed_run_keeps_the_previous_output(tmp_path):
    out = tmp_path / "tokens.safetensors"
    previous = write_previous_output(out)
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8 garbage")
    assert cli.main(["tokenize", str(bad), "--out", str(out), *FAST]) == 2
    assert out.read_bytes() == previous


def test_a_crash_while_writing_keeps_the_previous_output(tmp_path, good_images, monkeypatch, capsys):
    out = tmp_path / "tokens.safetensors"
    previous = write_previous_output(out)

    def write_half_then_fail(tensors, filename, metadata=None):
        with open(filename, "wb") as file:
            file.write(b"half a file")
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", write_half_then_fail)
    assert cli.main(["tokenize", *good_images, "--out", str(out), *FAST]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert out.read_bytes() == previous
    assert sorted(os.listdir(tmp_path)) == ["images", "tokens.safetensors"]


def test_a_safetensors_write_error_exits_2_and_keeps_the_previous_output(tmp_path, good_images, monkeypatch, capsys):
    out = tmp_path / "tokens.safetensors"
    previous = write_previous_output(out)

    def refuse(tensors, filename, metadata=None):
        raise safetensors.SafetensorError("Error while serializing: disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", refuse)
    assert cli.main(["tokenize", *good_images, "--out", str(out), *FAST]) == 2
    assert "disk full" in capsys.readouterr().err
    assert out.read_bytes() == previous


def test_an_unexpected_error_exits_3_not_1(tmp_path, good_images, monkeypatch, capsys):
    out = tmp_path / "tokens.safetensors"

    def crash(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(cli, "tokenize_files", crash)
    assert cli.main(["tokenize", *good_images, "--out", str(out), *FAST]) == 3
    assert "CUDA out of memory" in capsys.readouterr().err
    assert not out.exists()


def test_an_unexpected_error_in_a_sharded_run_says_the_finished_shards_are_kept(
    tmp_path, good_images, monkeypatch, capsys
):
    from lumenbridge import pipeline

    def crash(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(pipeline, "run", crash)
    assert cli.main(["tokenize", *good_images, "--out", str(tmp_path / "shards"), *FAST]) == 3
    err = capsys.readouterr().err
    assert "CUDA out of memory" in err
    assert "the shards finished before it are kept, and the same command resumes the run" in err
    assert "no output was written" not in err


def test_a_device_without_kernels_is_a_usage_error(tmp_path, good_images, capsys):
    assert (
        cli.main(["tokenize", *good_images, "--out", str(tmp_path / "t.safetensors"), *SMALL_MODEL, "--device", "meta"])
        == 2
    )
    assert "choose cpu, cuda" in capsys.readouterr().err


def test_a_successful_run_replaces_the_previous_output(tmp_path, good_images):
    out = tmp_path / "tokens.safetensors"
    write_previous_output(out)
    assert cli.main(["tokenize", *good_images, "--out", str(out), *FAST]) == 0
    assert read_output(out)[0].shape[0] == 3
    assert sorted(os.listdir(tmp_path)) == ["images", "tokens.safetensors"]


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_the_output_gets_the_usual_file_permissions(tmp_path, good_images):
    out = tmp_path / "tokens.safetensors"
    ordinary = tmp_path / "ordinary"
    ordinary.write_bytes(b"")
    assert cli.main(["tokenize", *good_images, "--out", str(out), *FAST]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE(ordinary.stat().st_mode)


def test_dtype_sets_the_models_and_the_stored_tokens_dtype(tmp_path, good_images):
    full, half = tmp_path / "full.safetensors", tmp_path / "half.safetensors"
    assert cli.main(["tokenize", *good_images, "--out", str(full), *FAST]) == 0
    assert cli.main(["tokenize", *good_images, "--out", str(half), "--dtype", "bfloat16", *FAST]) == 0
    full_tokens, half_tokens = read_output(full)[0], read_output(half)[0]
    assert full_tokens.dtype == torch.float32  # the default on the CPU
    assert half_tokens.dtype == torch.bfloat16
    # The model ran in bfloat16 (LayerNormed tokens: values of order 1).
    torch.testing.assert_close(half_tokens.float(), full_tokens, atol=0.1, rtol=0.05)
    model = VisualTokenizer(TokenizerConfig.preset(SMALL), seed=0).to(torch.bfloat16)
    batch = torch.stack([load_image(path, 32) for path in good_images])
    with torch.inference_mode():
        assert torch.equal(half_tokens, model(batch))


def test_the_default_dtype_is_bfloat16_on_cuda_and_float32_elsewhere():
    assert cli.default_dtype(torch.device("cuda")) == "bfloat16"
    assert cli.default_dtype(torch.device("cpu")) == "float32"
    assert cli.default_dtype(torch.device("mps")) == "float32"


@pytest.mark.parametrize(
    "arguments",
    [
        ["--image-size", "40"],  # not a multiple of the total stride
        ["--image-size", "32", "--resize", "16"],  # crop larger than the resized image
        ["--batch-size", "0"],
        ["--device", "cuda:99"],
        ["--backend", "no-such-backend"],
        ["--weights", "somewhere", "--seed", "3"],
    ],
)
def test_usage_errors_exit_2_without_output(tmp_path, good_images, arguments):
    out = tmp_path / "tokens.safetensors"
    assert cli.main(["tokenize", *good_images, "--out", str(out), "--workers", "0", *arguments]) == 2
    assert not out.exists()


def test_missing_output_directory_is_a_usage_error(tmp_path, good_images, capsys):
    out = tmp_path / "no" / "such" / "dir" / "tokens.safetensors"
    assert cli.main(["tokenize", *good_images, "--out", str(out), *FAST]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_help_documents_the_exit_codes(capsys):
    assert cli.main(["tokenize", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert "exit codes" in help_text and "some unreadable images were skipped" in help_text
    # The top-level help sends every command's reader to its own --help.
    assert cli.main(["info", "--help"]) == 0
    assert "exit codes:" in capsys.readouterr().out
    assert cli.main(["build", "--help"]) == 0
    assert "the build failed" in capsys.readouterr().out


def test_tokenize_files_reports_failures_and_row_sources(tmp_path, good_images):
    missing = str(tmp_path / "missing.png")
    seen = []
    model = VisualTokenizer(TokenizerConfig.preset(SMALL), seed=0)
    result = cli.tokenize_files(
        model,
        [good_images[0], missing, good_images[1]],
        image_size=32,
        batch_size=2,
        progress=False,
        on_failure=lambda path, reason: seen.append(path),
    )
    assert result.paths == [good_images[0], good_images[1]]
    assert [path for path, _ in result.failures] == seen == [missing]
    assert tuple(result.tokens.shape) == (2, 4, 384)


def test_info_prints_versions_and_the_backend_report(monkeypatch, capsys):
    monkeypatch.setattr(lumenbridge, "backends", lambda build_missing=True: f"BACKEND TABLE, building: {build_missing}")
    assert cli.main(["info"]) == 0
    output = capsys.readouterr().out
    assert f"lumenbridge {lumenbridge.__version__}" in output
    assert f"torch {torch.__version__}" in output
    assert "devices: cpu" in output
    assert "BACKEND TABLE, building: False" in output  # a status report never compiles


def test_build_reports_success_and_failure(monkeypatch, capsys):
    monkeypatch.setattr(lumenbridge.extension, "build", lambda: "built CPU kernels")
    assert cli.main(["build"]) == 0
    assert "built CPU kernels" in capsys.readouterr().out

    def fail():
        raise lumenbridge.extension.BuildError("no C++ compiler found")

    monkeypatch.setattr(lumenbridge.extension, "build", fail)
    assert cli.main(["build"]) == 1
    assert "no C++ compiler found" in capsys.readouterr().err


def console_script():
    scripts = os.path.dirname(sys.executable)
    return shutil.which("lumenbridge", path=os.pathsep.join([scripts, os.environ.get("PATH", "")]))


def test_installed_console_script(tmp_path, good_images):
    script = console_script()
    if script is None:
        pytest.skip("the lumenbridge console script is not installed")
    out = tmp_path / "tokens.safetensors"
    folder = os.path.dirname(good_images[0])
    run = subprocess.run(
        [script, "tokenize", folder, "--out", str(out), *SMALL_MODEL],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    tokens, metadata = read_output(out)
    assert tuple(tokens.shape) == (3, 4, 384)
    assert json.loads(metadata["paths"]) == good_images


def test_python_dash_m_runs_the_cli():
    run = subprocess.run(
        [sys.executable, "-m", "lumenbridge", "tokenize", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0
    assert "exit codes" in run.stdout
