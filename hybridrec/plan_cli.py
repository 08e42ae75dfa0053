"""`hybridrec-plan`: print the sharding plan of any model for a given cluster, without GPUs.

    hybridrec-plan --model dlrm_1tb_uncapped --world-size 8 --hbm-gb 80
    hybridrec-plan --model dlrm_1tb --world-size 1 --hbm-gb 80 --reserve-gb 64   # host caches
    hybridrec-plan data=table data.path=/data/ml100k/bin model.arch=two_tower \
        '+model.args.user_features=[user_id]' '+model.args.item_features=[movie_id]'
    hybridrec-plan model._target_=my_pkg.MyModel +model.args.dim=64 --world-size 4

The model is chosen as hybridrec-train chooses it: `--model` (a name under conf/model/ or a
path to a model yaml) or hybridrec-train's own overrides (`model=...`, `model.arch=...`,
`model._target_=...` with `model.args`, `data=table data.path=...` for a dataset's tables);
the tables planned are the ones the model declares (hybridrec.builder.model_features: a model
class is imported and built without rows). Memory sizes given in "GB" are GiB (2**30 bytes,
how GPU memory is sized: an "80 GB" H100 has 80 GiB); bandwidths are decimal (GB/s = 1e9
bytes/s, TB/s = 1e12), as links are rated. Returns 0 with a plan, 2 when the plan does not fit
or an argument is wrong.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridrec.builder import model_features
from hybridrec.config import CONF_DIR, TABLE_DTYPES, compose
from hybridrec.config.cli import model_file
from hybridrec.configure import validate
from hybridrec.model.registry import model_name
from hybridrec.planner.memory import host_memory
from hybridrec.planner.plan import MODES
from hybridrec.planner.report import format_plan
from hybridrec.planner.request import PlanRequest
from hybridrec.planner.types import (
    GIB,
    OPTIMIZERS,
    CachePolicy,
    OptimizerFootprint,
    Topology,
    human_bytes,
)
from hybridrec.types import TableConfig, pin_modes

DEFAULT_MODEL = "dlrm_kaggle"


def load_tables(model: str | None, overrides: Sequence[str] = ()) -> tuple[str, list[TableConfig]]:
    """(model name, the features its tables are declared for) of the model `model` (a name
    under conf/model/ or a yaml path; None: the overrides' choice, else DEFAULT_MODEL) and
    hybridrec-train's `overrides`, as hybridrec-train would build it."""
    overrides = list(overrides)
    chosen = any(o.lstrip("+").startswith(("model=", "model.", "data=")) for o in overrides)
    yaml = model is not None and Path(model).suffix != ""
    if not yaml and (model is not None or not chosen):
        overrides.insert(0, f"model={model or DEFAULT_MODEL}")
    try:
        raw = compose(overrides)
    except (HydraException, OmegaConfBaseException) as e:  # a misspelt group choice or key
        models = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        why = str(e).splitlines()[0]
        raise ValueError(f"{why} (models in conf/model: {', '.join(models)})") from None
    if yaml:  # a model file of one's own, as a model group file
        raw.model = OmegaConf.merge(raw.model, model_file(str(model)))
    cfg = validate(raw)
    m = cfg.model
    name = m.name if m._target_ is None and m.arch in ("dlrm", "dcnv2") else model_name(m)
    return name, model_features(cfg)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybridrec-plan",
        description="Plan how embedding tables are sharded over ranks and print the plan, "
        "memory per rank and an estimate of the exchange cost per step.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model name in conf/model/ or path to a model yaml (default: the overrides' "
        "model, else dlrm_kaggle)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="hybridrec-train overrides choosing any other model: model.arch=..., "
        "model._target_=pkg.Class +model.args.k=v, data=table data.path=DIR, ...",
    )
    p.add_argument("--world-size", type=int, default=8, help="number of ranks (default 8)")
    p.add_argument(
        "--hbm-gb", type=float, default=80.0, help="device memory per rank, GiB (default 80)"
    )
    p.add_argument(
        "--reserve-gb",
        type=float,
        default=5.0,
        help="GiB per rank kept for the dense model and activations (default 5)",
    )
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node (default 8)")
    p.add_argument(
        "--intra-bw-gbps",
        type=float,
        default=300.0,
        help="all-to-all GB/s per rank inside a node (default 300)",
    )
    p.add_argument(
        "--inter-bw-gbps", type=float, default=25.0, help="GB/s per rank across nodes (default 25)"
    )
    p.add_argument(
        "--hbm-bw-tbps",
        type=float,
        default=2.98,
        help="device memory bandwidth, TB/s (default 2.98, H100)",
    )
    p.add_argument(
        "--batch-size", type=int, default=65536, help="global batch size (default 65536)"
    )
    p.add_argument("--mode", default="auto", choices=MODES, help="sharding mode (default auto)")
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="TABLE=MODE",
        help="fix one table's sharding (repeatable; like sharding.tables): MODE is "
        f"{', '.join(pin_modes())}; --mode plans the other tables around it",
    )
    p.add_argument(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZERS,
        help="sparse optimizer, for its state size (default sgd)",
    )
    p.add_argument(
        "--weight-bytes",
        type=int,
        default=4,
        choices=(4, 2),
        help="bytes per embedding weight: 4 fp32, 2 fp16/bf16 (default 4)",
    )
    p.add_argument(
        "--comm-dtype",
        default="fp32",
        choices=tuple(TABLE_DTYPES),
        help="pooled embeddings and their gradients in the all-to-alls (sharding.comm_dtype; "
        "default fp32)",
    )
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=0.05,
        help="host-resident tables (--mode host, or auto past the budget): device cache rows "
        "per shard, as a fraction (default 0.05)",
    )
    p.add_argument(
        "--cache-gb",
        type=float,
        default=None,
        help="... or GiB of device caches per rank (overrides --cache-fraction)",
    )
    p.add_argument(
        "--no-host",
        action="store_true",
        help="auto: never move tables to host memory (fail instead when they do not fit)",
    )
    return p


