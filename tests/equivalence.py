"""What the equivalence suites share: the models they train, how a run is collected, and the
comparison with the single-process reference (float32 round-off: rtol 1e-4, atol 1e-5).

`make_cfg` is the suites' DLRM (5 tables of 3 to 20,000 rows, multi-hot); `jagged_cfg` a model
with list features, mixed widths and a shared table; `host_cfg` host-memory tables whose caches
evict. `train_and_collect` / `collect` train a few steps and snapshot every shard, optimizer
state and dense weight; `assemble` rebuilds whole tables from every rank's shards; `compare`
holds a sharded run to the reference. A plain module (not a test file) so that the suites and
multi-process workers import it, and test modules never import each other.
"""

from __future__ import annotations

import functools

import torch

from hybridrec.builder import model_features
from hybridrec.config import Config
from hybridrec.distributed import DistEnv, init_distributed
from hybridrec.train.checkpoint.format import dense_state
from hybridrec.train.trainer import Trainer
from hybridrec.types import storage_tables
from tests.configs import make_config

MODES = ["table_wise", "column_wise", "row_wise", "data_parallel", "auto"]


OPTIMIZERS = {"sgd": 0.5, "rowwise_adagrad": 0.1, "adam": 0.01, "adagrad": 0.1}


STEPS = 4


BATCH = 48  # divisible by 1, 2, 3, 4


def make_cfg(mode: str, sparse: str, world: int, pooling: str = "sum", *extra: str) -> Config:
    rows = [3, 40, 700, 5000, 20000]
    # auto on 2+ ranks: a budget of 80% of what the 20,000-row table needs whole (weights and
    # optimizer state) forces the planner to split it; every other mode gets plenty.
    state = {"sgd": 1.0, "rowwise_adagrad": 1.125, "adam": 3.0, "adagrad": 2.0}[sparse]
    budget = 0.8 * rows[-1] * 8 * 4 * state if mode == "auto" and world > 1 else 1 << 30
    overrides = [
        f"sharding={mode}" if mode != "none" else "sharding=none",
        "model.embedding_dim=8",
        "model.bottom_mlp=[16,8]",
        "model.top_mlp=[16,1]",
        f"model.num_embeddings_per_feature={rows}".replace(" ", ""),
        "model.hotness=[1,2,1,3,1]",
        f"model.pooling={pooling}",
        f"optim.sparse.name={sparse}",
        f"optim.sparse.lr={OPTIMIZERS[sparse]}",
        "optim.dense.name=sgd",
        "optim.dense.lr=0.1",
        f"train.batch_size={BATCH}",
        "eval.batch_size=48",
        "device=cpu",
        "seed=7",
        "sharding.data_parallel_max_bytes=2048",  # auto replicates tables <= 2 KiB
        f"sharding.hbm_gb={budget / 2**30}",
        *extra,
    ]
    return make_config(*overrides, world_size=world)


def train_and_collect(env: DistEnv, cfg: Config) -> dict:
    """K steps; returns logits of step 1, per-step global losses, shards and dense weights."""
    trainer = Trainer(cfg, env)
    batch0 = trainer.train_batch(0)
    with torch.no_grad():
        logits = trainer.model(batch0.dense, batch0.ids)
    losses = [trainer.global_mean(trainer.train_step(trainer.train_batch(s))) for s in range(STEPS)]
    return {"logits": logits, "losses": losses, **snapshot(trainer)}


def snapshot(trainer: Trainer) -> dict:
    """Copies of this rank's shards (spec, weight, state) and dense weights, and the plan."""
    shards = [
        (spec, w.clone(), {k: v.clone() for k, v in st.items()})
        for m in trainer.embeddings
        for spec, w, st in m.shard_views()
    ]
    dense = {k: v.detach().clone() for k, v in dense_state(trainer.model).items()}
    return {"shards": shards, "dense": dense, "plan": trainer.plan}


def run_all(env: DistEnv, configs: list[tuple[str, Config]]) -> dict:
    return {name: train_and_collect(env, cfg) for name, cfg in configs}


