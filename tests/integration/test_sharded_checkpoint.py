"""unison.save and unison.load over FSDP2 (torch.distributed.checkpoint): a run stopped after 4 steps
and resumed in fresh processes ends where the run that never stopped does; what cannot resume is
refused on every rank."""

import functools
import os

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unison

NODES, PER_NODE, STEPS, STOP = 2, 2, 8, 4

#: (algorithm, inner optimizer): algorithms that let the replicas drift apart, one that keeps them equal
CASES = [
    ("diloco:period=3,fragments=1,delay=0", "adamw"),
    ("local_sgd:period=3", "sgd"),
    ("allreduce", "adamw"),
    # no optimizer state: DCP's get_optimizer_state_dict makes some by a step of lr 0, which DataParallel must not count
    ("diloco:period=3,fragments=1,delay=0", "plain sgd"),
    # the error feedback of each rank's local shards, and the global weights
    ("sparseloco:period=3", "adamw"),
]
DRIFT = {"diloco", "local_sgd", "sparseloco"}
#: samples: each rank's shard of an epoch is STEPS batches of 4
DATA = torch.Generator().manual_seed(7)
X, Y = (
    torch.randn(NODES * PER_NODE * STEPS * 4, 6, generator=DATA),
    torch.randn(NODES * PER_NODE * STEPS * 4, 3, generator=DATA),
)


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


@functools.cache
def mesh_2d(nodes: int = NODES, per_node: int = PER_NODE):
    """One mesh per layout and process (torch caches a mesh's dimensions: a second mesh's would name the first)."""
    return init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))


def sharded_net(mesh) -> Net:
    """The same weights on every process, then the node's own perturbation (the initial broadcast
    gives every node node 0's: the drift comes from the batches), sharded over the node."""
    torch.manual_seed(0)
    net = Net()
    for block in net.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    return net


def built(algorithm: str, opt_name: str, mesh=None):
    """Everything afresh: net, fully_shard, optimizer, DataParallel, sampler."""
    mesh = mesh or mesh_2d()
    net = sharded_net(mesh)
    if opt_name == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    elif opt_name == "plain sgd":
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm, device_mesh=mesh["replicate"])
    sampler = unison.ShardSampler(torch.utils.data.TensorDataset(X, Y), seed=3)
    return net, opt, model, sampler


def train(model, opt, sampler, steps: int) -> None:
    """``steps`` batches of 4 drawn from the sampler's pass, each input noised from the global RNG
    (so a resume that lost the RNG state or the sampler's position would differ)."""
    indices = iter(sampler)
    for _ in range(steps):
        batch = [next(indices) for _ in range(4)]
        x, y = X[batch], Y[batch]
        opt.zero_grad()
        F.mse_loss(model(x + 0.01 * torch.randn(x.shape)), y).backward()
        opt.step()


def full(net) -> dict:
    """The whole weights (a collective over the node)."""
    return {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}


def before_the_stop(directory: str) -> list[dict]:
    """Per case: the weights at the start and after 8 steps straight; then, afresh, 4 steps saved."""
    rank = dist.get_rank()
    out = []
    for i, (algorithm, opt_name) in enumerate(CASES):
        net, opt, model, sampler = built(algorithm, opt_name)
        start = full(net)
        torch.manual_seed(100 + rank)
        train(model, opt, sampler, STEPS)
        straight = full(net)
        model.close()

        net, opt, model, sampler = built(algorithm, opt_name)
        torch.manual_seed(100 + rank)
        train(model, opt, sampler, STOP)
        unison.save(os.path.join(directory, str(i)), model, opt, sampler, step=STOP, extra={"case": i})
        out.append({"start": start, "straight": straight, "stopped": full(net)})
        model.close()
    return out


def after_the_stop(directory: str) -> list[dict]:
    """Per case, in fresh processes: everything built afresh, loaded, the remaining 4 steps; then saved
    over the same path and loaded into yet another fresh model."""
    out = []
    for i, (algorithm, opt_name) in enumerate(CASES):
        path = os.path.join(directory, str(i))
        net, opt, model, sampler = built(algorithm, opt_name)
        state = unison.load(path, model, opt, sampler)
        loaded = full(net)
        train(model, opt, sampler, STEPS - STOP)
        resumed = full(net)
        unison.save(path, model, opt, sampler, step=STEPS)  # over the previous checkpoint
        model.close()

        net, opt, model, sampler = built(algorithm, opt_name)
        again = unison.load(path, model, opt, sampler)
        out.append({"state": state, "loaded": loaded, "resumed": resumed, "again": again, "reloaded": full(net)})
        model.close()
    out.append(sorted(os.listdir(directory)))  # nothing left beside the checkpoints
    return out


