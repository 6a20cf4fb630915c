"""`unison launch --preload MODULES`: workers forked from a template that imported MODULES once
run their script as `python script.py ARGS` does (its name, arguments, sys.path, folder,
environment, session, exit status, traceback and atexit handlers), and bad --preload values
are refused before anything starts. Each launcher is capped in time; only the processes a test
started are signalled (by the launcher)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from integration.test_launcher import gone_within
from unison.apps import cli
from unison.apps.launch_cmd import module_list

LIMIT_S = 60
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

REPORTER = """\
import atexit, concurrent.futures, json, logging, os, random, sys, threading, time
preloaded = "torch" in sys.modules and "unison" in sys.modules  # before this script imports them
import numpy, torch, unison

unison.init()
wid = os.environ["UNISON_FT_ID"]
out = sys.argv[1]
report = {
    "preloaded": preloaded, "name": __name__, "argv": sys.argv, "path0": sys.path[0], "file": __file__,
    "cwd": os.getcwd(), "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
    "marker": os.environ.get("UNISON_TEST_MARKER"),
    "random": random.random(), "numpy": float(numpy.random.rand()), "torch": torch.rand(1).item(),
    "log_handlers": len(logging.getLogger("unison").handlers), "log_level": logging.getLogger("unison").level,
    "quick_exit": unison.runtime.ending._quick,
    "template": open(f"/proc/{os.getppid()}/cmdline").read().split(chr(0)),
}
with open(os.path.join(out, f"report-{wid}.json"), "w") as f:
    json.dump(report, f)


def ended():
    with open(os.path.join(out, f"atexit-{wid}"), "w") as f:
        f.write(str(later.done))


class Later:
    done = False


later = Later()
atexit.register(ended)
# A file held past the script's globals (here by sys) is flushed only as the interpreter ends.
sys.unison_test_unclosed = open(os.path.join(out, f"unclosed-{wid}"), "w")
sys.unison_test_unclosed.write("flushed")
# A non-daemon thread ends before the atexit handlers run, as at the end of python.
threading.Thread(target=lambda: (time.sleep(0.3), setattr(later, "done", True))).start()
# A thread pool left open ends too (threading's exit callbacks tell its threads; joined, they would hang).
concurrent.futures.ThreadPoolExecutor(1).submit(time.sleep, 0.01).result()
if wid == "1":
    sys.exit(3)
raise ValueError("the script's own error")
"""


def launch(tmp_path: Path, *args: str, script: str, cwd: Path, env: dict = ENV) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--no-status", *args, script]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S, env=env, cwd=cwd)


def cli_main(capsys, *args: str, script: str) -> tuple[object, str]:
    """``launch``'s command run in this process: its exit status (returned, or raised by argparse) and stderr."""
    capsys.readouterr()
    try:
        code: object = cli.main(["launch", "--fault-tolerant", "--no-status", *args, script])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def test_a_forked_worker_runs_its_script_as_python_does(tmp_path):
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "reporter.py").write_text(REPORTER)
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    env = {**ENV, "UNISON_TEST_MARKER": "given"}
    done = subprocess.Popen(
        [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--no-status", "--nproc", "2"]
        + ["--preload", "torch,unison", str(folder / "reporter.py"), str(out)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=work,
    )
    _, err = done.communicate(timeout=LIMIT_S)
    assert done.returncode == 1, err[-3000:]  # neither member finished
    reports = {wid: json.loads((out / f"report-{wid}.json").read_text()) for wid in (0, 1)}
    for wid, r in reports.items():
        assert r["preloaded"] and r["name"] == "__main__"
        assert r["argv"] == [str(folder / "reporter.py"), str(out)]
        assert r["path0"] == str(folder) and r["file"] == str(folder / "reporter.py")
        assert r["cwd"] == str(work) and r["marker"] == "given"
        assert r["sid"] == r["pid"]  # a session of its own, as the launcher gives every worker
        assert r["ppid"] != done.pid  # forked by the template, not started by the launcher
        # The template was forked from the launcher (no interpreter of its own), and what the
        # launcher set for itself is not the script's: no log handler, no quick end.
        assert r["template"][1:4] == ["-m", "unison", "launch"], r["template"]
        assert r["log_handlers"] == 0 and r["log_level"] == 0 and r["quick_exit"] is False
        assert (out / f"atexit-{wid}").read_text() == "True"  # after the non-daemon thread ended
        assert (out / f"unclosed-{wid}").read_text() == "flushed"
    # Random state as new processes have it: seeded anew in each (this torch too), not the template's.
    for source in ("random", "numpy", "torch"):
        assert reports[0][source] != reports[1][source], source
    assert f"worker 1 (pid {reports[1]['pid']}) finished, then exited with 3" in err  # sys.exit(3)
    assert f"worker 0 (pid {reports[0]['pid']}) exited with 1" in err
    traceback = err[err.index("Traceback (most recent call last):") :]
    frames = re.findall(r'File "([^"]+)"', traceback.split("ValueError")[0])
    assert frames == [str(folder / "reporter.py")], traceback[:2000]  # from the script's line, as python prints it
    assert "ValueError: the script's own error" in traceback


def test_the_template_ends_with_the_job(tmp_path):
    script = tmp_path / "quick.py"
    script.write_text(
        "import os, sys, unison\nunison.init()\n"
        "open(os.path.join(sys.argv[1], f'parent-{os.getpid()}'), 'w').write(str(os.getppid()))\n"
    )
    cmd = ["--nproc", "2", "--preload", "torch,unison"]
    done = subprocess.run(
        [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--no-status", *cmd, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (template,) = {int(p.read_text()) for p in tmp_path.glob("parent-*")}  # both forked by one template
    assert gone_within([template], 10.0) == []


def test_bad_preload_values_are_refused_with_what_to_do(tmp_path, capsys):
    """Refused before anything starts: the first as a user runs it (a fresh interpreter, its exit
    status), the next three through the same ``unison.apps.cli.main`` in this process."""
    script = tmp_path / "job.py"
    script.write_text("import unison\nunison.init()\n")
    unknown = launch(
        tmp_path, "--nproc", "2", "--preload", "torch,no_such_module_here", script=str(script), cwd=tmp_path
    )
    assert unknown.returncode == 2 and "no module named 'no_such_module_here'" in unknown.stderr, unknown.stderr
    code, err = cli_main(capsys, "--nproc", "2", "--preload", ",", script=str(script))
    assert code == 2 and "give at least one module" in err, err
    assert module_list(" torch,,unison ") == ("torch", "unison")  # blanks between commas are skipped
    code, err = cli_main(capsys, "--nproc", "2", "--preload", "torch", script=str(tmp_path))
    assert code == 2 and "--preload runs a script file" in err, err
    code, err = cli_main(
        capsys, "--procs-per-node", "2", "--coordinator", "127.0.0.1:1", "--preload", "torch", script=str(script)
    )
    assert code == 2 and "a node's agent (--coordinator)" in err, err
    # A module found here that fails as the template imports it: the launcher says which and why.
    (tmp_path / "broken_at_import.py").write_text("raise RuntimeError('not today')\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV.get("PYTHONPATH", "")])}
    broken = launch(
        tmp_path, "--nproc", "2", "--preload", "broken_at_import", script=str(script), cwd=tmp_path, env=env
    )
    assert broken.returncode == 1, broken.stderr[-3000:]
    assert "cannot import 'broken_at_import': RuntimeError: not today" in broken.stderr, broken.stderr[-3000:]
