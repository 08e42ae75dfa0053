"""Data sources. `synthetic` (the default) needs no files."""

from hybridrec.data.synthetic import SyntheticCriteo

__all__ = ["SyntheticCriteo"]
