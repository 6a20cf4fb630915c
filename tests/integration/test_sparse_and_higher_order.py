"""Sparse gradients (``nn.Embedding(sparse=True)``), ``backward(create_graph=True)``,
``static_graph`` and ``gradient_as_bucket_view`` in the gradient engine: each compared
with torch DDP (``torch.nn.parallel.DistributedDataParallel``) in the same run, on 2 gloo ranks."""

from __future__ import annotations

import copy
import os
import tempfile
import traceback
from functools import partial
from typing import Any, Callable

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import unison

GRADIENT_ALGORITHMS = ["allreduce", "fp16", "bf16", "bytegrad", "powersgd", "qadam", "nonblocking"]
SPARSE_TAKERS = ["allreduce", "fp16", "bf16", "nonblocking"]
SPARSE_REFUSERS = ["bytegrad", "powersgd", "qadam"]
AVERAGING = ["local_sgd", "async", "decentralized", "low_precision_decentralized", "diloco", "daso"]


class SparseNet(nn.Module):
    """An embedding and an embedding bag with sparse gradients, and a dense head."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=sparse)
        self.bag = nn.EmbeddingBag(20, 4, mode="sum", sparse=sparse)
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.emb(ids).mean(1), self.bag(ids)], dim=1))


class Functional(nn.Module):
    """A sparse gradient the construction cannot foresee: F.embedding on a bare Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(20, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(F.embedding(ids, self.table, sparse=True).mean(1))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def ids_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices that differ between ranks (rows touched by one rank, by both, by none)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 12 + 4 * rank, (6, 3), generator=g), torch.randn(6, 1, generator=g)


def dense_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 3, generator=g), torch.randn(5, 1, generator=g)


