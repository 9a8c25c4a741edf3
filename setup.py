"""The package list, found rather than listed: every folder with an ``__init__.py`` under the
code folders that ``package_dir`` in ``setup.cfg`` maps to ``zchannel.*`` (everything else about
the package is in ``setup.cfg``)."""

import configparser

from setuptools import find_packages, setup


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


setup(packages=_packages(_package_dir()))
