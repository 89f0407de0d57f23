"""Builds the API reference from the docstrings with pdoc, into build/docs (or --out).

Any warning (a module that does not import, a docstring pdoc cannot read) fails the build:
`bash scripts/test.sh` runs this, so CI checks the API docs on every change.

Run: python scripts/build_docs.py [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import warnings
from pathlib import Path

import pdoc

import kvpool


def modules() -> list[str]:
    """Every kvpool module, once: a package without `__all__` documents its submodules itself,
    so those are not listed again."""
    names = ["kvpool"] + [
        info.name
        for info in pkgutil.walk_packages(kvpool.__path__, prefix="kvpool.")
        if not info.name.endswith(".__main__")  # runs the command when imported
    ]
    walked_by = {
        name
        for name in names
        if name != "kvpool" and not hasattr(importlib.import_module(name), "__all__")
    }
    return [
        name for name in names if not any(name.startswith(parent + ".") for parent in walked_by)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/docs"))
    args = parser.parse_args()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.render.configure(docformat="markdown", show_source=False)
        pdoc.pdoc(*modules(), output_directory=args.out)
    ours = [w for w in caught if f"{Path(pdoc.__file__).parent}" in w.filename]
    for warning in ours:
        print(f"build_docs: {warning.category.__name__}: {warning.message}", file=sys.stderr)
    if ours:
        return 1
    print(f"API reference: {args.out / 'index.html'} ({len(modules())} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
