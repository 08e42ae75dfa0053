"""Config checks of exact mode (train.exact: docs/exact.md), each failure one line naming the
keys it reads and what to do."""

from __future__ import annotations

from hybridrec.config.schema import Config


def _multiples(n: int, of: int) -> str:
    """The multiples of `of` nearest `n`, for a suggestion."""
    down, up = n - n % of, n + of - n % of
    return f"{down} or {up}" if down else str(up)


def check_exact(c: Config, world_size: int) -> None:
    """train.exact=true: micro-shards that every rank and every batch split into, and the
    settings the mode supports (CPU, fp32 exchanges, a loss of the gathered batch alone)."""
    t, m = c.train, c.train.exact_shards
    if m < 1 or m % world_size:
        raise ValueError(
            f"train.exact_shards={m} must be a positive multiple of the world size {world_size} "
            f"(launcher.nproc_per_node, or torchrun's ranks): each rank takes a whole number of "
            f"micro-shards; try train.exact_shards={_multiples(max(m, 1), world_size)}"
        )
    for key, batch in (("train.batch_size", t.batch_size), ("eval.batch_size", c.eval.batch_size)):
        if batch % m:
            raise ValueError(
                f"{key}={batch} must be divisible by train.exact_shards={m} (every micro-shard "
                f"holds as many samples); try {key}={_multiples(batch, m)}"
            )
    if c.device == "cuda":
        raise ValueError(
            "train.exact=true runs on the CPU (its canonical sums use the CPU kernels): set "
            "device=cpu, or train without train.exact"
        )
    if c.sharding.comm_dtype != "fp32":
        raise ValueError(
            f"train.exact=true carries pooled embeddings in fp32: sharding.comm_dtype="
            f"{c.sharding.comm_dtype} would round them; set sharding.comm_dtype=fp32"
        )
    if t.compile in ("dense", "graphs"):
        raise ValueError(
            f"train.exact=true runs the model eagerly, micro-shard by micro-shard: "
            f"train.compile={t.compile} is not supported with it; set train.compile=none"
        )
    if c.model.task == "retrieval":
        raise ValueError(
            "train.exact=true does not train model.task=retrieval: its loss draws per-step "
            "negatives looked up once per rank, not per sample; train it without train.exact"
        )
    if c.model.task == "next_item" and t.next_item.loss == "softmax" and t.retrieval.negatives:
        raise ValueError(
            f"train.exact=true with train.next_item.loss=softmax takes no uniform negatives "
            f"(train.retrieval.negatives={t.retrieval.negatives}: looked up once per rank, not "
            "per sample); set train.retrieval.negatives=0, or use train.next_item.loss=bce"
        )
