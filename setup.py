"""The package list, found rather than listed: every folder with an ``__init__.py`` under the
code folders that ``package_dir`` in ``setup.cfg`` maps to ``zchannel.*``, and the
``zchannel/__init__.py`` a built package gets (everything else about the package is in
``setup.cfg``)."""

import configparser
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# ``zchannel/__init__.py`` of a built package: the checkout has no ``zchannel/`` folder (its code
# folders are mapped to ``zchannel.*``), so without it ``zchannel`` would be a namespace package,
# and any folder named ``zchannel`` on ``sys.path`` (a clone of this repository) would join it
# and run in place of the installed code; ``pip uninstall`` would leave ``zchannel/`` behind.
TOP_INIT = '''"""zchannel: named producer/consumer channels over ZeroMQ for distributed RL jobs.

The code is in ``zchannel.broker`` (channels), ``zchannel.hooks``, ``zchannel.embodied``,
``zchannel.cli`` and ``zchannel.configs``.
"""
'''


def _package_dir() -> dict[str, str]:
    config = configparser.ConfigParser()
    config.read("setup.cfg")
    lines = config.get("options", "package_dir").strip().splitlines()
    return dict((part.strip() for part in line.split("=", 1)) for line in lines)


def _packages(package_dir: dict[str, str]) -> list[str]:
    found = []
    for package, folder in package_dir.items():
        found.append(package)
        found += [f"{package}.{sub}" for sub in find_packages(where=folder)]
    return sorted(found)


class BuildWithTopInit(build_py):
    """``build_py`` that also writes ``zchannel/__init__.py`` (``TOP_INIT``) into the build, so
    that an installed zchannel is a regular package (an editable install maps the checkout's
    folders instead, and gets none)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            folder = os.path.join(self.build_lib, "zchannel")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "__init__.py"), "w", encoding="utf-8") as out:
                out.write(TOP_INIT)


setup(packages=_packages(_package_dir()), cmdclass={"build_py": BuildWithTopInit})
