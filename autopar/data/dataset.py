"""Token datasets on disk (``PREFIX.bin`` + ``PREFIX.idx``) and the batches a trainer reads.

File format, version 1 (all integers little-endian):

``PREFIX.bin``
    Every document's token ids, concatenated, no header and no padding. The element type is
    ``uint16`` when the vocabulary has fewer than 65536 ids, else ``uint32`` (dtype code in the
    index). Its size is exactly ``num_tokens * itemsize`` bytes. It is read with
    ``numpy.memmap`` and never loaded whole.

``PREFIX.idx``
    ======  =====================  ======================================================
    offset  type                   field
    ======  =====================  ======================================================
    0       8 bytes                magic ``b"APTOK\\x00\\x00\\x01"``
    8       uint32                 format version (1)
    12      uint32                 dtype code of the .bin: 1 = uint16, 2 = uint32
    16      uint64                 vocabulary size (every id in the .bin is below it)
    24      uint64                 number of documents N
    32      int64[N + 1]           document offsets in tokens: document i is
                                   ``bin[offsets[i]:offsets[i + 1]]``; ``offsets[0] = 0``,
                                   ``offsets[N]`` = number of tokens, non-decreasing
    ======  =====================  ======================================================

    The .idx is exactly ``32 + 8 * (N + 1)`` bytes.

:class:`TokenWriter` writes a pair under temporary names and renames both into place only when
it is closed without an error (the .idx last), so a reader never sees half a file.

Sampling (:meth:`TokenDataset.rows`). The corpus is one stream of ``num_tokens`` tokens
(windows may cross document boundaries; ``autopar data prepare`` ends each document with an
end-of-document token). It is cut into ``num_windows = num_tokens // (seq + 1)`` windows of
``seq + 1`` tokens at stride ``seq + 1`` (the tail shorter than a window is never read). Row
``r`` of step ``s``'s global batch is sample ``i = s * global_batch + r``; its epoch is
``i // num_windows`` and it reads window ``perm_e[i % num_windows]``, where ``perm_e`` is a
permutation of ``range(num_windows)`` shuffled by ``numpy.random.default_rng([seed, e])``.
A global batch is therefore a function of (seed, step, global_batch, seq) only -- the same for
any parallel plan -- and a data-parallel rank that asks for its rows ``[start, start+count)``
reads only those windows from disk.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from autopar.data.blend import BlendedTokens, is_blend, parse_blend
from autopar.data.synthetic import synthetic_batch
from autopar.errors import PlanError

MAGIC = b"APTOK\x00\x00\x01"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, dtype code, vocab size, documents
HEADER_BYTES = _HEADER.size  # 32
DTYPES: dict[int, np.dtype] = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
_PREPARE_HINT = "re-create it with 'autopar data prepare INPUT... --out PREFIX'"


def dtype_code_for(vocab_size: int) -> int:
    """The .bin element type for a vocabulary: 1 (uint16) below 65536 ids, else 2 (uint32)."""
    if vocab_size < 1 or vocab_size > 2**32:
        raise PlanError(f"vocabulary size {vocab_size} is out of range; it must be 1 .. 2**32")
    return 1 if vocab_size < 65536 else 2


def dataset_prefix(path: str | os.PathLike) -> Path:
    """``PREFIX`` from ``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx``."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".bin", ".idx") else p


def dataset_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """``(PREFIX.bin, PREFIX.idx)``."""
    p = dataset_prefix(prefix)
    return Path(f"{p}.bin"), Path(f"{p}.idx")


