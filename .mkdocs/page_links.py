"""mkdocs hook (``hooks:`` in mkdocs.yml): two things the Markdown renderer leaves for the site.

- **Page mentions become links.** The README sections the home page includes and the docstrings
  the API reference shows name other pages as ``docs/NAME.md``: a relative link there cannot
  work both in the repository and on the site, so the site links each such mention (outside
  code blocks and existing links) to that page.
- **``\\|`` in a table cell's code is ``|``.** GitHub's tables need the escape even inside
  code (``zchannel stat NAME\\|ADDRESS``); Python-Markdown splits cells around code already and
  keeps the backslash, which a copied command would carry.

``tests/test_site.py`` builds the site and checks that neither is left on any page.
"""

from __future__ import annotations

import re
from typing import Any

_TOKEN = re.compile(r"(<[^>]*>)")  # a tag, or the text between tags
_TAG_NAME = re.compile(r"</?([A-Za-z0-9]+)")
_MENTION = re.compile(r"\bdocs/([\w/-]+\.md)\b")
_TRACKED = ("a", "pre", "code", "td", "th")


def link_mentions(html: str, url_of: Any) -> str:
    """``html`` with every ``docs/NAME.md`` outside ``<a>`` and ``<pre>`` linked to
    ``url_of("NAME.md")`` (kept as text where that is None), and ``\\|`` inside ``<code>`` of a
    table cell turned into ``|``."""
    depth = dict.fromkeys(_TRACKED, 0)
    out = []
    for token in _TOKEN.split(html):
        if token.startswith("<"):
            name = _TAG_NAME.match(token)
            tag = name.group(1).lower() if name else ""
            if tag in depth and not token.endswith("/>"):
                depth[tag] = max(0, depth[tag] + (-1 if token.startswith("</") else 1))
            out.append(token)
            continue
        if not depth["pre"]:
            if depth["code"] and (depth["td"] or depth["th"]):
                token = token.replace("\\|", "|")
            if not depth["a"]:
                token = _MENTION.sub(lambda m: _anchor(m, url_of), token)
        out.append(token)
    return "".join(out)


def _anchor(match: re.Match, url_of: Any) -> str:
    url = url_of(match.group(1))
    return match.group(0) if url is None else f'<a href="{url}">{match.group(0)}</a>'


def on_page_content(html: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    def url_of(path: str) -> str | None:
        target = files.get_file_from_path(path)
        if target is None or not target.is_documentation_page():
            return None
        return target.url_relative_to(page.file)

    return link_mentions(html, url_of)