def refusals(directory: str) -> dict:
    """What each misuse raised on this rank (type and message), or what it returned."""
    outcomes = {}

    def attempt(case, call):
        try:
            outcomes[case] = ("returned", call())
        except Exception as exc:
            outcomes[case] = (type(exc).__name__, str(exc))  # torch.save keeps FileNotFoundError as OSError

    diloco, local_sgd = os.path.join(directory, "0"), os.path.join(directory, "1")
    net, opt, model, sampler = built("diloco:period=3,fragments=1,delay=0", "sgd")
    none = os.path.join(directory, "none")
    attempt("missing, missing_ok", lambda: unison.load(none, model, opt, missing_ok=True))
    attempt("missing", lambda: unison.load(none, model, opt))
    attempt("another algorithm", lambda: unison.load(local_sgd, model, opt, sampler))
    attempt("another algorithm, not strict", lambda: unison.load(local_sgd, model, opt, sampler, strict=False)["step"])
    attempt("another optimizer", lambda: unison.load(diloco, model, opt, sampler))
    model.close()
    attempt("unsharded model", lambda: unison.load(diloco, nn.Linear(6, 3)))
    taken = os.path.join(directory, "taken")
    if dist.get_rank() == 0:
        os.makedirs(taken, exist_ok=True)
        open(os.path.join(taken, "notes.txt"), "w").close()
    dist.barrier()
    attempt("save over something else", lambda: unison.save(taken, net, opt))
    attempt("another layout", lambda: unison.load(diloco, sharded_net(mesh_2d(1, NODES * PER_NODE))))
    return outcomes


def after_the_stop_and_refusals(directory: str):
    return after_the_stop(directory), refusals(directory)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two launches of 4 processes (2 nodes x 2): up to the stop, then from it; the refusals ride on the second."""
    directory = str(tmp_path_factory.mktemp("sharded_checkpoints"))
    before = launch.run(before_the_stop, NODES * PER_NODE, directory)
    after = launch.run(after_the_stop_and_refusals, NODES * PER_NODE, directory, timeout=180)
    return before, [resumed for resumed, _ in after], [refused for _, refused in after]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{a}-{o}" for a, o in CASES])
def test_a_resumed_run_ends_where_the_run_that_never_stopped_does(runs, case):
    before, after, _ = runs
    name = CASES[case][0].split(":")[0]
    for rank in range(NODES * PER_NODE):
        b, a = before[rank][case], after[rank][case]
        for n, straight in b["straight"].items():
            assert not torch.equal(b["stopped"][n], b["start"][n]), (rank, n)  # it trained before the stop
            assert not torch.equal(b["stopped"][n], straight), (rank, n)  # and after it
            assert torch.equal(a["loaded"][n], b["stopped"][n]), (rank, n)  # the weights it stopped with
            assert torch.equal(a["resumed"][n], straight), (rank, n)
            assert torch.equal(a["reloaded"][n], a["resumed"][n]), (rank, n)  # saved over the first checkpoint
        assert a["state"] == {"epoch": 0, "step": STOP, "extra": {"case": case}, "world_size": 4, "algorithm": name}
        assert a["again"]["step"] == STEPS and a["again"]["extra"] is None
    other = before[PER_NODE][case]["straight"]  # node 1's first rank
    drifted = any(not torch.equal(other[n], v) for n, v in before[0][case]["straight"].items())
    assert drifted == (name in DRIFT)  # each replica's own weights were kept


def test_saving_over_a_checkpoint_leaves_nothing_beside_it(runs):
    _, after, _ = runs
    for rank in range(NODES * PER_NODE):
        assert after[rank][-1] == [str(i) for i in range(len(CASES))]


#: case -> (the error type, words its message holds), or ("returned", value)
REFUSED = {
    "missing, missing_ok": ("returned", None),
    "missing": (FileNotFoundError, "no checkpoint at"),
    "another algorithm": (ValueError, "algorithm 'local_sgd'"),
    "another algorithm, not strict": ("returned", STEPS),  # saved again after the resume
    "another optimizer": (
        RuntimeError,
        "Missing key in checkpoint state_dict: replica.0.optimizer.0.state.blocks.0.weight.momentum_buffer",
    ),
    "unsharded model": (ValueError, "is a directory"),
    "save over something else": (RuntimeError, "is left alone"),
    "another layout": (ValueError, "(2, 2)"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_resume_is_refused_on_every_rank(runs, case):
    _, _, outcomes = runs
    kind, expected = REFUSED[case]
    for rank, raised in enumerate(outcomes):
        if kind == "returned":
            assert raised[case] == ("returned", expected), (rank, raised[case])
        else:
            assert raised[case][0] == kind.__name__ and expected in raised[case][1], (rank, raised[case])


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two renames"])
def test_a_new_directory_replaces_the_previous_one_whole(tmp_path, monkeypatch, exchange):
    """The swap alone (no processes): the new directory takes the path, the previous one goes, a
    killed writer's leftovers go, what is not a checkpoint stays."""
    from unison import sharded_checkpoint as sc

    if not exchange:
        monkeypatch.setattr(sc, "_exchange", lambda a, b: False)
    path = str(tmp_path / "ckpt")
    for version in ("first", "second"):
        tmp = sc._temporary_beside(path)
        os.makedirs(tmp)
        (tmp_path / os.path.basename(tmp) / sc.RECORD).write_text(version)
        sc._swap_into_place(tmp, path)
        assert (tmp_path / "ckpt" / sc.RECORD).read_text() == version
    os.makedirs(sc._temporary_beside(path))  # a writer killed before its swap
    (tmp_path / ".ckpt.old.0123abcd.tmp").mkdir()  # another path's ("ckpt.old") temporary directory
    sc._temporary_beside(path)
    assert sorted(os.listdir(tmp_path)) == [".ckpt.old.0123abcd.tmp", "ckpt"]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep")
    with pytest.raises(ValueError, match="is left alone"):
        sc._temporary_beside(str(tmp_path / "notes"))
