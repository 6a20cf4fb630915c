"""`unison bench`: emulated networks set up and torn down (also after a killed run), workloads,
contender specs, and a small real bench writing its JSON and plots."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import unison
from unison.apps import cli
from unison.apps.bench import command, contenders, netem, report, runner, workloads
from unison.apps.bench.worker import Judge, Stop, WorkerConfig, WorkerResult

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: bench_factory.py
needs_netns = pytest.mark.skipif(
    netem.unavailable_reason() is not None, reason=f"network namespaces unavailable: {netem.unavailable_reason()}"
)


def ours(pid: int) -> list[str]:
    """The namespaces that process ``pid`` created."""
    return [n for n in netem.namespaces() if re.fullmatch(rf"ub{pid}(n\d+|sw)", n)]


def wait_for(predicate, timeout: float = 60.0, what: str = "condition", details=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}" + (f"; left: {details()}" if details else ""))


# ---- option parsing -------------------------------------------------------------
def test_rates_and_delays():
    assert netem.parse_rate("1gbit") == 1e9
    assert netem.parse_rate("100mbit") == 1e8
    assert netem.parse_rate("50mbps") == 4e8
    assert netem.parse_rate("unlimited") is None
    assert netem.parse_delay("2ms") == pytest.approx(0.002)
    assert netem.parse_delay("500us") == pytest.approx(0.0005)
    assert netem.parse_delay("0") is None
    for bad in ("fast", "1gbyte", "-1mbit", "0mbit"):
        with pytest.raises(ValueError, match="bandwidth"):
            netem.parse_rate(bad)
    with pytest.raises(ValueError, match="latency"):
        netem.parse_delay("2 parsecs")


def test_contender_specs():
    specs = contenders.parse_list(
        "ddp,powersgd:rank=2,start_iter=5,allreduce:autotune=true,ddp_post_local_sgd:period=4"
    )
    assert [s.name for s in specs] == ["ddp", "powersgd", "allreduce", "ddp_post_local_sgd"]
    assert specs[1].options == {"rank": 2, "start_iter": 5}
    assert specs[2].options == {"autotune": True}
    assert [s.kind for s in specs] == ["torch", "unison", "unison", "torch"]
    every = [s.text for s in contenders.parse_list(None)]
    assert {"ddp", "ddp_fp16", "ddp_powersgd", "ddp_post_local_sgd", "ppe_ddp", "allreduce:autotune=true"} <= set(every)
    assert len(every) == 5 + len(unison.algorithms.names()) + 1
    assert [s.text for s in contenders.parse_list(None, quick=True)] == contenders.QUICK
    with pytest.raises(ValueError, match="unknown contender 'nccl_magic'"):
        contenders.parse_list("ddp,nccl_magic")
    with pytest.raises(ValueError, match="has no option"):
        contenders.parse_list("ddp_fp16:rank=2")
    with pytest.raises(ValueError, match="listed twice"):
        contenders.parse_list("ddp,ddp")
    with pytest.raises(ValueError, match="autotune must be True or False"):
        contenders.parse_list("allreduce:autotune=maybe")


def test_default_contenders_get_their_hierarchical_twins_on_several_processes_per_node():
    from unison import algorithms

    with_option = {n for n in algorithms.names() if "hierarchical" in algorithms.get(n).options_declared}
    assert {"allreduce", "fp16", "bf16", "bytegrad", "powersgd", "qadam", "nonblocking", "local_sgd"} <= with_option
    assert "daso" not in with_option  # hierarchical by design: no flat/hierarchical choice
    flat = [s.text for s in contenders.parse_list(None)]
    for nodes, procs in ((2, 1), (1, 4)):  # one process per node, or one node: nothing to compare
        assert [s.text for s in contenders.parse_list(None, False, nodes, procs)] == flat
    specs = contenders.parse_list(None, False, 2, 2)
    texts = [s.text for s in specs]
    twins = [t for t in texts if t not in flat]
    assert [t for t in texts if t in flat] == flat  # the defaults keep their order
    expected = [s for s in flat if s.split(":")[0] in with_option]
    assert twins == [s + ("," if ":" in s else ":") + "hierarchical=true" for s in expected]
    assert "allreduce:autotune=true,hierarchical=true" in twins
    for twin in twins:  # each right after its flat twin, already validated
        assert texts[texts.index(twin) - 1] == twin.rsplit(",", 1)[0].rsplit(":hierarchical", 1)[0]
        assert specs[texts.index(twin)].options["hierarchical"] is True
    quick = [s.text for s in contenders.parse_list(None, True, 3, 2)]
    assert quick == [t for s in contenders.QUICK for t in (s, s + ":hierarchical=true") if t != "ddp:hierarchical=true"]
    # a list given is run as it is
    assert [s.text for s in contenders.parse_list("ddp,allreduce,fp16:hierarchical=true", False, 2, 2)] == [
        "ddp",
        "allreduce",
        "fp16:hierarchical=true",
    ]
    assert contenders.hierarchical_twin(contenders.parse("allreduce:hierarchical=false")) is None
    assert contenders.hierarchical_twin(contenders.parse("daso")) is None
    assert contenders.hierarchical_twin(contenders.parse("ddp")) is None


def test_cli_refuses_bad_options(capsys):
    assert cli.main(["bench", "--contenders", "ddp,fp17"]) == 2
    assert "unknown contender 'fp17'" in capsys.readouterr().err
    assert cli.main(["bench", "--nodes", "1"]) == 2
    assert "at least 2 processes" in capsys.readouterr().err
    assert cli.main(["bench", "--model", "no_such_module_here:f"]) == 2
    assert "cannot import" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--bandwidth", "1gbyte"])


# ---- workloads ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["digits", "charlm", "mlp", "bench_factory:tiny"])
def test_workload_loads_and_trains_a_step(name):
    custom = ":" in name
    w = workloads.load(None if custom else name, seed=0, model_spec=name if custom else None)
    x, y = next(iter(torch.utils.data.DataLoader(w.train, batch_size=4)))
    before = w.evaluate(w.model)
    loss = w.loss_fn(w.model(x), y)
    loss.backward()
    workloads.make_optimizer(w, w.model.parameters()).step()
    after = w.evaluate(w.model)
    assert torch.isfinite(loss) and loss.item() > 0
    assert w.model.training  # evaluation restores training mode
    s = w.settings
    for q in (before, after):
        assert 0.0 <= q <= 1.0 if s.higher_is_better else 0.0 < q < 10.0
    assert w.params > {"digits": 4_000_000, "charlm": 100_000, "mlp": 20_000_000}.get(name, 0)
    assert len(w.train) > 100


def test_charlm_comes_in_sizes_and_refuses_others(capsys):
    large = workloads.load("charlm", seed=0, model_spec="large")
    assert large.params > 10_000_000 and large.name == "charlm (large)"
    assert large.settings.lr < workloads.load("charlm", seed=0).settings.lr
    assert workloads.settings_for("charlm", "small") == workloads.SETTINGS["charlm"]
    with pytest.raises(ValueError, match="sizes small, medium, large"):
        workloads.settings_for("charlm", "huge")
    with pytest.raises(ValueError, match="comes in one size"):
        workloads.load("mlp", model_spec="large")
    assert cli.main(["bench", "--workload", "charlm", "--model", "huge"]) == 2
    assert "sizes small, medium, large" in capsys.readouterr().err


def test_network_presets_and_their_overrides():
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    config = command.config_from(parser.parse_args(["bench"]))
    assert (config.bandwidth, config.latency) == ("1gbit", "2ms")
    config = command.config_from(parser.parse_args(["bench", "--network", "10mbit"]))
    assert (config.bandwidth, config.latency) == ("10mbit", "20ms")
    config = command.config_from(parser.parse_args(["bench", "--network", "1mbit", "--latency", "0"]))
    assert (config.bandwidth, config.latency) == ("1mbit", "0")
    assert netem.parse_rate(netem.PRESETS["1mbit"][0]) == 1e6
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--network", "5g"])


def test_bad_model_factories():
    with pytest.raises(ValueError, match="package.module:factory"):
        workloads.load(None, model_spec="bench_factory")
    with pytest.raises(ValueError, match="has no attribute"):
        workloads.load(None, model_spec="bench_factory:nothing")
    with pytest.raises(ValueError, match=r"must return \(model, dataset, loss_fn\)"):
        workloads.load(None, model_spec="bench_factory:not_a_triple")


# ---- report arithmetic ------------------------------------------------------------
def ok(spec, step_ms, curve, **more):
    """A contender's result as a worker reports it: ``curve`` is [seconds, step, quality] per evaluation."""
    return {
        "spec": spec,
        "label": spec,
        "status": "ok",
        "step_ms": step_ms,
        "samples_per_s": 1000 / step_ms,
        "final_quality": curve[-1][2],
        "curve": curve,
        **more,
    }


