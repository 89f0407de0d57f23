"""`KVPOOL_DEBUG=1` turns on full consistency checks after every public call (tests run with it).

Read once at import; each manager, request and slot allocator copies it when it is made (a
field read per call on the hot path, not a module lookup: 15% of a decode step).
"""

import os

DEBUG = os.environ.get("KVPOOL_DEBUG", "") not in ("", "0")
