"""Checkpoints: ``unison.save`` / ``unison.load`` resume the exact trajectory, and fail clearly.

The distributed checks run 2 real gloo ranks (tests/launch.py); the rest run in
this process, a world of one with no process group.
"""

import os
import signal
import subprocess
import sys
import time

import launch
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

import unison

# 40 samples, batch 4: 5 steps per epoch on 2 ranks, 10 alone.
N_SAMPLES, BATCH, STEPS, SAVE_AT = 40, 4, 13, 7

ALGORITHMS = [
    "allreduce",
    "bf16",
    "local_sgd:period=3",  # 7 is not a multiple of 3: the step counter must be restored
    "powersgd:rank=1,start_iter=2",  # per-rank error-feedback residuals and warm-start factors
    "bytegrad:error_feedback=True",
    "diloco:inner_steps=3",  # snapshot and outer optimizer
    "decentralized:peer_selection=ring,communication_interval=3",
    "low_precision_decentralized:communication_interval=3",  # public copies and neighbour replicas
    "nonblocking",  # deferred updates flushed by save
    "optimizer:bytegrad:error_feedback=True",  # a DistributedOptimizer around a plain module
]


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N_SAMPLES, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def build(spec: str, seed: int):
    """A fresh model (with dropout, so the RNG matters), optimizer and loader for ``spec``."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    if spec.startswith("optimizer:"):
        model, opt = net, unison.DistributedOptimizer(opt, net.named_parameters(), algorithm=spec[len("optimizer:") :])
    else:
        model = unison.DataParallel(net, optimizer=opt, algorithm=spec)
    loader = unison.sharded_loader(dataset(), batch_size=BATCH, seed=3)
    torch.manual_seed(100 * seed + dist.get_rank())  # per-rank dropout masks
    return model, opt, loader


def train(model, opt, loader, epoch=0, step=0, save_at=None, path=None) -> None:
    """Train until step STEPS (or save at ``save_at`` and stop), epoch by epoch."""
    while step < STEPS:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            if step == save_at:
                unison.save(path, model, opt, loader.sampler, epoch=epoch, step=step, extra={"note": "mid-epoch"})
                return
            if step == STEPS:
                return
        epoch += 1


def resume_matches_straight_run(path: str, specs=ALGORITHMS) -> dict:
    out = {}
    for spec in specs:
        model, opt, loader = build(spec, seed=0)
        train(model, opt, loader)
        getattr(model, "flush", lambda: None)()
        straight = [p.detach().clone() for p in model.parameters()]

        model, opt, loader = build(spec, seed=0)
        train(model, opt, loader, save_at=SAVE_AT, path=path)

        model, opt, loader = build(spec, seed=1)  # other weights and RNG: load must restore them
        state = unison.load(path, model, opt, loader.sampler)
        assert (state["epoch"], state["step"], state["extra"]) == (1, SAVE_AT, {"note": "mid-epoch"}), state
        assert state["world_size"] == 2 and state["algorithm"] == (
            None if spec.startswith("optimizer:") else spec.split(":")[0]
        )
        train(model, opt, loader, epoch=state["epoch"], step=state["step"])
        getattr(model, "flush", lambda: None)()
        out[spec] = max((a - b).abs().max().item() for a, b in zip(straight, model.parameters()))
    return out


def test_resume_reproduces_the_trajectory(tmp_path):
    """Train 13 steps straight, or 7 + save + fresh objects + load + 6: the same weights on every rank."""
    results = launch.run(resume_matches_straight_run, 2, str(tmp_path / "ckpt.pt"), timeout=180)
    for rank, diffs in enumerate(results):
        assert all(d == 0.0 for d in diffs.values()), f"rank {rank}: max parameter difference {diffs}"


def test_daso_resumes_its_sync_in_flight_exactly(tmp_path):
    """DASO on 2 simulated nodes, saved while a non-blocking global sync is in flight
    (received, not yet merged): the resumed run merges it at the same batch."""
    spec = "daso:warmup_epochs=0,cooldown_epochs=0,max_global_skips=2,downcast_type='bf16'"
    results = launch.run(
        resume_matches_straight_run, 2, str(tmp_path / "ckpt.pt"), [spec], env={"UNISON_NODES": "2"}, timeout=120
    )
    for diffs in results:
        assert diffs[spec] == 0.0, diffs


def train_alone(path, save_at=None, resume=False):
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 2))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    loader = unison.sharded_loader(dataset(), batch_size=BATCH, seed=3)
    epoch = step = 0
    if resume:
        torch.manual_seed(6)
        state = unison.load(path, net, opt, loader.sampler)
        epoch, step = state["epoch"], state["step"]
    train(net, opt, loader, epoch, step, save_at=save_at, path=path)
    return net


def test_world_of_one_plain_module_resumes_exactly(tmp_path):
    """No process group, a plain nn.Module and Adam: save, load and continue as if uninterrupted."""
    path = tmp_path / "sub" / "c.pt"  # the directory is created
    straight = train_alone(path)
    train_alone(path, save_at=SAVE_AT)
    resumed = train_alone(path, resume=True)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
    assert [p.name for p in path.parent.iterdir()] == ["c.pt"]  # no temporary file left


def test_load_errors_are_clear(tmp_path):
    net = nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    missing = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        unison.load(missing, net, opt)
    assert unison.load(missing, net, opt, missing_ok=True) is None

    plain = tmp_path / "plain.pt"
    torch.save(net.state_dict(), plain)
    with pytest.raises(ValueError, match="not a unison checkpoint.*model.load_state_dict"):
        unison.load(plain, net)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a checkpoint")
    with pytest.raises(ValueError, match="not a unison checkpoint"):
        unison.load(garbage, net)

    good = tmp_path / "good.pt"
    unison.save(good, net, opt)
    with pytest.raises(ValueError, match="1 optimizer state.*2 optimizer"):
        unison.load(good, net, [opt, opt])
    with pytest.raises(TypeError, match=r"extra\['f'\] is a builtin_function_or_method"):
        unison.save(good, net, extra={"f": len})
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        unison.save(good, net, "sgd")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(RuntimeError, match="was not saved: rank 0 could not write"):
        unison.save(blocker / "c.pt", net)


def test_algorithm_mismatch_says_how_to_proceed(tmp_path):
    path = tmp_path / "c.pt"
    net = nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    unison.save(path, unison.DataParallel(net, opt, algorithm="local_sgd"), opt)
    other = unison.DataParallel(nn.Linear(3, 2), opt, algorithm="allreduce")
    with pytest.raises(
        ValueError, match=r"'local_sgd' but this one runs 'allreduce'.*algorithm='local_sgd'.*strict=False"
    ):
        unison.load(path, other, opt)
    unison.load(path, other, opt, strict=False)
    assert torch.equal(other.module.weight, net.weight)


def test_save_is_atomic_under_a_real_kill(tmp_path):
    """SIGKILL a process that keeps overwriting a large checkpoint: the file always loads whole."""
    path = tmp_path / "c.pt"
    script = (
        "import sys, torch, unison\n"
        "net = torch.nn.Linear(1000, 1000)\n"
        f"unison.save({str(path)!r}, net, step=0)\n"
        "print('ready', flush=True)\n"
        "for step in range(1, 1000000):\n"
        f"    unison.save({str(path)!r}, net, step=step)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(100):  # wait until a temporary file exists: the kill lands mid-write
            if any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):
                break
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    net = nn.Linear(1000, 1000)
    state = unison.load(path, net)
    assert state["step"] >= 0
    unison.save(path, net)  # the next save clears what the killed writer left
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def world_size_change_source(path: str) -> None:
    torch.manual_seed(dist.get_rank())
    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = unison.DataParallel(net, opt, algorithm=unison.algorithms.create("local_sgd", period=100))
    loader = unison.sharded_loader(TensorDataset(torch.randn(40, 4), torch.zeros(40, dtype=torch.long)), batch_size=4)
    loader.sampler.set_epoch(2)
    for i, (x, y) in enumerate(loader):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i == 1:
            break
    unison.save(path, model, opt, loader.sampler, epoch=2, step=2)
    return {k: v.clone() for k, v in net.state_dict().items()}


def test_world_size_change_takes_rank_0s_state_with_a_warning(tmp_path):
    """Saved by 2 drifting ranks, loaded alone: rank 0's weights, the rest of the epoch, a warning."""
    path = str(tmp_path / "c.pt")
    rank0, rank1 = launch.run(world_size_change_source, 2, path)
    assert not torch.equal(rank0["weight"], rank1["weight"])  # local_sgd: the replicas drifted
    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = unison.DataParallel(net, opt, algorithm="local_sgd")
    sampler = unison.ShardSampler(TensorDataset(torch.zeros(40, 4)))
    with pytest.warns(UserWarning, match="saved by 2 ranks and is loaded by 1"):
        state = unison.load(path, model, opt, sampler)
    assert state["world_size"] == 2 and state["step"] == 2
    assert all(torch.equal(net.state_dict()[k], rank0[k]) for k in rank0)
    assert model.algorithm_state.steps == 2
    sampler.set_epoch(2)
    assert len(sampler) == 40 - 16  # 2 ranks x 2 batches x 4 samples were consumed


