"""Code blocks of the docs that show a file of the repository are that file's own text: a block after an
``<!-- excerpt: PATH -->`` line is a run of PATH's lines, verbatim (the block's lines less its fence's indent)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXCERPT = re.compile(r"^( *)<!-- excerpt: (\S+) -->\n\1```\w*\n(.*?)\n\1```$", re.M | re.S)


def excerpts(doc: str):
    text = (ROOT / doc).read_text()
    for indent, path, block in EXCERPT.findall(text):
        lines = [line[len(indent):] for line in block.split("\n")]
        yield pytest.param(path, lines, id=f"{doc}:{path}:{lines[0].strip()[:40]}")


CASES = list(excerpts("docs/model.md"))


def test_model_md_shows_the_test_mixers_code():
    assert {path for path, _ in (case.values for case in CASES)} == {
        "tests/mixers/gla.py", "tests/plugins/oryx-lanorm/pyproject.toml",
        "tests/plugins/oryx-lanorm/oryx_lanorm/__init__.py"}


@pytest.mark.parametrize("path,lines", CASES)
def test_an_excerpt_is_the_files_text(path, lines):
    source = (ROOT / path).read_text().split("\n")
    starts = [i for i, line in enumerate(source) if line == lines[0]]
    assert any(source[i:i + len(lines)] == lines for i in starts), f"{path} has no run of lines {lines}"
