"""Reliability with real processes: uneven inputs under join() for every algorithm,
ranks that die or go silent, non-finite gradients, desync in debug mode."""

import os
import signal
import time

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, batch
from scenarios import spread_across_ranks

import unison

PG_TIMEOUT = 6  # seconds a collective waits for a silent peer in these tests


def build(algorithm="allreduce", **kwargs):
    torch.manual_seed(0)
    net = MLP()
    opt = (
        unison.QAdamOptimizer(net.parameters(), lr=1e-3, warmup_steps=2)
        if algorithm.startswith("qadam")
        else torch.optim.SGD(net.parameters(), lr=0.05)
    )
    return net, opt, unison.DataParallel(net, optimizer=opt, algorithm=algorithm, **kwargs)


def step(model, opt, i, rank, poison=False):
    x, y = batch(i, rank)
    if poison:
        x = x.clone()
        x[0, 0] = float("nan")
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


# ---- join: uneven inputs ----------------------------------------------------
# Options that make each algorithm communicate within a few steps.
OFTEN = {
    "local_sgd": "local_sgd:period=2",
    "decentralized": "decentralized:communication_interval=2",
    "low_precision_decentralized": "low_precision_decentralized:communication_interval=3",
    "diloco": "diloco:inner_steps=2",
    "powersgd": "powersgd:start_iter=2",
    "async": "async:sync_interval_ms=5.0",
}


def join_every_algorithm():
    rank = dist.get_rank()
    report = {}
    for name in unison.algorithms.names():
        net, opt, model = build(OFTEN.get(name, name))
        before = [p.detach().clone() for p in net.parameters()]
        batches = 5 + 7 * rank  # rank 1 has more than twice as many
        with model.join():
            for i in range(batches):
                step(model, opt, i, rank)
                if i == 1:
                    with torch.no_grad():
                        model(batch(0, rank)[0])  # an evaluation forward in the middle
        moved = max((p - b).abs().max().item() for p, b in zip(net.parameters(), before))
        report[name] = (spread_across_ranks(net), moved, all(torch.isfinite(p).all() for p in net.parameters()))
        model.switch_to("allreduce")  # leaves no thread behind before the next model
    return report


def test_join_every_algorithm_finishes_with_equal_parameters():
    report = launch.run(join_every_algorithm, 2, timeout=240, pg_timeout=60)[0]
    assert set(report) == set(unison.algorithms.names())
    for name, (spread, moved, finite) in report.items():
        assert spread == 0.0, f"{name}: replicas differ by {spread} after join"
        assert moved > 0 and finite, name


