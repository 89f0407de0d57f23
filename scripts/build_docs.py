"""Builds the documentation site (MkDocs with the Material theme; the API reference generated
from the docstrings by mkdocstrings) into build/docs, or --out.

Strict: any warning (a broken link, a missing image, a docstring or a reference that does not
resolve) fails the build. `bash scripts/test.sh` runs this, so CI checks the site on every
change.

Run: python scripts/build_docs.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "docs")
    args = parser.parse_args()
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean"]
    command += ["--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(args.out.resolve())]
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # (the theme's banner)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=environment)
    output = done.stdout + done.stderr
    problems = [line for line in output.splitlines() if line.startswith(("WARNING", "ERROR"))]
    if done.returncode or problems:
        print(output, file=sys.stderr)
        print(f"build_docs: {len(problems)} warning(s) or error(s)", file=sys.stderr)
        return 1
    print(f"documentation site: {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
