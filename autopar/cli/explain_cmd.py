"""``autopar explain PLAN``: a block's or an op's chosen sharding, the alternatives, their costs."""

from __future__ import annotations

import click

from autopar.cli.common import load_plan
from autopar.report.explain import block_explain, node_explain, overview, render_explain


@click.command("explain", short_help="A block's or op's sharding, the alternatives, their costs.")
@click.argument("plan_path", metavar="PLAN")
@click.option("--block", default=None, metavar="K",
              help="A block index (0 = the embedding head) or name (model.layers.3).")
@click.option("--node", default=None, metavar="NAME",
              help="An op name from `--block` (linear_4), a module path "
                   "(model.layers.3.mlp.up_proj) or a path inside a block (mlp.up_proj).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              show_default=True)
def explain_cmd(plan_path: str, block: str | None, node: str | None, fmt: str) -> None:
    """Explain PLAN's choices. Without options: the block types and how their ops are
    sharded. With --block: the block's stage, its recompute mode against the others (memory
    kept, time added), its cost at every tensor-parallel degree searched, and each op's
    sharding with the alternatives' costs. With --node: one op's strategies and costs.

    \b
    Examples:
      autopar explain autopar-llama3-8b-64
      autopar explain autopar-llama3-8b-64 --block model.layers.3
      autopar explain plan.yaml --node self_attn.q_proj
      autopar explain plan.yaml --block 0 --format json
    """
    if block is not None and node is not None:
        raise click.UsageError("give --block or --node, not both")
    plan = load_plan(plan_path)
    if block is not None:
        data = block_explain(plan, block)
    elif node is not None:
        data = node_explain(plan, node)
    else:
        data = overview(plan)
    click.echo(render_explain(data, fmt), nl=False)