def weights(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


def grads(net: nn.Module) -> list[torch.Tensor]:
    """Each parameter's gradient, dense (zeros where None)."""
    out = []
    for p in net.parameters():
        g = p.grad
        out.append(torch.zeros_like(p) if g is None else (g.to_dense() if g.is_sparse else g).detach().clone())
    return out


def gap(a: list[torch.Tensor] | torch.Tensor, b: list[torch.Tensor] | torch.Tensor) -> float:
    if isinstance(a, torch.Tensor):
        a, b = [a], [b]  # type: ignore[list-item]
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def spread(t: torch.Tensor) -> float:
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return (hi - lo).abs().max().item()


def step(model: nn.Module, opt: torch.optim.Optimizer, s: int, rank: int, data: Callable = ids_batch) -> None:
    x, y = data(s, rank)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def outcome(fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, or ``(error type name, message)``."""
    try:
        return fn()
    except Exception as exc:
        return (type(exc).__name__, str(exc), traceback.format_exc()[-800:])


# ---- sparse gradients -------------------------------------------------------------------
def check_sparse_allreduce() -> dict:
    """Four steps of SGD with momentum: unison's allreduce and torch DDP agree at every step,
    and the averaged gradient is sparse, as DDP's is."""
    rank, out = dist.get_rank(), {}
    torch.manual_seed(0)
    base = SparseNet()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    model, ddp = unison.DataParallel(ours), DDP(theirs)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    out["grad_gap"] = out["weight_gap"] = 0.0
    for s in range(4):
        x, y = ids_batch(s, rank)
        for m, o in ((model, opt), (ddp, ref_opt)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
        out["grad_gap"] = max(out["grad_gap"], gap(grads(ours), grads(theirs)))
        out["layouts"] = [str(p.grad.layout) for p in ours.parameters()]
        out["ddp_layouts"] = [str(p.grad.layout) for p in theirs.parameters()]
        opt.step()
        ref_opt.step()
        out["weight_gap"] = max(out["weight_gap"], gap(weights(ours), weights(theirs)))
    out["spread"] = spread(weights(ours))
    out["buckets_hold_sparse"] = any(
        id(p) in {id(q) for q in b.params}
        for b in model.core.reducer.buckets
        for p in (ours.emb.weight, ours.bag.weight)
    )
    out["bytes"] = model.comm_stats["bytes_last_step"]
    return out


def dense_twin(net: nn.Module) -> nn.Module:
    """``net`` with its embeddings' gradients dense: the same values, for torch DDP where it
    cannot take sparse ones (a sparse gradient missing on a rank; join)."""
    twin = copy.deepcopy(net)
    for m in twin.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            m.sparse = False
    return twin


def check_sparse_unused_on_one_rank() -> dict:
    """An embedding only rank 0 uses: both ranks end with its average, as torch DDP with
    find_unused_parameters=True gives for the dense twin (with the sparse one, DDP raises
    "Expected sparse gradient to be defined" on the rank that did not use it)."""
    rank, out = dist.get_rank(), {}

    class TwoTables(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Embedding(10, 3, sparse=True)
            self.b = nn.Embedding(10, 3, sparse=True)

        def forward(self, ids: torch.Tensor, use_b: bool) -> torch.Tensor:
            y = self.a(ids).sum()
            return y + self.b(ids).sum() if use_b else y

    torch.manual_seed(0)
    base = TwoTables()
    ours, theirs = copy.deepcopy(base), dense_twin(base)
    model, ddp = unison.DataParallel(ours), DDP(theirs, find_unused_parameters=True)
    ids = torch.tensor([rank, 3, 7])
    for m in (model, ddp):
        m(ids, rank == 0).backward()
    out["gap"] = gap(grads(ours), grads(theirs))
    out["layouts"] = [str(p.grad.layout) for p in ours.parameters()]
    out["none"] = [p.grad is None for p in ours.parameters()]
    out["ddp_none"] = [p.grad is None for p in theirs.parameters()]
    # Used by no rank: no gradient, as a dense parameter.
    ours.zero_grad(set_to_none=True)
    model(ids, False).backward()
    out["unused_none"] = ours.b.weight.grad is None
    return out


def check_sparse_no_sync() -> dict:
    """Two micro-batches accumulated under no_sync, then a synchronized one."""
    rank, out = dist.get_rank(), {}
    torch.manual_seed(0)
    base = SparseNet()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    model, ddp = unison.DataParallel(ours), DDP(theirs)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
    for m, o in ((model, opt), (ddp, ref_opt)):
        for s in range(2):
            o.zero_grad()
            for micro in range(2):
                x, y = ids_batch(10 * s + micro, rank)
                with m.no_sync():
                    F.mse_loss(m(x), y).backward()
            x, y = ids_batch(10 * s + 2, rank)
            F.mse_loss(m(x), y).backward()
            o.step()
    out["grad_gap"] = gap(grads(ours), grads(theirs))
    out["weight_gap"] = gap(weights(ours), weights(theirs))
    out["spread"] = spread(weights(ours))
    return out


def check_sparse_join() -> dict:
    """Uneven inputs under join(): a joined rank sends empty sparse gradients. Compared with
    torch DDP's join on the dense twin (with sparse gradients DDP's join fails: "Expected a
    proper Tensor but got None" in _get_zeros_like_grad_buckets)."""
    rank, out = dist.get_rank(), {}
    torch.manual_seed(0)
    base = SparseNet()
    ours, theirs = copy.deepcopy(base), dense_twin(base)
    model, ddp = unison.DataParallel(ours), DDP(theirs)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
    steps = 3 if rank == 0 else 1

    def run(m: nn.Module, o: torch.optim.Optimizer) -> torch.Tensor:
        with m.join():
            for s in range(steps):
                step(m, o, s, rank)
        return weights(m.module)

    out["ours"] = outcome(lambda: run(model, opt))
    out["ddp"] = outcome(lambda: run(ddp, ref_opt))
    if isinstance(out["ours"], torch.Tensor) and isinstance(out["ddp"], torch.Tensor):
        out["weight_gap"] = gap(out["ours"], out["ddp"])
    out["spread"] = spread(weights(ours))
    return out


def check_sparse_checkpoint(path: str) -> dict:
    """unison.save after two steps, unison.load into a fresh wrapper, two more steps: the
    same weights as four uninterrupted steps, and as torch DDP's four."""
    rank, out = dist.get_rank(), {}
    torch.manual_seed(0)
    base = SparseNet()

    def wrapped() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
        net = copy.deepcopy(base)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        return net, unison.DataParallel(net, optimizer=opt), opt

    net, model, opt = wrapped()
    for s in range(2):
        step(model, opt, s, rank)
    unison.save(path, model, opt, step=2)
    net2, model2, opt2 = wrapped()
    unison.load(path, model2, opt2)
    for s in range(2, 4):
        step(model2, opt2, s, rank)
    theirs = copy.deepcopy(base)
    ddp, ref_opt = DDP(theirs), torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    for s in range(4):
        step(ddp, ref_opt, s, rank)
    out["weight_gap"] = gap(weights(net2), weights(theirs))
    return out


def check_sparse_algorithms() -> dict:
    """Gradient algorithms that take sparse gradients agree with torch DDP on the sparse
    parameters (the dense head differs by the wire format); the others are refused at
    construction, naming the parameter and the algorithms that take them."""
    rank, out = dist.get_rank(), {}
    for name in SPARSE_TAKERS:
        torch.manual_seed(0)
        base = SparseNet()
        ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
        opt = torch.optim.SGD(ours.parameters(), lr=0.1)
        model = unison.DataParallel(ours, optimizer=opt, algorithm=name)
        ddp, ref_opt = DDP(theirs), torch.optim.SGD(theirs.parameters(), lr=0.1)
        for s in range(3):
            step(model, opt, s, rank)
            step(ddp, ref_opt, s, rank)
        model.flush()
        out[name] = {
            "sparse_gap": gap([ours.emb.weight, ours.bag.weight], [theirs.emb.weight, theirs.bag.weight]),
            "weight_gap": gap(weights(ours), weights(theirs)),
            "spread": spread(weights(ours)),
        }
    for name in SPARSE_REFUSERS:
        net = SparseNet()
        opt = (
            unison.QAdamOptimizer(net.parameters(), lr=0.01)
            if name == "qadam"
            else torch.optim.SGD(net.parameters(), lr=0.1)
        )
        out[name] = outcome(partial(unison.DataParallel, net, optimizer=opt, algorithm=name))
    return out


def check_sparse_switch() -> dict:
    """switch_to an algorithm that cannot take sparse gradients is refused before the running
    one stops: training goes on under it, still in agreement with torch DDP."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = SparseNet()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    model = unison.DataParallel(ours, optimizer=opt)
    ddp, ref_opt = DDP(theirs), torch.optim.SGD(theirs.parameters(), lr=0.1)
    step(model, opt, 0, rank)
    step(ddp, ref_opt, 0, rank)
    refused = outcome(lambda: model.switch_to("bytegrad"))
    for s in range(1, 3):
        step(model, opt, s, rank)
        step(ddp, ref_opt, s, rank)
    return {"refused": refused, "algorithm": model.algorithm.name, "weight_gap": gap(weights(ours), weights(theirs))}


def train_averaging(name: str, net: nn.Module, opt: torch.optim.Optimizer, options: dict) -> dict:
    """Four steps of a model-averaging algorithm, then average(): finite, equal replicas?"""
    rank = dist.get_rank()
    model = unison.DataParallel(net, optimizer=opt, algorithm=unison.algorithms.create(name, **options))
    for s in range(4):
        step(model, opt, s, rank)
    model.average()
    result = {"finite": bool(torch.isfinite(weights(net)).all()), "spread": spread(weights(net))}
    model.close()
    return result


def check_sparse_averaging() -> dict:
    """Model-averaging algorithms average weights, never gradients: with sparse gradients
    they train, and after average() the replicas agree. local_sgd with period 1 and plain
    SGD is torch DDP's step exactly."""
    rank, out = dist.get_rank(), {}
    for name in AVERAGING:
        torch.manual_seed(0)
        net = SparseNet()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        options = {"period": 1} if name == "local_sgd" else {}

        out[name] = outcome(partial(train_averaging, name, net, opt, options))
    torch.manual_seed(0)
    base = SparseNet()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    opt, ref_opt = torch.optim.SGD(ours.parameters(), lr=0.1), torch.optim.SGD(theirs.parameters(), lr=0.1)
    model, ddp = unison.DataParallel(ours, optimizer=opt, algorithm="local_sgd:period=1"), DDP(theirs)
    for s in range(3):
        step(model, opt, s, rank)
        step(ddp, ref_opt, s, rank)
    out["local_sgd_vs_ddp"] = gap(weights(ours), weights(theirs))
    return out


def check_sparse_optimizer() -> dict:
    """DistributedOptimizer: with sparse_params named it agrees with torch DDP; without, the
    sparse gradient is refused naming the parameter (torch DDP raises RuntimeError too when a
    gradient's layout is not the one planned); a compressing algorithm is refused at construction."""
    rank, out = dist.get_rank(), {}
    torch.manual_seed(0)
    base = SparseNet()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    opt = unison.DistributedOptimizer(
        torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9),
        named_parameters=ours.named_parameters(),
        sparse_params=[ours.emb.weight, ours.bag.weight],
    )
    ddp, ref_opt = DDP(theirs), torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    for s in range(3):
        step(ours, opt, s, rank)
        step(ddp, ref_opt, s, rank)
    out["weight_gap"] = gap(weights(ours), weights(theirs))
    opt.close()
    net = SparseNet()
    unnamed = unison.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters()
    )
    out["unnamed"] = outcome(lambda: F.mse_loss(net(ids_batch(0, rank)[0]), torch.zeros(6, 1)).backward())
    unnamed.close()
    net = SparseNet()
    out["refused"] = outcome(
        lambda: unison.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1),
            named_parameters=net.named_parameters(),
            algorithm="powersgd",
            sparse_params=[net.emb.weight],
        )
    )
    out["not_held"] = outcome(
        lambda: unison.DistributedOptimizer(
            torch.optim.SGD(net.head.parameters(), lr=0.1), sparse_params=[net.emb.weight]
        )
    )
    return out


