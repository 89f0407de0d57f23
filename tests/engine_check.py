"""The tests use the package's data-verifying engine."""

from kvpool.replay.verify import RECORD_BYTES, CheckingEngine, token_value

__all__ = ["RECORD_BYTES", "CheckingEngine", "token_value"]
