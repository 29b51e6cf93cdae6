"""Plans shared by the report tests: planned once per session (seconds each)."""

from __future__ import annotations

import pytest

import autopar


@pytest.fixture(scope="session")
def tiny_graph():
    return autopar.capture("tiny-llama", seq=64)


@pytest.fixture(scope="session")
def tiny_plan(tiny_graph):
    """Data and tensor parallelism, one pipeline stage."""
    return autopar.plan(tiny_graph, devices=4, global_batch=16, constraints={"pp": 1})


@pytest.fixture(scope="session")
def pp_plan(tiny_graph):
    """Two pipeline stages (1F1B), so stages, bubbles and the timeline have something to show."""
    return autopar.plan(tiny_graph, devices=4, global_batch=16,
                        constraints={"pp": 2, "schedule": "1f1b"})


@pytest.fixture(scope="session")
def llama_graph():
    return autopar.capture("llama3-8b")


@pytest.fixture(scope="session")
def llama_plan(llama_graph):
    """The README's plan: Llama-3-8B on 64 A100-80G, global batch 512."""
    return autopar.plan(llama_graph, devices=64, global_batch=512)


@pytest.fixture(scope="session")
def llama_tp8_plan(llama_graph):
    """Tensor parallelism pinned at 8 and a pipeline: every op has sharding alternatives."""
    return autopar.plan(llama_graph, devices=64, global_batch=512,
                        constraints={"tp": 8, "pp": 2})
