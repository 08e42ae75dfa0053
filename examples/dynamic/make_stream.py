"""A drifting click stream whose ids are not known in advance, from a known teacher.

    python examples/dynamic/make_stream.py OUT_DIR [--days 8] [--rows-per-day 40000] [--seed 0]

writes OUT_DIR/stream/day=<d>/part-0.parquet (d = 0..days-1; the hive key `day` is a column)
and OUT_DIR/stream.json (the teacher's parameters, the id counts and the Bayes AUC of the last
day: the best any model can do).

The world. Users and items are born over time with random 40-bit ids (drawn from [0, 2^40),
so a vocabulary cannot be known before the data is seen) and live for a random number of days
(exponential, mean `--user-life` / `--item-life`), so new ids keep appearing and old ones fade.
On each day, a row picks an alive user and an alive item with Zipf-like popularity: each id
has a fixed popularity rank weight 1 / rank^s (its rank a uniform draw), times a daily
log-normal random walk, so the popular ids shift from day to day.

The teacher. Every user u has a latent vector p_u and a bias a_u, every item i a vector q_i
and a bias b_i (standard normal, width `--latent`), and the click probability is

    P(click) = sigmoid(scale * (p_u . q_i / sqrt(latent) + a_u + b_i) + w . x - shift)

with two dense features x ~ N(0, 1) and fixed weights w. The embeddings carry almost all of
the signal, so a model learns it only if it keeps a row per live id: collisions (the hashing
trick) mix ids' vectors, and evicting live ids forgets them.

Deterministic: the same arguments write the same files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ID_SPACE = 1 << 40


def _auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Rank AUC (ties averaged)."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    s = scores[order]
    edges = np.flatnonzero(np.diff(s)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(s)]])
    for a, b in zip(starts, ends, strict=True):
        ranks[order[a:b]] = (a + b + 1) / 2
    pos = labels == 1
    n1, n0 = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


class Population:
    """Ids born over [-life, days) with lifetimes, popularity ranks and daily drifts."""

    def __init__(
        self, rng: np.random.Generator, n: int, days: int, life: float, zipf: float, latent: int
    ) -> None:
        self.ids = rng.choice(ID_SPACE, size=n, replace=False).astype(np.int64)
        self.birth = rng.uniform(-life, days, n)
        self.death = self.birth + rng.exponential(life, n) + 0.5
        self.weight = 1.0 / rng.permutation(np.arange(1, n + 1)) ** zipf
        self.drift = np.zeros(n)
        self.vec = rng.standard_normal((n, latent))
        self.bias = 0.5 * rng.standard_normal(n)

    def draw(self, rng: np.random.Generator, day: int, rows: int, walk: float) -> np.ndarray:
        """Indices of `rows` ids alive on `day`, by today's popularity."""
        self.drift += walk * rng.standard_normal(len(self.drift))
        alive = np.flatnonzero((self.birth <= day + 1) & (self.death > day))
        p = self.weight[alive] * np.exp(self.drift[alive])
        return alive[rng.choice(len(alive), size=rows, p=p / p.sum())]


def make(out: Path, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    users = Population(rng, args.users, args.days, args.user_life, args.zipf, args.latent)
    items = Population(rng, args.items, args.days, args.item_life, args.zipf, args.latent)
    w = np.array([0.6, -0.4])
    stream = out / "stream"
    seen_users: set[int] = set()
    info: dict = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "days": [],
    }
    for day in range(args.days):
        u = users.draw(rng, day, args.rows_per_day, args.walk)
        i = items.draw(rng, day, args.rows_per_day, args.walk)
        x = rng.standard_normal((args.rows_per_day, 2))
        dot = (users.vec[u] * items.vec[i]).sum(1) / np.sqrt(args.latent)
        logit = args.scale * (dot + users.bias[u] + items.bias[i]) + x @ w - args.shift
        p = 1.0 / (1.0 + np.exp(-logit))
        y = (rng.uniform(size=len(p)) < p).astype(np.int8)
        day_users = set(users.ids[u].tolist())
        info["days"].append(
            {
                "day": day,
                "rows": int(len(y)),
                "ctr": float(y.mean()),
                "distinct_users": len(day_users),
                "distinct_items": len(set(items.ids[i].tolist())),
                "new_users": len(day_users - seen_users),  # never seen on an earlier day
                "bayes_auc": _auc(y, p),
            }
        )
        seen_users |= day_users
        table = pa.table(
            {
                "clicked": y,
                "x0": x[:, 0].astype(np.float32),
                "x1": x[:, 1].astype(np.float32),
                "user": users.ids[u],
                "item": items.ids[i],
            }
        )
        (stream / f"day={day}").mkdir(parents=True, exist_ok=True)
        pq.write_table(table, stream / f"day={day}" / "part-0.parquet")
    info["distinct_users"] = len(seen_users)
    info["bayes_auc_last_day"] = info["days"][-1]["bayes_auc"]
    (out / "stream.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--days", type=int, default=8)
    ap.add_argument("--rows-per-day", type=int, default=40000)
    ap.add_argument("--users", type=int, default=30000, help="users born over the stream")
    ap.add_argument("--items", type=int, default=3000, help="items born over the stream")
    ap.add_argument("--user-life", type=float, default=3.0, help="mean days a user lives")
    ap.add_argument("--item-life", type=float, default=4.0, help="mean days an item lives")
    ap.add_argument("--zipf", type=float, default=0.8, help="popularity ~ 1 / rank^zipf")
    ap.add_argument("--walk", type=float, default=0.3, help="daily log-popularity drift")
    ap.add_argument("--latent", type=int, default=8, help="teacher vector width")
    ap.add_argument("--scale", type=float, default=1.5, help="teacher logit scale")
    ap.add_argument("--shift", type=float, default=1.0, help="lowers the click rate")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    info = make(args.out, args)
    last = info["days"][-1]
    print(
        f"{args.days} days x {args.rows_per_day} rows -> {args.out / 'stream'}: "
        f"{info['distinct_users']} distinct users; last day {last['distinct_users']} users "
        f"({last['new_users']} new), ctr {last['ctr']:.3f}, Bayes AUC {last['bayes_auc']:.4f}"
    )


if __name__ == "__main__":
    main()