def join_matches_reference():
    """allreduce under join: each step averages the gradients of the ranks still training, over the full world."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    reference = torch.nn.Linear(4, 1)
    reference.load_state_dict(net.state_dict())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = unison.DataParallel(net, optimizer=opt)
    lengths = [2, 5]

    def data(r, i):
        g = torch.Generator().manual_seed(100 * r + i)
        return torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)

    with model.join():
        for i in range(lengths[rank]):
            x, y = data(rank, i)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    for i in range(max(lengths)):
        grads = [torch.zeros_like(p) for p in reference.parameters()]
        for r in range(world):
            if i < lengths[r]:
                reference.zero_grad()
                x, y = data(r, i)
                F.mse_loss(reference(x), y).backward()
                for g, p in zip(grads, reference.parameters()):
                    g += p.grad / world
        with torch.no_grad():
            for g, p in zip(grads, reference.parameters()):
                p -= 0.1 * g
    return max((a - b).abs().max().item() for a, b in zip(net.parameters(), reference.parameters()))


def test_join_averages_over_the_ranks_still_training():
    assert max(launch.run(join_matches_reference, 2)) < 1e-6


def join_throws_when_asked():
    rank = dist.get_rank()
    net, opt, model = build()
    try:
        with model.join(throw_on_early_termination=True):
            for i in range(2 + 3 * rank):
                step(model, opt, i, rank)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_join_throw_on_early_termination_raises_on_every_rank():
    messages = launch.run(join_throws_when_asked, 2)
    assert all("ran out of inputs" in m for m in messages), messages


# ---- ranks that die or stop answering ----------------------------------------
def train_until_a_rank_fails(algorithm, how):
    rank = dist.get_rank()
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    net, opt, model = build(algorithm)
    start = None
    try:
        for i in range(10_000):
            if rank == 1 and i == 5:
                if how == "exit":
                    os._exit(1)
                if how == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                if how == "stuck":  # alive (its heartbeat goes on) but away from the collectives
                    time.sleep(PG_TIMEOUT + 4)
                    os._exit(1)
            if i == 5:
                start = time.monotonic()
            step(model, opt, i, rank)
            if algorithm == "async":
                time.sleep(0.01)  # let the background averaging run
    except unison.RankFailure as exc:
        elapsed = time.monotonic() - start
        for pid in pids[1:2]:
            if how == "stop":
                os.kill(pid, signal.SIGKILL)  # the silent rank would never end otherwise
        return {"message": str(exc), "ranks": exc.ranks, "elapsed": elapsed}
    return None


@pytest.mark.parametrize(
    "algorithm,how,world",
    [
        ("allreduce", "exit", 3),
        ("allreduce", "stop", 2),
        ("async", "exit", 2),
        ("nonblocking", "exit", 2),
        ("local_sgd:period=2", "exit", 2),
    ],
)
def test_survivors_name_the_rank_that_died_or_went_silent(algorithm, how, world):
    outcomes = launch.run_outcomes(train_until_a_rank_fails, world, algorithm, how, timeout=90, pg_timeout=PG_TIMEOUT)
    assert outcomes[1]["exitcode"] != 0
    for r in [0] + list(range(2, world)):
        result = outcomes[r].get("ok")
        assert result is not None, outcomes[r]
        assert result["ranks"] == [1], result
        assert "rank 1 (" in result["message"] and "stopped answering" in result["message"], result["message"]
        # A dead peer is seen at once; a silent one after the collective timeout. Both then need a few heartbeats.
        assert result["elapsed"] < PG_TIMEOUT + 10, result


def test_a_rank_alive_but_stuck_is_named_as_behind():
    outcomes = launch.run_outcomes(train_until_a_rank_fails, 2, "allreduce", "stuck", timeout=90, pg_timeout=PG_TIMEOUT)
    result = outcomes[0]["ok"]
    assert result["ranks"] == [1], result
    assert "rank(s) 1, alive but behind" in result["message"], result["message"]
    assert result["elapsed"] < PG_TIMEOUT + 10, result


# ---- non-finite gradients ---------------------------------------------------
def nonfinite_runs(mode, algorithm):
    rank = dist.get_rank()
    net, opt, model = build(algorithm, nonfinite=mode)
    try:
        for i in range(6):
            step(model, opt, i, rank, poison=(rank == 1 and i == 3))
    except FloatingPointError as exc:
        return {"error": str(exc), "step": i}
    model.average()
    return {
        "skipped": model.skipped_steps,
        "finite": all(bool(torch.isfinite(p).all()) for p in net.parameters()),
        "spread": spread_across_ranks(net),
    }


@pytest.mark.parametrize("algorithm", ["allreduce", "local_sgd", "powersgd"])
def test_nonfinite_skip_skips_the_step_on_every_rank(algorithm):
    for result in launch.run(nonfinite_runs, 2, "skip", algorithm):
        assert result == {"skipped": 1, "finite": True, "spread": 0.0}


@pytest.mark.parametrize("algorithm", ["allreduce", "decentralized"])
def test_nonfinite_raise_names_the_rank_and_parameter_everywhere(algorithm):
    for result in launch.run(nonfinite_runs, 2, "raise", algorithm):
        assert result["step"] == 3
        assert "rank 1" in result["error"] and "'layers.0.weight'" in result["error"], result


def test_nonfinite_option_is_validated():
    with pytest.raises(ValueError, match="nonfinite must be None, 'raise' or 'skip'"):
        unison.DataParallel(MLP(), nonfinite="ignore")


# ---- desync -----------------------------------------------------------------
def desync_in_debug_mode(debug):
    rank = dist.get_rank()
    net, opt, model = build(debug=debug)
    try:
        for i in range(4):
            if rank == 1 and i == 2:
                with model.no_sync():  # rank 1 skips synchronizing: the others would mix data or hang
                    step(model, opt, i, rank)
            else:
                step(model, opt, i, rank)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_debug_mode_catches_a_rank_running_a_different_step():
    messages = launch.run(desync_in_debug_mode, 2, True, timeout=60)
    for m in messages:
        assert "differ between ranks" in m and "synchronized (not no_sync)" in m, m


def debug_mode_is_quiet_when_in_step():
    rank = dist.get_rank()
    net, opt, model = build(debug=True)
    for i in range(3):
        step(model, opt, i, rank)
    return spread_across_ranks(net)


def test_debug_mode_passes_a_normal_run():
    assert launch.run(debug_mode_is_quiet_when_in_step, 2) == [0.0, 0.0]
