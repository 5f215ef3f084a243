"""Sphinx configuration of gcwrap's documentation (MyST Markdown pages).

    pip install -e '.[docs]'
    python -m sphinx -W --keep-going -b html docs build/docs   # the site
    python docs/build_man.py                                   # man/gcwrap.1, man/gcshadow.1
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))  # gcwrap from this clone, installed or not

from gcwrap import __version__  # noqa: E402

project = "gcwrap"
author = "the gcwrap authors"
copyright = "the gcwrap authors"
version = release = __version__
# A fixed date: the man pages are committed, and rebuilding them must give the same bytes.
today = "2026-11-21"

extensions = ["myst_parser", "sphinx_click", "gcwrap_docs"]
myst_enable_extensions = ["deflist", "colon_fence"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown"}
root_doc = "index"
# Pages included by others (man page fragments) are not pages of their own.
exclude_patterns = ["_build", "**/_*.md"]

nitpicky = True
# "--" must stay two hyphens: options are written in running text.
smartquotes = False
highlight_language = "none"

html_theme = "alabaster"
html_static_path: list[str] = []
html_title = f"gcwrap {version}"

# (source, name, description, authors, section): the man builder writes man/NAME.SECTION.
man_pages = [
    ("man/gcwrap", "gcwrap", "run a batch job, streaming its output home over an unreliable network", [], 1),
    ("man/gcshadow", "gcshadow", "receive the output of gcwrap jobs at home and serve their input", [], 1),
]
man_show_urls = False
man_make_section_directory = False