def _parse_pins(items: Sequence[str]) -> dict[str, str]:
    pins = {}
    for item in items:
        table, sep, mode = item.partition("=")
        if not sep or not table or not mode:
            raise ValueError(f"--pin {item!r}: expected TABLE=MODE, e.g. --pin cat_0=row_wise")
        pins[table] = mode
    return pins


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:  # a model that does not build is a usage error too, one line
        name, tables = load_tables(args.model, args.overrides)
        budget = int((args.hbm_gb - args.reserve_gb) * GIB)
        if budget <= 0:
            raise ValueError(
                f"--hbm-gb {args.hbm_gb} minus --reserve-gb {args.reserve_gb} leaves no memory"
            )
        topology = Topology(
            world_size=args.world_size,
            hbm_bytes_per_rank=budget,
            ranks_per_node=args.ranks_per_node,
            intra_node_bw=args.intra_bw_gbps * 1e9,
            inter_node_bw=args.inter_bw_gbps * 1e9,
            hbm_bw=args.hbm_bw_tbps * 1e12,
        )
        optimizer = OptimizerFootprint.for_optimizer(args.optimizer)
        cache = None if args.no_host else CachePolicy(args.cache_fraction, args.cache_gb)
        request = PlanRequest(
            topology,
            args.mode,
            args.batch_size,
            optimizer,
            args.weight_bytes,
            cache=cache,
            pins=_parse_pins(args.pin),
        )
        plan = request.plan(tables)
        host = host_memory(plan, optimizer, args.weight_bytes)
    except ValueError as e:  # PlannerError included: it carries every rank's numbers
        print(f"hybridrec-plan: error: {e}", file=sys.stderr)
        return 2
    comm_bytes = 4 if args.comm_dtype == "fp32" else 2
    cost = request.cost(plan, tables, comm_bytes)
    print(
        f"model {name}: {len(tables)} tables, {args.world_size} ranks, "
        f"global batch {args.batch_size}, mode {args.mode}, optimizer {args.optimizer}, "
        f"{args.weight_bytes}-byte weights"
    )
    print(format_plan(plan, cost, tables))
    if any(host):
        print(
            "host memory per rank for host-resident tables and their optimizer state: "
            + ", ".join(f"rank {r}: {human_bytes(n)}" for r, n in enumerate(host))
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
