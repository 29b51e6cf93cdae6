"""Data preparation: text or JSON lines -> a token dataset (``PREFIX.bin`` / ``PREFIX.idx``)."""

from autopar.data.prepare import prepare

__all__ = ["prepare"]