def test_time_to_target_and_speedups():
    results = [
        ok("ddp", 100.0, [[0, 0, 0.1], [1.0, 10, 0.8], [2.0, 20, 0.96]]),
        ok("fp16", 50.0, [[0, 0, 0.1], [0.5, 10, 0.95], [1.0, 20, 0.97]]),
        ok("local_sgd", 10.0, [[0, 0, 0.1], [0.1, 10, 0.5], [0.2, 20, 0.6]]),
        {"spec": "ddp_powersgd", "label": "ddp_powersgd", "status": "failed", "error": "boom"},
    ]
    summary = report.summarize(results, workloads.SETTINGS["digits"], None)
    assert summary["target"]["value"] == 0.95 and summary["target"]["source"] == "workload default"
    assert (results[0]["time_to_target_s"], results[0]["steps_to_target"]) == (2.0, 20)
    assert results[1]["time_to_target_s"] == 0.5 and results[2]["time_to_target_s"] is None
    assert results[1]["speedup_vs_ddp"] == {"step": 2.0, "target": 4.0}
    assert summary["recommendation"]["contender"] == "fp16"
    assert "4.0x as fast as torch DDP" in summary["recommendation"]["text"]
    # no default target (a loss, lower is better): within 2% of the best final value
    losses = [ok("ddp", 100.0, [[0, 0, 3.0], [1.0, 10, 1.0]]), ok("fp16", 50.0, [[0, 0, 3.0], [0.5, 10, 1.1]])]
    summary = report.summarize(losses, workloads.SETTINGS["custom"], None)
    assert summary["target"]["value"] == pytest.approx(1.02)
    assert summary["recommendation"]["contender"] == "ddp"
    # --target-from: within 2% of that contender's final quality (here the worse one), even with a default target
    summary = report.summarize(losses, workloads.SETTINGS["charlm"], None, target_from="fp16")
    assert summary["target"]["value"] == pytest.approx(1.1 * 1.02)
    assert summary["target"]["source"] == "within 2% of fp16's final validation loss"
    assert losses[0]["time_to_target_s"] == 1.0 and losses[1]["time_to_target_s"] == 0.5
    losses[1] = {"spec": "fp16", "label": "fp16", "status": "failed", "error": "boom"}
    assert report.summarize(losses, workloads.SETTINGS["charlm"], None, target_from="fp16")["target"]["value"] is None


