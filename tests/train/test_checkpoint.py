"""Stop, resume under a different plan, continue: the uninterrupted losses."""

from __future__ import annotations

from pathlib import Path

import pytest

import autopar
from autopar.models import GPT, GPTConfig, token_inputs
from autopar.models.source import describe_source
from autopar.train.checkpoint import latest_checkpoint
from tests.fixtures.harness import run_ranks
from tests.fixtures.layouts import with_full_size_layout
from tests.parallel.test_equivalence import _plan

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def reference(gpt) -> list[float]:
    """Seven uninterrupted steps in one process."""
    source, graph = gpt
    return run_ranks(source, _plan(graph, 1, microbatch_size=2), steps=7)[0]


def _written(path: Path) -> dict[str, set[str]]:
    """Checkpoint key -> the data files (one per writing rank) holding it."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata()
    out: dict[str, set[str]] = {key: set() for key in meta.state_dict_metadata}
    for index, info in meta.storage_data.items():
        out[index.fqn].add(info.relative_path)
    return out


def test_resume_under_another_plan_continues_the_same_losses(gpt, reference, tmp_path
                                                             ) -> None:
    source, graph = gpt
    ckpt = str(tmp_path / "ckpt")
    first, _ = run_ranks(source, _plan(graph, 2, dp=2, zero_stage=3, microbatch_size=1),
                         steps=4, checkpoint_dir=ckpt)
    assert latest_checkpoint(ckpt).name == "step_000004"
    assert not list((tmp_path / "ckpt").glob("*.partial"))
    tp_plan = with_full_size_layout(_plan(graph, 2, tp=2, dp=1, microbatch_size=2,
                                          sequence_parallel=False), "gpt")
    rest, sharded = run_ranks(source, tp_plan, steps=2, checkpoint_dir=ckpt, resume=True)
    assert sharded > 0
    assert first + rest == pytest.approx(reference[:6], rel=1e-4)


def test_checkpoint_of_another_model_is_refused(gpt, tmp_path) -> None:
    source, graph = gpt
    ckpt = str(tmp_path / "ckpt")
    run_ranks(source, _plan(graph, 1, microbatch_size=2), steps=1, checkpoint_dir=ckpt)
    other = GPT(GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=3, n_heads=4))
    other_graph = autopar.capture(other, token_inputs(1, 32))
    with pytest.raises(RuntimeError, match="of another model"):
        run_ranks(describe_source(other), _plan(other_graph, 1, microbatch_size=2), steps=1,
                  checkpoint_dir=ckpt, resume=True)
    assert latest_checkpoint(ckpt).name == "step_000001"  # untouched


def _pipeline(graph, devices: int, schedule: str, **pins):
    plan = _plan(graph, devices, pp=2, tp=1, microbatch_size=1, schedule=schedule, **pins)
    assert plan.mesh["pp"] == 2 and plan.schedule == schedule
    return plan


def test_pipeline_checkpoint_resumes_under_pp_x_dp_then_zero3(gpt, reference, tmp_path
                                                              ) -> None:
    source, graph = gpt
    ckpt = tmp_path / "ckpt"
    first, _ = run_ranks(source, _pipeline(graph, 2, "1f1b", dp=1, num_microbatches=4),
                         steps=4, checkpoint_dir=str(ckpt))
    pp_dp = _pipeline(graph, 4, "1f1b", dp=2, zero_stage=3, num_microbatches=2)
    middle, sharded_stages = run_ranks(source, pp_dp, steps=1, checkpoint_dir=str(ckpt),
                                       resume=True)
    zero3 = _plan(graph, 2, dp=2, zero_stage=3, microbatch_size=1)
    last, sharded = run_ranks(source, zero3, steps=1, checkpoint_dir=str(ckpt), resume=True)
    assert sharded_stages > 0 and sharded > 0
    assert first + middle + last == pytest.approx(reference[:6], rel=1e-4)
    written = [_written(ckpt / f"step_{s:06d}") for s in (4, 5, 6)]
    assert set(written[0]) == set(written[1]) == set(written[2])  # one format for every plan
    piped = written[0]
    # each stage wrote its own layers; the tied head's optimizer state went under tok_emb
    assert piped["model.layers.0.attn.qkv.weight"] != piped["model.ln_f.weight"]
    assert "optim.state.tok_emb.weight.exp_avg" in piped
    assert not [k for k in piped if k.startswith("optim.") and ".head." in k]


def test_zero1_checkpoint_resumes_under_pipeline_tp_and_zero1(gpt, reference, tmp_path
                                                              ) -> None:
    source, graph = gpt
    ckpt = tmp_path / "ckpt"
    zero1 = _plan(graph, 2, dp=2, zero_stage=1, microbatch_size=1)
    assert zero1.zero_stage == 1
    losses, _ = run_ranks(source, zero1, steps=4, checkpoint_dir=str(ckpt))
    tp_plan = with_full_size_layout(_plan(graph, 2, tp=2, dp=1, microbatch_size=2,
                                          sequence_parallel=False), "gpt")
    for plan in (_pipeline(graph, 2, "gpipe", dp=1, num_microbatches=4), tp_plan, zero1):
        more, _ = run_ranks(source, plan, steps=1, checkpoint_dir=str(ckpt), resume=True)
        losses += more
    assert losses == pytest.approx(reference, rel=1e-4)
    written = [_written(ckpt / f"step_{s:06d}") for s in (4, 5, 6, 7)]
    assert all(set(w) == set(written[0]) for w in written)
    # each rank wrote its own partition's optimizer state: nothing was gathered on rank 0
    for w in (written[0], written[3]):
        states = [files for k, files in w.items() if k.startswith("optim.state.")]
        assert all(len(files) == 1 for files in states)
        assert len(set().union(*states)) == 2


def test_hf_pipeline_checkpoint_resumes_without_the_pipeline(tmp_path) -> None:
    """A traced Hugging Face stage lists the rotary inv_freq buffer, which the model itself does
    not save: the checkpoint holds the model's own keys, so a pp=1 plan resumes from it."""
    source, graph = describe_source("tiny-llama"), autopar.capture("tiny-llama", seq=32)
    reference, _ = run_ranks(source, _plan(graph, 1, microbatch_size=2), steps=3)
    ckpt = str(tmp_path / "ckpt")
    first, _ = run_ranks(source, _plan(graph, 2, pp=2, dp=1, tp=1, microbatch_size=1,
                                       num_microbatches=4, schedule="1f1b"),
                         steps=2, checkpoint_dir=ckpt)
    assert not any("inv_freq" in key for key in _written(latest_checkpoint(ckpt)))
    rest, _ = run_ranks(source, _plan(graph, 2, dp=2, zero_stage=0, microbatch_size=1),
                        steps=1, checkpoint_dir=ckpt, resume=True)
    assert first + rest == pytest.approx(reference, rel=1e-4)


def test_fused_projection_checkpoint_resumes_under_another_plan(tmp_path) -> None:
    """A fused projection split per part (q|k|v of GPT-2's Conv1D c_attn) holds its rows in
    per-rank order; its checkpoint stores the model's own order, so one process resumes it."""
    source, graph = describe_source("tiny-gpt2"), autopar.capture("tiny-gpt2", seq=32)
    reference, _ = run_ranks(source, _plan(graph, 1, microbatch_size=2), steps=4)
    ckpt = str(tmp_path / "ckpt")
    tp = with_full_size_layout(_plan(graph, 2, tp=2, dp=1, microbatch_size=2,
                                     sequence_parallel=False), "tiny-gpt2")
    assert tp.placements["params"]["transformer.h.0.attn.c_attn.weight"].startswith("Shard")
    first, _ = run_ranks(source, tp, steps=2, checkpoint_dir=ckpt)
    rest, _ = run_ranks(source, _plan(graph, 1, microbatch_size=2), steps=2,
                        checkpoint_dir=ckpt, resume=True)
    assert first + rest == pytest.approx(reference, rel=1e-4)