def backward_sum(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def check_unexpected_sparse() -> dict:
    """A sparse gradient the construction could not foresee: RuntimeError naming the
    parameter, where torch DDP raises NotImplementedError (a RuntimeError)."""
    rank = dist.get_rank()
    out = {}
    for key, wrap in (("ours", unison.DataParallel), ("ddp", DDP)):
        torch.manual_seed(0)
        net = Functional()
        model = wrap(net)
        out[key] = outcome(partial(backward_sum, model, ids_batch(0, rank)[0]))
    return out


# ---- backward(create_graph=True) --------------------------------------------------------
def second_order(net: nn.Module) -> list[torch.Tensor]:
    """The gradient of the squared gradient norm (a gradient penalty) through the graph each
    ``.grad`` keeps (``autograd.grad``: no gradient is accumulated, so no wrapper hook runs)."""
    params = list(net.parameters())
    penalty = sum((p.grad**2).sum() for p in params)
    return [g.detach() for g in torch.autograd.grad(penalty, params, retain_graph=True)]  # type: ignore[arg-type]


def second_backward(net: nn.Module) -> list[torch.Tensor]:
    """The same penalty's gradient by ``.backward()`` into ``.grad``."""
    penalty = sum((p.grad**2).sum() for p in net.parameters())
    net.zero_grad(set_to_none=True)
    penalty.backward()  # type: ignore[union-attr]
    return [p.grad.detach().clone() for p in net.parameters()]


def check_create_graph_vs_ddp() -> dict:
    """unison's allreduce against torch DDP (one parameter per bucket, where DDP can do it):
    the averaged gradients, their graph, and the gradient penalty's gradient through it."""
    rank, out = dist.get_rank(), {}
    torch.manual_seed(0)
    base = mlp()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    model = unison.DataParallel(ours)
    ddp = DDP(theirs, bucket_cap_mb=1e-6, find_unused_parameters=True)
    x, _ = dense_batch(0, rank)
    for m in (model, ddp):
        (m(x) ** 2).sum().backward(create_graph=True)
    out["grad_gap"] = gap(grads(ours), grads(theirs))
    out["requires_grad"] = [p.grad.requires_grad for p in ours.parameters()]
    out["ddp_requires_grad"] = [p.grad.requires_grad for p in theirs.parameters()]
    out["second_gap"] = gap(second_order(ours), second_order(theirs))
    # A second backward (no forward before it): torch DDP leaves it local, unison averages it
    # (its replicas stay equal): unison's is the mean over ranks of DDP's.
    mine, local = second_backward(ours), second_backward(theirs)
    for t in local:
        dist.all_reduce(t)
        t.div_(dist.get_world_size())
    out["second_backward_gap"] = gap(mine, local)
    # torch DDP's default buckets (several parameters in one) cannot take a graph; unison's can.
    torch.manual_seed(0)
    net = mlp()
    default = DDP(net)
    out["ddp_default"] = outcome(lambda: (default(x) ** 2).sum().backward(create_graph=True))
    return out


def algorithm_for(name: str, net: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    if name == "qadam":
        opt: torch.optim.Optimizer = unison.QAdamOptimizer(net.parameters(), lr=0.01, warmup_steps=1)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
    options = {"start_iter": 1, "rank": 1} if name == "powersgd" else {}
    algo = unison.algorithms.create(name, **options)
    return unison.DataParallel(net, optimizer=opt, algorithm=algo), opt


def check_create_graph_algorithms() -> dict:
    """Every gradient algorithm: a backward with create_graph=True gives the same averaged
    gradients as the same algorithm's plain backward (two models in lockstep, three steps,
    past warm-ups), and their graph gives the penalty's gradient torch DDP gives (the local
    gradient's, scaled: nothing flows back through the collective)."""
    rank, out = dist.get_rank(), {}
    for name in GRADIENT_ALGORITHMS:
        torch.manual_seed(0)
        base = mlp()
        plain, graphed = copy.deepcopy(base), copy.deepcopy(base)
        (m1, o1), (m2, o2) = algorithm_for(name, plain), algorithm_for(name, graphed)
        result: dict[str, Any] = {"grad_gap": 0.0, "weight_gap": 0.0}
        try:
            for s in range(3):
                x, _ = dense_batch(s, rank)
                o1.zero_grad()
                o2.zero_grad()
                (m1(x) ** 2).sum().backward()
                (m2(x) ** 2).sum().backward(create_graph=True)
                m1.core.reducer.complete()
                m2.core.reducer.complete()
                result["grad_gap"] = max(result["grad_gap"], gap(grads(plain), grads(graphed)))
                result["graphs"] = all(p.grad.requires_grad for p in graphed.parameters())
                with torch.no_grad():
                    for p in graphed.parameters():
                        p.grad = p.grad.detach()  # the optimizer steps on the values
                o1.step()
                o2.step()
                m1.flush()
                m2.flush()
                result["weight_gap"] = max(result["weight_gap"], gap(weights(plain), weights(graphed)))
            # The penalty's gradient: what DDP's straight-through average gives.
            x, _ = dense_batch(9, rank)
            o2.zero_grad()
            (m2(x) ** 2).sum().backward(create_graph=True)
            m2.core.reducer.complete()
            averaged = [p.grad.detach().clone() for p in graphed.parameters()]
            got = second_order(graphed)
            local = torch.autograd.grad((graphed(x) ** 2).sum(), list(graphed.parameters()), create_graph=True)
            scale = 0.5  # 1 / world size
            through = [g * scale + (a - g * scale).detach() for g, a in zip(local, averaged)]
            want = torch.autograd.grad(sum((t**2).sum() for t in through), list(graphed.parameters()))
            result["second_gap"] = gap(got, list(want))
        except Exception:
            result["error"] = traceback.format_exc()[-1500:]
        for m in (m1, m2):
            m.close()
        out[name] = result
    return out


def check_create_graph_averaging() -> dict:
    """A model-averaging algorithm never touches gradients: create_graph gives exactly the
    local model's gradients and penalty gradient."""
    rank, out = dist.get_rank(), {}
    torch.manual_seed(0)
    base = mlp()
    ours, local = copy.deepcopy(base), copy.deepcopy(base)
    opt = torch.optim.SGD(ours.parameters(), lr=0.05)
    model = unison.DataParallel(ours, optimizer=opt, algorithm="local_sgd:period=2")
    x, _ = dense_batch(0, rank)
    (model(x) ** 2).sum().backward(create_graph=True)
    (local(x) ** 2).sum().backward(create_graph=True)
    out["grad_gap"] = gap(grads(ours), grads(local))
    out["requires_grad"] = all(p.grad.requires_grad for p in ours.parameters())
    out["second_gap"] = gap(second_order(ours), second_order(local))
    return out


# ---- static_graph and gradient_as_bucket_view ------------------------------------------
def engine_model(net: nn.Module, **keywords: Any) -> unison.DataParallel:
    """A DataParallel given torch DDP's keywords for the gradient engine (static_graph, ...)."""
    return unison.DataParallel(net, **keywords)


def check_static_graph() -> dict:
    """static_graph=True: the same weights as torch DDP(static_graph=True), one tiny
    allreduce fewer per step after the first; a parameter that starts getting gradients
    later is refused, naming it."""
    rank, out = dist.get_rank(), {}
    torch.manual_seed(0)
    base = mlp()
    ours, theirs, negotiated = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    model, ddp = engine_model(ours, static_graph=True), DDP(theirs, static_graph=True)
    plain = engine_model(negotiated)
    opts = [torch.optim.SGD(n.parameters(), lr=0.05) for n in (ours, theirs, negotiated)]
    bytes_ = []
    for s in range(3):
        for m, o in zip((model, ddp, plain), opts):
            step(m, o, s, rank, dense_batch)
        bytes_.append((model.comm_stats["bytes_last_step"], plain.comm_stats["bytes_last_step"]))
    out["weight_gap"] = gap(weights(ours), weights(theirs))
    out["bytes"] = bytes_

    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 1), nn.Linear(3, 1)

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            return self.a(x) + (self.b(x) if use_b else 0)

    late = engine_model(Late(), static_graph=True)
    x, _ = dense_batch(0, rank)
    late(x, False).sum().backward()
    out["late"] = outcome(lambda: late(x, True).sum().backward())
    return out


def check_gradient_as_bucket_view() -> dict:
    """gradient_as_bucket_view=False: gradients are tensors of their own holding the average
    (torch DDP's default); True: views of the buckets. Both as torch DDP's."""
    rank, out = dist.get_rank(), {}
    for flag in (False, True):
        torch.manual_seed(0)
        base = mlp()
        ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
        model = engine_model(ours, gradient_as_bucket_view=flag)
        ddp = DDP(theirs, gradient_as_bucket_view=flag)
        opts = [torch.optim.SGD(n.parameters(), lr=0.05, momentum=0.9) for n in (ours, theirs)]
        for s in range(3):
            for m, o in zip((model, ddp), opts):
                x, y = dense_batch(s, rank)
                o.zero_grad(set_to_none=(s == 1))
                F.mse_loss(m(x), y).backward()
                o.step()
        flats = [b.flat for b in model.core.reducer.buckets]
        inside = [
            any(f.data_ptr() <= p.grad.data_ptr() < f.data_ptr() + f.numel() * f.element_size() for f in flats)
            for p in ours.parameters()
        ]
        out[flag] = {
            "weight_gap": gap(weights(ours), weights(theirs)),
            "grad_gap": gap(grads(ours), grads(theirs)),
            "views": inside,
        }
    return out


CHECKS: dict[str, Callable[..., dict]] = {
    "sparse_allreduce": check_sparse_allreduce,
    "sparse_unused": check_sparse_unused_on_one_rank,
    "sparse_no_sync": check_sparse_no_sync,
    "sparse_join": check_sparse_join,
    "sparse_algorithms": check_sparse_algorithms,
    "sparse_averaging": check_sparse_averaging,
    "sparse_optimizer": check_sparse_optimizer,
    "sparse_switch": check_sparse_switch,
    "create_graph_vs_ddp": check_create_graph_vs_ddp,
    "create_graph_algorithms": check_create_graph_algorithms,
    "create_graph_averaging": check_create_graph_averaging,
    "static_graph": check_static_graph,
    "gradient_as_bucket_view": check_gradient_as_bucket_view,
}


def run_checks(path: str) -> dict:
    out = {name: outcome(fn) for name, fn in CHECKS.items()}
    out["sparse_checkpoint"] = outcome(lambda: check_sparse_checkpoint(path))
    out["unexpected_sparse"] = outcome(check_unexpected_sparse)  # last: it leaves backward half-way
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        return launch.run(run_checks, 2, os.path.join(tmp, "ckpt.pt"), timeout=400)


def results(ranks: list[dict], name: str) -> list[dict]:
    got = [r[name] for r in ranks]
    for g in got:
        assert isinstance(g, dict), g
    return got


# ---- the tests ------------------------------------------------------------------------
def test_sparse_allreduce_same_as_ddp(ranks):
    for r in results(ranks, "sparse_allreduce"):
        assert r["grad_gap"] == 0.0 and r["weight_gap"] == 0.0, r
        assert r["layouts"] == r["ddp_layouts"] == ["torch.sparse_coo"] * 2 + ["torch.strided"] * 2
        assert not r["buckets_hold_sparse"] and r["spread"] == 0.0


def test_sparse_unused_on_one_rank(ranks):
    for r in results(ranks, "sparse_unused"):
        assert r["gap"] == 0.0, r
        assert r["none"] == r["ddp_none"] == [False, False]
        assert r["layouts"] == ["torch.sparse_coo"] * 2
        assert r["unused_none"]


def test_sparse_no_sync(ranks):
    for r in results(ranks, "sparse_no_sync"):
        assert r["grad_gap"] == 0.0 and r["weight_gap"] == 0.0 and r["spread"] == 0.0, r


def test_sparse_join(ranks):
    for r in results(ranks, "sparse_join"):
        assert isinstance(r["ours"], torch.Tensor), r["ours"]
        assert isinstance(r["ddp"], torch.Tensor), r["ddp"]
        assert r["weight_gap"] <= 1e-6 and r["spread"] == 0.0, r


def test_sparse_checkpoint(ranks):
    for r in results(ranks, "sparse_checkpoint"):
        assert r["weight_gap"] <= 1e-6, r


def test_sparse_gradient_algorithms(ranks):
    for r in results(ranks, "sparse_algorithms"):
        for name in SPARSE_TAKERS:
            exact = name in ("allreduce", "nonblocking")
            assert r[name]["sparse_gap"] <= (0.0 if exact else 1e-3), (name, r[name])
            assert r[name]["weight_gap"] <= (0.0 if exact else 2e-3), (name, r[name])
            assert r[name]["spread"] == 0.0
        for name in SPARSE_REFUSERS:
            kind, message = r[name][:2]
            assert kind == "ValueError", r[name]
            assert "'emb.weight'" in message and name in message
            assert "algorithms that take sparse gradients: allreduce" in message


def test_sparse_switch_refused_before_the_running_algorithm_stops(ranks):
    for r in results(ranks, "sparse_switch"):
        assert r["refused"][0] == "ValueError" and "'emb.weight'" in r["refused"][1], r
        assert r["algorithm"] == "allreduce" and r["weight_gap"] == 0.0, r


def test_sparse_refused_on_one_process_too():
    # No group, so no gradient engine: the refusal comes from the algorithm's start.
    opt = torch.optim.SGD(SparseNet().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'emb.weight' gets sparse gradients"):
        unison.DataParallel(SparseNet(), optimizer=opt, algorithm="powersgd")


def test_sparse_model_averaging(ranks):
    for r in results(ranks, "sparse_averaging"):
        for name in AVERAGING:
            assert isinstance(r[name], dict), (name, r[name])
            assert r[name]["finite"] and r[name]["spread"] == 0.0, (name, r[name])
        assert r["local_sgd_vs_ddp"] <= 1e-6


def test_sparse_distributed_optimizer(ranks):
    for r in results(ranks, "sparse_optimizer"):
        assert r["weight_gap"] == 0.0, r
        kind, message = r["unnamed"][:2]
        assert kind == "RuntimeError" and "'bag.weight'" in message and "sparse_params" in message
        kind, message = r["refused"][:2]
        assert kind == "ValueError" and "'emb.weight'" in message and "powersgd" in message
        assert r["not_held"][0] == "ValueError"


def test_unexpected_sparse_gradient_raises_as_ddp(ranks):
    for r in results(ranks, "unexpected_sparse"):
        # torch DDP raises NotImplementedError ("Cannot access storage of SparseTensorImpl"), a
        # RuntimeError: what catches DDP's catches unison's, which names the parameter.
        assert r["ours"][0] == "RuntimeError" and r["ddp"][0] == "NotImplementedError", r
        assert "'table'" in r["ours"][1]


def test_create_graph_same_as_ddp(ranks):
    for r in results(ranks, "create_graph_vs_ddp"):
        assert r["grad_gap"] == 0.0, r
        assert r["requires_grad"] == r["ddp_requires_grad"] == [True] * 4
        assert r["second_gap"] <= 1e-6, r
        assert r["second_backward_gap"] <= 1e-5, r
        # Where unison goes further: torch DDP's default buckets refuse a graph.
        assert r["ddp_default"][0] == "RuntimeError"


def test_create_graph_every_gradient_algorithm(ranks):
    for r in results(ranks, "create_graph_algorithms"):
        for name in GRADIENT_ALGORITHMS:
            got = r[name]
            assert "error" not in got, (name, got.get("error"))
            assert got["grad_gap"] <= 1e-7 and got["weight_gap"] <= 1e-7, (name, got)
            assert got["graphs"], name
            assert got["second_gap"] <= 1e-5, (name, got)


def test_create_graph_model_averaging_unaffected(ranks):
    for r in results(ranks, "create_graph_averaging"):
        assert r["grad_gap"] == 0.0 and r["second_gap"] == 0.0 and r["requires_grad"], r


def test_static_graph(ranks):
    for r in results(ranks, "static_graph"):
        assert r["weight_gap"] == 0.0, r
        (first, negotiated), *later = r["bytes"]
        assert first == negotiated
        assert all(ours < theirs for ours, theirs in later), r["bytes"]
        kind, message = r["late"][:2]
        assert kind == "RuntimeError" and "'b.weight'" in message and "static_graph=False" in message


def test_gradient_as_bucket_view(ranks):
    for r in results(ranks, "gradient_as_bucket_view"):
        for flag in (False, True):
            assert r[flag]["weight_gap"] == 0.0 and r[flag]["grad_gap"] == 0.0, r
            assert r[flag]["views"] == [flag] * 4
