"""The "async" algorithm on 2 gloo ranks: a background thread averages the
parameters while each rank trains; the update rule, safety against the
optimizer step, errors raised in the training thread, and stopping together."""

import gc
import time

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, batch
from scenarios import spread_across_ranks

import unison
from unison.algorithms.averaging import async_rounds
from unison.algorithms.averaging import asynchronous as async_average

#: A check that waits for something polls until this many seconds have passed.
DEADLINE_S = 20.0


class CheckedSGD(torch.optim.Optimizer):
    """Plain SGD whose slow step counts the parameters that changed under it
    other than by its own update (the averaging thread must wait for the step)."""

    def __init__(self, params, lr: float):
        super().__init__(params, {"lr": lr})
        self.violations = 0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            before = [p.clone() for p in params]
            time.sleep(0.002)
            for p in params:
                p.add_(p.grad, alpha=-group["lr"])
            time.sleep(0.001)
            self.violations += sum(
                not torch.equal(p, b.add(p.grad, alpha=-group["lr"])) for p, b in zip(params, before)
            )


def async_model(net, opt, process_group=None, **options):
    return unison.DataParallel(
        net, opt, algorithm=unison.algorithms.create("async", **options), process_group=process_group
    )


def train_step(model, opt, step, rank):
    opt.zero_grad()
    loss = F.mse_loss(model(batch(step % 8, rank)[0]), batch(step % 8, rank)[1])
    loss.backward()
    opt.step()
    return loss.item()


def wait_until(condition) -> bool:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def offset(shape, rank: int, k: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * rank + k)) * 0.1


def update_rule(rank, world):
    """Replicas made different (without training) become exactly their average,
    and every exchange is counted in bytes_sent."""
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    model = async_model(net, opt, sync_interval_ms=20, warmup_steps=0)
    alg = model.algorithm_state
    start = [p.detach().clone() for p in net.parameters()]
    with torch.no_grad():
        for k, p in enumerate(net.parameters()):
            p.add_(offset(p.shape, rank, k))
    expected = [x + sum(offset(x.shape, r, k) for r in range(world)) / world for k, x in enumerate(start)]
    train_step(model, opt, 0, rank)  # lr 0: changes nothing, starts the thread
    running_after_first_step = alg.running
    dist.barrier()
    first = alg.rounds
    waited = wait_until(lambda: alg.rounds >= first + 2)
    error = max((p - e).abs().max().item() for p, e in zip(net.parameters(), expected))
    spread = spread_across_ranks(net)
    model.average()
    numel = sum(p.numel() for p in net.parameters())
    exact_bytes = (alg.rounds + 1) * 2 * (world - 1) * 4 // world + alg.rounds * (2 * (world - 1) * numel * 4 // world)
    result = {
        "running_after_first_step": running_after_first_step,
        "waited": waited,
        "error_from_mean": error,
        "spread": spread,
        "moved": max((p - x).abs().max().item() for p, x in zip(net.parameters(), start)),
        "bytes_exact": alg.bytes_sent == exact_bytes,
        "running_after_average": alg.running,
    }
    train_step(model, opt, 1, rank)
    result["restarted_by_step"] = alg.running
    model.switch_to("allreduce")
    steps = alg.steps
    train_step(model, opt, 2, rank)
    result["stopped_by_switch"] = not alg.running and alg.steps == steps
    return result