class TokenWriter:
    """Writes a ``PREFIX.bin`` / ``PREFIX.idx`` pair atomically.

    Use it as a context manager: the files appear under their final names only when the block
    ends without an exception; otherwise the temporary files are removed and any earlier pair
    under PREFIX is left as it was. Call :meth:`close` yourself when not using ``with``.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)
        self.dtype = DTYPES[dtype_code_for(self.vocab_size)]
        self.bin_path, self.idx_path = dataset_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp{os.getpid()}"
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + tag)
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + tag)
        self._bin = open(self._bin_tmp, "wb")  # closed by close() or abort()
        self._lengths: list[np.ndarray] = []
        self.num_tokens = 0
        self.num_documents = 0
        self._closed = False

    def add_document(self, ids) -> None:
        """Append one document (a sequence or array of token ids)."""
        self.add_documents([ids])

    def add_documents(self, docs) -> None:
        """Append several documents with one write."""
        docs = [np.asarray(d, dtype=np.int64).reshape(-1) for d in docs]
        if not docs:
            return
        flat = np.concatenate(docs) if len(docs) > 1 else docs[0]
        if flat.size and (flat.min() < 0 or flat.max() >= self.vocab_size):
            bad = int(flat.min()) if flat.min() < 0 else int(flat.max())
            raise PlanError(f"{self.bin_path}: token id {bad} is outside the vocabulary of "
                            f"{self.vocab_size}; the tokenizer and the vocabulary size disagree")
        self._bin.write(flat.astype(self.dtype).tobytes())
        self._lengths.append(np.fromiter((d.size for d in docs), dtype=np.int64,
                                         count=len(docs)))
        self.num_tokens += int(flat.size)
        self.num_documents += len(docs)

    def close(self) -> None:
        """Finish both files and rename them into place (the .bin first, the .idx last)."""
        if self._closed:
            return
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
            offsets = np.zeros(lengths.size + 1, dtype="<i8")
            np.cumsum(lengths, out=offsets[1:])
            code = dtype_code_for(self.vocab_size)
            with open(self._idx_tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, code, self.vocab_size, lengths.size))
                f.write(offsets.tobytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(self._bin_tmp, self.bin_path)
            os.replace(self._idx_tmp, self.idx_path)
        except BaseException:
            self.abort()
            raise
        self._closed = True

    def abort(self) -> None:
        """Drop what was written; the final names are not touched."""
        self._closed = True
        if not self._bin.closed:
            self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class TokenSource(Protocol):
    """What a trainer reads tokens from: :class:`TokenDataset` or :class:`SyntheticTokens`."""

    @property
    def vocab_size(self) -> int: ...

    def rows(self, step: int, global_batch: int, seq: int, seed: int, start: int,
             count: int) -> torch.Tensor: ...


def _check_rows_args(step: int, global_batch: int, seq: int, start: int, count: int) -> None:
    if step < 0 or global_batch < 1 or seq < 1:
        raise ValueError(f"rows(step={step}, global_batch={global_batch}, seq={seq}): need "
                         "step >= 0, global_batch >= 1, seq >= 1")
    if start < 0 or count < 0 or start + count > global_batch:
        raise ValueError(f"rows [{start}, {start + count}) are not inside a global batch of "
                         f"{global_batch}")


class TokenDataset:
    """A ``PREFIX.bin`` / ``PREFIX.idx`` pair, memory-mapped and checked on open."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = dataset_prefix(prefix)
        self.bin_path, self.idx_path = dataset_paths(self.prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise PlanError(f"token dataset {self.prefix}: {path} not found; "
                                f"create it with 'autopar data prepare INPUT... --out "
                                f"{self.prefix}'")
        idx_size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < len(MAGIC) or head[:len(MAGIC)] != MAGIC:
            raise PlanError(f"{self.idx_path} is not an autopar token index (bad magic "
                            f"{head[:len(MAGIC)]!r}); {_PREPARE_HINT}")
        if len(head) < HEADER_BYTES:
            raise PlanError(f"{self.idx_path} is truncated ({idx_size} bytes, the header alone "
                            f"is {HEADER_BYTES}); {_PREPARE_HINT}")
        _, version, code, vocab, ndocs = _HEADER.unpack(head)
        if version != VERSION:
            raise PlanError(f"{self.idx_path} is token format version {version}; this autopar "
                            f"reads version {VERSION}: {_PREPARE_HINT}")
        if code not in DTYPES:
            raise PlanError(f"{self.idx_path} has unknown dtype code {code} (1 = uint16, "
                            f"2 = uint32); {_PREPARE_HINT}")
        if vocab < 1:
            raise PlanError(f"{self.idx_path} records a vocabulary size of 0; {_PREPARE_HINT}")
        want = HEADER_BYTES + 8 * (ndocs + 1)
        if idx_size != want:
            raise PlanError(f"{self.idx_path} has {idx_size} bytes but its header's {ndocs} "
                            f"documents need {want}; the index is truncated or corrupt: "
                            f"{_PREPARE_HINT}")
        self.dtype = DTYPES[code]
        self._vocab = int(vocab)
        self.offsets = np.memmap(self.idx_path, dtype="<i8", mode="r", offset=HEADER_BYTES,
                                 shape=(ndocs + 1,))
        ntok = int(self.offsets[-1])
        if int(self.offsets[0]) != 0 or ntok < 0 or (
                ndocs and bool(np.any(np.diff(self.offsets) < 0))):
            raise PlanError(f"{self.idx_path} has document offsets that do not start at 0 or "
                            f"go backwards; the index is corrupt: {_PREPARE_HINT}")
        bin_size = self.bin_path.stat().st_size
        if bin_size != ntok * self.dtype.itemsize:
            raise PlanError(f"{self.bin_path} has {bin_size} bytes but {self.idx_path.name} "
                            f"says {ntok} {self.dtype.name} tokens "
                            f"({ntok * self.dtype.itemsize} bytes); the .bin is truncated or "
                            f"from another run: {_PREPARE_HINT}")
        self._num_tokens = ntok
        # instruction data (autopar.data.instruction): a loss mask per token, and the
        # sequence length its rows were packed to
        mask_path, meta_path = Path(f"{self.prefix}.mask"), Path(f"{self.prefix}.meta.json")
        self.mask: np.ndarray | None = None
        self.packed_seq: int | None = None
        if mask_path.is_file():
            if mask_path.stat().st_size != ntok:
                raise PlanError(f"{mask_path} has {mask_path.stat().st_size} bytes for {ntok} "
                                f"tokens; {_PREPARE_HINT}")
            self.mask = np.memmap(mask_path, dtype=np.uint8, mode="r", shape=(ntok,)) \
                if ntok else np.zeros(0, dtype=np.uint8)
            self.packed_seq = self._meta(meta_path).get("seq")
        # the token that ends each document, when the data says (autopar.data.documents)
        eos = self._meta(meta_path).get("eos_id")
        self.eos_id: int | None = int(eos) if isinstance(eos, int) else None
        # numpy cannot map an empty file; an empty corpus is refused by rows() anyway
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(ntok,))
                       if ntok else np.zeros(0, dtype=self.dtype))
        self._perms: dict[tuple[int, int, int], np.ndarray] = {}

    @staticmethod
    def _meta(path: Path) -> dict:
        """PREFIX.meta.json (packing and document facts), or {} when absent or unreadable."""
        try:
            meta = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            return {}
        return meta if isinstance(meta, dict) else {}

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_documents(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def document(self, i: int) -> np.ndarray:
        """Document ``i``'s token ids (a view into the memory map)."""
        n = self.num_documents
        if not -n <= i < n:
            raise IndexError(f"document {i} of {n}")
        i %= n
        return self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])]

    def num_windows(self, seq: int) -> int:
        """How many windows of ``seq + 1`` tokens one epoch has."""
        return self._num_tokens // (seq + 1)

    def _permutation(self, seed: int, epoch: int, n: int) -> np.ndarray:
        key = (seed, epoch, n)
        perm = self._perms.get(key)
        if perm is None:
            perm = np.arange(n, dtype=np.uint32 if n < 2**32 else np.int64)
            np.random.default_rng([seed % 2**64, epoch]).shuffle(perm)
            if len(self._perms) >= 2:  # epochs are read in increasing order: keep the last two
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = perm
        return perm

    def rows(self, step: int, global_batch: int, seq: int, seed: int, start: int,
             count: int) -> torch.Tensor:
        """Rows ``[start, start + count)`` of step ``step``'s global batch: ``(count, seq + 1)``.

        Reads only those rows' windows; see the module docstring for the sampling.
        """
        width = seq + 1
        out = np.empty((count, width), dtype=np.int64)
        for r, w in enumerate(self._windows(step, global_batch, seq, seed, start, count)):
            out[r] = self.tokens[w * width:(w + 1) * width]
        return torch.from_numpy(out)

    def loss_mask(self, step: int, global_batch: int, seq: int, seed: int, start: int,
                  count: int) -> torch.Tensor | None:
        """Which tokens of :meth:`rows`' rows are trained targets (bool, same shape), or
        None for plain text (all of them)."""
        if self.mask is None:
            return None
        width = seq + 1
        out = np.empty((count, width), dtype=bool)
        for r, w in enumerate(self._windows(step, global_batch, seq, seed, start, count)):
            out[r] = self.mask[w * width:(w + 1) * width] != 0
        return torch.from_numpy(out)

    def _windows(self, step: int, global_batch: int, seq: int, seed: int, start: int,
                 count: int) -> list[int]:
        _check_rows_args(step, global_batch, seq, start, count)
        if self.packed_seq is not None and seq != self.packed_seq:
            raise PlanError(f"token dataset {self.prefix} was packed for sequences of "
                            f"{self.packed_seq} tokens, not {seq}; prepare it again with "
                            f"--seq {seq}")
        n = self.num_windows(seq)
        if n == 0:
            raise PlanError(f"token dataset {self.prefix} has {self._num_tokens} tokens, fewer "
                            f"than one sequence of {seq} + 1; use a larger corpus or a "
                            f"shorter --seq")
        first = step * global_batch + start
        return [int(self._permutation(seed, epoch, n)[pos])
                for epoch, pos in (divmod(first + r, n) for r in range(count))]

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.prefix)!r}: {self.num_documents} documents, "
                f"{self.num_tokens} tokens, vocab {self.vocab_size})")


