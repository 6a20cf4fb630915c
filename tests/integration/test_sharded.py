"""FSDP2 inside each node, unison across nodes: model averaging on the local shards, equal to the
same algorithm on the unsharded model with one process per node; what is not built yet is refused."""

import contextlib

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unison

NODES, PER_NODE, STEPS = 2, 2, 7  # 7: the last steps after a sync, so the nodes have drifted


#: The blocks' widths: parameters that shard evenly (8 rows over 2 ranks) and unevenly (5 and 3 rows).
WIDTHS = (6, 8, 5, 3)
#: Every parameter's rows split evenly into whole 2-row tiles: sparseloco's tiles of the local shards are the tensor's.
EVEN = (6, 8, 4, 4)


class Net(nn.Module):
    """Linear blocks of ``widths`` with ReLUs between."""

    def __init__(self, widths: tuple[int, ...] = WIDTHS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(a, b) for a, b in zip(widths, widths[1:])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            x = torch.relu(x) if i < len(self.blocks) - 1 else x
        return x


def built(node: int, widths: tuple[int, ...] = WIDTHS) -> Net:
    """The same weights on every process, then a node's own perturbation (the initial broadcast
    gives every node node 0's weights)."""
    torch.manual_seed(0)
    net = Net(widths)
    g = torch.Generator().manual_seed(10 + node)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return net


def rank_batch(step: int, rank: int, outputs: int = WIDTHS[-1]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, outputs, generator=g)


def node_batch(step: int, node: int, outputs: int = WIDTHS[-1]) -> tuple[torch.Tensor, torch.Tensor]:
    """The node's whole batch: its ranks' batches, concatenated."""
    parts = [rank_batch(step, node * PER_NODE + r, outputs) for r in range(PER_NODE)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01)


def train(model: nn.Module, opt: torch.optim.Optimizer, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # a mean loss: FSDP2's mean over the node is the node's gradient
        opt.step()


def mesh_2d():
    return init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))


def sharded_net(mesh, node: int, widths: tuple[int, ...] = WIDTHS) -> Net:
    net = built(node, widths)
    for block in net.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    return net


#: (algorithm, inner optimizer, the blocks' widths) held to the unsharded model. sparseloco cuts the
#: local shards into tiles and keeps a quantizer's table per local shard: with "max" (a scale per
#: tile) and shards of whole tiles it sends what it sends on the whole tensors.
AVERAGING = [
    ("local_sgd:period=3,fragments=1,delay=0", "sgd", WIDTHS),
    ("diloco:period=3,fragments=1,delay=0", "adamw", WIDTHS),
    ("diloco:period=2,fragments=1,delay=0,outer_momentum=0.9", "sgd", WIDTHS),
    ("sparseloco:period=3,tile=2,topk=2,quantizer=max", "adamw", EVEN),
    ("sparseloco:period=2,tile=2,topk=1,quantizer=max,bits=4,beta=1.0,outer_lr=0.7", "sgd", EVEN),
    ("decentralized:period=2,fragments=1,delay=0", "sgd", WIDTHS),
    ("decentralized:period=2,fragments=1,delay=0,peer_selection=ring", "sgd", WIDTHS),
    ("low_precision_decentralized:period=2,fragments=1,delay=0", "sgd", WIDTHS),
]
#: Held to the quantizer's precision: low_precision_decentralized's 8-bit min-max scales its chunks
#: of each rank's flat buffer of local shards, which are not the unsharded model's chunks (4e-4 off
#: here; it is exact with one rank a node, and a replica left out of the ring is 10-100 times further).
QUANTIZED_PER_SHARD = {"low_precision_decentralized": 2e-3}


