"""Reference engine (extra `torch`): a small decoder-only transformer whose attention reads and
writes K and V only through kvpool's page views and page tables, and a continuous-batching
generator on top of it."""

from kvpool.engine.generator import Generator
from kvpool.engine.model import PagedDecoder, manager_config_from_hf

__all__ = ["Generator", "PagedDecoder", "manager_config_from_hf"]
