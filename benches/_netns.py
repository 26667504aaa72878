"""Simulated hosts on one machine, for benches/multihost.py: each host is a network namespace
with one veth link (`eth0`) to a switch namespace that bridges them all, and its processes run
in a pid namespace of their own. Needs root (`ip netns`, `tc`, `unshare`).

A host's link rate is capped with `tc tbf` on both ends of its veth pair (its egress in the
host, its ingress as the switch port's egress), so what it sends and what it receives each get
at most the rate, as on a full-duplex NIC. Added latency is not available: this kernel has
tbf, htb and the fifos but no netem, fq or etf (nothing that holds a packet back by time).

Namespaces are named `<prefix>-<host>` and `<prefix>-sw`; `Fabric` removes them on exit, and
any left by an earlier run with the same prefix on entry, with every process still in them.
Faults for benches/crosshost_faults.py: a host's link set down (`set_link`), its processes
(`pids`, as the caller's pid namespace numbers them) stopped or killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

SUBNET = "10.213.0"
HOST_IFACE = "eth0"
BRIDGE = "br0"
# tbf's bucket: at least one timer tick of data at the rate (10 ms covers HZ >= 100), and never
# below a GSO segment.
BURST_S = 0.01
MIN_BURST_BYTES = 128 * 1024
# tbf's queue: this long at the rate (what a switch port buffers), then it drops.
QUEUE_S = 0.02


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def _existing_namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]


class Fabric:
    """Hosts `names` on one bridged /24; `address(name)` is a host's address on it."""

    def __init__(self, names: Sequence[str], prefix: str = "kvdmh"):
        self.names = list(names)
        self.prefix = prefix
        self._index = {name: i for i, name in enumerate(self.names)}
        self._rates: dict[str, float | None] = {name: None for name in self.names}

    def namespace(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def address(self, name: str) -> str:
        return f"{SUBNET}.{self._index[name] + 1}"

    def _port(self, name: str) -> str:
        return f"sw{self._index[name]}"  # the switch's end of the host's link

    @property
    def _switch(self) -> str:
        return f"{self.prefix}-sw"

    def __enter__(self) -> Fabric:
        self.remove()
        # A SIGTERM (timeout, kill) unwinds through __exit__ like Ctrl-C.
        self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
        signal.signal(signal.SIGTERM, self._previous_sigterm)

    def _create(self) -> None:
        sw = self._switch
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "set", "dev", "lo", "up")
        _run("ip", "-n", sw, "link", "add", "name", BRIDGE, "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "dev", BRIDGE, "up")
        for name in self.names:
            ns, port = self.namespace(name), self._port(name)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "dev", "lo", "up")
            _run("ip", "-n", sw, "link", "add", "name", port, "type", "veth",
                 "peer", "name", HOST_IFACE, "netns", ns)
            _run("ip", "-n", sw, "link", "set", "dev", port, "master", BRIDGE)
            _run("ip", "-n", sw, "link", "set", "dev", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", HOST_IFACE)
            _run("ip", "-n", ns, "link", "set", "dev", HOST_IFACE, "up")

    def remove(self) -> None:
        """Deletes this prefix's namespaces (their veths go with them), SIGKILLing the processes
        left in them first (deleting a namespace does not end them); never raises."""
        try:
            names = [ns for ns in _existing_namespaces() if ns.startswith(f"{self.prefix}-")]
        except (OSError, RuntimeError):
            return
        for ns in names:
            for pid in _namespace_pids(ns):
                if pid != os.getpid():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def set_rate(self, name: str, gbit: float | None) -> None:
        """Caps host `name`'s link at `gbit` Gbit/s each way; None lifts the cap."""
        ends = ((self.namespace(name), HOST_IFACE), (self._switch, self._port(name)))
        for ns, dev in ends:
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)  # none there yet is fine
            if gbit is None:
                continue
            rate_bytes = gbit * 1e9 / 8
            burst = max(MIN_BURST_BYTES, int(rate_bytes * BURST_S))
            limit = burst + int(rate_bytes * QUEUE_S)
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                 "rate", f"{gbit * 1000:g}mbit", "burst", str(burst), "limit", str(limit))
        self._rates[name] = gbit

    def rate(self, name: str) -> float | None:
        return self._rates[name]

    def qdisc(self, name: str) -> str:
        return _run("tc", "-n", self.namespace(name), "qdisc", "show", "dev", HOST_IFACE).strip()

    def link_bytes(self, name: str) -> dict[str, int]:
        """Bytes host `name` has received and sent on its link ({"rx", "tx"})."""
        out = _run("ip", "-n", self.namespace(name), "-s", "-j", "link", "show", "dev", HOST_IFACE)
        stats = json.loads(out)[0]["stats64"]
        return {"rx": stats["rx"]["bytes"], "tx": stats["tx"]["bytes"]}

    def set_link(self, name: str, up: bool) -> None:
        """Sets host `name`'s link (its `eth0`) up or down, as a cable pulled and put back."""
        _run("ip", "-n", self.namespace(name), "link", "set", "dev", HOST_IFACE,
             "up" if up else "down")

    def pids(self, name: str) -> list[int]:
        """The processes on host `name`, as this process's pid namespace numbers them."""
        return _namespace_pids(self.namespace(name))

    def launcher(self, name: str, directory: Path) -> str:
        """An executable that runs this Python interpreter on host `name` (VllmServer's
        `python`). On SIGTERM it kills `unshare` (which ignores SIGTERM), whose child, and so the
        whole pid namespace, goes with it; VllmServer would otherwise wait 30 s before its
        SIGKILL."""
        path = directory / f"python-on-{name}"
        path.write_text(
            "#!/bin/sh\n"
            + " ".join(self.exec_prefix(name)) + f" {sys.executable} \"$@\" &\n"
            + "child=$!\ntrap 'kill -KILL $child' TERM INT\nwait $child\nwait $child\n")
        path.chmod(0o755)
        return str(path)

    def exec_prefix(self, name: str) -> list[str]:
        """Runs a command on host `name`: in its network namespace, as pid 1 of a new pid
        namespace with its own /proc (so its processes see, and publish, pids of their own)."""
        return ["ip", "netns", "exec", self.namespace(name),
                "unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]


def _namespace_pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(pid) for pid in done.stdout.split() if pid.isdigit()]


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
