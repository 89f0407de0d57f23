"""The exceptions kvpool raises.

Every error is a `KVPoolError`, so an engine can catch them all in one place. `ArgumentError` and
its `ConfigError` are also `ValueError`s: they are always about a bad argument.
"""


class KVPoolError(Exception):
    """Base class of every kvpool error."""


class ArgumentError(KVPoolError, ValueError):
    """An argument is out of range; the message names it, its value and the allowed range.
    Raised before any state changes."""


class ConfigError(ArgumentError):
    """A configuration value is invalid; the message names the field, the value and the range."""


class OutOfPagesError(KVPoolError):
    """Not enough free slots (after eviction) for the request; nothing was changed."""


class LogicError(KVPoolError):
    """An operation was called in a state that does not allow it (a caller bug)."""


class CorruptedError(KVPoolError):
    """Internal bookkeeping is inconsistent (found by the debug invariant check)."""


class StorageError(KVPoolError, OSError):
    """Reading or writing a storage level failed (disk full, I/O error); nothing was changed."""


class DivergenceError(KVPoolError):
    """Replicated managers (one per tensor-parallel rank) took different decisions on the same
    step; the message names the step, the first decision that differs, and the ranks."""
