"""scripts/trace_pipeline.py: a tokenize run's timeline with every thread's marks."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import load_script
from test_cli_shards import FAST, make_images

trace_pipeline = load_script("trace_pipeline")


@pytest.mark.parametrize("name", ["trace.json", "trace.json.gz"])
def test_the_trace_holds_each_threads_marks(tmp_path, capsys, name):
    images = make_images(tmp_path / "images", 6)
    trace = tmp_path / name
    arguments = ["--trace", str(trace), "--", *images, "--out", str(tmp_path / "out"), *FAST, "--shard-size", "3"]
    assert trace_pipeline.main(arguments) == 0
    threads = {}
    text = gzip.decompress(trace.read_bytes()) if name.endswith(".gz") else trace.read_text()
    for event in json.loads(text)["traceEvents"]:
        if str(event.get("name", "")).startswith("lumenbridge."):
            threads.setdefault(event["name"], set()).add(event["tid"])
    # The model's thread and the writers' threads (two open shards) are all recorded, apart.
    assert threads["lumenbridge.tokenize"].isdisjoint(threads["lumenbridge.write_rows"])
    assert len(threads["lumenbridge.write_rows"]) == 2
    printed = capsys.readouterr().out
    assert "tokenize" in printed and "write_rows" in printed and f"trace: {trace}" in printed
