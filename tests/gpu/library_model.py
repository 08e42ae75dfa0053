"""The library equivalence model on a device against the same model on the CPU: the GPU
checks' library probe (`python -m tests.gpu.library_model`) and tests/gpu/test_gpu_library.py.

A user's model as docs/library.md writes it: two EmbeddingTables of widths 16 and 8, a user
table that a user id and a jagged, mean-pooled list of friends share, an age table, an item
table and a jagged genre list, scored by the dot product of two small towers plus a dense
input. It trains through its own loop (no Trainer) on the same `steps` batches of `batch`
samples with `sharding="none"` (every table on the device) or `"host"` (host memory behind
device caches of 20% of the rows, admitted on demand, evicting and writing back within 30
steps), with each sparse optimizer. `compare()` gives the largest relative difference of a
step's loss and the largest absolute difference of any row or optimizer state from the
single-process CPU run (`sharding="none"`), and how many rows the caches wrote back.
fp32 throughout: TF32 off while a CUDA run trains.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

import hybridrec
from hybridrec import EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.optim import RowWiseAdagrad, SparseAdagrad, SparseAdam, SparseSGD
from hybridrec.planner import CachePolicy
from hybridrec.sparse.api import embedding_modules

ROWS = {"users.user": 200_000, "users.age": 100, "items.item": 100_000, "items.genre": 1_000}
WIDTH = {"users": 16, "items": 8}
FEATURES = [("user_id", 1), ("friends", 8), ("age", 1), ("item_id", 1), ("genres", 4)]
FEATURE_ROWS = [ROWS[t] for t in ("users.user", "users.user", "users.age")] + [
    ROWS[t] for t in ("items.item", "items.genre")
]
OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam", "adagrad")
STEPS, BATCH, CACHE_FRACTION = 30, 2048, 0.2


def sparse_optimizer(name: str, eps: float | None = None):  # noqa: ANN201
    """The sparse optimizer `name` at this model's learning rate (`eps`: element-wise
    Adagrad's, default torch.optim.Adagrad's 1e-10)."""
    if name == "sgd":
        return SparseSGD(0.5)
    if name == "rowwise_adagrad":
        return RowWiseAdagrad(0.1)
    if name == "adam":
        return SparseAdam(0.01)
    if name == "adagrad":
        return SparseAdagrad(0.1) if eps is None else SparseAdagrad(0.1, eps)
    raise ValueError(f"unknown sparse optimizer {name!r}: one of {', '.join(OPTIMIZERS)}")


class TwoTowers(nn.Module):
    """A user side (width 16) and an item side (width 8), each its own EmbeddingTables."""

    def __init__(self) -> None:
        super().__init__()
        u, i = WIDTH["users"], WIDTH["items"]
        self.users = EmbeddingTables(
            [Table("user", ROWS["users.user"], u), Table("age", ROWS["users.age"], u)],
            [
                Feature("user_id", "user"),
                Feature("friends", "user", hotness=8, jagged=True, pooling="mean"),
                Feature("age", "age"),
            ],
        )
        self.items = EmbeddingTables(
            [Table("item", ROWS["items.item"], i), Table("genre", ROWS["items.genre"], i)],
            [Feature("item_id", "item"), Feature("genres", "genre", hotness=4, jagged=True)],
        )
        self.user_tower = nn.Sequential(nn.Linear(3 * u + 2, 32), nn.ReLU(), nn.Linear(32, 8))
        self.item_tower = nn.Linear(2 * i, 8)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, dense: torch.Tensor, ids: KeyedIds) -> torch.Tensor:
        u, i = self.users(ids), self.items(ids)
        user = self.user_tower(torch.cat([u["user_id"], u["friends"], u["age"], dense], dim=1))
        item = self.item_tower(torch.cat([i["item_id"], i["genres"]], dim=1))
        return (user * item).sum(1) + self.bias


@functools.cache
def batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`steps` batches on the CPU: dense [B, 2], ids [B, 15] (lists padded with -1, empty
    lists included; skewed ids, so rows repeat within and across batches), labels [B]."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        cols = []
        for (_, h), n in zip(FEATURES, FEATURE_ROWS, strict=True):
            ids = (torch.rand(batch, h, generator=g) ** 2 * n).long()
            if h > 1:  # a list of 0..h ids, the rest padding
                length = torch.randint(0, h + 1, (batch, 1), generator=g)
                ids[torch.arange(h).expand(batch, h) >= length] = -1
            cols.append(ids)
        labels = (torch.rand(batch, generator=g) < 0.4).float()
        out.append((torch.randn(batch, 2, generator=g), torch.cat(cols, 1), labels))
    return out


@contextlib.contextmanager
def _fp32(device: torch.device):
    """No TF32 in a CUDA run's matmuls (the CPU reference has none)."""
    if device.type != "cuda":
        yield
        return
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def train(
    device: str,
    sharding: str,
    optimizer: str,
    eps: float | None = None,
    steps: int = STEPS,
    batch: int = BATCH,
) -> dict:
    """Train TwoTowers; returns {"losses": [steps] floats, "tables": {table: {"weight" and
    each state: full tensor on the CPU}}, "rows_written": rows the host caches wrote back}."""
    dev = torch.device(device)
    torch.manual_seed(0)  # the same dense initialisation on every device
    with _fp32(dev):
        model = hybridrec.parallelize(
            TwoTowers(),
            batch_size=batch,
            sparse_optimizer=sparse_optimizer(optimizer, eps),
            sharding=sharding,
            device=dev,
            cache=CachePolicy(fraction=CACHE_FRACTION),
            seed=11,
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        names, hotness = zip(*FEATURES, strict=True)
        losses = []
        for dense, ids, labels in batches(steps, batch):
            out = model(dense.to(dev), KeyedIds(ids.to(dev), names, hotness))
            loss = nn.functional.binary_cross_entropy_with_logits(out, labels.to(dev))
            loss.backward()  # also updates the touched rows
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        hybridrec.check_inputs(model)
    written = 0
    for m in embedding_modules(model):
        for g in m.host_groups():
            written += g.take_stats().rows_written  # by evictions (before the flush's)
            g.flush()  # cached rows back into host memory
    return {
        "losses": torch.stack(losses).double().cpu().tolist(),  # one sync, at the end
        "tables": _full_tables(model),
        "rows_written": written,
    }


def _full_tables(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Every table's rows and optimizer state, assembled from this process's shards."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for m in embedding_modules(model):
        for spec, w, state in m.shard_views():
            dim = WIDTH[spec.table.split(".")[0]]
            entry = out.setdefault(spec.table, {})
            for name, t in {"weight": w, **state}.items():
                shape = (ROWS[spec.table],) if t.dim() == 1 else (ROWS[spec.table], dim)
                buf = entry.setdefault(name, torch.full(shape, float("nan")))
                if t.dim() == 1:
                    buf[spec.row_start : spec.row_end] = t.cpu()
                else:
                    buf[spec.row_start : spec.row_end, spec.col_start : spec.col_end] = t.cpu()
    return out


@functools.cache
def reference(optimizer: str, eps: float | None, steps: int, batch: int) -> dict:
    """The single-process CPU run (deterministic: once per process)."""
    return train("cpu", "none", optimizer, eps, steps, batch)


@dataclass
class Difference:
    loss: float  # the largest |loss - reference| / |reference| over the steps
    rows: float  # the largest |row or state - reference| over every table
    rows_written: int  # rows the host caches wrote back (0 without host caches)
    got: dict  # the run (train()'s result)
    want: dict  # the CPU reference's


def compare(
    device: str,
    sharding: str,
    optimizer: str,
    eps: float | None = None,
    steps: int = STEPS,
    batch: int = BATCH,
) -> Difference:
    """How far a run on `device` with `sharding` is from the CPU reference."""
    want = reference(optimizer, eps, steps, batch)
    got = train(device, sharding, optimizer, eps, steps, batch)
    a, b = torch.tensor(got["losses"]), torch.tensor(want["losses"])
    loss = float(((a - b).abs() / b.abs()).max())
    rows = 0.0
    for table, entries in want["tables"].items():
        for name, value in entries.items():
            rows = max(rows, float((got["tables"][table][name] - value).abs().max()))
    return Difference(loss, rows, got["rows_written"], got, want)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="The library model on a device vs the CPU reference, per sparse optimizer "
        "(tests/gpu/library_model.py)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--batch-size", type=int, default=BATCH)
    p.add_argument("--shardings", default="none,host")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument(
        "--adagrad-eps",
        default="1e-10,1e-3",
        help="element-wise Adagrad's eps values to run (1e-10: torch.optim.Adagrad's default)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(min(8, torch.get_num_threads()))
    print(
        f"library model on {args.device} vs the CPU reference: {args.steps} steps of "
        f"{args.batch_size}, host caches {CACHE_FRACTION:.0%} of the rows",
        flush=True,
    )
    print(
        f"{'optimizer':28s} {'sharding':8s} {'max rel loss diff':>17s} "
        f"{'max abs row diff':>16s} {'rows written':>12s} {'s':>6s}",
        flush=True,
    )
    for name in args.optimizers.split(","):
        epsilons = [float(e) for e in args.adagrad_eps.split(",")] if name == "adagrad" else [None]
        for eps in epsilons:
            label = name if eps is None else f"{name} (eps {eps:g})"
            for sharding in args.shardings.split(","):
                start = time.perf_counter()
                d = compare(args.device, sharding, name, eps, args.steps, args.batch_size)
                print(
                    f"{label:28s} {sharding:8s} {d.loss:17.2e} {d.rows:16.2e} "
                    f"{d.rows_written:12,d} {time.perf_counter() - start:6.1f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