class SyntheticTokens:
    """Deterministic random tokens: exactly ``synthetic_batch(...)[start:start + count]``."""

    def __init__(self, vocab: int) -> None:
        self._vocab = int(vocab)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def rows(self, step: int, global_batch: int, seq: int, seed: int, start: int,
             count: int) -> torch.Tensor:
        _check_rows_args(step, global_batch, seq, start, count)
        return synthetic_batch(step, seed, global_batch, seq, self._vocab)[start:start + count]

    def __repr__(self) -> str:
        return f"SyntheticTokens(vocab={self._vocab})"


def open_source(data: str, vocab: int):
    """``"synthetic"`` -> :class:`SyntheticTokens`; a blend (``"0.7 tok/a 0.3 tok/b"``) ->
    :class:`autopar.data.blend.BlendedTokens`; else the dataset at PREFIX[.bin|.idx].

    Refuses a dataset whose vocabulary is larger than the model's ``vocab``.
    """
    if data == "synthetic":
        return SyntheticTokens(vocab)
    if is_blend(data):
        return BlendedTokens([(w, open_source(p, vocab)) for w, p in parse_blend(data)])
    ds = TokenDataset(data)
    if ds.vocab_size > vocab:
        raise PlanError(f"token dataset {ds.prefix} has a vocabulary of {ds.vocab_size} ids but "
                        f"the model's vocab_size is {vocab}; prepare the data with the model's "
                        f"tokenizer or --vocab-size {vocab} or less")
    return ds
