"""The tests' real, throwaway `redis-server` (no mocks): the class lives in the package so the
soak benchmark starts the same one."""

from ragkv.bench.redis_process import RedisServer

__all__ = ["RedisServer"]
