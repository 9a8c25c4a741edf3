"""The API reference (``docs/reference/*.md``) documents exactly what each package exports: every
name of ``__all__`` has its ``::: package.Name`` entry, and every entry is exported (as httpx's
``test_exported_members`` checks its ``__all__``).  Read from the pages' source, no site build.
"""

from __future__ import annotations

import importlib
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = {"zchannel.broker": "broker.md", "zchannel.hooks": "hooks.md",
         "zchannel.embodied": "embodied.md"}


def _page(name: str) -> str:
    with open(os.path.join(REPO, "docs", "reference", name), encoding="utf-8") as f:
        return f.read()


def _documented(package: str) -> list[str]:
    """The names of the ``::: package.Name`` entries of the package's reference page."""
    return re.findall(rf"^::: {re.escape(package)}\.(\w+)\s*$", _page(PAGES[package]), re.M)


@pytest.mark.parametrize("package", sorted(PAGES))
def test_exported_members_are_documented(package):
    module = importlib.import_module(package)
    exported = list(module.__all__)
    assert len(exported) == len(set(exported)), f"{package}.__all__ repeats a name"
    assert all(hasattr(module, name) for name in exported), f"{package}.__all__ names a ghost"
    documented = _documented(package)
    assert documented, f"no ::: entries found on docs/reference/{PAGES[package]}"
    assert len(documented) == len(set(documented)), f"an entry repeats: {documented}"
    undocumented = sorted(set(exported) - set(documented))
    assert not undocumented, (f"exported by {package} but missing from "
                              f"docs/reference/{PAGES[package]}: {undocumented}")
    unexported = sorted(set(documented) - set(exported))
    assert not unexported, (f"on docs/reference/{PAGES[package]} but not in {package}.__all__: "
                            f"{unexported}")


def test_every_public_member_of_channel_is_documented():
    """``Channel``'s entry lists its members (so the page keeps the order of the guide): every
    public attribute of the class is listed, and every listed one exists."""
    from zchannel.broker import Channel

    entry = re.search(r"^::: zchannel\.broker\.Channel\n(.*?)(?=^\S)", _page("broker.md"),
                      re.M | re.S)
    assert entry, "no ::: zchannel.broker.Channel entry"
    listed = re.findall(r"^\s+- (\w+)\s*$", entry.group(1), re.M)
    public = sorted(name for name in dir(Channel) if not name.startswith("_"))
    assert sorted(listed) == public, (f"not listed: {sorted(set(public) - set(listed))}; "
                                      f"listed but not on Channel: {sorted(set(listed) - set(public))}")
