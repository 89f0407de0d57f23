"""`KVPOOL_DEBUG=1` turns on full consistency checks after every public call (tests run with it).

Read once at import: when unset, a check costs one global lookup and a branch.
"""

import os

DEBUG = os.environ.get("KVPOOL_DEBUG", "") not in ("", "0")
