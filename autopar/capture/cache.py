"""A disk cache of captured graphs, so that planning the same config again skips torch.export.

Capturing a Hugging Face config runs ``torch.export`` on the meta device: seconds for a tiny
model, half a minute for a 70B one on two slow cores, and the same every time for the same
config. The cache keys a graph by everything the capture reads: the config's content, the
batch, sequence and fine-tuning method, autopar's own source files, and the versions of torch
and transformers. Any change to one of them is a new key, so a stale graph is never read.

Graphs are stored as gzipped JSON (:mod:`autopar.ir.serialize`, data only), written atomically;
a graph that does not read back equal to the captured one is not stored. The folder is
``$AUTOPAR_CACHE_DIR`` (default ``$XDG_CACHE_HOME/autopar``, else ``~/.cache/autopar``);
``AUTOPAR_CACHE=off`` turns it off. An unreadable or unwritable cache is skipped silently: it
only ever saves time.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from autopar.ir.graph import Graph
from autopar.ir.serialize import graph_from_dict, graph_to_dict, same_graph

_PACKAGE = Path(__file__).resolve().parent.parent


def cache_dir() -> Path | None:
    """Where graphs are cached, or None when ``AUTOPAR_CACHE=off``."""
    if os.environ.get("AUTOPAR_CACHE", "").lower() in ("off", "0", "false", "no"):
        return None
    folder = os.environ.get("AUTOPAR_CACHE_DIR")
    if folder:
        return Path(folder) / "graphs"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "autopar" / "graphs"


@lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """A hash of autopar's source: a graph captured by other code is another key."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(_PACKAGE).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def graph_key(config: dict, batch: int, seq: int, peft: dict | None) -> str:
    """The cache key of capturing ``config`` at ``batch`` x ``seq`` with ``peft``."""
    import transformers

    facts = {"config": config, "batch": batch, "seq": seq, "peft": peft,
             "code": _code_fingerprint(), "torch": torch.__version__,
             "transformers": transformers.__version__}
    text = json.dumps(facts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_graph(key: str) -> Graph | None:
    """The cached graph under ``key``, or None."""
    folder = cache_dir()
    if folder is None:
        return None
    path = folder / f"{key}.json.gz"
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return graph_from_dict(json.load(f))
    except (OSError, ValueError, KeyError, TypeError, EOFError):
        return None  # absent, or not a graph this code wrote: capture anew


def store_graph(key: str, graph: Graph) -> None:
    """Cache ``graph`` under ``key`` if it reads back equal; never raises."""
    folder = cache_dir()
    if folder is None:
        return
    try:
        data = graph_to_dict(graph)
        text = json.dumps(data, separators=(",", ":"))
        if not same_graph(graph_from_dict(json.loads(text)), graph):
            return  # something in it is not plain data: do not cache it
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb",
                                                            compresslevel=3) as f:
                f.write(text.encode("utf-8"))
            os.replace(tmp, folder / f"{key}.json.gz")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, TypeError, ValueError):
        return
