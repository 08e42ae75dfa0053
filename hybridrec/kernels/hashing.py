"""Deterministic hashes of raw ids in torch int64 ops: buckets, admission draws, fresh rows.

Everything a dynamic table decides from an id alone comes from `mix64`, the splitmix64
finaliser written with int64 tensors (multiplication wraps modulo 2**64; right shifts are made
logical by masking), so it is the same on every rank, device and world size:

  bucket_of(ids, buckets)            the id's fixed hash bucket (which shard owns it)
  uniform_of(ids, key)               a draw in [0, 1) per id (probability admission)
  fresh_rows(ids, ..., cols)         the initial values of an admitted id's row: a function of
                                     (seed, table, id, column) only, so the same on any shard,
                                     column slice or slot
"""

from __future__ import annotations

import math

import torch

from hybridrec.kernels import native_map

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 value with the same bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of integer `x` (any shape; narrower integers are widened to int64 first: in
    their own dtype the arithmetic would wrap at their width, another hash), as int64 bits."""
    if x.dtype != torch.int64:
        x = x.long()
    z = x + _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_M1)
    z = (z ^ _shr(z, 27)) * _signed(_M2)
    return z ^ _shr(z, 31)


def mix64_int(x: int) -> int:
    """mix64 of one Python int (the same bits as the tensor version)."""
    m = (1 << 64) - 1
    z = (x + _GOLDEN) & m
    z = ((z ^ (z >> 30)) * _M1) & m
    z = ((z ^ (z >> 27)) * _M2) & m
    return _signed(z ^ (z >> 31))


def bucket_of(ids: torch.Tensor, buckets: int) -> torch.Tensor:
    """The fixed hash bucket [same shape] of raw int64 ids: mix64(id) mod buckets."""
    return (mix64(ids) & ((1 << 63) - 1)) % buckets


def table_key(seed: int, table_index: int, salt: int = 0) -> int:
    """One int64 per (seed, table, purpose): what the per-id draws of that table hash with."""
    return mix64_int(mix64_int(mix64_int(seed) ^ table_index) ^ salt)


def uniform_of(ids: torch.Tensor, key: int) -> torch.Tensor:
    """[same shape] float64 in [0, 1): a draw per id, fixed by (key, id)."""
    bits = _shr(mix64(mix64(ids) ^ key), 11)  # 53 bits
    return bits.double() * (1.0 / (1 << 53))


ADMIT_SALT = 0xAD  # table_key salts: the admission draw and the initial values differ
INIT_SALT = 0x1E


def fresh_rows(
    ids: torch.Tensor,
    seed: int,
    table_index: int,
    num_rows: int,
    col_start: int,
    col_end: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[K, col_end - col_start] initial values of ids [K]'s rows, columns [col_start, col_end):
    uniform in [-1/sqrt(num_rows), 1/sqrt(num_rows)] (the fixed tables' initialisation,
    hybridrec.sparse.init), each value a hash of (seed, table, id, column): mix64 of the id,
    plus the column times the golden ratio, through one more xorshift-multiply round; its top
    24 bits make the fp32 draw. So an id readmitted into any slot of any shard starts from the
    same row, at one 64-bit multiply per value."""
    key = table_key(seed, table_index, INIT_SALT)
    bound = 1.0 / math.sqrt(num_rows)
    if native_map.usable(ids):  # the same values in C, without ~15 [K, D] int64 tensors
        return native_map.fresh_rows(ids, key, col_start, col_end, bound).to(dtype)
    cols = torch.arange(col_start, col_end, dtype=torch.int64, device=ids.device)
    z = mix64(ids.view(-1, 1) ^ key) + cols.view(1, -1) * _signed(_GOLDEN)
    z = (z ^ _shr(z, 32)) * _signed(_M2)
    u = _shr(z, 40).float() * (1.0 / (1 << 24))  # [0, 1), exact in fp32
    return ((u * 2 - 1) * bound).to(dtype)
