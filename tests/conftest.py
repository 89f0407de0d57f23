"""Shared test setup: every test runs with the debug invariant checks on."""

import os

os.environ.setdefault("KVPOOL_DEBUG", "1")
