"""Host-memory tables behind a device cache (sharding=host) vs all-on-device vs naive CPU tables.

    # issue 8, same-size comparison (Kaggle fits on the GPU): host with a 5% cache vs all on GPU
    python -m benchmarks.host_cache --device cuda --model dlrm_kaggle --batch-size 65536 \
        --cache-fraction 0.05 --out benchmarks/results/host_cache_kaggle_h100.md
    # issue 8, the big model: 1TB cardinalities (187.8M rows x 128, ~96 GB fp32) in host memory,
    # at most 16 GiB of GPU memory for embeddings (caches + state + buffers): host RAM ~89 GiB
    # with row-wise Adagrad, so it fits a 125 GB machine with little to spare
    python -m benchmarks.host_cache --device cuda --model dlrm_1tb --batch-size 65536 \
        --cache-gb 12 --hbm-gb 16 --no-device-baseline \
        --out benchmarks/results/host_cache_1tb_h100.md
    # smoke test on CPU
    python -m benchmarks.host_cache --device cpu --model dlrm_tiny --batch-size 4096 --steps 5

Rows, each timed over the same stream of synthetic batches: a new batch every step (made up
front in host memory, copied to the device one step ahead as the trainer does), so the cache
never meets a batch twice; `--batches N` cycles N instead, which overstates the hit rate once
the cache holds them all (benchmarks/cache_policy.py measures by how much). The warmup (200
steps by default) lets the cache settle before the timed steps; caches first warm-start from
the data's id counts as in training (`--cold`: start empty):
- hybridrec all on the device (sharding=none), when the model fits;
- hybridrec with every table in host memory (sharding=host), per sparse optimizer, with the
  next batch prefetched during each step's backward as the trainer does; with its cache hit
  rate, rows moved per step, copy bandwidth and time waiting on host memory (`--no-prefetch`
  adds rows without prefetch, `--inline-prefetch` rows whose prefetch admits on the main
  thread, only moving rows on the group's background thread);
- naive: one nn.EmbeddingBag(sparse=True) per table on the CPU with torch SparseAdam, dense
  part on the device (what a PyTorch user does when tables do not fit): few steps, it is slow.
Prints samples/s and the ratio to the all-on-device row (or to the first host row), two ways,
over the same steps: waited, each step timed alone with a sync after it (the median and the
mean), and `pipelined`, steps run as the trainer runs them (no wait between steps, so the
host queues the next step's work while the device runs this one's): total time / steps, the
throughput training gets. The two alternate in blocks of `--block` steps, so both meet the
same stretch of the cache's life: an eviction writes back the dirty rows of 1/64 of the cache
at once, which on the 1TB model comes every ~12 steps, and a median leaves such steps out
(so compare pipelined with the waited mean; docs/host-cache.md, Measuring).
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from benchmarks.baseline import PlainDLRM
from benchmarks.common import (
    command_line,
    compose_config,
    hardware,
    markdown_table,
    median,
    peak_memory,
    reset_device,
    sync,
    time_steps,
)
from hybridrec.config import Config
from hybridrec.data import build_source
from hybridrec.distributed import init_distributed
from hybridrec.model import bce_loss
from hybridrec.optim import build_dense_optimizer
from hybridrec.sparse.host import CacheStats, HostCachedEmbedding
from hybridrec.train.trainer import Trainer
from hybridrec.types import Batch

SPARSE_LR = {"sgd": 0.05, "rowwise_adagrad": 0.05, "adam": 0.001, "adagrad": 0.05}


def make_cfg(
    args: argparse.Namespace, sparse: str, sharding: str, host_copy: str = "auto"
) -> Config:
    overrides = [
        f"sharding.host_copy={host_copy}",
        f"model={args.model}",
        f"sharding={sharding}",
        f"sharding.hbm_gb={args.hbm_gb}",
        f"sharding.cache_fraction={args.cache_fraction}",
        f"train.batch_size={args.batch_size}",
        f"optim.sparse.name={sparse}",
        f"optim.sparse.lr={SPARSE_LR[sparse]}",
        f"train.compile={args.compile}",
        "train.check_ids=false",
        f"device={args.device}",
    ]
    if args.cache_gb is not None:
        overrides.append(f"sharding.cache_gb={args.cache_gb}")
    return compose_config(overrides)


def _embedding_gib(emb: torch.nn.Module) -> str:
    """Device memory the embedding side holds: tables or cache rows, optimizer state, slot
    maps and use counts (the issue's budget: at most 16 GB for the 1TB model). Host tables are
    plain attributes, not buffers, so they are not counted."""
    return f"{sum(b.numel() * b.element_size() for b in emb.buffers()) / 2**30:.2f}"


class BatchStream:
    """Batch i of the run: made up front on the host (pinned on CUDA), copied to the device
    one step ahead and dropped after use. `distinct` > 0 cycles that many batches."""

    def __init__(self, source, args, device: torch.device, total: int) -> None:  # noqa: ANN001
        n = args.batches or total
        pin = device.type == "cuda"
        self.host = [source.batch(s, args.batch_size) for s in range(n)]
        if pin:
            self.host = [b.pin_memory() for b in self.host]
        self.device = device
        self._on_device: dict[int, Batch] = {}

    def __call__(self, i: int) -> Batch:
        """Batch i on the device (and batch i + 1 started on its way)."""
        for j in (i, i + 1):
            if j not in self._on_device:
                b = self.host[j % len(self.host)]
                self._on_device[j] = b.to(self.device, non_blocking=True)
        for j in [j for j in self._on_device if j < i]:
            del self._on_device[j]
        return self._on_device[i]

    def on_host(self, i: int) -> Batch:
        return self.host[i % len(self.host)]


def run_hybridrec(cfg: Config, env, stream: BatchStream, args, prefetch: bool) -> dict:  # noqa: ANN001
    reset_device(env.device)
    trainer = Trainer(cfg, env)
    emb = trainer.embeddings[0]
    cached = emb.prefetches  # host-resident tables
    if cached and not args.cold:
        trainer.warm_start_caches()  # as training does: the data's hottest rows first
    groups = emb.host_groups() if cached else []
    pipe = trainer.pipeline(stream(i) for i in itertools.count())

    def step(wait: bool) -> None:
        trainer.train_step(pipe.next(), pipe if prefetch else None)
        if wait:
            sync(env.device)

    def evictions() -> int:
        return sum(g.evictions for g in groups)

    for _ in range(args.warmup):
        step(True)
    if cached:
        emb.cache_stats()  # count the timed steps only (waits for the prefetch in flight)
    # Both ways, in alternating blocks of args.block steps, so that they meet the same
    # stretch of the cache's life: an eviction frees 1/64 of the cache and writes back its
    # dirty rows at once, every step on Kaggle but every ~12 on the 1TB model, and write-backs
    # start late (docs/host-cache.md, Measuring). waited: each step timed alone, a sync after
    # it; pipelined: as training runs, no sync between steps (the host queues the next step's
    # work while the device runs this one's), timed per block.
    waited: list[float] = []
    pipelined = 0.0
    stats = {"waited": CacheStats(), "pipelined": CacheStats()}
    selections = {"waited": 0, "pipelined": 0}
    done = {"waited": 0, "pipelined": 0}
    while min(done.values()) < args.steps:
        for way in ("waited", "pipelined"):
            n = min(args.block, args.steps - done[way])
            before = evictions()
            sync(env.device)
            if way == "waited":
                for _ in range(n):
                    start = time.perf_counter()
                    step(True)
                    waited.append(time.perf_counter() - start)
            elif n:
                start = time.perf_counter()
                for _ in range(n):
                    step(False)
                sync(env.device)
                pipelined += time.perf_counter() - start
            if cached:  # after the timed region: it waits for the prefetch in flight
                stats[way].add(emb.cache_stats())
                selections[way] += evictions() - before
            done[way] += n
    out = {
        "ms": 1e3 * median(waited),
        "ms_mean": 1e3 * sum(waited) / len(waited),
        "ms_pipelined": 1e3 * pipelined / args.steps,
        "peak": peak_memory(env.device, 2**30),
        "emb": _embedding_gib(emb),
    }
    if cached:
        total = CacheStats()
        for st in stats.values():
            total.add(st)
        per_way = "; ".join(
            f"{way}: out {st.rows_written / args.steps:,.0f} rows/step, "
            f"{selections[way] / args.steps:.2f} evictions/step, "
            f"wait {1e3 * st.wait_s / args.steps:.2f} ms/step"
            for way, st in stats.items()
        )
        out["cache"] = (
            f"hit {total.hits / max(1, total.rows_requested):.3f}, "
            f"in {total.rows_loaded / (2 * args.steps):,.0f} rows/step, "
            f"{total.bytes_moved / max(total.transfer_s, 1e-9) / 1e9:.1f} GB/s; {per_way}"
        )
    return out


def run_naive(cfg: Config, stream: BatchStream, device: torch.device, args) -> dict:  # noqa: ANN001
    """nn.EmbeddingBag(sparse=True) tables on the CPU + SparseAdam, dense part on `device`."""
    reset_device(device)
    model = PlainDLRM(cfg)
    model.dense.to(device)
    dense_opt = build_dense_optimizer(model.dense.parameters(), cfg.optim.dense, device)
    s = cfg.optim.sparse
    sparse_opt = torch.optim.SparseAdam(list(model.bags.parameters()), lr=s.lr)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(i: int) -> None:
        b = stream(i)
        ids = stream.on_host(i).ids
        pooled = torch.stack(
            [
                bag(ids[:, model.offsets[t] : model.offsets[t + 1]])
                for t, bag in enumerate(model.bags)
            ],
            dim=1,
        )
        dev = pooled.detach().to(device).requires_grad_()
        with autocast:
            logits = model.dense(b.dense, dev).float()
        loss = bce_loss(logits, b.labels)
        dense_opt.zero_grad(set_to_none=True)
        sparse_opt.zero_grad(set_to_none=True)
        loss.backward()
        pooled.backward(dev.grad.cpu())
        dense_opt.step()
        sparse_opt.step()
        sync(device)

    times = time_steps(step, args.naive_steps, 1, before=lambda: sync(device))
    ms = 1e3 * median(times)  # it syncs every step anyway (the gradients go to the CPU)
    mean = 1e3 * sum(times) / len(times)
    return {
        "ms": ms,
        "ms_mean": mean,
        "ms_pipelined": mean,
        "peak": peak_memory(device, 2**30),
        "emb": "0 (CPU)",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--model", default=None, help="default: dlrm_kaggle on CUDA, dlrm_tiny on CPU")
    p.add_argument("--batch-size", type=int, default=None, help="default 65536 CUDA, 4096 CPU")
    p.add_argument("--cache-fraction", type=float, default=0.05)
    p.add_argument("--cache-gb", type=float, default=None, help="overrides --cache-fraction")
    p.add_argument("--hbm-gb", type=float, default=16.0, help="device budget for embeddings")
    p.add_argument("--optimizers", default="sgd,rowwise_adagrad")
    p.add_argument("--steps", type=int, default=20, help="timed steps each way")
    p.add_argument(
        "--block",
        type=int,
        default=10,
        help="the timed steps alternate between waited and pipelined blocks of this many",
    )
    p.add_argument("--warmup", type=int, default=200, help="steps before timing (cache fill)")
    p.add_argument("--batches", type=int, default=0, help="distinct batches, cycled (0: new)")
    p.add_argument("--compile", default="auto", help="train.compile: auto | dense | none")
    p.add_argument("--no-device-baseline", action="store_true", help="skip all-on-device")
    p.add_argument("--cold", action="store_true", help="host caches start empty")
    p.add_argument("--no-prefetch", action="store_true", help="host rows without prefetch too")
    p.add_argument(
        "--inline-prefetch",
        action="store_true",
        help="host rows whose prefetch admits on the main thread (rows still move on the "
        "background thread) too",
    )
    p.add_argument(
        "--host-copy",
        default="auto",
        help="sharding.host_copy per host row, comma-separated: auto,kernel,staged "
        "(kernel,staged compares the UVA kernel with staged copies)",
    )
    p.add_argument("--naive-steps", type=int, default=3, help="0 skips the naive CPU row")
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    env = init_distributed(args.device, force_group=True)  # sharding=host needs a group
    device = env.device
    args.device = device.type
    args.model = args.model or ("dlrm_kaggle" if device.type == "cuda" else "dlrm_tiny")
    args.batch_size = args.batch_size or (65536 if device.type == "cuda" else 4096)
    torch.manual_seed(0)
    optimizers = args.optimizers.split(",")
    base = make_cfg(args, optimizers[0], "host")
    source = build_source(base)
    stream = BatchStream(source, args, device, args.warmup + 2 * args.steps + 1)
    rows: list[list[str]] = []
    ref: list[float] = []

    def add(name: str, res: dict) -> None:
        if not ref:
            ref.extend([res["ms"], res["ms_pipelined"]])
        sps = args.batch_size / (res["ms"] / 1e3)
        ratio = ref[0] / res["ms"]
        sps_p = args.batch_size / (res["ms_pipelined"] / 1e3)
        ratio_p = ref[1] / res["ms_pipelined"]
        cache = res.get("cache", "")
        rows.append(
            [name, f"{res['ms']:.2f}", f"{res['ms_mean']:.2f}", f"{sps:,.0f}", f"{ratio:.2f}"]
            + [f"{res['ms_pipelined']:.2f}", f"{sps_p:,.0f}", f"{ratio_p:.2f}"]
            + [res["peak"], res["emb"], cache]
        )
        print(
            f"{name:44s} {res['ms']:9.2f} ms (mean {res['ms_mean']:.2f}) {sps:14,.0f} samples/s "
            f"x{ratio:.2f}  "
            f"pipelined {res['ms_pipelined']:.2f} ms {sps_p:,.0f} samples/s x{ratio_p:.2f}  "
            f"peak {res['peak']} GiB  embeddings {res['emb']} GiB  {cache}",
            flush=True,
        )
        if args.out:  # after every row: a run cut short still leaves its report
            write_report(args, rows)

    if not args.no_device_baseline:
        for name in optimizers:
            cfg = make_cfg(args, name, "none")
            add(f"all on {device.type}, {name}", run_hybridrec(cfg, env, stream, args, False))
    for name in optimizers:
        for copy in args.host_copy.split(","):
            cfg = make_cfg(args, name, "host", copy)
            label = f"host + cache, {name}" + (f", {copy} copies" if copy != "auto" else "")
            add(label, run_hybridrec(cfg, env, stream, args, True))
            if args.inline_prefetch:
                default, HostCachedEmbedding.background = HostCachedEmbedding.background, False
                try:
                    res = run_hybridrec(cfg, env, stream, args, True)
                finally:
                    HostCachedEmbedding.background = default
                add(f"{label}, prefetch on the main thread", res)
            if args.no_prefetch:
                add(f"{label}, no prefetch", run_hybridrec(cfg, env, stream, args, False))
    if args.naive_steps:
        add("naive CPU EmbeddingBag + SparseAdam", run_naive(base, stream, device, args))
    if args.out:
        print(f"wrote {args.out}")


def write_report(args: argparse.Namespace, rows: list[list[str]]) -> None:
    size = f"cache_gb={args.cache_gb}" if args.cache_gb else f"cache_fraction={args.cache_fraction}"
    stream_kind = (
        f"{args.batches} synthetic batches cycled"
        if args.batches
        else "a new synthetic batch every step"
    )
    headers = ["run", "ms/step", "mean ms/step", "samples/s", "vs first row"]
    headers += ["pipelined ms/step", "pipelined samples/s", "pipelined vs first row"]
    table = markdown_table([*headers, "peak GiB", "embeddings GiB", "cache"], rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        "# Host-memory tables with a device cache\n\n"
        f"Command: `{command_line()}`\n\n- Hardware: {hardware()}\n"
        f"- Model `{args.model}`, global batch {args.batch_size}, {stream_kind}, host caches "
        f"{'started empty' if args.cold else 'warm-started from the id counts'}; "
        f"{size}, hbm_gb={args.hbm_gb}, train.compile={args.compile}.\n"
        f"- {args.steps} steps each way after {args.warmup} warmup steps, in alternating "
        f"blocks of {args.block} (waited, pipelined, waited, ...), so both ways meet the same "
        "stretch of the cache's life. Waited: each step alone, a sync after it; ms/step is "
        "their median, mean ms/step their mean. Pipelined: as training runs, no sync between "
        "steps (the host queues the next step while the device runs this one); total time / "
        "steps, to be read beside the waited mean: an eviction writes back the dirty rows of "
        "1/64 of the cache at once (every step on Kaggle with 5%, every ~12 on the 1TB "
        "model), and a median leaves such steps out.\n"
        "- cache: hit rate and rows loaded over both ways; per way the rows written back, "
        "the evictions (victim selections) and the time lookups waited for host memory, "
        "per step.\n"
        "- peak GiB: the device's peak allocation (dense part and activations included); "
        "embeddings GiB: what the embedding side holds on the device (tables or cache rows, "
        "optimizer state, slot maps).\n\n"
        f"{table}\n"
    )


if __name__ == "__main__":
    main()
