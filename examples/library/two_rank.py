"""Train your own model with sharded embedding tables: torchrun --nproc_per_node=2 two_rank.py"""

import logging

import torch
import torch.distributed as dist
from torch import nn

import hybridrec
from hybridrec import EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.optim import RowWiseAdagrad


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = EmbeddingTables(
            [Table("user", rows=10_000, dim=16), Table("item", rows=50_000, dim=16)],
            [
                Feature("user_id", "user"),
                Feature("follows", "user", hotness=8, jagged=True),
                Feature("item_id", "item"),
            ],
        )
        self.mlp = nn.Sequential(nn.Linear(3 * 16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: KeyedIds) -> torch.Tensor:
        pooled = self.emb(ids)  # by feature: pooled["follows"] is [B, 16]
        return self.mlp(torch.cat([pooled[f] for f in pooled], dim=1)).squeeze(1)


logging.basicConfig(level=logging.INFO)  # hybridrec logs the sharding plan on rank 0
dist.init_process_group("gloo")
rank, world, batch = dist.get_rank(), dist.get_world_size(), 512  # batch: global
torch.manual_seed(0)  # the same dense weights on every rank and in every run
model = hybridrec.parallelize(MyModel(), batch_size=batch, sparse_optimizer=RowWiseAdagrad(0.1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(rank)  # each rank reads its own samples
for step in range(20):
    users = torch.randint(0, 10_000, (batch // world, 9), generator=g)
    items = torch.randint(0, 50_000, (batch // world, 1), generator=g)
    users[:, 1 + step % 8 :] = -1  # a follows list of 0..7 ids, padded with -1
    ids = KeyedIds(torch.cat([users, items], 1), ["user_id", "follows", "item_id"], [1, 8, 1])
    labels = (ids.values[:, 0] % 2).float()  # something to learn: odd user ids click
    loss = nn.functional.binary_cross_entropy_with_logits(model(ids), labels)
    loss.backward()  # also updates the touched embedding rows, on the ranks that hold them
    opt.step()
    opt.zero_grad()
if rank == 0:
    print(f"trained 20 steps on {world} ranks, last loss {loss.item():.4f}")
hybridrec.shutdown()  # every rank: wait for the others, then end the process group cleanly
