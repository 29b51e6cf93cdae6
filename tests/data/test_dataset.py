"""Token dataset files (PREFIX.bin / PREFIX.idx) and the batches read from them."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from autopar.data.dataset import (
    HEADER_BYTES,
    MAGIC,
    SyntheticTokens,
    TokenDataset,
    TokenWriter,
    open_source,
)
from autopar.data.synthetic import synthetic_batch
from autopar.errors import PlanError


def _docs(n: int = 40, vocab: int = 1000, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(0, 60)) for _ in range(n)]


def _write(prefix, docs, vocab: int = 1000):
    with TokenWriter(prefix, vocab) as w:
        for d in docs:
            w.add_document(d)
    return TokenDataset(prefix)


def test_round_trip(tmp_path) -> None:
    docs = _docs()
    ds = _write(tmp_path / "c", docs)
    assert ds.num_documents == len(docs)
    assert ds.num_tokens == sum(d.size for d in docs)
    assert ds.vocab_size == 1000 and ds.dtype == np.dtype("<u2")
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds.document(i), d)
    assert isinstance(ds.tokens, np.memmap)
    assert (tmp_path / "c.bin").stat().st_size == 2 * ds.num_tokens
    assert (tmp_path / "c.idx").read_bytes()[:8] == MAGIC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin", "c.idx"]
    # a window is a slice of the concatenated stream
    stream = np.concatenate(docs)
    row = ds.rows(0, 4, 15, seed=3, start=0, count=4)
    assert row.dtype == torch.int64 and row.shape == (4, 16)
    for r in row.numpy():
        starts = [s for s in range(0, stream.size - 15, 16) if (stream[s:s + 16] == r).all()]
        assert starts


def test_large_vocab_uses_uint32(tmp_path) -> None:
    ds = _write(tmp_path / "big", [np.array([0, 70000, 65535, 99999])] * 3, vocab=100000)
    assert ds.dtype == np.dtype("<u4")
    assert ds.rows(0, 3, 3, 0, 0, 3).max().item() == 99999


def test_rows_deterministic_and_seeded(tmp_path) -> None:
    ds = _write(tmp_path / "c", _docs())
    a = ds.rows(5, 8, 7, seed=1, start=0, count=8)
    again = TokenDataset(tmp_path / "c.idx").rows(5, 8, 7, seed=1, start=0, count=8)
    assert torch.equal(a, again)
    assert not torch.equal(a, ds.rows(5, 8, 7, seed=2, start=0, count=8))
    assert not torch.equal(a, ds.rows(6, 8, 7, seed=1, start=0, count=8))


def test_ranks_read_their_shard(tmp_path) -> None:
    ds = _write(tmp_path / "c", _docs())
    for step in (0, 3, 11):
        whole = ds.rows(step, 6, 9, seed=0, start=0, count=6)
        parts = [ds.rows(step, 6, 9, seed=0, start=k * 3, count=3) for k in range(2)]
        assert torch.equal(torch.cat(parts), whole)
    # only the rows' own windows are read
    touched = []

    class Spy(np.ndarray):
        def __getitem__(self, key):
            touched.append(key)
            return super().__getitem__(key)

    ds.tokens = ds.tokens.view(Spy)
    ds.rows(2, 64, 9, seed=0, start=10, count=3)
    assert len(touched) == 3


def test_epochs_cover_every_window_then_reshuffle(tmp_path) -> None:
    ds = _write(tmp_path / "c", _docs(12))
    seq, gb = 4, 3
    n = ds.num_windows(seq)
    assert n == ds.num_tokens // (seq + 1) and n > 6
    steps = -(-2 * n // gb) + 1
    rows = torch.cat([ds.rows(s, gb, seq, 7, 0, gb) for s in range(steps)])
    stream = torch.from_numpy(ds.tokens[:n * (seq + 1)].astype(np.int64)).view(n, seq + 1)
    windows = {tuple(w.tolist()): i for i, w in enumerate(stream)}
    order = [windows[tuple(r.tolist())] for r in rows]
    assert sorted(order[:n]) == list(range(n))  # epoch 0 sees every window once
    assert sorted(order[n:2 * n]) == list(range(n))  # so does epoch 1 ...
    assert order[:n] != order[n:2 * n]  # ... in another order


def test_too_small_corpus_and_bad_args(tmp_path) -> None:
    ds = _write(tmp_path / "tiny", [np.arange(10)])
    assert ds.rows(0, 2, 9, 0, 0, 2).shape == (2, 10)
    with pytest.raises(PlanError, match="fewer than one sequence"):
        ds.rows(0, 2, 10, 0, 0, 2)
    with pytest.raises(ValueError):
        ds.rows(0, 4, 3, 0, 3, 2)
    empty = _write(tmp_path / "empty", [])
    assert empty.num_tokens == 0 and empty.num_documents == 0
    with pytest.raises(PlanError, match="0 tokens"):
        empty.rows(0, 1, 1, 0, 0, 1)


def test_synthetic_tokens_match_synthetic_batch() -> None:
    src = SyntheticTokens(vocab=50)
    full = synthetic_batch(4, 9, 8, 16, 50)
    assert torch.equal(src.rows(4, 8, 16, 9, 0, 8), full)
    assert torch.equal(src.rows(4, 8, 16, 9, 2, 3), full[2:5])
    assert src.vocab_size == 50


def test_open_source(tmp_path) -> None:
    _write(tmp_path / "c", _docs())
    assert isinstance(open_source("synthetic", 64), SyntheticTokens)
    for name in ("c", "c.bin", "c.idx"):
        ds = open_source(str(tmp_path / name), 1000)
        assert isinstance(ds, TokenDataset) and ds.prefix == tmp_path / "c"
    with pytest.raises(PlanError, match="vocabulary of 1000 .* vocab_size is 512"):
        open_source(str(tmp_path / "c"), 512)


def test_writer_leaves_nothing_on_error(tmp_path) -> None:
    _write(tmp_path / "c", _docs(5))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(PlanError, match="outside the vocabulary"):
        with TokenWriter(tmp_path / "c", 1000) as w:
            w.add_document([1, 2, 3])
            w.add_document([5, 1000])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def _one_line(exc: pytest.ExceptionInfo, *needles: str) -> None:
    text = str(exc.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text, text


def test_bad_files(tmp_path) -> None:
    prefix = tmp_path / "c"
    with pytest.raises(PlanError) as exc:
        TokenDataset(prefix)
    _one_line(exc, "c.idx not found", "autopar data prepare")

    _write(prefix, _docs())
    good_idx = (tmp_path / "c.idx").read_bytes()
    good_bin = (tmp_path / "c.bin").read_bytes()

    (tmp_path / "c.bin").write_bytes(good_bin[:-2])
    with pytest.raises(PlanError) as exc:
        TokenDataset(prefix)
    _one_line(exc, "c.bin", "truncated", "autopar data prepare")
    (tmp_path / "c.bin").write_bytes(good_bin)

    (tmp_path / "c.idx").write_bytes(b"NOTMAGIC" + good_idx[8:])
    with pytest.raises(PlanError) as exc:
        TokenDataset(prefix)
    _one_line(exc, "c.idx", "magic")

    (tmp_path / "c.idx").write_bytes(good_idx[:-8])
    with pytest.raises(PlanError) as exc:
        TokenDataset(prefix)
    _one_line(exc, "c.idx", "truncated")

    (tmp_path / "c.idx").write_bytes(good_idx[:20])
    with pytest.raises(PlanError) as exc:
        TokenDataset(prefix)
    _one_line(exc, "c.idx", "truncated")

    bad_version = good_idx[:8] + struct.pack("<I", 9) + good_idx[12:]
    (tmp_path / "c.idx").write_bytes(bad_version)
    with pytest.raises(PlanError) as exc:
        TokenDataset(prefix)
    _one_line(exc, "version 9")

    backwards = bytearray(good_idx)
    backwards[HEADER_BYTES + 8:HEADER_BYTES + 16] = struct.pack("<q", 10**6)
    (tmp_path / "c.idx").write_bytes(bytes(backwards))
    with pytest.raises(PlanError) as exc:
        TokenDataset(prefix)
    _one_line(exc, "c.idx", "offsets")

    (tmp_path / "c.idx").unlink()
    (tmp_path / "c.bin").unlink()
    (tmp_path / "c.idx").write_bytes(good_idx)
    with pytest.raises(PlanError) as exc:
        TokenDataset(prefix)
    _one_line(exc, "c.bin not found")
