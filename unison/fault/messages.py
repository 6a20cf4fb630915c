"""What a fault-tolerant job's processes say to each other through the coordinator's store:
a worker's bell (``ring``), the coordinator's inbox (``post``), and what /proc says of a process
(``process_stat``). The workers (``member``), the coordinator and the nodes' agents
(``launcher``) all speak through these, so a change of the protocol's keys is made here once.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

import torch.distributed as dist


def ring(store: dist.Store, worker: int) -> None:
    """Wake worker ``worker``'s watcher (``ft/bell/<id>/<k>``, k from the counter ``ft/bell/<id>``):
    it reads the newest membership and ``ft/abort`` again. Rung after the news is written, so a
    watcher that read before it still wakes."""
    k = int(store.add(f"ft/bell/{worker}", 1))
    store.set(f"ft/bell/{worker}/{k}", "")


def unring(store: dist.Store, worker: int, first: int = 1) -> None:
    """Delete worker ``worker``'s bell: the rings from ``first`` on (its watcher deleted those
    before, the ones it woke on), then the counter. Only once its watcher has left."""
    for k in range(first, int(store.add(f"ft/bell/{worker}", 0)) + 1):
        store.delete_key(f"ft/bell/{worker}/{k}")
    store.delete_key(f"ft/bell/{worker}")


def post(store: dist.Store, kind: str, worker: int, **fields: Any) -> None:
    """Leave a message for the coordinator in its inbox (``ft/inbox/<k>``, k from a counter): it
    waits on the next one, blocked in the store, instead of looking at per-worker keys."""
    k = int(store.add("ft/inbox", 1))
    store.set(f"ft/inbox/{k}", json.dumps({"kind": kind, "worker": worker, **fields}))


def process_stat(pid: Union[int, str] = "self") -> Optional[list[bytes]]:
    """The fields of ``/proc/<pid>/stat`` from the state on (``[0]``: R, S, T (stopped), Z (dead),
    ...; ``[11]``, ``[12]``: the CPU time it used, user and system, in clock ticks; ``[19]``: when
    it started); None where there is no /proc or the process is gone. The coordinator tells a slow
    worker from a stopped one by it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