class FailsOnRank1(nn.Linear):
    def state_dict(self, *args, **kwargs):
        if dist.get_rank() == 1:
            raise RuntimeError("disk of rank 1 is on fire")
        return super().state_dict(*args, **kwargs)


def failures_reach_every_rank(tmpdir: str) -> dict:
    """A rank that cannot produce its state, or cannot see the file: every rank raises, none hangs."""
    rank = dist.get_rank()
    out = {}
    net = FailsOnRank1(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = unison.DataParallel(net, opt, algorithm=unison.algorithms.create("local_sgd"))  # per-rank weights
    try:
        unison.save(os.path.join(tmpdir, "a.pt"), model, opt)
    except RuntimeError as exc:
        out["save"] = str(exc)
    plain = unison.DataParallel(nn.Linear(3, 2))
    unison.save(os.path.join(tmpdir, "shared.pt"), plain)
    if rank == 0:
        os.rename(os.path.join(tmpdir, "shared.pt"), os.path.join(tmpdir, "only0.pt"))
    dist.barrier()
    try:
        unison.load(os.path.join(tmpdir, "only0.pt" if rank == 0 else "elsewhere.pt"), plain)
    except FileNotFoundError as exc:
        out["visible"] = str(exc)
    for r in range(2):
        unison.save(os.path.join(tmpdir, f"mine{r}.pt"), plain)
    try:
        unison.load(os.path.join(tmpdir, f"mine{rank}.pt"), plain)
    except ValueError as exc:
        out["different"] = str(exc)
    return out


def test_failures_reach_every_rank(tmp_path):
    for out in launch.run(failures_reach_every_rank, 2, str(tmp_path), timeout=120, pg_timeout=30):
        assert "not saved" in out["save"] and "rank 1: RuntimeError: disk of rank 1 is on fire" in out["save"]
        assert "rank(s) [1] cannot see" in out["visible"] and "filesystem every rank can read" in out["visible"]
        assert "different checkpoints" in out["different"]
    assert not (tmp_path / "a.pt").exists()


# ---- ShardSampler ----------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_sampler_order_is_torchs_and_resumes_at_any_point(world, drop_last):
    data = list(range(23))
    for rank in range(world):
        ours = unison.ShardSampler(data, world, rank, seed=4, drop_last=drop_last)
        torchs = DistributedSampler(data, world, rank, seed=4, drop_last=drop_last)
        for epoch in range(3):
            ours.set_epoch(epoch)
            torchs.set_epoch(epoch)
            expected = list(torchs)
            assert list(ours) == expected and len(ours) == len(expected)
            for start in range(len(expected) + 1):
                ours.set_epoch(epoch, start=start)
                assert len(ours) == len(expected) - start
                assert list(ours) == expected[start:]
            assert list(ours) == expected  # a resume applies to one pass only


def test_sampler_state_resumes_the_rest_of_the_epoch():
    data = list(range(30))
    ours = unison.ShardSampler(data, 2, 1, seed=1)
    ours.set_epoch(4)
    first = []
    for index in ours:
        first.append(index)
        if len(first) == 6:
            break
    state = ours.state_dict()
    assert state["epoch"] == 4 and state["consumed"] == 12
    fresh = unison.ShardSampler(data, 2, 1, seed=1)
    fresh.load_state_dict(state)
    fresh.set_epoch(4)  # the saved epoch: resumes
    assert first + list(fresh) == _epoch(data, 4)
    fresh.set_epoch(5)  # any other epoch starts at its beginning
    assert len(list(fresh)) == 15
    with pytest.raises(ValueError, match="seed=1 but this one has seed=2"):
        unison.ShardSampler(data, 2, 1, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="non-negative"):
        fresh.set_epoch(0, start=-1)


def _epoch(data, epoch):
    s = DistributedSampler(data, 2, 1, seed=1)
    s.set_epoch(epoch)
    return list(s)


def test_sampler_resumes_across_a_world_size_change():
    """3 ranks consumed 2 samples each; 2 ranks then share exactly the rest (with equal shards)."""
    data = list(range(30))
    old = [unison.ShardSampler(data, 3, r, seed=0) for r in range(3)]
    seen = []
    for s in old:
        s.set_epoch(1)
        it = iter(s)
        seen += [next(it), next(it)]
    new = [unison.ShardSampler(data, 2, r, seed=0) for r in range(2)]
    rest = []
    for s in new:
        s.load_state_dict(old[0].state_dict())
        rest.append(list(s))
    assert len(rest[0]) == len(rest[1]) == 12
    assert sorted(seen + rest[0] + rest[1]) == data
