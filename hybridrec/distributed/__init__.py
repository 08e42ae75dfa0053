"""Process groups (env) and collectives as autograd Functions (comm)."""

from hybridrec.distributed.env import DistEnv, destroy_distributed, init_distributed, resolve_device
from hybridrec.distributed.failure import CollectiveError

__all__ = [
    "CollectiveError",
    "DistEnv",
    "destroy_distributed",
    "init_distributed",
    "resolve_device",
]
