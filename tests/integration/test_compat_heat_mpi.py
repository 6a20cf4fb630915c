"""unison.compat.heat with mpi4py communicators, under a real ``mpiexec -n 2``.

Skipped unless mpi4py and an ``mpiexec`` are installed (both optional: for
example ``pip install mpi4py mpich``). The processes talk over gloo; the
mpi4py communicators given as HeAT's ``comm`` are mapped to the torch groups
of the same ranks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mpi4py")
MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")

SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    import torch, torch.distributed as dist, torch.nn.functional as F
    from mpi4py import MPI
    import unison
    from unison.compat import heat as ht
    from models import MLP, batch

    topo = unison.init(backend="gloo")
    world = MPI.COMM_WORLD
    rank = world.Get_rank()

    def flat(net):
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def spread(t):
        lo, hi = t.clone(), t.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return (hi - lo).abs().max().item()

    def train(comm=None, native=False):
        torch.manual_seed(0)
        net = MLP()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        if native:
            model = unison.DataParallel(net, optimizer=opt)
        else:
            model = ht.nn.DataParallel(net, comm, ht.optim.DataParallelOptimizer(opt), blocking_parameter_updates=True)
        for s in range(4):
            x, y = batch(s, rank)
            opt.zero_grad(set_to_none=False)
            F.mse_loss(model(x), y).backward()
            opt.step()
        return model, flat(net)

    out = {{"rank": rank, "torch_rank": topo.rank, "launcher": topo.launcher, "mpi_module": ht.MPI is MPI}}
    model, x = train(world)
    out["world"] = (model.comm.rank, model.comm.size, model.comm.Get_size())
    out["world_gap"] = (x - train(native=True)[1]).abs().max().item()
    out["mpi_method"] = model.comm.allreduce(rank)  # mpi4py's own method, through the communicator
    sub = world.Split(color=rank, key=0)  # one communicator per process
    model, x = train(sub)
    out["split"] = (model.comm.rank, model.comm.size)
    out["split_spread"] = spread(x)  # no averaging across the two singleton groups
    with open({out!r} + f".{{rank}}.json", "w") as f:
        json.dump(out, f)
    """
)


def test_heat_layer_under_mpiexec(tmp_path):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path / "out")
    script = tmp_path / "heat_mpi.py"
    script.write_text(SCRIPT.format(tests=tests, out=out))
    from unison.runtime import client_env, serve_store

    store = serve_store()  # the ranks' rendezvous store, bound here before they start (kept up until they end)
    env = {**os.environ, **client_env(store)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "UNISON_NODES"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(tests), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["torch_rank"] == r["rank"] and r["launcher"] == "mpich"
        assert r["mpi_module"]
        assert r["world"] == [r["rank"], 2, 2]
        assert r["world_gap"] == 0.0
        assert r["mpi_method"] == 1
        assert r["split"] == [0, 1]
        assert r["split_spread"] > 0.0
