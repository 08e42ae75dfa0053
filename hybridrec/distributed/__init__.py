"""Process groups (env) and collectives as autograd Functions (comm)."""

from hybridrec.distributed.env import DistEnv, destroy_distributed, init_distributed, resolve_device

__all__ = ["DistEnv", "destroy_distributed", "init_distributed", "resolve_device"]
