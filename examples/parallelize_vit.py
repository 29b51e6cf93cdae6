"""Your own loop: plan a small ViT image classifier built from ``nn.TransformerEncoderLayer``,
then train it with your own loss and DataLoader after ``autopar.parallelize``.

    python examples/parallelize_vit.py                                  # one process
    torchrun --nproc-per-node 2 examples/parallelize_vit.py dp=2,zero_stage=3
    torchrun --nproc-per-node 2 examples/parallelize_vit.py tp=2
    torchrun --nproc-per-node 2 examples/parallelize_vit.py tp=2 a100-80g   # plan for GPUs

Prints one line per step: the global mean loss (the same under every plan).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autopar
from autopar.train.parallelize import optimizer

IMAGE, PATCH, CHANNELS, CLASSES, WIDTH, HEADS, DEPTH = 16, 4, 3, 10, 64, 4, 3
GLOBAL_BATCH, STEPS = 8, 5


class ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        patches = (IMAGE // PATCH) ** 2
        self.patch = nn.Linear(CHANNELS * PATCH * PATCH, WIDTH)
        self.pos = nn.Parameter(torch.randn(1, patches, WIDTH) * 0.02)
        # torch's own encoder layer (nn.MultiheadAttention inside), as torchvision's ViT:
        # under tensor parallelism autopar runs each layer from its exported graph
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.classify = nn.Linear(WIDTH, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b = images.shape[0]
        x = images.unfold(2, PATCH, PATCH).unfold(3, PATCH, PATCH)  # b c h w p p
        x = x.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, CHANNELS * PATCH * PATCH)
        x = self.patch(x) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.classify(self.norm(x).mean(1))


def main() -> None:
    constraints = sys.argv[1] if len(sys.argv) > 1 else None
    # the cluster planned for: on "cpu" the search keeps small layers whole (a split costs
    # more in communication than it saves); planned for GPUs, tp=2 splits every layer
    cluster = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)
    model = ViT()  # every rank builds the same weights
    example = torch.zeros(1, CHANNELS, IMAGE, IMAGE)
    # the model itself (not a captured graph): the search then checks that the split it
    # proposes runs on this model's code
    plan = autopar.plan(model, (example,), devices=world, cluster=cluster,
                        global_batch=GLOBAL_BATCH,
                        constraints=constraints or {"pp": 1})
    model = autopar.parallelize(model, plan)
    opt = optimizer(model, plan, lr=1e-3)
    replicas, rank = plan.mesh["dp"], dist.get_rank() if dist.is_initialized() else 0
    mine = rank // plan.mesh["tp"]  # this rank's data-parallel index (tp is innermost)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(GLOBAL_BATCH * STEPS, CHANNELS, IMAGE, IMAGE,
                                     generator=generator),
                         torch.randint(0, CLASSES, (GLOBAL_BATCH * STEPS,), generator=generator))
    for step, (images, labels) in enumerate(DataLoader(data, batch_size=GLOBAL_BATCH)):
        share = GLOBAL_BATCH // replicas
        rows = slice(mine * share, (mine + 1) * share)
        loss = F.cross_entropy(model(images[rows]), labels[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= world
        if rank == 0:
            print(f"step {step} loss {total.item():.6f}", flush=True)
    if dist.is_initialized():
        dist.barrier()  # every rank done before any tears gloo down
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