def test_hierarchical_results_are_compared_with_their_flat_twins():
    """2 nodes x 2 processes, 1000 parameters: the twins' link bytes, speed-ups and the recommendation."""
    from io import StringIO

    from rich.console import Console

    def twin(spec, step_ms, link, curve):
        return ok(spec, step_ms, curve, params=1000, link_bytes_per_step=link)

    results = [
        twin("ddp", 100.0, 6000.0, [[0, 0, 0.1], [4.0, 10, 0.96]]),
        twin("allreduce", 100.0, 6000.0, [[0, 0, 0.1], [3.0, 10, 0.96]]),
        twin("allreduce:hierarchical=true", 50.0, 4000.0, [[0, 0, 0.1], [1.0, 10, 0.96]]),
        twin("powersgd:hierarchical=true", 40.0, 800.0, [[0, 0, 0.1], [2.0, 10, 0.9]]),
        twin("fp16:hierarchical=true", 60.0, 2000.0, [[0, 0, 0.1], [2.0, 10, 0.9]]),
        {"spec": "fp16", "label": "fp16", "status": "failed", "error": "boom"},
    ]
    summary = report.summarize(results, workloads.SETTINGS["digits"], None, nodes=2, procs_per_node=2)
    flat, hier, powersgd, fp16 = results[1:5]
    assert flat["hierarchical_twin"] == "allreduce:hierarchical=true" and "flat_twin" not in flat
    assert hier["flat_twin"] == "allreduce"
    assert hier["link_bytes_vs_flat"] == pytest.approx(2 / 3)
    assert (hier["step_vs_flat"], hier["target_vs_flat"]) == (2.0, 3.0)
    assert "flat_twin" not in powersgd and "flat_twin" not in fp16  # their flat twins did not run or failed
    # a gradient allreduce of S = 4000 bytes: a flat ring of 4 crosses each link 1.5 S, two levels S
    assert (flat["link_bytes_flat_ring"], flat["link_bytes_two_level"]) == (6000.0, 4000.0)
    assert (fp16["link_bytes_flat_ring"], fp16["link_bytes_two_level"]) == (3000.0, 2000.0)
    assert powersgd["link_bytes_two_level"] is None and results[0]["link_bytes_two_level"] is None
    rec = summary["recommendation"]
    assert rec["contender"] == "allreduce:hierarchical=true" and rec["hierarchical"] is True
    assert "4.0x as fast as torch DDP" in rec["text"]
    assert "It is hierarchical: 3.00x as fast to the target as its flat twin allreduce (3.0 s)." in rec["text"]
    doc = {
        "workload": {"name": "synthetic"},
        "network": {"summary": "2 nodes x 2 processes"},
        "target": summary["target"],
        "recommendation": rec,
        "contenders": results,
    }
    out = StringIO()
    report.print_table(doc, Console(file=out, width=200))
    row = next(line for line in out.getvalue().splitlines() if "allreduce:hierarchical=true" in line)
    assert "vs flat" in out.getvalue() and "0.67x" in row
    # without its flat twin's time to target the text says so; without twins there is no column
    results[1]["curve"] = [[0, 0, 0.1], [3.0, 10, 0.5]]
    rec = report.summarize(results, workloads.SETTINGS["digits"], None, nodes=2, procs_per_node=2)["recommendation"]
    assert "its flat twin allreduce did not reach the target" in rec["text"]
    flat_only = [results[0], results[1]]
    report.summarize(flat_only, workloads.SETTINGS["digits"], None, nodes=2, procs_per_node=2)
    out = StringIO()
    report.print_table({**doc, "contenders": flat_only}, Console(file=out, width=200))
    assert "vs flat" not in out.getvalue()


