"""Data-loading benchmark on CPU/gloo: batches/s of the rank-0 broadcast loader vs per-rank
reading, next to the training step rate they feed.

Data: fake raw Criteo rows (hybridrec.data.fake, `--rows`), preprocessed by the real pipeline
(hash encoding, `--cap` rows per table, 90% train, blocks of `--block-rows`) into a temp dir,
or an existing dataset with `--data DIR` (then `--cap` must be its largest cardinality).

1. One process: the memmap reader and, where NVIDIA DALI is installed, the DALI reader (on
   the CPU here), reading whole global batches of the shuffled train split.
2. W gloo processes (one torch thread each, tests/distributed/harness.py), per global batch:
   - loaders alone: `per_rank` (every rank reads its B/W rows), `broadcast` (rank 0 reads B
     rows and broadcasts them; prefetch off, then on);
   - training (`Trainer.train_step` on a DLRM whose 26 tables match the dataset, table-wise
     sharding): steps/s fed by each loader, and with no loading at all (the same batch every
     step) as the ceiling.
   Every rate is global batches per second over `--steps` steps after `--warmup`, between two
   barriers (so the slowest rank sets it).

3. With `--rss-days N`: N fake day files of `--rss-rows` rows each (about 240 bytes a row, so
   the default 4 x 4.2M rows is 3.8 GB) are written to a temp dir (never the repo), and
   `hybridrec-preprocess` runs on them with 2 workers, once per encoding, while a sampler
   reads /proc every 0.1 s: peak RSS summed over the whole process tree and of the largest
   process. Then again on half the files, to show the peak does not grow with the input.

    python -m benchmarks.data_loader --rss-days 4 --out benchmarks/results/data_loader.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import (
    command_line,
    compose_config,
    cpu_seconds,
    git_state,
    hardware,
    load_average,
    markdown_table,
)
from hybridrec.config import Config
from hybridrec.data import open_dataset
from hybridrec.data.broadcast import BroadcastLoader
from hybridrec.data.fake import write_fake_day
from hybridrec.data.loader import SliceLoader
from hybridrec.data.preprocess import PreprocessOptions, preprocess
from hybridrec.data.readers import dali_available
from hybridrec.data.source import BinarySource
from hybridrec.distributed import DistEnv
from hybridrec.train.trainer import Trainer
from tests.distributed.harness import spawn

ROOT = Path(__file__).resolve().parents[1]  # on the preprocessing child's PYTHONPATH


def make_cfg(data: str, cards: list[int], batch: int, world: int, loader: str) -> Config:
    overrides = [
        "data=criteo",
        f"data.path={data}",
        f"data.loader={loader}",
        "data.verify=size",
        "model=criteo_sample",
        "model.name=bench",
        f"model.num_embeddings_per_feature=[{','.join(map(str, cards))}]",
        "sharding=table_wise",
        f"train.batch_size={batch}",
        f"eval.batch_size={batch}",
        "optim.sparse.name=sgd",
        "device=cpu",
    ]
    return compose_config(overrides, world_size=world)


def _rate(env: DistEnv, fn, steps: int, warmup: int) -> float:  # noqa: ANN001
    for _ in range(warmup):
        fn()
    dist.barrier(env.group)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    dist.barrier(env.group)
    return steps / (time.perf_counter() - t0)


def run_rank(env: DistEnv, data: str, cards: list[int], batches: list[int], a: dict) -> dict:
    steps, warmup = a["steps"], a["warmup"]
    src = BinarySource(open_dataset(data), seed=0)
    out: dict = {}
    for b in batches:
        r: dict = {}
        for name, make in (
            ("per_rank", lambda b=b: SliceLoader(src, env.rank, env.world_size, b, prefetch=0)),
            (
                "broadcast",
                lambda b=b: BroadcastLoader(
                    src, env.rank, env.world_size, b, group=env.group, prefetch=0
                ),
            ),
            (
                "broadcast_prefetch",
                lambda b=b: BroadcastLoader(
                    src, env.rank, env.world_size, b, group=env.group, prefetch=2
                ),
            ),
        ):
            loader = make()
            r[name] = _rate(env, lambda loader=loader: next(loader), steps, warmup)
            loader.close()
        for loader_name in ("per_rank", "broadcast"):
            trainer = Trainer(make_cfg(data, cards, b, env.world_size, loader_name), env)
            loader = trainer.loader("train")
            r["train_" + loader_name] = _rate(
                env, lambda t=trainer, ld=loader: t.train_step(next(ld)), steps, warmup
            )
            loader.close()
        fixed = trainer.train_batch(0)
        step = lambda t=trainer, f=fixed: t.train_step(f)  # noqa: E731
        r["train_no_loading"] = _rate(env, step, steps, warmup)
        out[b] = r
    return out


def single_process(data: str, batches: list[int], steps: int) -> dict:
    out: dict = {}
    ok, why = dali_available()
    readers = ["memmap"] + (["dali"] if ok else [])
    for reader in readers:
        src = BinarySource(open_dataset(data), reader=reader, seed=0)
        for b in batches:
            src.batch(0, b)
            t0 = time.perf_counter()
            for s in range(1, steps + 1):
                src.batch(s, b)
            out[(reader, b)] = steps / (time.perf_counter() - t0)
        src.close()
    return {"rates": out, "dali": why if not ok else f"DALI {why}"}


def _tree_rss_kb(root: int) -> tuple[int, int]:
    """(sum, max) of VmRSS in KiB over `root` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total = largest = 0
    stack = [root]
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        kb = int(line.split()[1])
                        total, largest = total + kb, max(largest, kb)
        except OSError:
            pass
    return total, largest