def unsharded_runs() -> list[dict]:
    """The reference: one process per node, each with the node's whole batch; every case of ``AVERAGING``."""
    node = dist.get_rank()
    out = []
    for algorithm, opt_name, widths in AVERAGING:
        net = built(node, widths)
        opt = optimizer(opt_name, net.parameters())
        model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm)
        train(model, opt, [node_batch(s, node, widths[-1]) for s in range(STEPS)])
        out.append({n: p.detach().clone() for n, p in net.named_parameters()})
        model.close()
    return out


def sharded_runs() -> list[dict]:
    """FSDP2 over each node's 2 ranks, unison across the nodes; the full weights each rank sees, per case."""
    rank = dist.get_rank()
    node = rank // PER_NODE
    mesh = mesh_2d()
    out = []
    for algorithm, opt_name, widths in AVERAGING:
        net = sharded_net(mesh, node, widths)
        opt = optimizer(opt_name, net.parameters())
        model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm, device_mesh=mesh["replicate"])
        local = [p.to_local().data_ptr() for p in net.parameters()]
        train(model, opt, [rank_batch(s, rank, widths[-1]) for s in range(STEPS)])
        assert [p.to_local().data_ptr() for p in net.parameters()] == local  # FSDP2 kept its local tensors
        out.append({n: p.full_tensor().detach().clone() for n, p in net.named_parameters()})
        model.close()
    return out


@pytest.fixture(scope="module")
def averaged():
    """Every case run once unsharded (2 processes) and once over FSDP2 (4): one launch each."""
    return launch.run(unsharded_runs, NODES), launch.run(sharded_runs, NODES * PER_NODE)


