"""SASRec as the paper trains it, in plain PyTorch (one process, nn.Embedding), on a `user item`
dataset with the leave-one-out split: the baseline of issue 39 and the model code of its
tuning runs.

    OMP_NUM_THREADS=1 python -m benchmarks.sasrec_baseline \
        --data ../shared/data/amazon_games.txt --out /tmp/sasrec.json

The model (Kang and McAuley, ICDM 2018, as the public SASRec.pytorch trains it): an item
nn.Embedding shared by the input and the output (score = <hidden, item row>), the library's
SASRec encoder (hybridrec.model.sasrec: learned positions, pre-LN blocks, causal attention,
dropout; positions "from_end", the paper's left-padded layout; `--encoder hstu`: the HSTU
units of hybridrec.model.hstu instead, scores still plain dot products), every >= 2-D parameter
initialised xavier-normal as SASRec.pytorch does. Training: each epoch every user with at
least 2 train events once, in a random order, in batches of `--batch`; a user's input is its
most recent `--max-len` train events before the last and the target at each position the
next event (hybridrec.data.sequences.LeaveOneOut.train_windows); loss `--loss bce`: SASRec's
binary cross-entropy with `--negatives` (default 1) negative per position, drawn uniformly
from the items not in the user's train sequence (as SASRec.pytorch's random_neq); Adam.

`--loss softmax` (the tuning runs; gSASRec, "Turning Dross Into Gold", RecSys 2023, and the
retrieval task's loss): at each position a softmax over the batch's target items plus
`--negatives` uniform items shared by the batch, logQ-corrected, with temperature
`--temperature` (hybridrec.train.next_item.next_item_softmax_loss).

Every `--eval-every` epochs the val split is evaluated (hybridrec.train.next_item_eval: 100
sampled negatives per user with a fixed seed, and with `--full-val` the full catalogue with
the user's input items excluded); the parameters of the best val `--select` are kept,
training stops after `--patience` evaluations without improvement (or at `--epochs`,
`--max-minutes`, or a SIGUSR1: each ends after the current epoch, evaluating val there),
and val and test are evaluated with the kept parameters under both protocols. `--out`
writes every figure as JSON.

Speed on the CPU, without changing what is computed: a batch's rows run through the encoder
in `--groups` groups of similar lengths, each as wide as its longest sequence (most users
have far fewer than max-len events; the loss is the batch's, over the same positions), one
table lookup serves inputs, targets and negatives, and Adam runs fused.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from benchmarks.common import command_line, git_state, hardware
from hybridrec.config.schema import RetrievalConfig
from hybridrec.data.sequences import LeaveOneOut, Sequences, read_user_item
from hybridrec.model.hstu import HSTU
from hybridrec.model.next_item import last_states, sampled_bce_loss
from hybridrec.model.sasrec import SASRec
from hybridrec.train.next_item import next_item_objective, next_item_softmax_loss
from hybridrec.train.next_item_eval import evaluate_next_item, sample_negatives
from hybridrec.train.retrieval import RetrievalObjective

DEFAULT_DATA = Path("../shared/data/amazon_games.txt")  # from the repository root
SELECT = ("sampled_ndcg@10", "sampled_hr@10", "ndcg@10", "hr@10")


class SASRecModel(nn.Module):
    """Item embedding + SASRec encoder; PAD (-1) positions read zero rows."""

    def __init__(self, num_items: int, args: argparse.Namespace) -> None:
        super().__init__()
        self.items = nn.Embedding(num_items, args.dim)
        layers = {"blocks": args.blocks, "heads": args.heads, "dropout": args.dropout}
        self.encoder: nn.Module
        if args.encoder == "sasrec":
            self.encoder = SASRec(args.dim, args.max_len, positions=args.positions, **layers)
        else:  # scores stay plain dot products, as SASRec's
            self.encoder = HSTU(
                args.dim, args.max_len, positions=args.positions, output_norm="none", **layers
            )

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[..., D] item rows of ids (PAD -1: zeros)."""
        return self.items(ids.clamp(min=0)) * (ids >= 0).unsqueeze(-1).float()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, L] (PAD -1) -> hidden [B, L, D]."""
        return self.encoder(self.rows(ids), ids >= 0)

    def user_states(self, ids: torch.Tensor) -> torch.Tensor:
        return last_states(self(ids), ids >= 0)

    def grouped(self, rows: torch.Tensor, mask: torch.Tensor, groups: int) -> torch.Tensor:
        """hidden [B, W, D] of rows [B, L, D] and mask [B, L] (W: the batch's longest
        sequence), computed on `groups` groups of rows of similar lengths, each on its own
        longest width. Equal to encoder(rows, mask)[:, :W]: rows are independent and
        trailing PAD changes nothing (tests/sequence/test_encoders.py), so this only skips
        the PAD positions' work."""
        lengths = mask.sum(1)
        width = int(lengths.max())
        order = torch.argsort(lengths, stable=True)
        parts = []
        for part in order.chunk(groups):
            w = max(int(lengths[part].max()), 1)
            hidden = self.encoder(rows[part, :w], mask[part, :w])
            parts.append(nn.functional.pad(hidden, (0, 0, 0, width - w)))
        return torch.cat(parts)[torch.argsort(order)]


