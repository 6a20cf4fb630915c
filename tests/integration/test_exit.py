"""Processes leave cleanly right after their last collective (real interpreter exits)."""

import os
import subprocess
import sys

import pytest

import unison
from tests import launch

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "exit_after_backward.py")


def test_ranks_exit_cleanly_right_after_backward(tmp_path):
    for _ in range(3):  # the old race aborted about one launch in two with this script (7 in 8 caught)
        proc = launch.torchrun(SCRIPT, cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "terminate called" not in proc.stderr


THREADS = os.path.join(os.path.dirname(SCRIPT), "exit_threads.py")


@pytest.mark.parametrize("end", ["shutdown", "atexit"])
def test_no_gloo_worker_is_left_when_the_interpreter_finalizes(tmp_path, end):
    """The abort's root (runtime/ending.py): a gloo worker thread alive when the interpreter
    finalizes can free a tensor there and abort the process. After ``unison.shutdown()``, and at
    exit when the script never called it, every group's workers must have been joined, with
    every algorithm having trained (each builds its own groups) and the script still holding its
    models, optimizers and last losses."""
    proc = launch.torchrun(THREADS, end, ",".join(unison.algorithms.names()), cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    for rank in range(2):
        lines = dict(line.split(":", 1) for line in (tmp_path / f"threads-{rank}.txt").read_text().splitlines())
        assert set(lines) == ({"after shutdown", "at exit"} if end == "shutdown" else {"at exit"})
        for where, threads in lines.items():
            assert "pt_gloo_runloop" not in threads, f"rank {rank}, {where}: gloo workers still alive: {threads}"


@pytest.mark.parametrize("quick", [True, False])
def test_only_unisons_own_processes_skip_the_last_collections(tmp_path, quick):
    """``ending.quick_exit()`` (the launcher, ``unison train``'s workers, ``python -m unison``):
    what is left at exit is frozen after the job has ended, so the interpreter's finalization does
    not walk it for cycles; a script that did not call it keeps the ordinary end."""
    script = tmp_path / "ends.py"
    script.write_text(
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count(), flush=True))  # runs last\n"
        "from unison.runtime import ending\n"
        "if sys.argv[1] == 'quick':\n"
        "    ending.quick_exit()\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script), "quick" if quick else "plain"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    frozen = int(proc.stdout.split()[-1])
    assert (frozen > 0) == quick, proc.stdout


def test_the_cli_run_in_a_process_of_its_caller_leaves_its_end_alone(capsys):
    """``unison.apps.cli.main(argv)`` called by a program (a test, a notebook) is not the program:
    only ``main()`` of the console script and ``python -m unison`` says the process is unison's."""
    from unison.apps import cli
    from unison.runtime import ending

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert cli.main(["launch", "--fault-tolerant", "script.py"]) == 2  # neither --nproc nor --nodes
    assert not ending._quick
