"""Does sparse weight decay regularise? Biased matrix factorisation on MovieLens 100K.

    python examples/movielens/prepare.py /tmp/ml          # OUT_DIR/ratings.parquet
    python -m benchmarks.sparse_weight_decay --data /tmp/ml/ratings.parquet \\
        --out benchmarks/results/sparse_weight_decay_movielens.md

The model is rating = mean + b_user + b_item + <p_user, q_item>: four embedding tables
(`mf.user`, `mf.item` of width --dim, `mf.user_bias`, `mf.item_bias` of width 1) declared with
hybridrec.EmbeddingTables and sharded by hybridrec.parallelize in one process (the
equivalence tests show any world size computes the same), trained with the library's own
loop: MSE, batches of --batch-size shuffled per epoch (seeded), the sparse optimizer inside
the backward. No dense parameters (mean is the train ratings' mean, a constant).
The split is examples/movielens/prepare.py's (random: 72% train, 8% val, 20% test). Each run
reports the val RMSE per epoch, the epoch with the best val RMSE and its test RMSE (chosen
on val only), and the last epoch's val and test RMSE (how far it overfits by then).
Runs: no decay, then each --runs mode:decay, with --optimizer.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from torch import nn

import hybridrec
from benchmarks.common import command_line, git_state, hardware, load_average, markdown_table
from hybridrec import EmbeddingTables, Feature, KeyedIds, Table
from hybridrec.optim import RowWiseAdagrad, SparseAdagrad, SparseAdam, SparseSGD

OPTIMIZERS = {
    "sgd": SparseSGD,
    "adagrad": SparseAdagrad,
    "rowwise_adagrad": RowWiseAdagrad,
    "adam": SparseAdam,
}
NAMES = ("user", "item", "user_b", "item_b")
HOTNESS = (1, 1, 1, 1)


class BiasedMF(nn.Module):
    def __init__(self, users: int, items: int, dim: int, mean: float) -> None:
        super().__init__()
        self.emb = EmbeddingTables(
            [
                Table("user", users, dim),
                Table("item", items, dim),
                Table("user_bias", users, 1),
                Table("item_bias", items, 1),
            ],
            [
                Feature("user", "user"),
                Feature("item", "item"),
                Feature("user_b", "user_bias"),
                Feature("item_b", "item_bias"),
            ],
            namespace="mf",
        )
        self.register_buffer("mean", torch.tensor(mean))

    def forward(self, ids: KeyedIds) -> torch.Tensor:
        e = self.emb(ids)
        dot = (e["user"] * e["item"]).sum(1)
        return self.mean + e["user_b"].squeeze(1) + e["item_b"].squeeze(1) + dot


def load(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """split -> (ids [n, 4]: user, item, user, item; ratings [n])."""
    t = pq.read_table(path, columns=["user_id", "movie_id", "rating", "split"]).to_pydict()
    out: dict[str, tuple[list, list]] = {}
    for u, m, r, s in zip(t["user_id"], t["movie_id"], t["rating"], t["split"], strict=True):
        ids, ratings = out.setdefault(s, ([], []))
        ids.append((u, m, u, m))
        ratings.append(r)
    return {s: (torch.tensor(i), torch.tensor(r, dtype=torch.float32)) for s, (i, r) in out.items()}


def rmse(model: nn.Module, ids: torch.Tensor, ratings: torch.Tensor) -> float:
    with torch.no_grad():
        pred = torch.cat([model(KeyedIds(chunk, NAMES, HOTNESS)) for chunk in ids.split(8192)])
    return math.sqrt(float(((pred - ratings) ** 2).mean()))


def train(args: argparse.Namespace, data: dict, decay: float, mode: str) -> dict:
    ids, ratings = data["train"]
    users = int(max(int(d[0][:, 0].max()) for d in data.values())) + 1
    items = int(max(int(d[0][:, 1].max()) for d in data.values())) + 1
    torch.manual_seed(0)
    opt = OPTIMIZERS[args.optimizer](args.lr, weight_decay=decay, weight_decay_mode=mode)
    model = hybridrec.parallelize(
        BiasedMF(users, items, args.dim, float(ratings.mean())),
        batch_size=args.batch_size,
        sparse_optimizer=opt,
        sharding="none",
        seed=args.seed,
    )
    g = torch.Generator().manual_seed(args.seed)
    curve = []
    for _ in range(args.epochs):
        order = torch.randperm(ids.shape[0], generator=g)
        for batch in order.split(args.batch_size):
            pred = model(KeyedIds(ids[batch], NAMES, HOTNESS))
            nn.functional.mse_loss(pred, ratings[batch]).backward()
        curve.append((rmse(model, *data["val"]), rmse(model, *data["test"])))
    best = min(range(len(curve)), key=lambda e: curve[e][0])
    return {"curve": curve, "best": best}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="examples/movielens/prepare.py's")
    p.add_argument("--optimizer", default="adagrad", choices=sorted(OPTIMIZERS))
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument(
        "--runs",
        default="l2:0.0005,l2:0.001,l2:0.002,decoupled:0.03,decoupled:0.1,decoupled:0.3",
        help="comma list of mode:weight_decay (mode: l2 or decoupled), after one without",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args()
    torch.set_num_threads(1)
    data = load(args.data)
    runs = [(0.0, "-")] + [
        (float(d), m) for m, d in (run.split(":") for run in args.runs.split(","))
    ]
    rows, curves = [], []
    for decay, mode in runs:
        start = time.perf_counter()
        res = train(args, data, decay, "l2" if mode == "-" else mode)
        c, b = res["curve"], res["best"]
        rows.append([
            f"{decay:g}", mode, f"{b + 1}", f"{c[b][0]:.4f}", f"{c[b][1]:.4f}",
            f"{c[-1][0]:.4f}", f"{c[-1][1]:.4f}", f"{time.perf_counter() - start:.0f}",
        ])  # fmt: skip
        curves.append(f"{decay:g} {mode}: " + " ".join(f"{v:.4f}" for v, _ in c))
        print(" | ".join(rows[-1]), flush=True)
    head = [
        "weight_decay", "mode", "best epoch (val)", "val RMSE", "test RMSE",
        f"val RMSE, epoch {args.epochs}", f"test RMSE, epoch {args.epochs}", "s",
    ]  # fmt: skip
    report = (
        "# Sparse weight decay: biased matrix factorisation on MovieLens 100K\n\n"
        f"`{command_line()}`\n\n{git_state()}; {hardware()}; {load_average()}.\n\n"
        f"{args.optimizer}, lr {args.lr}, dim {args.dim}, batch {args.batch_size}, "
        f"{args.epochs} epochs, one process; the test RMSE is the epoch chosen on val.\n\n"
        + markdown_table(head, rows)
        + "\n\nval RMSE per epoch:\n\n```\n"
        + "\n".join(curves)
        + "\n```\n"
    )
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
