"""examples/: each runs as shipped (train_classifier.py shortened), on the CPU, in seconds."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from conftest import import_or_skip

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_vlm_connector_trains_every_part_for_one_step():
    import_or_skip("transformers")
    example = runpy.run_path(str(EXAMPLES / "vlm_connector.py"))
    result = example["main"]()
    assert result.image_tokens == [24, 21]  # 300 x 200 -> 6 x 4 tokens, 180 x 400 -> 3 x 7
    assert result.loss_after < result.loss_before
    model = result.model
    for part in (model.vision, model.projector, model.language_model):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters() if p.requires_grad)


def test_vlm_connector_refuses_placeholders_that_do_not_match_the_images():
    """Counts swapped between samples, or one image for two prompts, would
    put an image's tokens into another sample's prompt."""
    import_or_skip("transformers")
    example = runpy.run_path(str(EXAMPLES / "vlm_connector.py"))
    model = example["build_model"]()
    images = [
        torch.randint(0, 256, (3, 96, 64), dtype=torch.uint8),
        torch.randint(0, 256, (3, 48, 112), dtype=torch.uint8),
    ]
    texts = [torch.randint(3, 128, (4,)) for _ in images]
    with pytest.raises(ValueError, match=r"hold \[21, 24\] placeholders for 2 images of \[24, 21\] tokens"):
        model(images, *example["build_batch"]([21, 24], texts))
    with pytest.raises(ValueError, match="for 1 images of"):
        model(images[:1], *example["build_batch"]([24, 21], texts))


def test_train_classifier_checkpoints_each_epoch_and_resumes_exactly(tmp_path, native_ops):
    """A shortened run: two epochs straight, against one interrupted after its
    first checkpoint and resumed; both end with the same weights."""
    example = runpy.run_path(str(EXAMPLES / "train_classifier.py"))
    main = example["main"]
    common = ["--epochs", "2", "--steps-per-epoch", "2", "--batch-size", "8", "--device", "cpu"]
    straight = main([*common, "--checkpoint", str(tmp_path / "straight")])
    assert 0.0 <= straight.accuracy <= 1.0 and straight.held_out == 135 and straight.epochs == 2
    saved = tmp_path / "straight" / "epoch-2"
    assert sorted(p.name for p in (tmp_path / "straight").iterdir()) == ["epoch-2"]  # older epochs dropped
    assert {p.name for p in saved.iterdir()} == {"tokenizer", "classifier.safetensors", "training.pt"}

    train_epoch = main.__globals__["train_epoch"]

    def interrupted(model, training, regions, epoch, args, device):
        if epoch == 2:
            raise KeyboardInterrupt
        return train_epoch(model, training, regions, epoch, args, device)

    main.__globals__["train_epoch"] = interrupted
    with pytest.raises(KeyboardInterrupt):
        main([*common, "--checkpoint", str(tmp_path / "resumed")])
    main.__globals__["train_epoch"] = train_epoch
    with pytest.raises(SystemExit, match="already holds a checkpoint"):
        main([*common, "--checkpoint", str(tmp_path / "resumed")])
    abandoned = tmp_path / "resumed" / ".epoch-2.partial-999999"  # a save killed midway, in another process
    (abandoned / "tokenizer").mkdir(parents=True)
    resumed = main([*common, "--checkpoint", str(tmp_path / "resumed"), "--resume"])
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == ["epoch-2"]
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.accuracy == straight.accuracy


@pytest.fixture
def train_classifier():
    return runpy.run_path(str(EXAMPLES / "train_classifier.py"))


def test_train_classifier_refuses_a_resume_with_other_settings(tmp_path, train_classifier, native_ops):
    main = train_classifier["main"]
    common = ["--steps-per-epoch", "1", "--batch-size", "4", "--device", "cpu", "--checkpoint", str(tmp_path)]
    main(["--epochs", "1", *common])
    with pytest.raises(SystemExit, match=r"other settings: --epochs 2 \(the checkpoint's: 1\), --lr 0.5"):
        main(["--epochs", "2", "--lr", "0.5", *common, "--resume"])
    result = main(["--epochs", "1", *common, "--resume"])  # the same settings: nothing left to train
    assert result.epochs == 1 and result.images_per_second == 0.0


def test_train_classifier_resumes_an_unscaled_run_where_float16_needs_a_scaler(tmp_path, train_classifier):
    """A checkpoint of a run without float16 autocast holds an empty GradScaler
    state; a resume with an enabled scaler starts it afresh."""
    model = torch.nn.Linear(2, 2)
    args = train_classifier["parse_args"](["--device", "cpu"])
    saved = train_classifier["Training"](model, torch.device("cpu"), args).state_dict()
    assert saved["scaler"] == {}
    training = train_classifier["Training"](model, torch.device("cpu"), args)
    training.scaler = torch.amp.GradScaler("cpu", enabled=True)
    training.load_state_dict(saved)
    assert training.scaler.is_enabled() and training.scaler.get_scale() == 2.0**16


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "-1"], "--lr must be positive"),
        (["--seed", str(10**17)], "--seed must be in"),
        (["--device", "gpu0"], "--device 'gpu0'"),
        (["--lr", "inf"], "--lr must be positive and finite"),
        *([(["--device", "cuda"], "no such CUDA device here")] if not torch.cuda.is_available() else []),
        (["--device", "meta"], "choose cpu, cuda[:N] or mps"),
    ],
)
def test_train_classifier_bad_arguments_are_one_usage_line(argv, message, train_classifier, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_classifier["parse_args"](argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_train_classifier_stops_on_a_loss_that_is_not_finite(tmp_path, train_classifier, monkeypatch):
    """A diverged epoch is not saved over the last good checkpoint."""
    cross_entropy, calls = train_classifier["F"].cross_entropy, []

    def diverging_in_epoch_two(*arguments):
        calls.append(1)
        return cross_entropy(*arguments) * (float("nan") if len(calls) == 2 else 1.0)

    monkeypatch.setattr(train_classifier["F"], "cross_entropy", diverging_in_epoch_two)
    argv = ["--epochs", "2", "--steps-per-epoch", "1", "--batch-size", "2", "--device", "cpu"]
    with pytest.raises(SystemExit, match="the loss became nan in epoch 2"):
        train_classifier["main"]([*argv, "--checkpoint", str(tmp_path)])
    assert [folder.name for folder in train_classifier["epoch_folders"](tmp_path)] == ["epoch-1"]


def test_train_classifier_does_not_save_weights_that_are_not_finite(tmp_path, train_classifier, monkeypatch):
    """The loss is checked before each step; an epoch's last step can still diverge."""
    namespace = train_classifier["main"].__globals__
    train_epoch = namespace["train_epoch"]

    def last_step_diverges_in_epoch_two(model, training, regions, epoch, args, device):
        speed = train_epoch(model, training, regions, epoch, args, device)
        if epoch == 2:
            with torch.no_grad():
                next(model.parameters()).fill_(float("inf"))
        return speed

    monkeypatch.setitem(namespace, "train_epoch", last_step_diverges_in_epoch_two)
    argv = ["--epochs", "2", "--steps-per-epoch", "1", "--batch-size", "2", "--device", "cpu"]
    with pytest.raises(SystemExit, match="the weights are no longer finite after epoch 2"):
        train_classifier["main"]([*argv, "--checkpoint", str(tmp_path)])
    assert [folder.name for folder in train_classifier["epoch_folders"](tmp_path)] == ["epoch-1"]


def test_train_classifier_an_unwritable_checkpoint_fails_before_training(tmp_path, train_classifier, monkeypatch):
    (tmp_path / "afile").write_text("")
    monkeypatch.setitem(train_classifier["main"].__globals__, "train_epoch", lambda *a: pytest.fail("trained first"))
    with pytest.raises(SystemExit, match="cannot write checkpoints in"):
        train_classifier["main"](["--device", "cpu", "--checkpoint", str(tmp_path / "afile" / "ck")])


def test_train_classifier_checkpoint_must_be_a_folder(tmp_path, train_classifier, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        train_classifier["parse_args"](["--checkpoint", str(tmp_path / "file")])
    assert exit_info.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err
