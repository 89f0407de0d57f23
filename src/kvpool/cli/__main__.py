"""`python -m kvpool.cli`: the `kvpool` command."""

import sys

from kvpool.cli import main

sys.exit(main())
