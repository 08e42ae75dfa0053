"""The exchanges of the sharded collection, one module per stage: `input` (ids to their
owners), `output` (pooled rows back, differentiable), `replicated` (data-parallel tables) and
`row_stats` (column shards sharing row-wise Adagrad's statistic)."""
