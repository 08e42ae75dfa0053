"""A small `user item` file for the next-item trainer tests: users whose items follow a
pattern a sequence model can learn (each user walks the catalogue in steps of its own
stride), with lengths from 2 to 13 events so that some users only train and every
leave-one-out split holds users. Ids are 1-based, as the format says."""

from __future__ import annotations

from pathlib import Path

USERS, ITEMS = 48, 150


def write_user_item(path: Path, users: int = USERS, items: int = ITEMS) -> Path:
    lines = []
    for u in range(1, users + 1):
        stride, start, length = 1 + u % 5, (37 * u) % items, 2 + u % 12
        for j in range(length):
            lines.append(f"{u} {(start + j * stride) % items + 1}")
    path.write_text("\n".join(lines) + "\n")
    return path