# ---- the worker's config, result and stop rule ---------------------------------------
def worker_config(tmp_path, **changes) -> WorkerConfig:
    spec = contenders.parse("powersgd:rank=2")
    run = {**runner.BenchConfig().resolved(), "target": 0.9, "higher_is_better": True, **changes}
    return runner.worker_config(spec, runner.BenchConfig(), run, str(tmp_path / "00-powersgd"), measure_link=False)


def test_worker_config_round_trips_and_refuses_missing_or_unknown_keys(tmp_path):
    cfg = worker_config(tmp_path)
    cfg.write(str(tmp_path / "c.json"))
    assert WorkerConfig.read(str(tmp_path / "c.json")) == cfg
    assert (cfg.spec, cfg.steps, cfg.target, cfg.reference) == ("powersgd:rank=2", 150, 0.9, False)
    data = json.loads((tmp_path / "c.json").read_text())
    with pytest.raises(ValueError, match="missing key.*steps"):
        WorkerConfig.from_dict({k: v for k, v in data.items() if k != "steps"})
    with pytest.raises(ValueError, match="unknown key.*stepz"):
        WorkerConfig.from_dict({**data, "stepz": 3})
    with pytest.raises(ValueError, match="eval_every must be at least 1"):
        WorkerConfig.from_dict({**data, "eval_every": 0})


def test_stop_reasons_keep_their_json_words_and_codes():
    words = [(0, "going on"), (1, "steps"), (2, "time budget"), (3, "time cap"), (4, "target")]
    assert [(int(s), s.text) for s in Stop] == words
    result = WorkerResult(
        "ddp", 4, Stop.TIME_CAP, 1.0, 250.0, 8.0, 10.0, None, 0.5, [[0.0, 0, 0.1]], 7, {"autotune": 1}
    )
    data = result.to_json()
    assert data["stopped"] == "time cap" and data["autotune"] == 1 and "extra" not in data
    assert list(data)[:3] == ["spec", "steps", "stopped"]
    assert json.loads(json.dumps(data)) == data


def test_the_stop_rule(tmp_path):
    """Steps first; the budget once the target is reached; past it while short of the target, up to the cap."""
    judge = Judge(worker_config(tmp_path, steps=20, time_budget_s=10.0, time_cap_s=30.0))
    assert judge.record(0, 0.0, 0.1) is Stop.GOING_ON
    assert judge.record(5, 11.0, 0.5) is Stop.GOING_ON and judge.overtime  # short of 0.9 after the budget
    assert judge.record(10, 12.0, 0.95) is Stop.TARGET
    assert Judge(worker_config(tmp_path, target=None, time_budget_s=10.0)).record(5, 10.0, 0.1) is Stop.TIME_BUDGET
    assert Judge(worker_config(tmp_path, time_budget_s=10.0)).record(1, 10.0, 0.95) is Stop.TIME_BUDGET
    assert Judge(worker_config(tmp_path, time_budget_s=10.0, time_cap_s=30.0)).record(5, 30.0, 0.1) is Stop.TIME_CAP
    assert Judge(worker_config(tmp_path, steps=5)).record(5, 99.0, 0.1) is Stop.STEPS
    reference = Judge(worker_config(tmp_path, reference=True, time_budget_s=10.0, time_cap_s=30.0))
    assert reference.record(5, 20.0, 0.95) is Stop.GOING_ON and not reference.overtime  # it trains all its steps
    assert reference.record(6, 30.0, 0.95) is Stop.TIME_CAP
    assert [p[1] for p in reference.curve] == [5, 6]