def xavier_init(model: nn.Module) -> None:
    """SASRec.pytorch's initialisation: xavier-normal for every parameter of 2 or more dims."""
    for p in model.parameters():
        if p.dim() >= 2:
            nn.init.xavier_normal_(p)


def avoiding_negatives(
    windows: np.ndarray, train_sets: np.ndarray, num_items: int, n: int, rng: np.random.Generator
) -> np.ndarray:
    """[B, L, n] item rows uniform over the items outside each row's user's train items
    (train_sets: sorted codes row * num_items + item of this batch's rows), redrawn until
    outside."""
    b, length = windows.shape[0], windows.shape[1] - 1
    neg = rng.integers(0, num_items, size=(b, length, n))
    rows = np.broadcast_to(np.arange(b)[:, None, None], neg.shape)
    bad = np.isin(rows * num_items + neg, train_sets)
    while bad.any():
        neg[bad] = rng.integers(0, num_items, size=int(bad.sum()))
        bad = np.isin(rows * num_items + neg, train_sets)
    return neg


def train_codes(split: LeaveOneOut, users: np.ndarray) -> np.ndarray:
    """Sorted codes q * num_items + item of the train items of `users` (q: their index)."""
    seqs = split.seqs
    starts, ends = seqs.offsets[users], split.train_ends[users]
    counts = ends - starts
    q = np.repeat(np.arange(len(users)), counts)
    at = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.unique(q * seqs.num_items + seqs.items[np.repeat(starts, counts) + at])


