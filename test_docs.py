"""The README, docs and reproduce/README.md: every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure  # no torch, transformers, peft or vLLM code: CI runs it once


def test_every_relative_link_in_the_readme_and_docs_resolves():
    """Files and #anchors: an anchor must be a heading of its page, slugged as GitHub does."""

    def anchors(page: Path) -> set[str]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
        headings = re.findall(r"^#{1,6}\s+(.+)$", text, flags=re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}

    root = Path(__file__).parent
    broken = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "reproduce").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path, _, anchor = target.partition("#")
            if re.match(r"[a-z]+:", path):
                continue
            dest = page.parent / path if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
                broken.append(f"{page.relative_to(root)}: {target}")
    assert broken == []
    assert "the-result-15-minutes-a-run" in anchors(root / "reproduce" / "README.md")  # the slugging itself
