"""FSDP2 inside each node, unison across nodes: model averaging on the local shards, equal to the
same algorithm on the unsharded model with one process per node; what is not built yet is refused."""

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


class Net(nn.Module):
    """Blocks whose parameters shard evenly (8 rows over 2 ranks) and unevenly (5 and 3 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 8), nn.Linear(8, 5), nn.Linear(5, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            x = torch.relu(x) if i < len(self.blocks) - 1 else x
        return x


def built(node: int) -> Net:
    """The same weights on every process, then a node's own perturbation (the initial broadcast
    gives every node node 0's weights)."""
    torch.manual_seed(0)
    net = Net()
    g = torch.Generator().manual_seed(10 + node)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return net


def rank_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def node_batch(step: int, node: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The node's whole batch: its ranks' batches, concatenated."""
    parts = [rank_batch(step, node * PER_NODE + r) for r in range(PER_NODE)]
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


def sharded_net(mesh, node: int) -> Net:
    net = built(node)
    for block in net.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    return net


#: (algorithm, inner optimizer) held to the unsharded model
AVERAGING = [
    ("local_sgd:period=3,fragments=1,delay=0", "sgd"),
    ("diloco:period=3,fragments=1,delay=0", "adamw"),
    ("diloco:period=2,fragments=1,delay=0,outer_momentum=0.9", "sgd"),
]


def unsharded_runs() -> list[dict]:
    """The reference: one process per node, each with the node's whole batch; every case of ``AVERAGING``."""
    node = dist.get_rank()
    out = []
    for algorithm, opt_name in AVERAGING:
        net = built(node)
        opt = optimizer(opt_name, net.parameters())
        model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm)
        train(model, opt, [node_batch(s, node) for s in range(STEPS)])
        out.append({n: p.detach().clone() for n, p in net.named_parameters()})
        model.close()
    return out


def sharded_runs() -> list[dict]:
    """FSDP2 over each node's 2 ranks, unison across the nodes; the full weights each rank sees, per case."""
    rank = dist.get_rank()
    node = rank // PER_NODE
    mesh = mesh_2d()
    out = []
    for algorithm, opt_name in AVERAGING:
        net = sharded_net(mesh, node)
        opt = optimizer(opt_name, net.parameters())
        model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm, device_mesh=mesh["replicate"])
        local = [p.to_local().data_ptr() for p in net.parameters()]
        train(model, opt, [rank_batch(s, rank) for s in range(STEPS)])
        assert [p.to_local().data_ptr() for p in net.parameters()] == local  # FSDP2 kept its local tensors
        out.append({n: p.full_tensor().detach().clone() for n, p in net.named_parameters()})
        model.close()
    return out


@pytest.fixture(scope="module")
def averaged():
    """Every case run once unsharded (2 processes) and once over FSDP2 (4): one launch each."""
    return launch.run(unsharded_runs, NODES), launch.run(sharded_runs, NODES * PER_NODE)


