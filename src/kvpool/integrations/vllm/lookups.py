"""(Moved to `kvpool.node.lookups`: the node daemon answers lookups the same way.)"""

from kvpool.node.lookups import Answer, AsyncLookups

__all__ = ["Answer", "AsyncLookups"]
