"""unison.compat.heat: HeAT's documented API on real gloo ranks.

HeAT's DataParallel (non-blocking by default) follows unison's "nonblocking"
exactly, blocking follows "allreduce"; the DASO object on 2 simulated nodes
follows the "daso" algorithm exactly, with its scheduler and GradScaler; every
documented argument is seen to act, or to be accepted as documented."""

from __future__ import annotations

import contextlib
import io
import warnings

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, batch

import unison

NODES = {"UNISON_NODES": "2"}


def flat(net) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


def spread(t: torch.Tensor) -> float:
    """Largest difference of ``t`` between the ranks."""
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return (hi - lo).abs().max().item()


def sgd(net):
    return [torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)]


def two(net):
    params = list(net.parameters())
    return [torch.optim.SGD(params[:2], lr=0.05), torch.optim.Adam(params[2:], lr=0.01)]


# ---- DataParallel / DataParallelOptimizer ---------------------------------------


def native(algorithm: str, make_opts=sgd, steps: int = 6) -> torch.Tensor:
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = MLP()
    opts = make_opts(net)
    model = unison.DataParallel(net, optimizer=opts, algorithm=algorithm)
    for s in range(steps):
        x, y = batch(s, rank)
        for o in opts:
            o.zero_grad(set_to_none=False)
        F.mse_loss(model(x), y).backward()
        for o in opts:
            o.step()
    model.flush()
    return flat(net)


def heat_script(make_opts=sgd, steps: int = 6, **kwargs):
    """HeAT's documented usage, with only the import changed."""
    from unison.compat import heat as ht

    rank = ht.MPI_WORLD.rank
    torch.manual_seed(0)
    net = MLP()
    opts = [ht.optim.DataParallelOptimizer(o) for o in make_opts(net)]
    model = ht.nn.DataParallel(net, ht.MPI_WORLD, opts if len(opts) > 1 else opts[0], **kwargs)
    for s in range(steps):
        x, y = batch(s, rank)
        for o in opts:
            o.zero_grad()
        F.mse_loss(model(x), y).backward()
        for o in opts:
            o.step()
    model.flush()
    return model, flat(net)


def check_data_parallel() -> dict:
    from unison.compat import heat as ht

    rank = dist.get_rank()
    out = {"world": (ht.MPI_WORLD.rank, ht.MPI_WORLD.size, ht.MPI_WORLD.Get_rank(), ht.MPI_WORLD.Get_size())}
    model, heat_nb = heat_script()
    out["default_algorithm"] = model.algorithm.name
    out["nonblocking_gap"] = (heat_nb - native("nonblocking")).abs().max().item()
    out["vs_allreduce_gap"] = (heat_nb - native("allreduce")).abs().max().item()
    model, heat_b = heat_script(blocking_parameter_updates=True)
    out["blocking_algorithm"] = model.algorithm.name
    out["blocking_gap"] = (heat_b - native("allreduce")).abs().max().item()
    model, heat_two = heat_script(two)
    out["two_algorithm"] = model.algorithm.name
    out["two_gap"] = (heat_two - native("nonblocking", two)).abs().max().item()
    out["spread"] = spread(heat_nb)

    # Non-blocking: step() is applied at the next forward; eval() applies it too.
    torch.manual_seed(0)
    net = MLP()
    opt = ht.optim.DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    model = ht.nn.DataParallel(net, None, opt)
    x, y = batch(0, rank)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    before = flat(net)
    opt.step()
    out["deferred"] = (flat(net) - before).abs().max().item()
    out["update_next_after_step"] = opt.update_next
    model(x)
    out["applied_at_forward"] = (flat(net) - before).abs().max().item()
    out["update_next_after_forward"] = opt.update_next
    opt.zero_grad()
    out["zeroed_not_none"] = all(p.grad is not None and not p.grad.any() for p in net.parameters())
    F.mse_loss(model(x), y).backward()
    before = flat(net)
    opt.step()
    model.eval()  # HeAT finalizes pending updates at the end of the training phase
    out["applied_at_eval"] = (flat(net) - before).abs().max().item()
    model.train()

    # Switching the flag switches the algorithm (and the optimizer's flag).
    model.blocking_parameter_updates = True
    out["switched"] = (model.algorithm.name, opt.blocking_parameter_updates)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    before = flat(net)
    opt.step()
    out["blocking_step_immediate"] = (flat(net) - before).abs().max().item()
    out["blocking_update_next"] = opt.update_next

    # comm: a torch ProcessGroup (the world, or a group of all ranks) works like MPI_WORLD.
    for name, comm in (("world_group", dist.group.WORLD), ("new_group", dist.new_group([0, 1]))):
        torch.manual_seed(0)
        net = MLP()
        o = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        m = ht.nn.DataParallel(net, comm, ht.optim.DataParallelOptimizer(o), blocking_parameter_updates=True)
        for s in range(6):
            xx, yy = batch(s, rank)
            o.zero_grad(set_to_none=False)
            F.mse_loss(m(xx), yy).backward()
            o.step()
        out[name] = (flat(net) - native("allreduce")).abs().max().item()

    # A torch optimizer is wrapped; HeAT's misuse (the optimizer as comm) is refused with the signature.
    torch.manual_seed(0)
    net = MLP()
    raw = torch.optim.SGD(net.parameters(), lr=0.1)
    m = ht.nn.DataParallel(net, ht.MPI_WORLD, raw)
    out["raw_optimizer"] = m.algorithm.name
    with pytest.raises(TypeError, match=r"DataParallel\(module, comm, optimizer\)"):
        ht.nn.DataParallel(MLP(), raw)
    with pytest.raises(AttributeError, match="torch.distributed on comm.group"):
        _ = ht.MPI_WORLD.Allreduce
    # DataParallelMultiGPU with a torch optimizer: node-local only; one node of 2 here = allreduce.
    torch.manual_seed(0)
    net = MLP()
    o = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    m = ht.nn.DataParallelMultiGPU(net, o)
    for s in range(6):
        xx, yy = batch(s, rank)
        o.zero_grad(set_to_none=False)
        F.mse_loss(m(xx), yy).backward()
        o.step()
    out["multigpu_node_local"] = (flat(net) - native("allreduce")).abs().max().item()
    return out


