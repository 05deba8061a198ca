#!/usr/bin/env bash
# Lint, format and types, as CI runs them: ruff over the repository, mypy over the installed
# package `memfilter`. mypy cannot follow setuptools' folder mapping (streams/ -> memfilter,
# schemas/ -> memfilter.schemas), so it reads a tree of links made here in build/typecheck.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
rm -rf build/typecheck && mkdir -p build/typecheck/memfilter
cp -as "$PWD/streams/." build/typecheck/memfilter/
ln -s "$PWD/schemas" build/typecheck/memfilter/schemas
MYPYPATH=build/typecheck .venv/bin/mypy -p memfilter
