"""What the next-item export tests share (tests/sequence/test_export.py at one rank,
tests/distributed/test_next_item_export.py at two): a small `user item` file with a few
repeated held-out items, the trainer's run (its test metrics and every test user's ranks from
its own evaluation, then a checkpoint), and the check that the export's top-K, given each
test user's history, puts the held-out item where the trainer's evaluation ranked it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.config import Config
from hybridrec.data.sequences import LeaveOneOut, read_user_item
from hybridrec.distributed import DistEnv
from hybridrec.inference import NextItemExport
from hybridrec.model import load_export
from hybridrec.train.export_cli import main as export_main
from hybridrec.train.next_item_eval import ranks_among, sample_negatives
from hybridrec.train.trainer import Trainer
from tests.configs import make_config
from tests.sequence.files import write_user_item

MAX_LEN, STEPS, ITEMS = 6, 12, 150
TOPK = [10, ITEMS]  # K = the catalogue: the evaluation's ranks are exact for every user
CASES = {
    "sasrec_bce": ["model=sasrec", "optim.sparse.name=adam", "optim.sparse.lr=0.01"],
    "dynamic": [  # raw item ids mapped to the table's rows: the catalogue through the map
        "model=sasrec",
        "+model.dynamic.item.buckets=6",
        "+model.dynamic.item.evict=lru",
        "optim.sparse.name=adam",
        "optim.sparse.lr=0.01",
    ],
    "hstu_softmax": [
        "model=hstu",
        "train.next_item.loss=softmax",
        "train.retrieval.negatives=5",
        "optim.sparse.name=rowwise_adagrad",
        "optim.sparse.lr=0.1",
    ],
}


def write_events(path: Path) -> Path:
    """tests/sequence/files.py's file, with every 7th user's last event (its test item) set
    to its first: a held-out item that is also an input item (a miss, as the evaluation and
    the export leave a user's input items out)."""
    write_user_item(path)
    lines = path.read_text().split("\n")[:-1]
    users = [int(line.split()[0]) for line in lines]
    for i, u in enumerate(users):
        last = i + 1 == len(users) or users[i + 1] != u
        first = users.index(u)
        if last and u % 7 == 0 and i - first >= 3:
            lines[i] = f"{u} {lines[first].split()[1]}"
    path.write_text("\n".join(lines) + "\n")
    return path


def make_cfg(data: Path, case: str, sharding: str, world: int, ckpt: Path) -> Config:
    return make_config(
        "data=sequences", f"data.path={data}", f"data.sequence.max_len={MAX_LEN}",
        f"sharding={sharding}", "model.embedding_dim=8", "model.args.dropout=0.0",
        "optim.dense.lr=0.01", "train.batch_size=12", "eval.batch_size=16",
        f"eval.topk=[{TOPK[0]},{TOPK[1]}]", "eval.every=0", f"train.steps={STEPS}",
        "device=cpu", "seed=5", f"checkpoint.dir={ckpt}", *CASES[case], world_size=world,
    )  # fmt: skip


def train_and_rank(env: DistEnv, cfg: Config) -> dict:
    """Train, then the trainer's test metrics (evaluate("test", whole=True)) and every test
    user's ranks from the same evaluation (full catalogue, sampled); save a checkpoint."""
    trainer = Trainer(cfg, env)
    batches = [trainer.train_batch(s) for s in range(STEPS)]
    losses = [trainer.global_mean(loss) for loss in trainer.train_batches(batches)]
    metrics = trainer.evaluate("test", whole=True)
    full, sampled = trainer.objective._next_item_eval.ranks("test", trainer.keyed)
    trainer.save()
    return {"losses": losses, "metrics": metrics, "full": full, "sampled": sampled}


def held_out(data: Path) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """(each test user's whole input history as the file numbers items, oldest first: train
    and val events, often longer than MAX_LEN; held-out items as the file numbers them; the
    users' sampled negatives as item rows [Q, 100], the evaluation's draws)."""
    seqs = read_user_item(data)
    ev = LeaveOneOut(seqs).eval_split("test", MAX_LEN)
    starts = seqs.offsets[ev.users]
    histories = [
        (seqs.items[a:b] + 1).tolist() for a, b in zip(starts, ev.history_ends, strict=True)
    ]
    return histories, ev.targets + 1, sample_negatives(seqs, ev.users, seed=5)


def export(ckpt: Path, out: Path) -> NextItemExport:
    """hybridrec-export of a next-item checkpoint (no flag needed), loaded."""
    assert export_main([str(ckpt), str(out)]) == 0
    model = load_export(out)
    assert isinstance(model, NextItemExport)
    return model


def check_export(model: NextItemExport, data: Path, want: dict) -> None:
    """For every test user of `data`, the export's top-K puts the held-out item at the rank
    the trainer's evaluation (`want`: train_and_rank's) gave it (absent: K, a miss), hr@K
    and ndcg@K from its lists are the evaluation's, and `score` ranks the sampled protocol's
    items as the evaluation did."""
    assert model.item_ids.tolist() == list(range(1, ITEMS + 1))  # the file's 1-based ids
    histories, targets, negatives = held_out(data)
    assert max(map(len, histories)) > MAX_LEN  # the export keeps the most recent MAX_LEN
    k = TOPK[-1]
    items, scores = model.topk(histories, k)
    got = [row.index(t) if t in row else k for row, t in zip(items.tolist(), targets.tolist())]
    assert got == want["full"].tolist()
    assert any(r == k for r, h, t in zip(got, histories, targets) if t in h)  # a repeat: a miss
    assert (scores[:, :-1] >= scores[:, 1:]).all()
    for kk in TOPK:
        hits = [r < kk for r in got]
        ndcg = [1 / math.log2(r + 2) if r < kk else 0.0 for r in got]
        assert want["metrics"][f"hr@{kk}"] == pytest.approx(sum(hits) / len(got), rel=1e-9)
        assert want["metrics"][f"ndcg@{kk}"] == pytest.approx(sum(ndcg) / len(got), rel=1e-9)
    # the sampled protocol through `score`: the held-out item against the same 100 items
    cand = torch.cat([torch.from_numpy(targets).view(-1, 1), torch.from_numpy(negatives + 1)], 1)
    s = model.score(histories, cand)
    ranks = ranks_among(s[:, 0], cand[:, 0], s[:, 1:], cand[:, 1:])
    assert torch.equal(ranks, want["sampled"])
