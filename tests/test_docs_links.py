"""README.md is a short introduction, and the documentation's links hold.

- README.md is at most 20 KB: what gcwrap is, the set-up commands, a short
  tour and links into docs/ (the rest lives in the pages);
- every relative link and image of README.md and of every page under docs/
  (docs/**/*.md) points at a file or directory that exists, and a link
  with an anchor into a page points at a target that page defines: an
  explicit MyST target, `(name)=` on the line before a heading, which is
  what Sphinx resolves; into README.md, a heading as GitHub names it.
  Links into docs/reference/ are checked once that directory exists (it is
  generated from the command line).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT = 20_000  # bytes
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
TARGET = re.compile(r"^\(([\w-]+)\)=\s*$")


def pages(root: Path = ROOT) -> list[Path]:
    docs = sorted(p for p in (root / "docs").rglob("*.md") if "_build" not in p.relative_to(root).parts)
    return [root / "README.md", *docs]


def prose(text: str) -> list[tuple[int, str]]:
    """The page's lines outside code blocks, inline code blanked out."""
    out = []
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, re.sub(r"`[^`]*`", "``", line)))
    return out


def github_slug(heading: str) -> str:
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """What a link may name after `#` in a page: its explicit targets; in README.md its headings too."""
    lines = [line for _, line in prose(page.read_text(encoding="utf-8"))]
    found = {m.group(1) for line in lines if (m := TARGET.match(line))}
    if page.name == "README.md":
        found |= {github_slug(line.lstrip("#")) for line in lines if re.match(r"^#{1,6} ", line)}
    return found


def broken_links(root: Path = ROOT) -> list[str]:
    problems = []
    generated = root / "docs" / "reference"
    for page in pages(root):
        where = page.relative_to(root).as_posix()
        for n, line in prose(page.read_text(encoding="utf-8")):
            for m in LINK.finditer(line):
                url = m.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", url):  # http:, https:, mailto:...
                    continue
                path, _, anchor = url.partition("#")
                target = (page.parent / unquote(path)).resolve() if path else page
                if target.is_relative_to(generated) and not generated.exists():
                    continue
                if not target.exists():
                    problems.append(f"{where}:{n}: {url}: no such file ({target})")
                elif not target.is_relative_to(root):
                    problems.append(f"{where}:{n}: {url}: outside the repository")
                elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                    problems.append(f"{where}:{n}: {url}: {target.relative_to(root)} has no target ({anchor})=")
    return problems


def test_readme_is_a_short_introduction() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT, (
        f"README.md is {size} bytes, more than {README_LIMIT}: it is an introduction; the rest belongs in docs/"
    )


def test_every_relative_link_points_at_what_exists() -> None:
    assert len(pages()) > 10, "the documentation's pages are under docs/"
    problems = broken_links()
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_check_catches_what_it_is_for(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text(
        "# x\n\n## A heading\n\n[ok](docs/a/page.md#here) [ok](#a-heading) [ok](https://example.org/x.md)\n"
        "[gone](docs/a/nope.md) `[code](not/checked.md)`\n\n```\n[block](not/checked.md)\n```\n"
    )
    page = tmp_path / "docs" / "a" / "page.md"
    page.parent.mkdir(parents=True)
    page.write_text("# Page\n\n(here)=\n## Here\n\n[bad anchor](page.md#there) ![img](../pic.png) "
                    "[up](../../README.md#a-heading) [ref](../reference/gcwrap.md)\n")
    assert broken_links(tmp_path) == [
        f"README.md:6: docs/a/nope.md: no such file ({tmp_path / 'docs/a/nope.md'})",
        "docs/a/page.md:6: page.md#there: docs/a/page.md has no target (there)=",
        f"docs/a/page.md:6: ../pic.png: no such file ({tmp_path / 'docs/pic.png'})",
    ]
    (tmp_path / "docs" / "reference").mkdir()  # generated: checked once it is there
    assert broken_links(tmp_path)[-1].startswith("docs/a/page.md:6: ../reference/gcwrap.md: no such file")


# (a page named _*.md is a fragment other pages include, not a page of its own: conf.py excludes it)
@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in pages() if not p.name.startswith("_")])
def test_every_page_starts_with_its_title(page: str) -> None:
    first = (ROOT / page).read_text(encoding="utf-8").splitlines()[0]
    assert re.match(r"^# \S", first), f"{page} must start with `# Title`, not {first!r}"
