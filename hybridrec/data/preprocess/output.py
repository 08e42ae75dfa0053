"""Where a dataset is built, and how it replaces the previous one: never in place.

Both preprocessors (the Criteo parser and `--spec` tables) build the whole dataset in
`.<name>.partial/` beside the output directory and swap it in only when it is complete, so a
run that fails (a bad row, a bad spec, a full disk) or is interrupted (Ctrl-C, kill -9)
leaves the output exactly as it was: the previous dataset, or nothing. The swap is one
atomic exchange of the two directory names where the OS has one (Linux renameat2
RENAME_EXCHANGE), else two renames. Entries of the old directory that are not the
dataset's own files (a README the user put there) are moved into the new one first. After
the swap the old dataset is deleted.

An interrupted Criteo run keeps `.<name>.partial/.work/` so the same command resumes; a
failed run removes the partial directory (unless `--keep-work`). A write that fails for
lack of space becomes one line naming the directory and what to do (DiskFullError).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from hybridrec.data.manifest import MANIFEST
from hybridrec.data.preprocess.options import UsageError

# the dataset's own entries in its directory, with any `<array>.npy.tmp` an older version left
# (anything else there is the user's and stays)
DATASET_ENTRIES = frozenset(
    {MANIFEST, f"{MANIFEST}.tmp", "labels.npy", "dense.npy", "categorical.npy", "counts", ".work"}
)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """A write failed for lack of space (or quota); the message names where and what to do."""

    def __str__(self) -> str:
        return str(self.strerror)


def partial_dir(output: Path) -> Path:
    """The directory the dataset for `output` is built in: `.<name>.partial` beside it."""
    output = resolved(output)
    return output.with_name(f".{output.name}.partial")


def resolved(output: str | Path) -> Path:
    """The absolute, symlink-free output path (the swap renames the real directory)."""
    return Path(os.path.realpath(output))


def check_output(output: Path) -> None:
    """UsageError for an output the swap cannot replace: a file, the current directory (or
    one above it), a mount point."""
    real = resolved(output)
    for p in (real, *real.parents):
        if p.exists() and not p.is_dir():
            what = "" if p == real else f" ({p} is a file)"
            raise UsageError(f"--output {output} cannot be a directory{what}")
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        raise UsageError(
            f"--output {output} is the current directory (or holds it); the dataset is built "
            "beside the output and swapped in, so name a directory from outside it"
        )
    if real.is_dir() and os.path.ismount(real):
        raise UsageError(
            f"--output {output} is a mount point, which cannot be swapped; give a directory "
            "inside it"
        )


@contextlib.contextmanager
def building(output: Path, keep_work: bool = False, resumable: bool = False) -> Iterator[Path]:
    """Yield the partial directory to build in; when the block ends normally, swap it in
    (`swap_in`). On an exception it is removed, or kept when `keep_work` or, for a
    `resumable` run, on KeyboardInterrupt; a full disk becomes a DiskFullError."""
    partial = partial_dir(output)
    try:
        partial.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise type(e)(
            e.errno,
            f"cannot create {partial}, where the dataset for --output {output} is built before "
            f"it is swapped in: {e.strerror}",
        ) from None
    try:
        yield partial
        swap_in(partial, output)
    except BaseException as e:
        keep = keep_work or (resumable and isinstance(e, KeyboardInterrupt))
        if not keep:
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in _NO_SPACE and not isinstance(e, DiskFullError):
            raise DiskFullError(e.errno, no_space_message(output, partial)) from e
        raise


def no_space_message(output: Path, partial: Path) -> str:
    free = shutil.disk_usage(partial.parent).free
    return (
        f"no space left on the device of {partial.parent} ({_size(free)} free) while writing "
        f"the new dataset in {partial}; free space there, or give an --output on another "
        f"disk; {output} was not changed"
    )


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def clear_partial(partial: Path, keep: str | None = None) -> None:
    """Remove what a previous run left in `partial`, except the entry named `keep`."""
    for entry in list(partial.iterdir()) if partial.is_dir() else []:
        if entry.name != keep:
            _remove(entry)


def swap_in(partial: Path, output: Path) -> None:
    """Make the finished dataset in `partial` the output directory (see the module doc)."""
    output = resolved(output)
    if not output.exists():
        os.rename(partial, output)
        return
    moved: list[str] = []
    try:
        for entry in output.iterdir():  # the user's own files stay with the dataset
            if entry.name not in DATASET_ENTRIES and not entry.name.endswith(".npy.tmp"):
                os.rename(entry, partial / entry.name)
                moved.append(entry.name)
        os.chmod(partial, stat.S_IMODE(output.stat().st_mode))
        if not _exchange(partial, output):
            old = output.with_name(f".{output.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(output, old)
            try:
                os.rename(partial, output)
            except BaseException:
                os.rename(old, output)
                raise
            os.rename(old, partial)  # as after an exchange: the old dataset is `partial`
    except BaseException:
        for name in moved:  # nothing swapped: the user's files go back where they were
            with contextlib.suppress(OSError):
                os.rename(partial / name, output / name)
        raise
    shutil.rmtree(partial, ignore_errors=True)  # the previous dataset, under the partial name


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux renameat2); False where the OS cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # not on this filesystem
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
