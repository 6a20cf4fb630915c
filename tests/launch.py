"""Run a function on N real processes joined by a gloo process group on loopback.

Processes come from a forkserver that has already imported torch, torch._dynamo (which
building an optimizer imports) and unison, so each group starts in well under a second;
several checks share one group. The group's store is served by the test's process on a
port the OS picked as it bound it, as torchrun's agent serves its workers'
(``unison.runtime.serve_store``): every rank is a client, and a rank's death leaves the
store up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as mp

from unison.runtime import client_env, serve_store

#: ``unison launch``'s option that forks the workers from a template which imported these once
#: (torch's optimizers import torch._dynamo when the first is built): a ledger job then takes
#: about a third less time and half the CPU. test_fault_tolerance, test_fault_chaos and the node
#: tests use it; test_launcher, the agents' tests and test_train_fault_tolerant start their
#: workers as ``python script``.
PRELOAD = ("--preload", "torch,torch._dynamo,unison")
#: What the forkserver of ``run`` imports once, before it forks any rank: the same modules, so a
#: rank that builds an optimizer (nearly every one) does not import torch._dynamo itself (about
#: 1.5 s of CPU per rank, which every group paid again).
FORKSERVER_PRELOAD = ("torch", "torch._dynamo", "unison")


def torchrun(*args: str, cwd: Any, timeout: float) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 *args`` (torchrun's options, then a script and
    its arguments), one torch thread per worker, its output captured as text."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # unison.init copes with torchrun's shared store itself
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _worker(
    rank: int, fn: Callable, world: int, store_env: dict, outdir: str, env: dict, args: tuple, pg_timeout: float
) -> None:
    os.environ.update(
        {
            **store_env,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            **env,
        }
    )
    torch.set_num_threads(1)
    import unison

    try:
        unison.init(backend="gloo", timeout=pg_timeout)
        result = fn(*args)
        torch.save({"ok": result}, os.path.join(outdir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(outdir, f"{rank}.pt"))
        raise
    finally:
        unison.shutdown()


def _start(fn: Callable, world: int, args: tuple, outdir: str, pg_timeout: float, env: Optional[dict], store):
    """Start ``world`` ranks from the forkserver on ``store``; each writes its outcome to ``outdir/<rank>.pt``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return mp.start_processes(
        _worker,
        args=(fn, world, client_env(store), outdir, env or {}, args, pg_timeout),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )


def _outcome(outdir: str, rank: int) -> dict:
    """What rank wrote: {"ok": result} or {"error": traceback}; {} if it died without a word."""
    path = os.path.join(outdir, f"{rank}.pt")
    return torch.load(path, weights_only=False) if os.path.exists(path) else {}


def _kill_the_living(procs) -> None:
    for p in procs.processes:
        if p.is_alive():
            p.kill()
            p.join(5)


def run(
    fn: Callable, world: int = 2, *args: Any, timeout: float = 120, pg_timeout: float = 60, env: Optional[dict] = None
) -> list[Any]:
    """Call ``fn(*args)`` on ``world`` ranks; return each rank's result.

    Fails with every rank's traceback if any rank raised, and kills the group
    if it has not finished within ``timeout`` seconds (a hang is a failure).
    """
    store = serve_store()  # up until every rank has ended
    with tempfile.TemporaryDirectory() as outdir:
        procs = _start(fn, world, args, outdir, pg_timeout, env, store)
        deadline = time.monotonic() + timeout
        failure = None
        try:
            while not procs.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    failure = f"ranks did not finish within {timeout} s (hang)"
                    break
        except Exception as exc:  # a rank failed; start_processes killed the rest
            failure = f"a rank failed: {exc}"
        finally:
            _kill_the_living(procs)
        outcomes = [_outcome(outdir, r) for r in range(world)]
        errors = [f"--- rank {r} ---\n{o['error']}" for r, o in enumerate(outcomes) if "error" in o]
        if failure or errors:
            raise AssertionError((failure or "a rank failed") + "\n" + "\n".join(errors))
        return [o.get("ok") for o in outcomes]


def run_outcomes(
    fn: Callable, world: int = 2, *args: Any, timeout: float = 120, pg_timeout: float = 60, env: Optional[dict] = None
) -> list[dict]:
    """Like ``run``, for tests where ranks die on purpose: every rank runs to its own end.

    Returns, per rank, ``{"exitcode": int, "ok": result}`` or ``{"exitcode": int,
    "error": traceback}``; a rank that died without a word has only its exit
    code. A group still running after ``timeout`` seconds is killed and fails
    the test (a hang).
    """
    store = serve_store()  # up until every rank has ended
    with tempfile.TemporaryDirectory() as outdir:
        procs = _start(fn, world, args, outdir, pg_timeout, env, store)
        deadline = time.monotonic() + timeout
        for p in procs.processes:
            p.join(max(0.1, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs.processes) if p.is_alive()]
        _kill_the_living(procs)
        if hung:
            raise AssertionError(f"ranks {hung} did not finish within {timeout} s (hang)")
        return [{"exitcode": p.exitcode, **_outcome(outdir, r)} for r, p in enumerate(procs.processes)]
