"""Emulated networks: one Linux network namespace per node, joined by a bridge, links limited with tc.

Node ``i`` is the namespace ``ub<pid>n<i>`` holding one veth, ``ub<pid>e<i>``,
with the private address ``10.77.0.<i+1>/24``; its peer ``ub<pid>p<i>`` is a
port of the bridge ``ub<pid>br`` in a switch namespace ``ub<pid>sw``. Nothing
is created in the host's own namespace and no host interface is touched
(``<pid>`` is the creating process). Processes of one node talk over their
namespace's loopback (unlimited); nodes talk over the veths, each limited to
``bandwidth`` in both directions (tc's token bucket on the node's egress and on
the switch port's) and delayed by ``latency`` one way (netem on the node's
egress, so a round trip between two nodes takes twice the latency). A kernel
without netem (``sch_netem``) still gets the bandwidth limit; ``latency_note``
then says the latency is not emulated.

``with Network(nodes=2, bandwidth="1gbit", latency="2ms") as net:`` creates it
and always removes it: on leaving the block, at interpreter exit, on SIGTERM or
SIGHUP (turned into SystemExit) and Ctrl-C (KeyboardInterrupt). A run killed
outright (SIGKILL) leaves its namespaces behind; ``cleanup_stale()`` (called by
every new Network, and by ``unison bench --cleanup``) removes those whose
creating process is gone.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import threading
from typing import Literal, Optional

#: Names this module creates: ``ub<pid>n<i>`` (a node) and ``ub<pid>sw`` (the switch).
NAMESPACE_RE = re.compile(r"^ub(\d+)(?:n\d+|sw)$")
SUBNET = "10.77.0"

_RATE_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}

#: Named networks (``unison bench --network NAME``): (bandwidth, one-way latency) of each node's link.
#: "lan" is the bench's default; "10mbit" and "1mbit" are links between sites or homes, where
#: SparseLoCo and DeMo are meant to run (a kernel without netem emulates only their bandwidth).
PRESETS: dict[str, tuple[str, str]] = {
    "lan": ("1gbit", "2ms"),
    "10mbit": ("10mbit", "20ms"),
    "1mbit": ("1mbit", "50ms"),
}
_NO_LIMIT = ("", "0", "none", "unlimited", "off")


class NetworkError(RuntimeError):
    """The emulated network could not be built (the message says why)."""


def _quantity(text: str, units: dict[str, float], refusal: str) -> Optional[float]:
    """A number with one of ``units`` (tc syntax), scaled; None for no limit; ValueError(refusal) otherwise."""
    text = str(text).strip().lower()
    if text in _NO_LIMIT:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]+)", text)
    if not match or match.group(2) not in units or float(match.group(1)) <= 0:
        raise ValueError(refusal.format(text=text))
    return float(match.group(1)) * units[match.group(2)]


def parse_rate(text: str) -> Optional[float]:
    """Bits per second of a tc-style rate (``"1gbit"``, ``"100mbit"``, ``"50mbps"``); None for no limit."""
    return _quantity(
        text, _RATE_UNITS, "bandwidth {text!r} is not a rate such as 1gbit, 100mbit, 10gbit or 50mbps (or 'unlimited')"
    )


def parse_delay(text: str) -> Optional[float]:
    """Seconds of a tc-style time (``"2ms"``, ``"500us"``, ``"0.1s"``); None for no delay."""
    return _quantity(text, _TIME_UNITS, "latency {text!r} is not a time such as 2ms, 500us or 0.1s (or 0)")


def unavailable_reason() -> Optional[str]:
    """Why namespaces cannot be used here (not root, no iproute2), or None if they can."""
    if os.geteuid() != 0:
        return "not running as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's {tool!r} command is not installed"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetworkError(f"{' '.join(argv)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def namespaces() -> list[str]:
    """The names ``ip netns list`` shows."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_namespace(name: str) -> None:
    """Kill what still runs in namespace ``name`` (our rank processes), then delete it."""
    pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run("ip", "netns", "del", name, check=False)


