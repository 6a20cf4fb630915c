"""The launcher-environment parsing and everything that runs in one process."""

import pytest
import torch
import torch.distributed as dist

import unison
from unison.runtime import detect_launch, first_host


def test_torchrun_environment():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "h1",
        "MASTER_PORT": "1234",
    }
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 8, 1, 2)
    assert (info.master_addr, info.master_port, info.launcher) == ("h1", 1234, "torchrun")


def test_openmpi_environment():
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "6",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
    }
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.launcher) == (
        5,
        6,
        2,
        3,
        "openmpi",
    )
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 29500)


def test_mpich_environment():
    env = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.launcher) == (1, 4, 1, 2, "mpich")


def test_slurm_environment():
    env = {
        "SLURM_PROCID": "7",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "3",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "123456",
    }
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.launcher) == (7, 8, 3, 4, "slurm")
    assert info.master_addr == "gpu07"
    assert info.master_port == 20000 + 123456 % 20000


def test_torchrun_wins_over_slurm():
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "8"}
    assert detect_launch(env).launcher == "torchrun"


def test_nothing_launched_is_a_world_of_one():
    info = detect_launch({})
    assert (info.rank, info.world_size, info.launcher) == (0, 1, "none")


def test_no_node_information_means_one_node():
    info = detect_launch({"PMI_RANK": "2", "PMI_SIZE": "4"})
    assert (info.local_rank, info.local_world_size) == (2, 4)


@pytest.mark.parametrize(
    "nodelist, host",
    [("node1", "node1"), ("gpu[03-05,9],cpu1", "gpu03"), ("a,b", "a"), ("r[1,3]", "r1"), ("x-[010-020]", "x-010")],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_bad_rank_is_refused():
    with pytest.raises(ValueError, match="rank 4 outside world size 4"):
        detect_launch({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="not an integer"):
        detect_launch({"RANK": "x", "WORLD_SIZE": "4"})


def test_init_alone_is_a_world_of_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    unison.shutdown()
    topo = unison.init()
    assert (topo.rank, topo.world_size, topo.num_nodes, topo.node) == (0, 1, 1, 0)
    assert unison.init() is topo  # idempotent
    assert not dist.is_initialized()
    unison.shutdown()


def test_data_parallel_without_process_group_is_the_module():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    model = unison.DataParallel(net)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    expected = x.sum(0).expand(2, 4)
    assert torch.allclose(net.weight.grad, expected)
    assert model.module is net
    assert list(model.state_dict()) == ["weight", "bias"]


def test_torch_ddp_device_ids_on_cpu_are_refused_as_torch_refuses_them():
    with pytest.raises(ValueError, match="device_ids and output_device arguments only work"):
        unison.DataParallel(torch.nn.Linear(2, 2), device_ids=[0], output_device=0)


def test_unknown_argument_is_a_type_error():
    with pytest.raises(TypeError, match="bogus"):
        unison.DataParallel(torch.nn.Linear(2, 2), bogus=1)


def test_bad_bucket_size():
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        unison.DataParallel(torch.nn.Linear(2, 2), bucket_cap_mb=0)


def test_load_state_dict_accepts_module_prefix():
    model = unison.DataParallel(torch.nn.Linear(2, 2))
    state = {"module.weight": torch.ones(2, 2), "module.bias": torch.zeros(2)}
    model.load_state_dict(state)
    assert torch.equal(model.module.weight, torch.ones(2, 2))


def test_algorithms_by_name():
    assert "allreduce" in unison.algorithms.names()
    assert unison.algorithms.create("allreduce").name == "allreduce"
    with pytest.raises(ValueError, match="unknown algorithm 'nope'; available: allreduce"):
        unison.algorithms.create("nope")
    with pytest.raises(ValueError, match="has no option 'period'"):
        unison.algorithms.create("allreduce", period=3)
    with pytest.raises(ValueError, match="unknown algorithm"):
        unison.DataParallel(torch.nn.Linear(2, 2), algorithm="nope")


def test_shard_sampler_splits_evenly_and_reshuffles():
    data = list(range(10))
    shards = [list(unison.ShardSampler(data, num_replicas=3, rank=r, seed=1)) for r in range(3)]
    assert all(len(s) == 4 for s in shards)
    assert set().union(*shards) == set(data)
    sampler = unison.ShardSampler(data, num_replicas=3, rank=0, seed=1)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first


def test_sharded_loader_alone_sees_everything():
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    loader = unison.sharded_loader(data, batch_size=4)
    assert sorted(torch.cat([b for (b,) in loader]).tolist()) == list(map(float, range(10)))


# ---- the store: bound by whoever serves it, never a port found free and bound later ----------
def test_a_served_store_is_bound_and_its_clients_environment_points_at_it():
    from datetime import timedelta

    from unison.runtime import client_env, serve_store

    store = serve_store(timeout=timedelta(seconds=5))
    assert store.port > 0  # the OS's choice, bound
    env = client_env(store)
    assert env == {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"


@pytest.mark.parametrize(
    "agent_store, named, ranks",
    [(None, "rank 0, which hosts the rendezvous store, cannot be reached", [0]), ("True", "the launcher's", [])],
)
def test_a_failure_with_the_store_gone_names_whoever_hosted_it(monkeypatch, agent_store, named, ranks):
    """Under env:// rendezvous rank 0 hosts the store, so a store that cannot be reached names rank 0;
    under torchrun's agent store (and tests/launch.py's) it is the launcher's."""
    from datetime import timedelta

    from unison.runtime import health, serve_store

    if agent_store is None:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", agent_store)
    server = serve_store(timeout=timedelta(seconds=2))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2))
    beat = health.Heartbeat(client, rank=1, world=2)
    monkeypatch.setattr(health, "_heartbeat", beat)
    try:
        del server  # its host died
        failure = health.explain(dist.DistNetworkError("Connection reset by peer"), "the allreduce")
    finally:
        beat.close()
    assert isinstance(failure, unison.RankFailure)
    assert named in str(failure) and failure.ranks == ranks


def test_a_raise_in_unisons_own_code_is_no_peer_failure():
    # A check unison raises itself (static_graph's "the graph changed") is deterministic: told from
    # a transport's error coming out of native code by how it was raised, whatever the text says.
    from unison.runtime import health

    scope: dict = {"__name__": "unison.engine.example", "torch": torch}
    exec(
        "def checked():\n    raise RuntimeError('gloo: Connection closed by peer, timed out')\n"
        "def native():\n    return torch.empty(-1)\n",
        scope,
    )
    for fn, failure in ((scope["checked"], False), (scope["native"], True)):
        with pytest.raises(RuntimeError) as caught:
            fn()
        assert health.is_comm_failure(caught.value) is failure, fn


def test_the_backend_init_builds_groups_with():
    """init()'s backend, under torchrun and under the fault-tolerant launcher alike (which builds
    every membership's groups with it): NCCL where CUDA is there, gloo otherwise; a bad name or
    NCCL without a GPU is refused before any group is built."""
    from unison.runtime.launch import _backend

    assert _backend("gloo", 3) == "gloo"
    if not torch.cuda.is_available():
        assert _backend(None, 0) == "gloo"
        with pytest.raises(ValueError, match="needs CUDA"):
            _backend("nccl", 0)
    with pytest.raises(ValueError, match="backend must be"):
        _backend("", 0)
