"""Every Python block in README.md runs as written, so the examples cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import import_or_skip

README = Path(__file__).resolve().parent.parent / "README.md"
# Third-party packages a block may need; a block that imports one skips without it.
OPTIONAL = ("timm", "transformers")


def python_blocks() -> list[tuple[str, str]]:
    """(the heading above it, code) for each ```python block."""
    blocks, heading = [], "top"
    for match in re.finditer(r"^(#{1,6} [^\n]*)$|^```python\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL):
        if match.group(1):
            heading = match.group(1).lstrip("# ").strip()
        else:
            blocks.append((heading, match.group(2)))
    return blocks


BLOCKS = python_blocks()


def test_the_readme_has_an_example_per_integration():
    headings = [heading for heading, _ in BLOCKS]
    for section in ("Python API", "Native resolution", "timm", "Hugging Face", "vLLM"):
        assert any(section in heading for heading in headings), section


@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[heading for heading, _ in BLOCKS])
def test_readme_block_runs(code, tmp_path, monkeypatch):
    for package in OPTIONAL:
        if re.search(rf"^\s*(import|from) {package}\b", code, re.MULTILINE):
            import_or_skip(package)
    monkeypatch.chdir(tmp_path)  # blocks may write files, like save_pretrained("my-tokenizer")
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})  # noqa: S102 -- running the README is the test