@pytest.mark.parametrize("case", range(len(AVERAGING)), ids=[a for a, _ in AVERAGING])
def test_model_averaging_over_fsdp2_is_that_of_the_unsharded_model(averaged, case):
    reference = [r[case] for r in averaged[0]]
    sharded = [r[case] for r in averaged[1]]
    assert not all(torch.equal(reference[0][n], reference[1][n]) for n in reference[0])  # the nodes drifted
    for rank, weights in enumerate(sharded):
        expected = reference[rank // PER_NODE]
        assert weights.keys() == expected.keys()
        for name, value in weights.items():
            assert torch.allclose(value, expected[name], atol=1e-5, rtol=0), (rank, name)


def streamed() -> dict:
    """The defaults (fragments of the local shards synced in turn, each travelling a step or more)."""
    rank = dist.get_rank()
    mesh = mesh_2d()
    replicate = mesh["replicate"].get_group()
    out = {}
    for algorithm in ("diloco:period=4", "local_sgd:period=4"):
        net = sharded_net(mesh, rank // PER_NODE)
        opt = optimizer("sgd", net.parameters())
        model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm, device_mesh=mesh["replicate"])
        state = model.algorithm_state
        start = [s.detach().clone() for s in getattr(state, "snapshot", [])]
        train(model, opt, [rank_batch(s, rank) for s in range(10)])
        model.flush()
        if start:  # diloco's global weights: shared by the replicas, moved by the outer steps
            snapshot = torch.cat([s.detach().reshape(-1) for s in state.snapshot])
            peers = [torch.empty_like(snapshot) for _ in range(NODES)]
            dist.all_gather(peers, snapshot, group=replicate)
            out["snapshot shared"] = torch.equal(peers[0], peers[1])
            out["snapshot moved"] = not torch.equal(snapshot, torch.cat([s.reshape(-1) for s in start]))
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


def hsdp_and_allreduce() -> tuple[bool, bool]:
    """allreduce over FSDP2 next to torch's own HSDP (fully_shard over the 2-D mesh), 20 steps."""
    rank = dist.get_rank()
    mesh = mesh_2d()
    ours = sharded_net(mesh, 0)
    theirs = built(0)
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opts = [optimizer("sgd", ours.parameters()), optimizer("sgd", theirs.parameters())]
    model = unison.DataParallel(ours, optimizer=opts[0], device_mesh=mesh["replicate"])
    batches = [rank_batch(s, rank) for s in range(20)]
    train(model, opts[0], batches)
    train(theirs, opts[1], batches)
    same = all(
        torch.allclose(p.full_tensor(), q.full_tensor(), atol=1e-5, rtol=0)
        for p, q in zip(ours.parameters(), theirs.parameters())
    )
    model.switch_to("local_sgd:period=100")  # allreduce's hooks leave with it: the nodes now drift
    train(model, opts[0], [rank_batch(20, rank)])
    full = torch.cat([p.full_tensor().reshape(-1) for p in ours.parameters()])
    peers = [torch.empty_like(full) for _ in range(NODES)]
    dist.all_gather(peers, full, group=mesh["replicate"].get_group())
    return same, not torch.equal(peers[0], peers[1])


def test_allreduce_over_fsdp2_is_torchs_hsdp():
    for same, drifted in launch.run(hsdp_and_allreduce, NODES * PER_NODE):
        assert same
        assert drifted


# ---- what is not built yet over FSDP2: refused on every rank, with the reason --------------------------------

GRADIENTS = ("fp16", "bf16", "bytegrad", "powersgd", "demo", "qadam", "nonblocking", "daso")
NOT_YET = ("async", "decentralized", "low_precision_decentralized", "sparseloco")


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
    **{
        a: (lambda m, a=a: wrapped(m, a), NotImplementedError, f"algorithm {a!r} is not built yet over FSDP2")
        for a in NOT_YET
    },
    "local_sgd hierarchical": (
        lambda m: wrapped(m, "local_sgd:hierarchical=True"),
        NotImplementedError,
        "hierarchical=True",
    ),
    "diloco hierarchical": (lambda m: wrapped(m, "diloco:hierarchical=True"), NotImplementedError, "hierarchical=True"),
    "allreduce autotune": (lambda m: wrapped(m, "allreduce:autotune=True"), NotImplementedError, "autotune=True"),
    "allreduce hierarchical": (
        lambda m: wrapped(m, "allreduce:hierarchical=True"),
        NotImplementedError,
        "hierarchical",
    ),
    "allreduce no_sync": (after_allreduce(lambda model: model.no_sync().__enter__()), NotImplementedError, "no_sync()"),
    "local_sgd warm-up": (lambda m: wrapped(m, "local_sgd:warmup_steps=2"), NotImplementedError, "warmup_steps=2"),
    "fault_tolerant": (lambda m: wrapped(m, fault_tolerant=True), NotImplementedError, "fault_tolerant=True"),
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