@pytest.fixture(scope="module")
def dp_results():
    return launch.run(check_data_parallel, 2, timeout=120)


def test_default_is_nonblocking_and_follows_unison_nonblocking(dp_results):
    for r in dp_results:
        assert r["world"] == (r["world"][0], 2, r["world"][0], 2)
        assert r["default_algorithm"] == "nonblocking"
        assert r["nonblocking_gap"] == 0.0
        assert r["vs_allreduce_gap"] < 1e-6
        assert r["spread"] == 0.0
    assert sorted(r["world"][0] for r in dp_results) == [0, 1]


def test_blocking_follows_allreduce_and_several_optimizers_stay_nonblocking(dp_results):
    for r in dp_results:
        assert r["blocking_algorithm"] == "allreduce"
        assert r["blocking_gap"] == 0.0
        assert r["two_algorithm"] == "nonblocking"
        assert r["two_gap"] == 0.0


def test_step_is_applied_at_the_next_forward_or_eval(dp_results):
    for r in dp_results:
        assert r["deferred"] == 0.0
        assert r["update_next_after_step"] is True
        assert r["applied_at_forward"] > 0.0
        assert r["update_next_after_forward"] is False
        assert r["zeroed_not_none"]
        assert r["applied_at_eval"] > 0.0
        assert r["switched"] == ("allreduce", True)
        assert r["blocking_step_immediate"] > 0.0
        assert r["blocking_update_next"] is False


def test_comm_accepts_process_groups_and_multigpu_is_node_local(dp_results):
    for r in dp_results:
        assert r["world_group"] == 0.0
        assert r["new_group"] == 0.0
        assert r["raw_optimizer"] == "nonblocking"
        assert r["multigpu_node_local"] == 0.0


# ---- DASO ------------------------------------------------------------------------

EPOCHS, BATCHES = 5, 6
SCHEDULE = dict(warmup_epochs=1, cooldown_epochs=1, max_global_skips=4)


def daso_native(scheduler=False, scaler=False, **options):
    """unison's "daso" algorithm, as unison's README uses it."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5) if scheduler else None
    algo = unison.algorithms.create("daso", total_epochs=EPOCHS, **{**SCHEDULE, **options})
    model = unison.DataParallel(net, opt, algorithm=algo)
    sc = torch.amp.GradScaler("cpu", init_scale=8.0) if scaler else None
    if sc is not None:
        model.add_scaler(sc)
    for e in range(EPOCHS):
        for b in range(BATCHES):
            x, y = batch(e * BATCHES + b, rank)
            opt.zero_grad(set_to_none=False)
            loss = F.mse_loss(model(x), y)
            if sc is None:
                loss.backward()
                opt.step()
            else:
                sc.scale(loss).backward()
                sc.step(opt)
                sc.update()
            if sched is not None:
                sched.step()
        model.end_epoch(loss)
    return flat(net)


def daso_script(scheduler=False, scaler=False, trace=None, **options):
    """HeAT's DASO checklist, with only the import changed."""
    from unison.compat import heat as ht

    rank = ht.MPI_WORLD.rank
    torch.manual_seed(0)
    net = MLP()  # 2. the network
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)  # 3. the local optimizer
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5) if scheduler else None  # 4.
    daso = ht.optim.DASO(
        local_optimizer=optimizer, total_epochs=EPOCHS, scheduler=sched, **{**SCHEDULE, **options}
    )  # 5.
    model = ht.nn.DataParallelMultiGPU(net, daso)  # 6.
    sc = None
    if scaler:  # 7.
        sc = torch.amp.GradScaler("cpu", init_scale=8.0)
        daso.add_scaler(sc)
    for e in range(EPOCHS):
        daso.last_batch = BATCHES - 1  # 10.
        for b in range(BATCHES):
            x, y = batch(e * BATCHES + b, rank)
            daso.zero_grad()
            loss = F.mse_loss(model(x), y)
            (loss if sc is None else sc.scale(loss)).backward()
            daso.step()  # 11.
            if trace is not None:
                trace.append(spread(flat(net)))
        daso.epoch_loss_logic(loss)  # 9.
        if trace is not None:
            trace.append(
                ("epoch", daso.epoch, daso.global_skip, daso.local_skip, daso.batches_to_wait, spread(flat(net)))
            )
    return daso, model, flat(net)


