"""Every relative link in docs/ and the READMEs resolves: the file exists and, for `page.md#anchor`,
the page has a heading with that GitHub anchor. Splitting or renaming a page cannot leave a dead link."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def pages() -> list[Path]:
    return sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", *(ROOT / "plugins").glob("*/README.md")])


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (links there are examples, not links)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation but '-' and '_' dropped, spaces to '-', repeats
    numbered."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", title.lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    found.update(re.findall(r'<a (?:name|id)="([^"]+)"', page.read_text(encoding="utf-8")))
    return found


def test_relative_links_resolve():
    broken = []
    for page in pages():
        for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not resolved.exists():
                broken.append(f"{where}: no file {path}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_anchor_rule():
    page = ROOT / "docs" / "plugin-authors" / "starting.md"
    assert "starting-a-plugin-fw-plugins-new" in anchors(page)
