"""``autopar data prepare``: text / JSON lines -> tokenizer + PREFIX.bin / PREFIX.idx."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys

import numpy as np
import pytest

from autopar.data.dataset import TokenDataset
from autopar.data.prepare import prepare
from autopar.errors import PlanError

WORDS = ("the quick brown fox jumps over a lazy dog while tensor pipeline and data parallel "
         "ranks train the model on tokens of every batch; gradients flow, losses fall. "
         "Über café naïve façade 東京 数据 😀 -- 42 3.14 x_y=z").split()


def _lines(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 25))) for _ in range(n)]


@pytest.fixture
def corpus(tmp_path):
    lines = _lines()
    path = tmp_path / "corpus.txt"
    # blank and whitespace-only lines are not documents
    path.write_text("\n".join(lines[:100]) + "\n\n   \n" + "\n".join(lines[100:]) + "\n",
                    encoding="utf-8")
    return path, lines


def test_prepare_trains_bpe_and_round_trips(tmp_path, corpus) -> None:
    from tokenizers import Tokenizer

    path, lines = corpus
    stats = prepare([path], tmp_path / "out" / "c", tokenizer=None, vocab_size=400)
    assert stats["documents"] == len(lines)
    assert 256 < stats["vocab_size"] <= 400 and stats["dtype"] == "uint16"
    assert stats["tokenizer_trained"] and stats["eos_id"] == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "c.bin", "c.idx", "c.meta.json", "c.tokenizer.json"]
    ds = TokenDataset(tmp_path / "out" / "c")
    assert ds.eos_id == 0  # recorded: the runtime keeps the documents apart by it
    assert ds.num_documents == len(lines) and ds.num_tokens == stats["tokens"]
    assert ds.vocab_size == stats["vocab_size"]
    # BPE merged something: fewer tokens than UTF-8 bytes (+1 EOS per document)
    assert ds.num_tokens < sum(len(s.encode()) + 1 for s in lines)
    tok = Tokenizer.from_file(stats["tokenizer"])
    for i in (0, 1, 57, 150, len(lines) - 1):
        ids = ds.document(i).tolist()
        assert ids[-1] == stats["eos_id"]
        assert tok.decode(ids[:-1]) == lines[i]
    # the same tokenizer, given back, reproduces the same tokens
    again = prepare([path], tmp_path / "again", tokenizer=stats["tokenizer"], vocab_size=1)
    assert not again["tokenizer_trained"]
    np.testing.assert_array_equal(TokenDataset(tmp_path / "again").tokens, ds.tokens)


def test_prepare_jsonl_gz_and_no_eos(tmp_path) -> None:
    lines = _lines(50, seed=1)
    path = tmp_path / "docs.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i, text in enumerate(lines):
            f.write(json.dumps({"id": i, "body": text}) + "\n")
    stats = prepare([path], tmp_path / "j", tokenizer=None, vocab_size=300, text_key="body",
                    append_eos=False)
    assert stats["documents"] == 50 and stats["eos_id"] is None
    ds = TokenDataset(tmp_path / "j")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(stats["tokenizer"])
    assert tok.decode(ds.document(7).tolist()) == lines[7]


@pytest.mark.parametrize("content, needle", [
    ('{"text": "ok"}\n{"txt": "no"}\n', "bad.jsonl:2: no 'text' field (fields: txt)"),
    ('{"text": "ok"}\n{"text": "ok"\n', "bad.jsonl:2: not valid JSON"),
    ('{"text": "ok"}\n\n[1, 2]\n', "bad.jsonl:3: a JSON list"),
    ('{"text": 5}\n', "bad.jsonl:1: field 'text' is a JSON int"),
    ("\n  \n\n", "no documents in"),
])
def test_bad_jsonl(tmp_path, content: str, needle: str) -> None:
    (tmp_path / "bad.jsonl").write_text(content)
    for tokenizer in (None, "given"):
        if tokenizer == "given":
            (tmp_path / "good.txt").write_text("\n".join(_lines(20)))
            tokenizer = prepare([tmp_path / "good.txt"], tmp_path / "t", None, 300)["tokenizer"]
        with pytest.raises(PlanError) as exc:
            prepare([tmp_path / "bad.jsonl"], tmp_path / "out", tokenizer, 300)
        assert needle in str(exc.value) and "\n" not in str(exc.value)
        assert not list(tmp_path.glob("out*"))


def test_bad_inputs(tmp_path, corpus) -> None:
    path, _ = corpus
    with pytest.raises(PlanError, match="missing.txt: input file not found"):
        prepare([path, tmp_path / "missing.txt"], tmp_path / "o", None, 300)
    (tmp_path / "latin1.txt").write_bytes(b"fine\ncaf\xe9\n")
    with pytest.raises(PlanError, match="latin1.txt:2: not UTF-8"):
        prepare([tmp_path / "latin1.txt"], tmp_path / "o", None, 300)
    with pytest.raises(PlanError, match="too small for a byte-level BPE"):
        prepare([path], tmp_path / "o", None, 100)
    with pytest.raises(PlanError, match="nope.json not found"):
        prepare([path], tmp_path / "o", str(tmp_path / "nope.json"), 300)
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(PlanError, match="junk.json is not a Hugging Face tokenizer.json"):
        prepare([path], tmp_path / "o", str(tmp_path / "junk.json"), 300)
    assert not list(tmp_path.glob("o*"))


def _cli(*args: str, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autopar", "data", "prepare", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)


def test_cli(tmp_path, corpus) -> None:
    path, lines = corpus
    (tmp_path / "bad.jsonl").write_text('{"text": "a b c"}\nnot json\n')
    # both runs at once: the interpreter start (torch import) dominates
    runs = [_cli(str(path), "--out", "ds/c", "--vocab-size", "320", "--json",
                 cwd=tmp_path),
            _cli(str(path), "bad.jsonl", "--out", "bad/c", cwd=tmp_path)]
    (ok_out, ok_err), (bad_out, bad_err) = (p.communicate(timeout=120) for p in runs)
    assert runs[0].returncode == 0, ok_err
    stats = json.loads(ok_out)
    assert stats["documents"] == len(lines) and stats["vocab_size"] <= 320
    assert TokenDataset(tmp_path / "ds" / "c").num_tokens == stats["tokens"]

    assert runs[1].returncode == 2
    assert bad_out == ""
    assert bad_err.count("\n") == 1
    assert bad_err.startswith("autopar: error: bad.jsonl:2: not valid JSON")
    assert not (tmp_path / "bad").exists()