def measure_preprocess(files: list[Path], out: Path, encoding: str) -> dict:
    """Run hybridrec-preprocess on `files` (2 workers) and sample its peak RSS."""
    cmd = [sys.executable, "-m", "hybridrec.data.preprocess_cli", "--input", *map(str, files)]
    cmd += ["--output", str(out), "--workers", "2", "--no-progress", "--encoding", encoding]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak_total = peak_one = 0
    while proc.poll() is None:
        total, one = _tree_rss_kb(proc.pid)
        peak_total, peak_one = max(peak_total, total), max(peak_one, one)
        time.sleep(0.1)
    output = proc.stdout.read().decode() if proc.stdout else ""
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{output}")
    rows = open_dataset(out).num_rows
    shutil.rmtree(out)
    return {
        "gb": sum(f.stat().st_size for f in files) / 1e9,
        "rows": rows,
        "encoding": encoding,
        "seconds": time.perf_counter() - t0,
        "peak_total_mib": peak_total / 1024,
        "peak_one_mib": peak_one / 1024,
        "command": "hybridrec-preprocess " + " ".join(cmd[3:]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=300_000, help="fake raw rows to preprocess")
    p.add_argument("--cap", type=int, default=50_000, help="hash cap: rows per table")
    p.add_argument("--block-rows", type=int, default=4096)
    p.add_argument("--data", default=None, help="an existing preprocessed dataset instead")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch-sizes", default="4096,16384")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rss-days", type=int, default=0, help="preprocess-memory files (0 = skip)")
    p.add_argument("--rss-rows", type=int, default=4_200_000, help="rows per day file")
    p.add_argument("--rss-encodings", default="hash,vocab")
    p.add_argument("--tmp", default=None, help="where the big files go (default: system temp)")
    p.add_argument("--out", default=None, help="write the markdown report here")
    a = p.parse_args()
    batches = [int(x) for x in a.batch_sizes.split(",")]
    load_before, (host0, own0), t_start = load_average(), cpu_seconds(), time.perf_counter()
    tmp = tempfile.TemporaryDirectory(dir=a.tmp)
    data = a.data
    if data is None:
        raw = write_fake_day(Path(tmp.name) / "day_0", a.rows, seed=0)
        data = str(Path(tmp.name) / "bin")
        options = PreprocessOptions(
            hash_cap=a.cap, split="rows", train_fraction=0.9, block_rows=a.block_rows
        )
        preprocess([raw], data, options, workers=1, progress=False)
    ds = open_dataset(data)
    cards = ds.manifest.cardinalities
    torch.set_num_threads(1)
    memory = []
    if a.rss_days:
        big = Path(tmp.name) / "big"
        big.mkdir()
        days = [
            write_fake_day(big / f"day_{d}", a.rss_rows, seed=100 + d) for d in range(a.rss_days)
        ]
        half = days[: max(2, a.rss_days // 2)]
        for enc in a.rss_encodings.split(","):
            memory.append(measure_preprocess(days, Path(tmp.name) / "rss_out", enc))
        if len(half) < len(days):
            memory.append(measure_preprocess(half, Path(tmp.name) / "rss_out", "hash"))
        shutil.rmtree(big)
    single = single_process(data, batches, a.steps)
    ranks = spawn(a.world, run_rank, data, cards, batches, vars(a), timeout=1800)
    res = ranks[0]
    host1, own1 = cpu_seconds()
    elapsed = time.perf_counter() - t_start
    others = max(0.0, (host1 - host0) - (own1 - own0))

    rows = []
    for b in batches:
        r = res[b]
        rows.append(
            [
                f"{b:,}",
                f"{r['per_rank']:.1f}",
                f"{r['broadcast']:.1f}",
                f"{r['broadcast_prefetch']:.1f}",
                f"{r['train_per_rank']:.2f}",
                f"{r['train_broadcast']:.2f}",
                f"{r['train_no_loading']:.2f}",
            ]
        )
    table = markdown_table(
        [
            "global batch",
            "per_rank loader",
            "broadcast loader",
            "broadcast + prefetch",
            "train, per_rank",
            "train, broadcast",
            "train, no loading",
        ],
        rows,
    )
    single_rows = [
        [reader, f"{b:,}", f"{rate:.1f}", f"{rate * b / 1e6:.2f}"]
        for (reader, b), rate in single["rates"].items()
    ]
    single_table = markdown_table(
        ["reader", "global batch", "batches/s", "M samples/s"], single_rows
    )
    m = ds.manifest
    memory_md = ""
    if memory:
        mem_rows = [
            [
                f"{r['gb']:.2f} GB, {r['rows']:,} rows",
                r["encoding"],
                f"{r['seconds']:.0f}",
                f"{r['rows'] / r['seconds'] / 1e3:.0f}k",
                f"{r['peak_total_mib']:.0f}",
                f"{r['peak_one_mib']:.0f}",
            ]
            for r in memory
        ]
        memory_md = (
            "\n## Preprocessing memory (hybridrec-preprocess, 2 workers)\n\n"
            + markdown_table(
                [
                    "input (fake raw TSV)",
                    "encoding",
                    "wall s",
                    "rows/s",
                    "peak RSS, all processes (MiB)",
                    "peak RSS, largest process (MiB)",
                ],
                mem_rows,
            )
            + "\n\nCommands (inputs: fake day files in a temp dir):\n\n```bash\n"
            + "\n".join(r["command"] for r in memory)
            + "\n```\n"
        )
    report = f"""# Data-loading benchmark on CPU/gloo

Command (from the repository root):

```bash
{command_line()}
```

- Hardware: {hardware()}.
- Code: git {git_state()}.
- Host load: other processes used {others:.0f} CPU-seconds during the {elapsed:.0f} s run;
  load average (1, 5, 15 min) {load_before} before, {load_average()} after (this run included).
- Data: {m.num_rows:,} rows ({
        "fake raw rows through hybridrec-preprocess" if a.data is None else a.data
    }), train split {m.splits["train"][1] - m.splits["train"][0]:,} rows, blocks of
  {m.block_rows} rows, block-shuffled; 26 tables of {max(cards):,} rows, dim 16 (model
  `criteo_sample`'s MLPs), table-wise sharding, SGD. {single["dali"]}.
- {a.world} gloo ranks, one torch thread each; rates in global batches per second over
  {a.steps} steps after {a.warmup} warmup steps, between barriers (the slowest rank).

## Loaders and training steps ({a.world} ranks)

{table}

## Readers alone (one process)

{single_table}
{memory_md}"""
    print(report)
    if a.out:
        Path(a.out).write_text(report)
    tmp.cleanup()


if __name__ == "__main__":
    main()
