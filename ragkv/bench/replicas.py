"""Two `ragkv serve` replicas over one redis-server, as on two hosts: each with its own data
folder, sharing the chunk tier (db 0), the document registry (db 1) and the sessions (db 2).
What the soak, the cross-replica follow-up benchmark and the replica tests start."""

from __future__ import annotations

import threading
from pathlib import Path

from ragkv.api.launcher import ServerProcess


def replica(root: Path, name: str, redis_url: str, extra: tuple[str, ...] = ()) -> ServerProcess:
    """Replica `name` with its data folder and log under `root` (not started)."""
    base = redis_url.rsplit("/", 1)[0]
    folder = root / name
    return ServerProcess(
        [
            "--data-dir",
            str(folder),
            "--store",
            f"tiered+lmdb://{folder}/db?redis={base}/0",
            "--registry",
            f"{base}/1",
            "--session-store",
            f"{base}/2",
            *extra,
        ],
        log_path=root / f"{name}.log",
    )


def start_all(servers: list[ServerProcess], timeout_s: float = 600.0) -> None:
    """Start the replicas in parallel (each loads the model); if one fails, stop them all and
    raise its error."""
    errors: list[BaseException] = []

    def start(server: ServerProcess) -> None:
        try:
            server.start(timeout_s=timeout_s)
        except BaseException as error:  # raised below, once every start has ended
            errors.append(error)

    threads = [threading.Thread(target=start, args=(server,)) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for server in servers:
            server.stop()
        raise RuntimeError(f"a replica did not start: {errors[0]}") from errors[0]
