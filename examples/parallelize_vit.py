"""Your own loop: plan a small ViT-style image classifier, then train it with your own loss and
DataLoader after ``autopar.parallelize``.

    python examples/parallelize_vit.py                                  # one process
    torchrun --nproc-per-node 2 examples/parallelize_vit.py dp=2,zero_stage=3
    torchrun --nproc-per-node 2 examples/parallelize_vit.py tp=2

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
from autopar.runtime.apply import optimizer

IMAGE, PATCH, CHANNELS, CLASSES, WIDTH, HEADS, DEPTH = 16, 4, 3, 10, 64, 4, 3
GLOBAL_BATCH, STEPS = 8, 5


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a share of them
        q, k, v = (p(x).view(b, n, -1, WIDTH // HEADS).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        patches = (IMAGE // PATCH) ** 2
        self.patch = nn.Linear(CHANNELS * PATCH * PATCH, WIDTH)
        self.pos = nn.Parameter(torch.randn(1, patches, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
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
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)
    model = ViT()  # every rank builds the same weights
    example = torch.zeros(1, CHANNELS, IMAGE, IMAGE)
    plan = autopar.plan(autopar.capture(model, (example,)), devices=world, cluster="cpu",
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