def check_daso() -> dict:
    from unison.compat import heat as ht

    out = {}
    trace: list = []
    daso, model, x = daso_script(trace=trace)
    out["gap"] = (x - daso_native()).abs().max().item()
    out["trace"] = trace
    out["options"] = {
        k: model.algorithm.options[k]
        for k in ("total_epochs", "sending_chunk_size", "downcast_type", "stability_level")
    }
    out["attributes"] = (daso.max_gs, daso.split_val, daso.cast_dtype, daso.loc_gpus, daso.amp, len(daso.params_ref))
    _, _, x = daso_script(scheduler=True)
    out["scheduler_gap"] = (x - daso_native(scheduler=True)).abs().max().item()
    d, _, x = daso_script(scaler=True)
    out["scaler_gap"] = (x - daso_native(scaler=True)).abs().max().item()
    out["amp"] = d.amp
    d, _, x = daso_script(use_mpi_groups=False, downcast_type=torch.half, sending_chunk_size=100, stability_level=0.1)
    out["groups_gap"] = (
        (x - daso_native(downcast_type=torch.half, sending_chunk_size=100, stability_level=0.1)).abs().max().item()
    )
    out["half_options"] = (
        d.module.algorithm.options["downcast_type"],
        d.module.algorithm.options["sending_chunk_size"],
    )

    # The scheduler really steps once per batch: lr halves every 5 batches.
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    daso = ht.optim.DASO(opt, total_epochs=3, scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5))
    model = ht.nn.DataParallelMultiGPU(net, daso)
    for s in range(10):
        x, y = batch(s, dist.get_rank())
        daso.zero_grad()
        F.mse_loss(model(x), y).backward()
        daso.step()
    out["lr"] = opt.param_groups[0]["lr"]
    out["current_batch"] = daso.current_batch

    # last_batch is checked against the batches stepped; verbose prints on rank 0 only.
    daso.verbose = True
    daso.last_batch = 3
    buf = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(buf):
        warnings.simplefilter("always")
        daso.epoch_loss_logic(torch.tensor(1.0))
    out["last_batch_warning"] = [str(w.message) for w in caught]
    out["printed"] = buf.getvalue()
    daso.last_batch = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        daso.epoch_loss_logic(1.0, loss_globally_averaged=True)  # no batch stepped, last_batch 0: consistent
    out["no_warning"] = [str(w.message) for w in caught]
    out["epoch_before_reset"] = daso.epoch

    # reset(): back to epoch 0 and the warm-up, replicas identical, gradients zero.
    x, y = batch(99, dist.get_rank())
    F.mse_loss(model(x), y).backward()
    daso.reset()
    out["reset"] = (daso.epoch, daso.global_skip, daso.current_batch, spread(flat(net)))
    out["reset_grads_zero"] = all(not p.grad.any() for p in net.parameters())

    # Misuse is named.
    lone = ht.optim.DASO(torch.optim.SGD(MLP().parameters(), lr=0.1), total_epochs=2)
    with pytest.raises(RuntimeError, match="DataParallelMultiGPU"):
        lone.step()
    with pytest.raises(TypeError, match="DataParallelMultiGPU"):
        lone.set_model(MLP())
    with pytest.raises(ValueError, match="already drives"):
        ht.nn.DataParallelMultiGPU(net, daso)

    # HeAT accepts skip_reduction_factor=1 and max_global_skips=0: either they reach the algorithm or the gap is named.
    for name, value in (("skip_reduction_factor", 1), ("max_global_skips", 0)):
        try:
            d = ht.optim.DASO(torch.optim.SGD(MLP().parameters(), lr=0.1), total_epochs=2, **{name: value})
            out[name] = ("works", d.algorithm.options[name])
        except NotImplementedError as exc:
            out[name] = ("not implemented", str(exc))

    # DataParallelMultiGPU with a plain optimizer on 2 nodes x 1: no global sync, replicas part.
    torch.manual_seed(0)
    net = MLP()
    o = torch.optim.SGD(net.parameters(), lr=0.05)
    m = ht.nn.DataParallelMultiGPU(net, o)
    for s in range(3):
        x, y = batch(s, dist.get_rank())
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        o.step()
    out["node_local_spread"] = spread(flat(net))
    return out