def cleanup_stale() -> list[str]:
    """Remove the namespaces (and with them the veths and bridge) left by runs whose process is gone."""
    if unavailable_reason() is not None:
        return []
    removed = []
    for name in namespaces():
        match = NAMESPACE_RE.match(name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            _remove_namespace(name)
            removed.append(name)
    return removed


class Network:
    """``nodes`` namespaces on one bridge, each link limited to ``bandwidth`` and ``latency``
    (tc syntax, e.g. "1gbit" and "2ms"; None or "unlimited"/"0" for no limit)."""

    def __init__(self, nodes: int, bandwidth: Optional[str] = None, latency: Optional[str] = None) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= 250:
            raise ValueError(f"nodes must be an integer from 1 to 250, got {nodes!r}")
        self.nodes = nodes
        self.rate_bits = parse_rate(bandwidth or "")
        self.delay_s = parse_delay(latency or "")
        self.bandwidth = None if self.rate_bits is None else str(bandwidth).strip().lower()
        self.latency = None if self.delay_s is None else str(latency).strip().lower()
        self.prefix = f"ub{os.getpid()}"
        self.switch = f"{self.prefix}sw"
        self.bridge = f"{self.prefix}br"
        self.latency_note: Optional[str] = None
        self.active = False

    def namespace(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def ifname(self, node: int) -> str:
        """The node's veth (what GLOO_SOCKET_IFNAME must name inside its namespace)."""
        return f"{self.prefix}e{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def exec_argv(self, node: int) -> list[str]:
        """The command prefix that runs a program inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    @property
    def latency_emulated(self) -> bool:
        return self.delay_s is not None and self.latency_note is None

    # ---- lifetime ---------------------------------------------------------
    def __enter__(self) -> "Network":
        self.up()
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.down()
        return False

    def up(self) -> None:
        """Create the namespaces, bridge and links; on any failure remove what was made and raise NetworkError."""
        reason = unavailable_reason()
        if reason:
            raise NetworkError(f"cannot emulate a network: {reason}")
        if any(n.prefix == self.prefix for n in _active):
            raise NetworkError("this process already has an emulated network up")
        cleanup_stale()
        _watch(self)
        try:
            self.active = True
            _run("ip", "netns", "add", self.switch)
            _run("ip", "-n", self.switch, "link", "set", "lo", "up")
            _run("ip", "-n", self.switch, "link", "add", self.bridge, "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", self.bridge, "up")
            for node in range(self.nodes):
                self._add_node(node)
        except BaseException:
            self.down()
            raise

    def _add_node(self, node: int) -> None:
        ns, veth, port = self.namespace(node), self.ifname(node), f"{self.prefix}p{node}"
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", veth, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
        _run("ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", veth)
        _run("ip", "-n", ns, "link", "set", veth, "up")
        _run("ip", "-n", self.switch, "link", "set", port, "master", self.bridge, "up")
        self._shape(ns, veth, delay=True)
        self._shape(self.switch, port, delay=False)

    def _shape(self, ns: str, dev: str, delay: bool) -> None:
        """Limit ``dev``'s egress: netem for the delay (node side) with the rate's token bucket under it."""
        parent = ["root"]
        if delay and self.delay_s is not None and self.latency_note is None:
            usec = max(1, round(self.delay_s * 1e6))
            netem = f"qdisc add dev {dev} root handle 1: netem delay {usec}us limit 100000".split()
            proc = _run("tc", "-n", ns, *netem, check=False)
            if proc.returncode == 0:
                parent = ["parent", "1:1"]
            else:
                self.latency_note = (
                    f"latency not emulated: this kernel has no netem qdisc (tc said: {proc.stderr.strip()})"
                )
        if self.rate_bits is not None:
            burst = max(64 * 1024, int(self.rate_bits / 8 * 0.004))  # 4 ms at line rate, at least a GSO segment
            tbf = f"handle 10: tbf rate {int(self.rate_bits)}bit burst {burst} latency 100ms".split()
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, *tbf)

    def down(self) -> None:
        """Remove everything this network created (idempotent); processes still inside are killed."""
        if not self.active:
            return
        present = set(namespaces())
        for name in [self.namespace(n) for n in range(self.nodes)] + [self.switch]:
            if name in present:
                _remove_namespace(name)
        self.active = False
        _active.discard(self)

    def describe(self) -> dict:
        """What the network is, for reports."""
        return {
            "emulated": True,
            "nodes": self.nodes,
            "bandwidth": self.bandwidth,
            "bandwidth_bits_per_s": self.rate_bits,
            "latency": self.latency,
            "latency_s": self.delay_s,
            "latency_emulated": self.latency_emulated,
            "note": self.latency_note,
        }


# ---- teardown on exit and on signals ------------------------------------------
_active: set[Network] = set()
_handlers_installed = False


def _teardown_all() -> None:
    for net in list(_active):
        net.down()


def _on_signal(signum, _frame):
    _teardown_all()
    raise SystemExit(128 + signum)


def _watch(net: Network) -> None:
    """Remember ``net`` for teardown at exit, and turn SIGTERM/SIGHUP into SystemExit (once, main thread only)."""
    global _handlers_installed
    _active.add(net)
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_teardown_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)
