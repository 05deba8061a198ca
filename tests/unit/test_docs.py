"""The docs name what exists: every path of the repository that the README and docs/ name (a
file or folder under tests/, deploy/, streams/, schemas/, benchmarks/, docs/ or .ci/), and
every relative link between them, is there; a moved test or script is renamed in its docs."""

from __future__ import annotations

import re

import pytest
from pipeline import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w./-])((?:tests|deploy|streams|schemas|benchmarks|docs|\.ci)/[\w./-]*[\w/])")
LINK = re.compile(r"\]\(([^)#\s]+)")
BUILT = {"streams/gateway/page/chat.js"}  # made by deploy/setup.sh (npm run build), not kept in git


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_and_link_a_doc_names_exists(doc):
    text = doc.read_text()
    missing = [p for p in PATH.findall(text) if p not in BUILT and not (REPO / p).exists()]
    missing += [link for link in LINK.findall(text) if not link.startswith(("http://", "https://")) and not (doc.parent / link).exists()]
    assert missing == [], f"{doc.relative_to(REPO)} names what is not in the repository: {missing}"


def test_the_check_finds_a_path_that_is_not_there():
    assert PATH.findall("run `tests/test_gone.py`, then deploy/run-local.sh.") == ["tests/test_gone.py", "deploy/run-local.sh"]
