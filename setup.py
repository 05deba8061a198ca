"""The package list, derived from the tree, so that a new subpackage ships without anyone listing
it: `streams/` is the package `memfilter` and each folder under it with an `__init__.py` one of
its subpackages; `schemas/` is `memfilter.schemas`. Everything else is in pyproject.toml (which
cannot compute a list under another name than the folders')."""

from setuptools import find_packages, setup

setup(packages=["memfilter", *(f"memfilter.{name}" for name in find_packages("streams")), "memfilter.schemas"])