def tight_loop(rank, world):
    """Training as fast as possible while the thread averages: the step is never
    disturbed, the loss falls, average() makes the replicas identical."""
    torch.manual_seed(0)
    net = MLP()
    opt = CheckedSGD(net.parameters(), lr=0.05)
    model = async_model(net, opt, sync_interval_ms=10, warmup_steps=5)
    alg = model.algorithm_state
    losses = [train_step(model, opt, s, rank) for s in range(4)]
    result = {"running_in_warmup": alg.running}
    losses.append(train_step(model, opt, 4, rank))
    result["running_after_warmup"] = alg.running
    result["warmup_spread"] = spread_across_ranks(net)
    deadline = time.monotonic() + DEADLINE_S
    step = 5
    while (step < 150 or alg.rounds < 10) and time.monotonic() < deadline:
        losses.append(train_step(model, opt, step, rank))
        step += 1
    result["rounds"] = alg.rounds
    result["violations"] = opt.violations
    result["finite"] = all(torch.isfinite(p).all().item() for p in net.parameters())
    result["first_loss"] = sum(losses[:8]) / 8
    result["last_loss"] = sum(losses[-8:]) / 8
    dist.barrier()
    t = time.monotonic()
    model.average()
    result["average_s"] = time.monotonic() - t
    result["final_spread"] = spread_across_ranks(net)
    state = model.state_dict()["_unison_algorithm"]
    fresh = async_average.AsyncState()
    fresh.load_state_dict(state["state"])
    result["state"] = (state["name"], fresh.state_dict() == alg.state_dict(), alg.bytes_sent > 0)
    result["comm_stats_count_it"] = model.comm_stats["bytes_total"] >= alg.bytes_sent
    model.switch_to("allreduce")
    train_step(model, opt, 0, rank)
    model.switch_to(unison.algorithms.create("async", sync_interval_ms=10, warmup_steps=0))
    again = model.algorithm_state
    train_step(model, opt, 1, rank)
    result["rounds_after_switching_back"] = wait_until(lambda: again.rounds >= 2)
    model.switch_to("allreduce")
    return result


def failing_average(*args, **kwargs):
    raise ValueError("injected failure")


def train_until_error(model, opt, rank, inject: bool):
    """Train (with the background averaging made to fail if ``inject``) until the
    training thread raises, or DEADLINE_S passes; return the exception or None."""
    real = async_rounds.ChunkedRound.launch
    if inject:
        async_rounds.ChunkedRound.launch = failing_average
    deadline = time.monotonic() + DEADLINE_S
    try:
        step = 1
        while time.monotonic() < deadline:
            try:
                train_step(model, opt, step, rank)
            except RuntimeError as exc:
                return exc
            step += 1
        return None
    finally:
        async_rounds.ChunkedRound.launch = real


def errors_surface(rank, world):
    """An exception in the background thread is raised in the training thread."""
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = async_model(net, opt, sync_interval_ms=10, warmup_steps=0)
    alg = model.algorithm_state
    train_step(model, opt, 0, rank)
    caught = train_until_error(model, opt, rank, inject=True)
    result = {"message": str(caught), "cause": type(caught.__cause__).__name__ if caught is not None else None}
    for s in range(3):
        train_step(model, opt, s, rank)  # reported once; no restart after an error
    result["restarted"] = alg.running
    model.average()
    result["spread"] = spread_across_ranks(net)
    return result


def one_rank_fails():
    """The thread of rank 0 fails in the middle of a round: rank 1's waits at most
    the timeout given to unison.init() (3 s here), then fails too (an error, not a hang)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = async_model(net, opt, sync_interval_ms=10, warmup_steps=0)
    train_step(model, opt, 0, rank)
    start = time.monotonic()
    caught = train_until_error(model, opt, rank, inject=rank == 0)
    if rank == 0:
        time.sleep(8)  # stay alive (no barrier: the group is broken) while rank 1 runs into its timeout
    return {"message": str(caught), "seconds": time.monotonic() - start}


def peer_tears_down(rank, world, how):
    """Rank 0 stops (teardown, or its model is garbage collected); rank 1's thread stops too and stays stopped."""
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = async_model(net, opt, sync_interval_ms=10, warmup_steps=0)
    alg = model.algorithm_state
    train_step(model, opt, 0, rank)
    dist.barrier()
    result = {}
    if rank == 0:
        if how == "teardown":
            model.close()
            result["stopped"] = not alg.running
        else:
            del model, opt, net
            gc.collect()
            result["stopped"] = wait_until(lambda: not alg.running)
    else:
        step = [1]

        def stopped():
            train_step(model, opt, step[0], rank)
            step[0] += 1
            return not alg.running

        result["stopped"] = wait_until(stopped)
        for s in range(3):
            train_step(model, opt, s, rank)
        result["restarted"] = alg.running
    dist.barrier()
    return result


_kept: list = []


def peer_exits(rank, world):
    """Rank 0 returns (and its process exits) with its thread running: rank 1's
    next exchange fails and the error reaches its training thread."""
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = async_model(net, opt, sync_interval_ms=10, warmup_steps=0)
    train_step(model, opt, 0, rank)
    dist.barrier()
    if rank == 0:
        _kept.append(model)  # alive until the process exits (a returned-from local would be collected: a clean stop)
        return {"left": True}
    caught, step, deadline = None, 1, time.monotonic() + DEADLINE_S
    while caught is None and time.monotonic() < deadline:
        try:
            train_step(model, opt, step, rank)
        except RuntimeError as exc:
            caught = exc
        step += 1
    return {"message": str(caught)}


