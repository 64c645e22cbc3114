"""scripts/profile_tokenize.py's arithmetic of a step's kernel gaps (the
script itself needs a CUDA GPU)."""

from __future__ import annotations

from conftest import load_script

profile_tokenize = load_script("profile_tokenize")


def test_kernel_gaps_count_idle_time_between_kernels_only():
    kernels = [(0.0, 100.0, "a"), (150.0, 200.0, "b"), (190.0, 400.0, "c"), (1400.0, 1500.0, "d")]
    span, idle, waits = profile_tokenize.kernel_gaps(kernels)
    assert span == 1.5
    assert idle == (50.0 + 1000.0) / 1000
    assert waits == [(50.0, "b"), (-10.0, "c"), (1000.0, "d")]


def test_a_kernel_inside_an_earlier_one_does_not_shorten_the_busy_time():
    span, idle, waits = profile_tokenize.kernel_gaps([(0.0, 500.0, "long"), (10.0, 20.0, "short"), (600.0, 700.0, "x")])
    assert (span, idle) == (0.7, 0.1)
    assert waits[-1] == (100.0, "x")


def test_without_the_profiler_every_call_still_runs(monkeypatch):
    # ncu profiles launches after the first few; the unprofiled run must make them all.
    monkeypatch.setattr(profile_tokenize.torch.cuda, "synchronize", lambda: None)
    calls = []
    assert profile_tokenize.run(lambda: calls.append(1), 3, 10, profiled=False) is None
    assert len(calls) == 13
