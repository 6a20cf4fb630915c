import fcntl
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _share_the_machine(request, tmp_path_factory):
    """Under pytest-xdist (two workers, CONTRIBUTING.md): a test marked ``alone`` runs while no
    other test does (an exclusive lock on a file the workers share); every other test holds the
    lock shared, so any number of them run together. The ``alone`` ones watch a heal on the wire
    or a loaded CPU, and a second test's load would change what they watch."""
    path = tmp_path_factory.getbasetemp().parent / "unison-alone.lock"
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if request.node.get_closest_marker("alone") else fcntl.LOCK_SH)
        yield
