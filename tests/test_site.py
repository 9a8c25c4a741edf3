"""The documentation site as a reader gets it: built with ``mkdocs build`` into a temporary
folder (skipped where mkdocs is not installed: ``pip install -e '.[docs]'``), then read page by
page.  ``mkdocs build --strict`` catches broken links and anchors; these catch what it does not:

- a literal ``\\|`` in a table (GitHub's escaped pipe inside table code, which a copied command
  would keep);
- a page named as ``docs/NAME.md`` in text that is not a link to it;
- in the API reference, a private parameter (``_proc``) in a signature, or a base class that the
  reference does not document (``Bases: BrokerChannel``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from html.parser import HTMLParser

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MENTION = re.compile(r"\bdocs/[\w/-]+\.md\b")


class _Text(HTMLParser):
    """The text of a page outside ``<script>`` and ``<style>``: that of ``<pre>`` blocks apart,
    and which of the rest sits inside a link."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = {"a": 0, "pre": 0, "script": 0, "style": 0, "td": 0, "th": 0}
        self.outside_links: list[str] = []
        self.everywhere: list[str] = []
        self.code_blocks: list[str] = []  # the text inside <pre> (signatures, code)
        self.cells: list[str] = []  # the text of table cells

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in self.depth:
            self.depth[tag] += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in self.depth:
            self.depth[tag] = max(0, self.depth[tag] - 1)

    def handle_data(self, data: str) -> None:
        if self.depth["script"] or self.depth["style"]:
            return
        if self.depth["pre"]:
            self.code_blocks.append(data)
            return
        self.everywhere.append(data)
        if self.depth["td"] or self.depth["th"]:
            self.cells.append(data)
        if not self.depth["a"]:
            self.outside_links.append(data)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> dict[str, str]:
    """Every HTML page of the built site: path relative to the site -> HTML."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    pytest.importorskip("material", reason="the docs extra is not installed")
    if not os.path.isdir(os.path.join(REPO, ".mkdocs", "zchannel")):
        pytest.skip("the API pages read the code through .mkdocs/zchannel, a git checkout's "
                    "symlinks (not in the sdist: MANIFEST.in)")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    pages = {}
    for root, _dirs, files in os.walk(out):
        for name in files:
            if name.endswith(".html") and name != "404.html":
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    pages[os.path.relpath(path, out)] = f.read()
    return pages


def _text(html: str) -> _Text:
    parser = _Text()
    parser.feed(html)
    return parser


def test_the_site_has_its_pages(site):
    assert {"index.html", "channel/index.html", "errors/index.html",
            "reference/broker/index.html"} <= set(site)
    assert "zchannel stat NAME|ADDRESS" in "".join(_text(site["index.html"]).everywhere)


def test_no_escaped_pipe_in_a_table(site):
    """GitHub's tables need ``\\|`` for a ``|`` inside code; the site must show ``|``."""
    found = {page: [t.strip()[:80] for t in _text(html).cells if "\\|" in t]
             for page, html in site.items()}
    found = {page: texts for page, texts in found.items() if texts}
    assert not found, f"a literal \\| on the site (copied commands would keep it): {found}"


def test_every_page_mention_is_a_link(site):
    found = {page: sorted(set(MENTION.findall("".join(_text(html).outside_links))))
             for page, html in site.items()}
    found = {page: names for page, names in found.items() if names}
    assert not found, f"docs/*.md named in text but not linked: {found}"


def test_api_reference_shows_no_private_parameter_or_undocumented_base(site):
    for page in ("reference/broker/index.html", "reference/hooks/index.html",
                 "reference/embodied/index.html"):
        html = site[page]
        signatures = "".join(_text(html).code_blocks)
        private = sorted(set(re.findall(r"^\s+(_\w+):", signatures, re.M)))
        assert "(" in signatures and not private, \
            f"{page}: private parameters in signatures: {private}"
        # a documented base is a link; an undocumented zchannel class is a bare <span title>
        bases = re.findall(r'Bases: <code>(.*?)</p>', html, re.S)
        assert bases, page
        hidden = sorted(set(re.findall(r'<span title="(zchannel\.[\w.]+)"', "".join(bases))))
        assert not hidden, f"{page}: bases the reference does not document: {hidden}"
    broker = "".join(_text(site["reference/broker/index.html"]).everywhere)
    assert "BrokerChannel" not in broker and "_token" not in broker


def _page_links():
    spec = importlib.util.spec_from_file_location(
        "page_links", os.path.join(REPO, ".mkdocs", "page_links.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_hook_links_mentions_and_unescapes_table_pipes():
    """``.mkdocs/page_links.py`` on its own (no mkdocs needed)."""
    link = _page_links().link_mentions
    urls = {"channel.md": "../channel/"}.get
    assert link("<p>see <code>docs/channel.md</code>.</p>", urls) == \
        '<p>see <code><a href="../channel/">docs/channel.md</a></code>.</p>'
    assert link("<p>see docs/channel.md, docs/nowhere.md</p>", urls) == \
        '<p>see <a href="../channel/">docs/channel.md</a>, docs/nowhere.md</p>'
    kept = ['<a href="x">docs/channel.md</a>', "<pre><code>docs/channel.md a\\|b</code></pre>",
            "<p><code>a\\|b</code></p>", "<td>a\\|b</td>"]
    for html in kept:
        assert link(html, urls) == html
    assert link("<td><code>stat NAME\\|ADDRESS</code></td>", urls) == \
        "<td><code>stat NAME|ADDRESS</code></td>"