def beating(tmp_path, *beats: float) -> tuple[runner.RankGroup, str]:
    """A one-rank group whose process touches a heartbeat file after each of ``beats`` seconds
    (a step each), then sleeps on: the heartbeat ``runner.wait`` watches."""
    tmp_path.mkdir()
    heartbeat = str(tmp_path / "beat")
    code = (
        "import pathlib, sys, time\n"
        "for pause in map(float, sys.argv[2:]):\n"
        "    time.sleep(pause); pathlib.Path(sys.argv[1]).touch()\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, heartbeat, *map(str, beats)])
    return runner.RankGroup([proc], []), heartbeat


def test_a_contender_whose_every_step_is_slow_is_not_taken_for_a_hung_one(tmp_path):
    """The stall rule: a pause of ``stall_s`` and ten times the slowest step so far. It once had
    no slowest step after the first (a bench of torch DDP on a 10 Mbit/s link failed as "hung"
    while its second step ran); the first step now counts from the start."""
    group, heartbeat = beating(tmp_path / "slow", 0.4, 1.5)  # the second step takes 1.5 s
    why = runner.wait(group, timeout=3.0, heartbeat=heartbeat, first_step_s=2.0, stall_s=1.0)
    assert why == "timed out after 3 s"  # not "hung": it beat twice, the last after 1.9 s
    group, heartbeat = beating(tmp_path / "hung", 0.2)  # one step, then nothing
    why = runner.wait(group, timeout=20.0, heartbeat=heartbeat, first_step_s=2.0, stall_s=1.0)
    assert why is not None and why.startswith("hung: no training step finished for"), why


# ---- emulated networks --------------------------------------------------------------
@needs_netns
def test_network_up_and_down():
    with netem.Network(2, bandwidth="100mbit", latency="1ms") as net:
        names = ours(os.getpid())
        assert sorted(names) == sorted([net.namespace(0), net.namespace(1), net.switch])
        qdisc = subprocess.run(
            ["tc", "-n", net.namespace(0), "qdisc", "show", "dev", net.ifname(0)], capture_output=True, text=True
        ).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        if net.latency_emulated:
            assert "netem" in qdisc
        else:
            assert "netem" in net.latency_note
        # node 0 reaches node 1 over the bridge, at the addresses of our own namespaces
        server = subprocess.Popen(
            net.exec_argv(1)
            + [
                sys.executable,
                "-c",
                (
                    "import socket; s = socket.create_server(('%s', 7777)); c, _ = s.accept(); c.sendall(c.recv(5) + b'!')"
                )
                % net.address(1),
            ]
        )
        reply = subprocess.run(
            net.exec_argv(0)
            + [
                sys.executable,
                "-c",
                (
                    "import socket, time\n"
                    "for _ in range(100):\n"
                    "    try: c = socket.create_connection(('%s', 7777)); break\n"
                    "    except OSError: time.sleep(0.05)\n"
                    "c.sendall(b'hello'); print(c.recv(6).decode())"
                )
                % net.address(1),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        server.wait(10)
        assert reply.stdout.strip() == "hello!"
        host_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert net.prefix not in host_links  # nothing was created in the host's namespace
    assert ours(os.getpid()) == []
    assert net.prefix not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def start_bench(tmp_path, *extra):
    """A long bench of one contender, in its own process, from the tests' folder (for --model).

    It starts as from a terminal, with Ctrl-C's default meaning: an ignored SIGINT is
    inherited across exec, and an earlier test's library may have left it ignored in
    this process (Lightning ignores it while it destroys its process group)."""
    argv = [
        sys.executable,
        "-m",
        "unison",
        "bench",
        "--model",
        "bench_factory:tiny",
        "--contenders",
        "ddp",
        "--steps",
        "1000000",
        "--time-budget",
        "600",
        "--bandwidth",
        "10mbit",
        "--out",
        str(tmp_path),
        *extra,
    ]
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(argv, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        signal.signal(signal.SIGINT, previous)


def processes(pids: list[str]) -> str:
    """``ps`` lines for ``pids``, to say in a failure what was left running."""
    if not pids:
        return "none"
    return subprocess.run(
        ["ps", "-o", "pid,ppid,stat,etime,args", "-p", ",".join(pids)], capture_output=True, text=True
    ).stdout


def ranks_running(pid: int) -> list[str]:
    return [
        p
        for n in ours(pid)
        for p in subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
    ]


@needs_netns
def test_killed_run_leaves_namespaces_that_cleanup_removes(tmp_path):
    bench = start_bench(tmp_path)
    try:
        names = wait_for(
            lambda: len(ours(bench.pid)) == 3 and ranks_running(bench.pid) and ours(bench.pid),
            what="the bench's namespaces and ranks",
        )
        bench.send_signal(signal.SIGKILL)
        bench.wait(10)
        assert sorted(ours(bench.pid)) == sorted(names)  # nothing could tear them down
        wait_for(
            lambda: not ranks_running(bench.pid),
            60,
            "the ranks to die with the bench",
            lambda: processes(ranks_running(bench.pid)),
        )
        assert cli.main(["bench", "--cleanup"]) == 0
        assert ours(bench.pid) == []
        assert f"ub{bench.pid}" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    finally:
        if bench.poll() is None:
            bench.kill()
        netem.cleanup_stale()


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_tears_down(tmp_path, sig):
    bench = start_bench(tmp_path)
    try:
        wait_for(lambda: ranks_running(bench.pid), what="the bench's ranks")
        bench.send_signal(sig)
        assert bench.wait(90) != 0  # generous: a loaded machine is slow, a hang still fails
        assert ours(bench.pid) == []
    finally:
        if bench.poll() is None:
            bench.kill()
        netem.cleanup_stale()


# ---- a real bench ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_bench(tmp_path_factory):
    """Three contenders, one of which fails (nonblocking refuses a weight read earlier than where the
    first forward read it), on 2 nodes."""
    out = tmp_path_factory.mktemp("bench")
    argv = [
        "bench",
        "--model",
        "bench_factory:attending",
        "--contenders",
        "ddp,nonblocking,allreduce:autotune=true",
        "--steps",
        "12",
        "--eval-every",
        "4",
        "--out",
        str(out),
        "--json",
        str(out / "report.json"),
    ]
    cwd = os.getcwd()
    os.chdir(HERE)
    try:
        code = cli.main(argv)
    finally:
        os.chdir(cwd)
    with open(out / "report.json") as f:
        return code, out, json.load(f)


def test_bench_writes_json_and_plots(small_bench):
    code, out, doc = small_bench
    assert code == 0
    assert doc["world"] == {"nodes": 2, "procs_per_node": 1, "world_size": 2}
    assert doc["workload"]["name"] == "bench_factory:attending" and doc["workload"]["steps"] == 12
    assert doc["network"]["emulated"] is (netem.unavailable_reason() is None)
    by_spec = {r["spec"]: r for r in doc["contenders"]}
    assert list(by_spec) == ["ddp", "nonblocking", "allreduce:autotune=true"]
    for spec in ("ddp", "allreduce:autotune=true"):
        r = by_spec[spec]
        assert r["status"] == "ok" and r["steps"] == 12
        assert r["step_ms"] > 0 and r["samples_per_s"] > 0 and r["bytes_per_step"] > 0
        assert [p[1] for p in r["curve"]] == [0, 4, 8, 12, 12]  # evaluations, then the final one
        assert 0 < r["final_quality"] < 1.0  # held-out cross-entropy of 2 classes, trained a little
        if doc["network"]["emulated"]:
            assert r["link_bytes_per_step"] > 0.9 * r["bytes_per_step"]
    assert by_spec["ddp"]["speedup_vs_ddp"]["step"] == 1.0
    assert by_spec["allreduce:autotune=true"]["autotune"]["chosen_mb"] == 25  # a tiny model: one bucket at every size
    assert doc["target"]["source"].startswith("within 2%")
    assert doc["recommendation"]["contender"] in ("ddp", "allreduce:autotune=true")
    assert sorted(os.path.basename(p) for p in doc["plots"]) == [
        "bytes.png",
        "quality.png",
        "throughput.png",
        "time_to_target.png",
    ]
    for p in doc["plots"]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(p) > 10_000


def test_failing_contender_is_reported_and_the_bench_goes_on(small_bench):
    _, out, doc = small_bench
    failed = doc["contenders"][1]
    assert failed["status"] == "failed"
    assert "RuntimeError: nonblocking: parameter 'out.weight' was read in this forward before" in failed["error"]
    assert all(os.path.exists(log) for log in failed["logs"])
    assert doc["contenders"][2]["status"] == "ok"  # the one after it ran


def test_not_installed_peer_is_not_a_failure(monkeypatch):
    monkeypatch.setattr(contenders.importlib.util, "find_spec", lambda name: None)
    spec = contenders.parse("ppe_ddp")
    assert contenders.unavailable(spec).startswith("not installed")
    result = runner.run_contender(0, spec, runner.BenchConfig(), runner.BenchConfig().resolved(), None, "/nonexistent")
    assert result["status"] == "not installed"


@needs_netns
def test_processes_of_a_node_talk_over_its_loopback(tmp_path):
    """Hierarchical allreduce on 2 nodes x 2 processes: only the shards' allreduces cross the links
    (each a ring between 2 nodes: the gradients once per node per step, 2(M-1)/M of them); the
    reduce-scatter and all-gather inside each node stay on its loopback, or the links would carry
    twice as much. Flat allreduce, its twin, runs too: its ring of 4 crosses each link 1.5 times the
    gradients, and the report compares the two."""
    out = tmp_path / "b"
    cwd = os.getcwd()
    os.chdir(HERE)
    try:
        assert (
            cli.main(
                [
                    "bench",
                    "--model",
                    "bench_factory:wide",
                    "--contenders",
                    "allreduce:hierarchical=true,bytegrad:hierarchical=true,allreduce",
                    "--nodes",
                    "2",
                    "--procs-per-node",
                    "2",
                    "--steps",
                    "6",
                    "--eval-every",
                    "3",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    finally:
        os.chdir(cwd)
    with open(out / "bench.json") as f:
        doc = json.load(f)
    r = doc["contenders"][0]
    assert r["status"] == "ok", r.get("error")
    grads = 4 * r["params"]
    assert 0.95 * grads < r["link_bytes_per_step"] < 1.2 * grads
    assert r["link_bytes_two_level"] == grads and r["link_bytes_flat_ring"] == 1.5 * grads
    r = doc["contenders"][1]  # bytegrad's shards cross in 8 bits: a quarter (and headers)
    assert r["status"] == "ok", r.get("error")
    assert 0.24 * grads < r["link_bytes_per_step"] < 0.32 * grads
    flat = doc["contenders"][2]  # a ring of 4 crosses each link 2(N-1)/N = 1.5 times the gradients
    assert flat["status"] == "ok", flat.get("error")
    assert flat["hierarchical_twin"] == "allreduce:hierarchical=true"
    hier = doc["contenders"][0]
    assert hier["flat_twin"] == "allreduce" and "flat_twin" not in r
    assert hier["link_bytes_vs_flat"] == pytest.approx(hier["link_bytes_per_step"] / flat["link_bytes_per_step"])
    assert 0.55 < hier["link_bytes_vs_flat"] < 0.8  # 1/1.5 with two levels


def bench_json(tmp_path, *argv) -> dict:
    """Run ``unison bench`` from the tests' folder (for --model) and read its JSON."""
    cwd = os.getcwd()
    os.chdir(HERE)
    try:
        assert cli.main(["bench", *argv, "--out", str(tmp_path), "--json", str(tmp_path / "bench.json")]) == 0
    finally:
        os.chdir(cwd)
    with open(tmp_path / "bench.json") as f:
        return json.load(f)


def test_a_contender_short_of_the_target_trains_past_its_time_budget(tmp_path):
    """A time budget spent after 4 steps (1 ms): with a known target, torch DDP trains on until the
    first evaluation at the target (here within 2% of allreduce's final loss; allreduce, the
    reference, runs first and trains all its steps); with a time cap equal to the budget, it stops
    at the first evaluation past the budget, short of an unreachable target."""
    doc = bench_json(
        tmp_path / "soft",
        "--model",
        "bench_factory:tiny",
        "--contenders",
        "ddp",
        "--target-from",
        "allreduce",
        "--steps",
        "24",
        "--eval-every",
        "4",
        "--time-budget",
        "0.001",
        "--time-cap",
        "600",
    )
    ref, ddp = doc["contenders"]
    assert (ref["spec"], ref["status"], ref["steps"], ref["stopped"]) == ("allreduce", "ok", 24, "steps")
    assert doc["target"]["value"] == pytest.approx(1.02 * ref["final_quality"])
    assert doc["target"]["source"] == "within 2% of allreduce's final held-out loss"
    assert doc["workload"]["time_cap_s"] == 600
    assert ddp["status"] == "ok" and ddp["stopped"] in ("target", "steps")
    assert ddp["train_time_s"] > 0.001 and ddp["steps_to_target"] is not None
    assert ddp["steps"] == ddp["steps_to_target"] > 4  # it stopped where it reached the target, past the budget
    assert ddp["speedup_vs_ddp"]["target"] == 1.0

    doc = bench_json(
        tmp_path / "hard",
        "--model",
        "bench_factory:tiny",
        "--contenders",
        "ddp",
        "--target",
        "0",
        "--steps",
        "24",
        "--eval-every",
        "4",
        "--time-budget",
        "0.001",
        "--time-cap",
        "0.001",
    )
    (ddp,) = doc["contenders"]
    assert (ddp["status"], ddp["steps"], ddp["stopped"], ddp["time_to_target_s"]) == ("ok", 4, "time cap", None)


# ---- optional dependencies ---------------------------------------------------------------
WITHOUT = "import sys; sys.modules[{module!r}] = None; from unison.apps import cli; sys.exit(cli.main(sys.argv[1:]))"


def bench_without(module: str, out, *argv: str) -> subprocess.CompletedProcess:
    """``unison bench ARGV --out OUT`` in a fresh interpreter, from the tests' folder, where ``import module``
    fails (None in ``sys.modules``, as Python does for a module that is not installed)."""
    code = WITHOUT.format(module=module)
    return subprocess.run(
        [sys.executable, "-c", code, "bench", *argv, "--out", str(out)],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.parametrize(
    "module, argv, words",
    [
        (
            "matplotlib",
            ["--model", "bench_factory:tiny"],
            ["matplotlib is not installed, and the plots need it", "--no-plot"],
        ),
        ("sklearn", ["--workload", "digits", "--no-plot"], ["scikit-learn is not installed, and the digits workload"]),
        ("rich", ["--model", "bench_factory:tiny", "--no-plot"], ["rich is not installed, and the bench's output"]),
    ],
)
def test_a_missing_optional_module_stops_the_bench_before_any_contender(tmp_path, module, argv, words):
    """Found before the network is set up or a contender starts (it used to crash at the plots, after the training)."""
    proc = bench_without(module, tmp_path / "out", *argv, "--contenders", "ddp", "--steps", "4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for text in words + ["unison bench: ", 'pip install "unison[bench]"']:
        assert text in proc.stderr
    assert not (tmp_path / "out").exists()  # no logs folder: no contender ran
    assert "contenders" not in proc.stdout  # nor was the run announced


def test_no_plot_runs_without_matplotlib(tmp_path):
    proc = bench_without(
        "matplotlib",
        tmp_path,
        "--model",
        "bench_factory:tiny",
        "--contenders",
        "ddp",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--no-plot",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["plots"] == [] and doc["contenders"][0]["status"] == "ok"
    assert not list(tmp_path.glob("*.png"))
    assert "no plots (--no-plot)" in proc.stdout


def test_results_are_written_before_the_plots_can_fail(tmp_path, monkeypatch, capsys):
    """The table and the JSON come first; a plotting error then exits 1 with a message, and loses nothing."""

    def broken(doc, out_dir):
        raise RuntimeError("no display")

    monkeypatch.setattr(report, "write_plots", broken)
    monkeypatch.chdir(HERE)
    code = cli.main(
        [
            "bench",
            "--model",
            "bench_factory:tiny",
            "--contenders",
            "ddp",
            "--steps",
            "4",
            "--eval-every",
            "2",
            "--out",
            str(tmp_path),
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    captured = capsys.readouterr()
    assert code == 1
    assert "the plots failed (RuntimeError: no display)" in captured.err
    assert "torch DDP" in captured.out and "Use torch DDP" in captured.out  # the table and the recommendation
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["contenders"][0]["status"] == "ok" and doc["contenders"][0]["steps"] == 4
    assert doc["plots"] == [] and doc["recommendation"]["contender"] == "ddp"
