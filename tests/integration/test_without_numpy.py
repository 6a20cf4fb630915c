"""The core install (torch alone, no NumPy) trains, switches, saves and loads on 2 ranks:
torch's *_object collectives need NumPy, unison's own do not."""

import os
import re

from tests import launch

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "without_numpy.py")


def test_two_ranks_train_save_and_load_without_numpy(tmp_path):
    proc = launch.torchrun(SCRIPT, str(tmp_path / "c.pt"), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-6000:])
    assert sorted(re.findall(r"rank (\d) ok", proc.stdout)) == ["0", "1"]  # the two ranks' lines may interleave