def train_epoch(
    model: SASRecModel,
    opt: torch.optim.Optimizer,
    split: LeaveOneOut,
    windows: np.ndarray,
    users: np.ndarray,
    args: argparse.Namespace,
    rng: np.random.Generator,
    softmax: RetrievalObjective | None,
    step: int,
) -> tuple[float, int]:
    """One epoch over the train windows in a random order, after `step` steps; returns the
    mean loss and the steps taken."""
    model.train()
    order = rng.permutation(len(windows))
    total, batches = 0.0, 0
    num_items = split.seqs.num_items
    for a in range(0, len(order), args.batch):
        pick = order[a : a + args.batch]
        ids = torch.from_numpy(windows[pick])
        width = int((ids[:, :-1] >= 0).sum(1).max())  # past every input: nothing trains
        inputs, targets = ids[:, :width], ids[:, 1 : width + 1]
        mask = (inputs >= 0) & (targets >= 0)
        if softmax is None:
            neg = avoiding_negatives(
                windows[pick, : width + 1],
                train_codes(split, users[pick]),
                num_items,
                args.negatives,
                rng,
            )
            # one lookup for inputs, targets and negatives: one gradient of the table
            rows = model.rows(torch.cat([inputs, targets, torch.from_numpy(neg).flatten(1)], 1))
            hidden = model.grouped(rows[:, :width], inputs >= 0, args.groups)
            b, n = len(pick), args.negatives
            negatives = rows[:, 2 * width :].view(b, width, n, -1)
            loss = sampled_bce_loss(hidden, rows[:, width : 2 * width], negatives, mask)
        else:
            hidden = model.grouped(model.rows(inputs), inputs >= 0, args.groups)
            neg_ids = softmax.negatives(step + batches + 1)
            loss = next_item_softmax_loss(
                hidden,
                model.rows(targets),
                targets,
                mask,
                None if neg_ids is None else model.rows(neg_ids),
                neg_ids,
                log_q=softmax.log_q,
                temperature=args.temperature,
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.item()
        batches += 1
    return total / max(batches, 1), batches


def evaluate(
    model: SASRecModel,
    split: LeaveOneOut,
    name: str,
    args: argparse.Namespace,
    negatives: dict,
    full: bool = True,
) -> dict[str, float]:
    """Split `name`'s metrics: sampled, and with `full` the full catalogue's."""
    model.eval()
    ev = split.eval_split(name, args.max_len)
    if "users" not in negatives:  # val and test rank against the same draws (one per user)
        negatives["users"] = sample_negatives(split.seqs, ev.users, seed=args.eval_seed)
    ks = (10, 50) if full else ()
    return evaluate_next_item(
        model.user_states, model.items.weight.detach(), ev, split.seqs, negatives["users"], ks
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="`user item` file")
    p.add_argument("--max-len", type=int, default=50, help="most recent events kept (50)")
    p.add_argument("--dim", type=int, default=50, help="item and hidden width (50)")
    p.add_argument("--blocks", type=int, default=2, help="attention blocks (2)")
    p.add_argument("--heads", type=int, default=1, help="attention heads (1)")
    p.add_argument("--dropout", type=float, default=0.5, help="dropout rate (0.5)")
    p.add_argument(
        "--encoder", choices=("sasrec", "hstu"), default="sasrec", help="block stack (sasrec)"
    )
    p.add_argument(
        "--positions", choices=("from_end", "from_start"), default="from_end", help="(from_end)"
    )
    p.add_argument("--lr", type=float, default=0.001, help="Adam learning rate (0.001)")
    p.add_argument("--beta2", type=float, default=0.98, help="Adam beta2 (0.98; beta1 0.9)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="Adam L2 (0)")
    p.add_argument("--batch", type=int, default=128, help="users per batch (128)")
    p.add_argument("--epochs", type=int, default=200, help="at most this many epochs (200)")
    p.add_argument("--eval-every", type=int, default=5, help="val evaluation period (5)")
    p.add_argument(
        "--patience", type=int, default=6, help="val evaluations without improvement (6)"
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="end training after the first epoch past this wall time, evaluating val\n"
        "there (kill -USR1 the process does the same at once)",
    )
    p.add_argument("--select", choices=SELECT, default="sampled_ndcg@10", help="val metric")
    p.add_argument(
        "--full-val", action="store_true", help="rank the full catalogue at every val evaluation"
    )
    p.add_argument("--loss", choices=("bce", "softmax"), default="bce", help="(bce)")
    p.add_argument(
        "--negatives", type=int, default=None, help="per position (bce, 1) or per batch (softmax)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (1)")
    p.add_argument("--no-logq", action="store_true", help="softmax without logQ correction")
    p.add_argument("--seed", type=int, default=0, help="model, order and negatives seed (0)")
    p.add_argument("--eval-seed", type=int, default=0, help="sampled protocol's seed (0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument(
        "--groups",
        type=int,
        default=4,
        help="a batch's rows run in this many groups of similar lengths (4; the same\n"
        "loss and gradients as one group, less work on PAD positions)",
    )
    p.add_argument("--out", type=Path, default=None, help="write every figure here (JSON)")
    args = p.parse_args(argv)
    if not args.select.startswith("sampled_") and not args.full_val:
        p.error(
            f"--select {args.select} ranks the full catalogue at every evaluation: add --full-val"
        )
    if args.negatives is None:
        args.negatives = 1 if args.loss == "bce" else 256
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    seqs: Sequences = read_user_item(args.data)
    split = LeaveOneOut(seqs)
    windows, users = split.train_windows(args.max_len), split.train_users()
    print(
        f"{args.data.name}: {len(seqs)} users, {seqs.num_items} items, {len(seqs.items)} "
        f"events; {len(windows)} train users, {len(split.evaluated)} evaluated",
        flush=True,
    )
    model = SASRecModel(seqs.num_items, args)
    xavier_init(model)
    opt = torch.optim.Adam(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, args.beta2),
        weight_decay=args.weight_decay,
        fused=True,  # the same maths as the default loop, in one kernel per step
    )
    softmax = None
    if args.loss == "softmax":
        cfg = RetrievalConfig(args.temperature, not args.no_logq, args.negatives, True)
        softmax = next_item_objective(
            cfg, None, windows, seqs.num_items, args.batch, args.seed, torch.device("cpu")
        )
    negatives: dict = {}
    history, best, best_state, best_epoch, waited, step = [], -math.inf, None, 0, 0, 0
    stop: list[str] = []  # why training ended early, if it did
    signal.signal(signal.SIGUSR1, lambda *_: stop.append("SIGUSR1"))
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        loss, steps = train_epoch(model, opt, split, windows, users, args, rng, softmax, step)
        step += steps
        row = {"epoch": epoch, "loss": loss, "train_s": time.perf_counter() - t0}
        if args.max_minutes and time.perf_counter() - start > 60 * args.max_minutes:
            stop.append(f"--max-minutes {args.max_minutes}")
        if epoch % args.eval_every == 0 or epoch == args.epochs or stop:
            val = evaluate(model, split, "val", args, negatives, args.full_val)
            row.update({f"val_{k}": v for k, v in val.items()})
            if val[args.select] > best:
                best, best_epoch, waited = val[args.select], epoch, 0
                best_state = copy.deepcopy(model.state_dict())
            else:
                waited += 1
            shown = ", ".join(f"{k} {v:.4f}" for k, v in val.items() if "@" in k)
            took = time.perf_counter() - start
            print(f"epoch {epoch}: loss {loss:.4f}, val {shown} ({took:.0f} s)", flush=True)
        history.append(row)
        if waited >= args.patience or stop:
            break
    assert best_state is not None
    model.load_state_dict(best_state)
    val = evaluate(model, split, "val", args, negatives)
    test = evaluate(model, split, "test", args, negatives)
    result = {
        "command": command_line(),
        "git": git_state(),
        "hardware": hardware(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "best_epoch": best_epoch,
        "stopped_by": stop[0] if stop else ("patience" if waited >= args.patience else "epochs"),
        "epochs_run": history[-1]["epoch"],
        "seconds": time.perf_counter() - start,
        "val": val,
        "test": test,
        "history": history,
    }
    print(f"best epoch {best_epoch} on val {args.select}")
    for name, m in (("val", val), ("test", test)):
        print(
            f"{name}: sampled HR@10 {m['sampled_hr@10']:.4f} NDCG@10 {m['sampled_ndcg@10']:.4f}"
            f" | full HR@10 {m['hr@10']:.4f} NDCG@10 {m['ndcg@10']:.4f} HR@50 {m['hr@50']:.4f}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