def everything():
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {
        "update_rule": update_rule(rank, world),
        "tight_loop": tight_loop(rank, world),
        "errors_surface": errors_surface(rank, world),
        "teardown": peer_tears_down(rank, world, "teardown"),
        "collected": peer_tears_down(rank, world, "collected"),
    }
    results["peer_exits"] = peer_exits(rank, world)
    return results


@pytest.fixture(scope="module")
def ranks():
    return launch.run(everything, 2, timeout=120)


def test_replicas_become_their_average(ranks):
    for r in ranks:
        u = r["update_rule"]
        assert u["running_after_first_step"] and u["waited"]
        assert u["error_from_mean"] < 1e-6 and u["spread"] < 1e-6
        assert u["moved"] > 1e-3
        assert u["bytes_exact"]


def test_average_stops_the_thread_and_the_next_step_restarts_it(ranks):
    for r in ranks:
        u = r["update_rule"]
        assert not u["running_after_average"]
        assert u["restarted_by_step"]
        assert u["stopped_by_switch"]


def test_training_while_averaging_never_disturbs_a_step(ranks):
    for r in ranks:
        t = r["tight_loop"]
        assert t["rounds"] >= 10
        assert t["violations"] == 0
        assert t["finite"]
        assert t["last_loss"] < t["first_loss"]


def test_warmup_is_synchronous(ranks):
    for r in ranks:
        t = r["tight_loop"]
        assert not t["running_in_warmup"] and t["running_after_warmup"]
        assert t["warmup_spread"] == 0.0


def test_average_makes_replicas_identical_without_waiting_for_a_timeout(ranks):
    for r in ranks:
        t = r["tight_loop"]
        assert t["final_spread"] == 0.0
        assert t["average_s"] < 5


def test_counters_are_saved_and_switching_back_restarts(ranks):
    for r in ranks:
        t = r["tight_loop"]
        assert t["state"] == ("async", True, True)
        assert t["comm_stats_count_it"]
        assert t["rounds_after_switching_back"]


def test_background_error_is_raised_in_the_training_thread(ranks):
    for r in ranks:
        e = r["errors_surface"]
        assert "injected failure" in e["message"] and "Traceback" in e["message"]
        assert e["cause"] == "ValueError"
        assert not e["restarted"]
        assert e["spread"] == 0.0


def test_one_rank_failing_makes_the_other_fail_within_the_timeout():
    ranks = launch.run(one_rank_fails, 2, timeout=60, pg_timeout=3)
    assert "injected failure" in ranks[0]["message"]
    other = ranks[1]
    assert "averaging round" in other["message"] and "another rank" in other["message"]
    assert other["seconds"] < DEADLINE_S


@pytest.mark.parametrize("how", ["teardown", "collected"])
def test_a_rank_that_stops_stops_the_others(ranks, how):
    assert ranks[0][how]["stopped"]
    assert ranks[1][how]["stopped"]
    assert not ranks[1][how]["restarted"]


def test_a_rank_that_exits_makes_the_other_fail_not_hang(ranks):
    assert ranks[0]["peer_exits"] == {"left": True}
    # The background thread's error reaches the training thread as a RankFailure naming rank 0 (the
    # store is the launcher's, as under torchrun: rank 0's heartbeat went silent; a store that went
    # with rank 0 is tested in tests/unit/test_runtime.py).
    message = ranks[1]["peer_exits"]["message"]
    assert "rank 0 (" in message and "stopped answering" in message, message


def test_options_are_checked():
    for bad in (0, -5, float("inf"), True, "10"):
        with pytest.raises(ValueError, match="sync_interval_ms must be a positive number"):
            unison.algorithms.create("async", sync_interval_ms=bad)
    with pytest.raises(ValueError, match="warmup_steps"):
        unison.algorithms.create("async", warmup_steps=-1)
    with pytest.raises(ValueError, match="needs the optimizer"):
        unison.DataParallel(MLP(), algorithm="async")