@pytest.fixture(scope="module")
def daso_results():
    return launch.run(check_daso, 2, env=NODES, timeout=150)


def test_daso_checklist_follows_the_daso_algorithm(daso_results):
    for r in daso_results:
        assert r["gap"] == 0.0
        assert r["scheduler_gap"] == 0.0
        assert r["scaler_gap"] == 0.0 and r["amp"] is True
        assert r["groups_gap"] == 0.0
        assert r["half_options"] == (torch.half, 100)
        assert r["options"] == {
            "total_epochs": EPOCHS,
            "sending_chunk_size": 10_000_000,
            "downcast_type": torch.bfloat16,
            "stability_level": 0.05,
        }
        assert r["attributes"] == (4, 10_000_000, torch.bfloat16, 1, False, 6)


def test_daso_phases_and_attributes(daso_results):
    for r in daso_results:
        epochs = [t for t in r["trace"] if isinstance(t, tuple)]
        # epoch, global_skip, local_skip, batches_to_wait after each epoch_loss_logic
        assert [t[1:5] for t in epochs] == [(1, 4, 1, 1), (2, 4, 1, 1), (3, 4, 1, 1), (4, 0, 0, 0), (5, 0, 0, 0)]
        assert all(t[5] == 0.0 for t in epochs)  # identical after every epoch
        steps = [t for t in r["trace"] if not isinstance(t, tuple)]
        warm, cycling, cool = steps[:BATCHES], steps[BATCHES : 4 * BATCHES], steps[4 * BATCHES :]
        assert max(warm) == 0.0 and max(cool) == 0.0  # blocking syncs after every batch
        assert max(cycling) > 0.0  # the nodes drift between syncs


def test_daso_scheduler_last_batch_verbose_reset(daso_results):
    for rank, r in enumerate(daso_results):
        assert r["lr"] == pytest.approx(0.05 * 0.25)
        assert r["current_batch"] == 10
        assert len(r["last_batch_warning"]) == 1 and "last_batch is 3" in r["last_batch_warning"][0]
        assert r["no_warning"] == []
        assert ("DASO after epoch 1" in r["printed"]) == (rank == 0)
        assert r["epoch_before_reset"] == 2
        assert r["reset"] == (0, 0, 0, 0.0)
        assert r["reset_grads_zero"]
        assert r["node_local_spread"] > 0.0


def test_daso_settings_heat_accepts(daso_results):
    for r in daso_results:
        for name, value in (("skip_reduction_factor", 1), ("max_global_skips", 0)):
            status, detail = r[name]
            assert (status, detail) == ("works", value) or (status == "not implemented" and name in detail)


def test_daso_checks_heat_types_and_ranges():
    """HeAT's own type and range checks, before any communication."""
    from unison.compat import heat as ht

    opt = torch.optim.SGD(MLP().parameters(), lr=0.1)
    with pytest.raises(TypeError, match="total_epochs"):
        ht.optim.DASO(opt, total_epochs=2.0)
    with pytest.raises(ValueError, match="total_epochs"):
        ht.optim.DASO(opt, total_epochs=0)
    with pytest.raises(ValueError, match="warmup_epochs"):
        ht.optim.DASO(opt, total_epochs=3, warmup_epochs=-1)
    with pytest.raises(TypeError, match="downcast_type"):
        ht.optim.DASO(opt, total_epochs=3, downcast_type="bf16")
    with pytest.raises(ValueError, match="downcast_type"):
        ht.optim.DASO(opt, total_epochs=3, downcast_type=torch.int8)
    with pytest.raises(TypeError, match="not a class"):
        ht.optim.DASO(opt, total_epochs=3, scheduler=torch.optim.lr_scheduler.StepLR)
    with pytest.raises(TypeError, match="ReduceLROnPlateau"):
        ht.optim.DASO(opt, total_epochs=3, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(TypeError, match="verbose"):
        ht.optim.DASO(opt, total_epochs=3, verbose=1)
    with pytest.raises(TypeError, match="Local optimizer"):
        ht.optim.DASO(MLP(), total_epochs=3)
    with pytest.raises(TypeError, match="comm"):
        ht.nn.DataParallel(MLP(), opt)
    with pytest.raises(TypeError, match="blocking"):
        ht.optim.DataParallelOptimizer(opt, blocking=1)
    assert ht.nn.Linear is torch.nn.Linear and ht.optim.SGD is torch.optim.SGD