def assemble(cfg: Config, results: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Full tables (weight and state) rebuilt from every rank's shards; replicas must agree."""
    tables = {t.name: t for t in storage_tables(model_features(cfg))}
    full: dict[str, dict[str, torch.Tensor]] = {}
    seen: dict[str, torch.Tensor] = {}
    for res in results:
        for spec, w, state in res["shards"]:
            t = tables[spec.table]
            entry = full.setdefault(
                t.name, {"weight": torch.full((t.num_rows, t.dim), float("nan"))}
            )
            region = (slice(spec.row_start, spec.row_end), slice(spec.col_start, spec.col_end))
            key = f"{t.name}{region}"
            if key in seen:  # a replica: must equal the other ranks' copy exactly
                torch.testing.assert_close(w, seen[key], rtol=0, atol=0)
            seen[key] = w
            entry["weight"][region] = w
            for name, s in state.items():
                # row-wise state [rows]: one value per row, the same in every column slice;
                # element-wise state [rows, cols], [rows, 1] for a width-1 shard
                if s.dim() == 1:
                    buf = entry.setdefault(name, torch.full((t.num_rows,), float("nan")))
                    buf[spec.row_start : spec.row_end] = s
                else:
                    buf = entry.setdefault(name, torch.full((t.num_rows, t.dim), float("nan")))
                    buf[region] = s
    return full


def reference(cfg: Config) -> dict:
    torch.set_num_threads(1)
    return train_and_collect(init_distributed("cpu"), cfg)


def compare(ref: dict, results: list[dict], cfg: Config, label: str) -> None:
    tol = {"rtol": 1e-4, "atol": 1e-5}
    world = len(results)
    logits = torch.cat([r["logits"] for r in results])
    torch.testing.assert_close(logits, ref["logits"], **tol, msg=lambda m: f"{label} logits: {m}")
    torch.testing.assert_close(
        torch.tensor(results[0]["losses"]),
        torch.tensor(ref["losses"]),
        **tol,
        msg=lambda m: f"{label} losses: {m}",
    )
    got, want = assemble(cfg, results), assemble(cfg, [ref])
    for table, entries in want.items():
        for name, value in entries.items():
            assert not got[table][name].isnan().any(), f"{label}: {table}.{name} not fully covered"
            torch.testing.assert_close(
                got[table][name],
                value,
                **tol,
                msg=lambda m, t=table, n=name: f"{label} {t}.{n}: {m}",
            )
    for r in range(world):
        for k, v in ref["dense"].items():
            torch.testing.assert_close(
                results[r]["dense"][k],
                v,
                **tol,
                msg=lambda m, r=r, k=k: f"{label} rank {r} dense {k}: {m}",
            )


def dcnv2(cfg: Config) -> Config:
    cfg.model.arch, cfg.model.dcn_layers, cfg.model.dcn_rank = "dcnv2", 2, 4
    return cfg


def bf16_tables(cfg: Config) -> Config:
    cfg.model.table_dtype = "bf16"
    return cfg


VARIANTS = {"": lambda cfg: cfg, "dcnv2": dcnv2, "bf16": bf16_tables}


@functools.cache
def cached_reference(sparse: str, pooling: str = "sum", variant: str = "", initial=False) -> dict:
    """reference() (or reference_initial()) of make_cfg("none", sparse, 1, pooling) with
    VARIANTS[variant]: deterministic, so each is run once per session, not once per use."""
    cfg = VARIANTS[variant](make_cfg("none", sparse, 1, pooling))
    return reference_initial(cfg) if initial else reference(cfg)


def reference_initial(cfg: Config) -> dict:
    torch.set_num_threads(1)
    return snapshot(Trainer(cfg, init_distributed("cpu")))


HOST_STEPS = 10  # host tables: enough steps that the caches evict


ZIPF = 0.3  # flatter than the default: more distinct rows per step, so even 3 ranks evict


def host_cfg(mode: str, sparse: str, world: int) -> Config:
    cfg = make_cfg(mode, sparse, world)
    cfg.data.zipf_exponent = ZIPF
    cfg.sharding.cache_fraction = 0.001
    if mode == "auto":
        # room for the small tables and the caches, not for the 5,000 and 20,000-row tables
        # (row-wise Adagrad; about 1.2-1.3x what the plan with both of them on host needs)
        cfg.sharding.hbm_gb = {1: 345_000, 2: 199_000, 3: 140_000}[world] / 2**30
    return cfg


def collect(
    env: DistEnv, cfg: Config, prefetch: bool, warm: bool = False, steps: int = HOST_STEPS
) -> dict:
    trainer = Trainer(cfg, env)
    if warm:  # as training does: each rank's caches start with its rows' hottest ids
        assert trainer.warm_start_caches() > 0
    batches = [trainer.train_batch(s) for s in range(steps)]
    with torch.no_grad():
        first = batches[0].to(env.device)
        logits = trainer.model(first.dense, first.ids)
    losses = [trainer.global_mean(v) for v in trainer.train_batches(batches, prefetch)]
    emb = trainer.embeddings[0]
    stats = emb.cache_stats()
    return {
        "logits": logits,
        "losses": losses,
        **snapshot(trainer),
        "stats": stats,
        "pinned": [g.weight.is_pinned() for g in emb.host_groups()],
        "prefetched": sum(g.prefetched_lookups for g in emb.host_groups()),
    }


JAGGED_ROWS = [3, 40, 700, 5000, 20000, 700]  # the last feature shares the third one's table


def jagged_cfg(
    mode: str, sparse: str, world: int, host_data: bool = False, arch: str = "dcnv2"
) -> Config:
    """`host_data`: uniform ids (with HOST_STEPS steps, even 3 ranks' caches evict)."""
    state = {"sgd": 1.0, "rowwise_adagrad": 1.125, "adam": 3.0}[sparse]
    budget = 0.8 * max(JAGGED_ROWS) * 8 * 4 * state if mode == "auto" and world > 1 else 1 << 30
    cfg = make_config(
        f"sharding={mode}",
        f"model.arch={arch}",
        "model.embedding_dims=" + ("[4,8,8,4,8,8]" if arch == "dcnv2" else "[8,8,8,8,8,8]"),
        "model.bottom_mlp=[16,8]",
        "model.top_mlp=[16,1]",
        f"model.num_embeddings_per_feature={JAGGED_ROWS}".replace(" ", ""),
        "model.hotness=[1,3,1,4,2,3]",
        "model.jagged=[false,true,false,true,true,true]",
        "model.pooling=[sum,mean,sum,sum,mean,mean]",
        "model.feature_names=[f0,f1,f2,f3,f4,f5]",
        "model.table_names=[t0,t1,t2,t3,t4,t2]",
        f"optim.sparse.name={sparse}",
        f"optim.sparse.lr={OPTIMIZERS[sparse]}",
        "optim.dense.name=sgd",
        "optim.dense.lr=0.1",
        "train.batch_size=48",
        "eval.batch_size=48",
        "device=cpu",
        "seed=7",
        "sharding.data_parallel_max_bytes=2048",
        f"sharding.hbm_gb={budget / 2**30}",
        world_size=world,
    )
    if host_data:
        cfg.data.zipf_exponent = 0.0
        cfg.sharding.cache_fraction = 0.001
    return cfg