@pytest.mark.parametrize("case", range(len(AVERAGING)), ids=[a for a, _, _ in AVERAGING])
def test_model_averaging_over_fsdp2_is_that_of_the_unsharded_model(averaged, case):
    reference = [r[case] for r in averaged[0]]
    sharded = [r[case] for r in averaged[1]]
    tolerance = QUANTIZED_PER_SHARD.get(AVERAGING[case][0].partition(":")[0], 1e-5)
    assert not all(torch.equal(reference[0][n], reference[1][n]) for n in reference[0])  # the nodes drifted
    for rank, weights in enumerate(sharded):
        expected = reference[rank // PER_NODE]
        assert weights.keys() == expected.keys()
        for name, value in weights.items():
            assert torch.allclose(value, expected[name], atol=tolerance, rtol=0), (rank, name)


def over_node_mesh() -> dict:
    """``AVERAGING``'s first case sharded over ``unison.node_mesh()`` and wrapped without a
    ``device_mesh`` (the replicas: this local rank on every node)."""
    rank = dist.get_rank()
    algorithm, opt_name, widths = AVERAGING[0]
    net, mesh = built(rank // PER_NODE, widths), unison.node_mesh()
    assert mesh is unison.node_mesh() and mesh.mesh_dim_names == ("shard",) and mesh.size() == PER_NODE
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = optimizer(opt_name, net.parameters())
    model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm)
    assert (model.world_size, model.rank) == (NODES, rank // PER_NODE)
    train(model, opt, [rank_batch(s, rank, widths[-1]) for s in range(STEPS)])
    model.close()
    return {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}


def test_a_model_sharded_over_node_mesh_needs_no_device_mesh(averaged):
    reference = [r[0] for r in averaged[0]]
    for rank, weights in enumerate(launch.run(over_node_mesh, NODES * PER_NODE, env={"UNISON_NODES": str(NODES)})):
        for name, value in weights.items():
            assert torch.allclose(value, reference[rank // PER_NODE][name], atol=1e-5, rtol=0), (rank, name)


#: At their defaults (fragments of the local shards synced in turn, each travelling a step or more; sparseloco's
#: tiles and bins of the local shards; async's rounds on a thread), with the period shortened.
STREAMED = (
    "diloco:period=4",
    "local_sgd:period=4",
    "sparseloco:period=4",
    "decentralized:period=4",
    "low_precision_decentralized:period=4",
    "async:sync_interval_ms=5",
)


def streamed() -> dict:
    """Every algorithm of ``STREAMED``: the replicas drift, average() makes them equal; diloco's and
    sparseloco's global weights are shared by the replicas and moved by the outer steps."""
    rank = dist.get_rank()
    mesh = mesh_2d()
    replicate = mesh["replicate"].get_group()
    out = {}
    for algorithm in STREAMED:
        net = sharded_net(mesh, rank // PER_NODE)
        opt = optimizer("sgd", net.parameters())
        model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm, device_mesh=mesh["replicate"])
        state = model.algorithm_state
        shared = getattr(state, "snapshot", None) or [g.flat for g in getattr(state, "globals", [])]
        start = [s.detach().clone() for s in shared]
        train(model, opt, [rank_batch(s, rank) for s in range(10)])
        model.flush()
        if start:  # diloco's or sparseloco's global weights: shared by the replicas, moved by the outer steps
            snapshot = torch.cat([s.detach().reshape(-1) for s in shared])
            peers = [torch.empty_like(snapshot) for _ in range(NODES)]
            dist.all_gather(peers, snapshot, group=replicate)
            out[f"{algorithm} global weights shared"] = torch.equal(peers[0], peers[1])
            out[f"{algorithm} global weights moved"] = not torch.equal(
                snapshot, torch.cat([s.reshape(-1) for s in start])
            )
        full = torch.cat([p.full_tensor().reshape(-1) for p in net.parameters()])
        everyone = [torch.empty_like(full) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, full)
        out[f"{algorithm} drifted"] = not torch.equal(everyone[0], everyone[PER_NODE])  # node 0 against node 1
        model.average()
        full = torch.cat([p.full_tensor().reshape(-1) for p in net.parameters()])
        everyone = [torch.empty_like(full) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, full)
        out[f"{algorithm} equal after average()"] = all(torch.equal(f, everyone[0]) for f in everyone)
        model.close()
    return out


def test_streamed_defaults_over_fsdp2_sync_the_shards():
    for checks in launch.run(streamed, NODES * PER_NODE):
        assert checks and all(checks.values()), checks


SWITCHED = "diloco:period=2,fragments=1,delay=0"


def unsharded_switch() -> dict:
    """local_sgd, a switch to diloco (which averages weights and optimizer states), average() at the end."""
    node = dist.get_rank()
    net = built(node)
    opt = optimizer("sgd", net.parameters())
    model = unison.DataParallel(net, optimizer=opt, algorithm="local_sgd:period=3,fragments=1,delay=0")
    train(model, opt, [node_batch(s, node) for s in range(4)])
    model.switch_to(SWITCHED)
    train(model, opt, [node_batch(s, node) for s in range(4, STEPS)])
    model.average()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def sharded_switch() -> dict:
    rank = dist.get_rank()
    mesh = mesh_2d()
    net = sharded_net(mesh, rank // PER_NODE)
    opt = optimizer("sgd", net.parameters())
    model = unison.DataParallel(
        net, optimizer=opt, algorithm="local_sgd:period=3,fragments=1,delay=0", device_mesh=mesh["replicate"]
    )
    train(model, opt, [rank_batch(s, rank) for s in range(4)])
    model.switch_to(SWITCHED)
    train(model, opt, [rank_batch(s, rank) for s in range(4, STEPS)])
    model.average()
    return {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}


def test_switch_to_and_average_over_fsdp2_are_those_of_the_unsharded_model():
    reference = launch.run(unsharded_switch, NODES)
    sharded = launch.run(sharded_switch, NODES * PER_NODE)
    for rank, weights in enumerate(sharded):
        for name, value in weights.items():
            assert torch.equal(value, sharded[0][name]), (rank, name)  # average(): every replica the same
            assert torch.allclose(value, reference[0][name], atol=1e-5, rtol=0), (rank, name)


def reloaded() -> dict:
    """state_dict() and load_state_dict() keep the local shards the algorithm trains (FSDP2 copies
    into them); with assign=True FSDP2 replaces them, and the wrapper refuses to go on."""
    rank = dist.get_rank()
    mesh = mesh_2d()
    net = sharded_net(mesh, rank // PER_NODE)
    opt = optimizer("sgd", net.parameters())
    model = unison.DataParallel(net, optimizer=opt, algorithm=SWITCHED, device_mesh=mesh["replicate"])
    state = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
    train(model, opt, [rank_batch(s, rank) for s in range(3)])
    model.load_state_dict(state)
    restored = all(torch.equal(p.full_tensor(), state[n].full_tensor()) for n, p in net.named_parameters())
    train(model, opt, [rank_batch(s, rank) for s in range(3)])  # the algorithm still trains the live shards
    try:
        model.load_state_dict(state, assign=True)
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    return restored, refused


def test_load_state_dict_over_fsdp2_keeps_the_local_shards():
    for restored, refused in launch.run(reloaded, NODES * PER_NODE):
        assert restored
        assert refused is not None and "replaced the local shard" in refused, refused


#: Half precision on the wire: the weights of torch's HSDP to the wire's precision after 20 steps
HALF = {"fp16": 1e-3, "bf16": 1e-2}


def hsdp_and_allreduce() -> dict:
    """allreduce, fp16 and bf16 over FSDP2 next to torch's own HSDP (fully_shard over the 2-D mesh), 20 steps."""
    rank = dist.get_rank()
    mesh = mesh_2d()
    theirs = built(0)
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    batches = [rank_batch(s, rank) for s in range(20)]
    train(theirs, optimizer("sgd", theirs.parameters()), batches)
    # comm_stats counts the hook's all-reduces: each rank's padded shard (rows rounded up to the
    # node's ranks) sent once a step on 2 replicas (a ring's 2 (R - 1) / R of it), in the wire's dtype
    shard = sum(-(-p.shape[0] // PER_NODE) * p[0].numel() for p in theirs.parameters())
    checks = {}
    for algorithm, tolerance in (("allreduce", 1e-5), *HALF.items()):
        ours = sharded_net(mesh, 0)
        opt = optimizer("sgd", ours.parameters())
        model = unison.DataParallel(ours, optimizer=opt, algorithm=algorithm, device_mesh=mesh["replicate"])
        train(model, opt, batches)
        gaps = [
            (p.full_tensor() - q.full_tensor()).abs().max().item()
            for p, q in zip(ours.parameters(), theirs.parameters())
        ]
        checks[f"{algorithm}: HSDP's weights"] = max(gaps) <= tolerance
        if algorithm in HALF:
            checks[f"{algorithm}: rounded on the wire"] = max(gaps) > 0
        checks[f"{algorithm}: bytes counted"] = model.comm_stats["bytes_total"] == 20 * shard * (
            4 if algorithm == "allreduce" else 2
        )
        model.switch_to("local_sgd:period=100")  # the hooks leave with the algorithm: the nodes now drift
        train(model, opt, [rank_batch(20, rank)])
        full = torch.cat([p.full_tensor().reshape(-1) for p in ours.parameters()])
        peers = [torch.empty_like(full) for _ in range(NODES)]
        dist.all_gather(peers, full, group=mesh["replicate"].get_group())
        checks[f"{algorithm}: hooks removed"] = not torch.equal(peers[0], peers[1])
        model.close()
    return checks


def test_allreduce_over_fsdp2_is_torchs_hsdp_and_fp16_bf16_round_it():
    for checks in launch.run(hsdp_and_allreduce, NODES * PER_NODE):
        assert len(checks) == 11 and all(checks.values()), checks


def accumulated() -> tuple[bool, bool]:
    """no_sync() over FSDP2 against torch's HSDP with set_requires_gradient_sync(False): 3
    micro-batches a step, the first two accumulated without communicating."""
    rank = dist.get_rank()
    mesh = mesh_2d()
    theirs, ours = built(0), sharded_net(mesh, 0)
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opts = [optimizer("sgd", ours.parameters()), optimizer("sgd", theirs.parameters())]
    model = unison.DataParallel(ours, optimizer=opts[0], device_mesh=mesh["replicate"])
    for step in range(4):
        for opt in opts:
            opt.zero_grad()
        for micro in range(3):
            x, y = rank_batch(10 * step + micro, rank)
            last = micro == 2
            theirs.set_requires_gradient_sync(last)
            F.mse_loss(theirs(x), y).backward()
            with contextlib.nullcontext() if last else model.no_sync():
                F.mse_loss(model(x), y).backward()
        for opt in opts:
            opt.step()
    same = all(
        torch.allclose(p.full_tensor(), q.full_tensor(), atol=1e-5, rtol=0)
        for p, q in zip(ours.parameters(), theirs.parameters())
    )
    shard = sum(-(-p.shape[0] // PER_NODE) * p[0].numel() * 4 for p in ours.parameters())
    return same, model.comm_stats["bytes_total"] == 4 * shard  # one all-reduce a step: the last micro-batch's


def test_no_sync_over_fsdp2_is_hsdps_accumulation():
    for same, once_a_step in launch.run(accumulated, NODES * PER_NODE):
        assert same and once_a_step


# ---- what is not built yet over FSDP2: refused on every rank, with the reason --------------------------------

GRADIENTS = ("bytegrad", "powersgd", "demo", "qadam", "nonblocking", "daso")


def wrapped(mesh, algorithm: str = "local_sgd:period=2", **kwargs) -> unison.DataParallel:
    net = sharded_net(mesh, dist.get_rank() // PER_NODE)
    opt = optimizer("sgd", net.parameters())
    return unison.DataParallel(net, optimizer=opt, algorithm=algorithm, device_mesh=mesh["replicate"], **kwargs)


def mixed(mesh):
    net = built(0)
    fully_shard(net.blocks[0], mesh=mesh["shard"])  # the other blocks stay plain tensors
    return unison.DataParallel(net, optimizer=optimizer("sgd", net.parameters()), device_mesh=mesh["replicate"])


def meshless(mesh):
    net = sharded_net(mesh, 0)
    return unison.DataParallel(net, optimizer=optimizer("sgd", net.parameters()), algorithm="local_sgd")


def root_unsharded(mesh):
    net = built(0)
    for block in net.blocks:
        fully_shard(block, mesh=mesh["shard"])
    return unison.DataParallel(net, optimizer=optimizer("sgd", net.parameters()), device_mesh=mesh["replicate"])


def tensor_parallel(mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor

    net = nn.Linear(6, 3)
    net.weight = nn.Parameter(distribute_tensor(net.weight.detach(), mesh["shard"], [Replicate()]))
    net.bias = nn.Parameter(distribute_tensor(net.bias.detach(), mesh["shard"], [Replicate()]))
    return unison.DataParallel(net, optimizer=optimizer("sgd", net.parameters()), device_mesh=mesh["replicate"])


def torch_hsdp(mesh):
    net = built(0)
    fully_shard(net, mesh=mesh)  # torch's own HSDP: replicated and sharded, a 2-D mesh
    return unison.DataParallel(net, optimizer=optimizer("sgd", net.parameters()), device_mesh=mesh["replicate"])


def same_dimension(mesh):
    net = sharded_net(mesh, 0)
    return unison.DataParallel(net, optimizer=optimizer("sgd", net.parameters()), device_mesh=mesh["shard"])


def after_construction(call):
    def attempt(mesh):
        model = wrapped(mesh)
        try:
            call(model)
        finally:
            model.close()

    return attempt


def after_allreduce(call):
    def attempt(mesh):
        model = wrapped(mesh, "allreduce")
        try:
            call(model)
        finally:
            model.close()

    return attempt


def distributed_optimizer(mesh):
    return unison.DistributedOptimizer(optimizer("sgd", sharded_net(mesh, 0).parameters()))


#: case -> (what it does on every rank, the error type, words its message holds)
REFUSALS = {
    **{
        a: (lambda m, a=a: wrapped(m, a), NotImplementedError, "averages gradients, which is not built yet over FSDP2")
        for a in GRADIENTS
    },
    "local_sgd hierarchical": (
        lambda m: wrapped(m, "local_sgd:hierarchical=True"),
        NotImplementedError,
        "hierarchical=True",
    ),
    "diloco hierarchical": (lambda m: wrapped(m, "diloco:hierarchical=True"), NotImplementedError, "hierarchical=True"),
    "sparseloco hierarchical": (
        lambda m: wrapped(m, "sparseloco:hierarchical=True"),
        NotImplementedError,
        "hierarchical=True",
    ),
    "allreduce autotune": (lambda m: wrapped(m, "allreduce:autotune=True"), NotImplementedError, "autotune=True"),
    "allreduce hierarchical": (
        lambda m: wrapped(m, "allreduce:hierarchical=True"),
        NotImplementedError,
        "hierarchical",
    ),
    "local_sgd warm-up": (lambda m: wrapped(m, "local_sgd:warmup_steps=2"), NotImplementedError, "warmup_steps=2"),
    "async warm-up": (lambda m: wrapped(m, "async:warmup_steps=2"), NotImplementedError, "async with warmup_steps=2"),
    "fault_tolerant over a device_mesh": (
        lambda m: wrapped(m, fault_tolerant=True),
        NotImplementedError,
        "fault_tolerant=True is not built yet over a module sharded by FSDP2 over a device_mesh: shard over "
        "unison.node_mesh()",
    ),
    "nonfinite": (lambda m: wrapped(m, nonfinite="raise"), NotImplementedError, "nonfinite='raise'"),
    "debug": (lambda m: wrapped(m, debug=True), NotImplementedError, "debug=True"),
    "reduce_function": (
        lambda m: wrapped(m, reduce_function=lambda t, g: None),
        NotImplementedError,
        "reduce_function",
    ),
    "register_comm_hook": (
        after_construction(lambda model: model.register_comm_hook(lambda m: None)),
        NotImplementedError,
        "register_comm_hook()",
    ),
    "join": (after_construction(lambda model: model.join()), NotImplementedError, "join()"),
    "switch_to": (
        after_construction(lambda model: model.switch_to("powersgd")),
        NotImplementedError,
        "'powersgd' averages gradients",
    ),
    "DistributedOptimizer": (distributed_optimizer, NotImplementedError, "DistributedOptimizer is not built yet"),
    "mixed parameters": (mixed, ValueError, "is a plain tensor"),
    "no device_mesh": (meshless, ValueError, "needs the mesh dimension"),
    "root not sharded": (root_unsharded, ValueError, "not an FSDPModule"),
    "tensor parallelism": (tensor_parallel, NotImplementedError, "Replicate()"),
    "torch's HSDP": (torch_hsdp, NotImplementedError, "2-D mesh"),
    "the shard dimension": (same_dimension, ValueError, "not another dimension"),
}


def every_refusal() -> dict:
    """Each case on this rank: the type and message it raised, or None."""
    mesh = mesh_2d()
    raised = {}
    for case, (attempt, _, _) in REFUSALS.items():
        try:
            attempt(mesh)
            raised[case] = None
        except Exception as exc:
            raised[case] = (type(exc), str(exc))
    return raised


@pytest.fixture(scope="module")
def refusals():
    return launch.run(every_refusal, NODES * PER_NODE, timeout=300)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_on_every_rank(refusals, case):
    _, kind, words = REFUSALS[case]
    for rank, raised in enumerate(refusals):
        assert raised[case] is not None, f"rank {rank} did not refuse {case}"
        assert issubclass(raised[case][0], kind) and words in raised[case][1], (rank, raised[case])
