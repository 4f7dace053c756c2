"""Test hosts on this machine: network namespaces, each joined to the host by a veth pair on a /30 of its own.

Host ``i`` (1-based) of a run is the namespace ``el<pid>w<i>``; its pair is ``el<pid>w<i>h`` (host side, carrying
the host-side address the workers connect to) and ``el<pid>w<i>n`` (moved into the namespace). Names carry the
pytest process's pid, so two runs never share one, and leftovers of a run that died are recognised and removed by
the next (:func:`remove_leftovers`). Nothing routes beyond the pairs: traffic stays on this machine.

A link is cut on the host side (``ip link set dev <host side> down``): the namespace side loses its carrier, packets
to the host are dropped, and a connect times out (it is not refused), as across a failed switch port.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

#: Subnets are /30s inside 10.231.X.0/24, X chosen per run among those no address or route of this machine uses.
SUBNET_FIRST_OCTETS = (10, 231)
_LEFTOVER = re.compile(r"^el(\d+)w\d+[hn]?$")


class NetworkError(RuntimeError):
    """An ``ip`` command failed; the message has its arguments and stderr."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def missing_requirements() -> str | None:
    """Why this machine cannot run test hosts (None when it can): root, ``ip`` and ``faketime`` are needed."""
    if os.geteuid() != 0:
        return "the multi-host test makes network namespaces: it needs root"
    for tool, package in (("ip", "iproute2"), ("faketime", "faketime")):
        if shutil.which(tool) is None:
            return f"the multi-host test needs {tool!r} (Debian package {package})"
    return None


@dataclass(frozen=True)
class TestHost:
    """One namespace and its link: ``host_addr`` is where its workers reach the host's services."""

    index: int
    namespace: str
    host_if: str
    ns_if: str
    host_addr: str
    ns_addr: str

    @property
    def name(self) -> str:
        return f"w{self.index}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Deletes namespaces and host-side links of earlier runs whose pytest process is gone (a run killed before its
    teardown), after SIGKILLing the processes still inside those namespaces (a worker left stopped cannot notice
    that its test is gone); returns what it removed."""
    removed = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _LEFTOVER.match(name)
        if match and not pid_alive(int(match.group(1))):
            for pid in ip("netns", "pids", name, check=False).stdout.split():
                for signum in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(int(pid), signum)
                    except ProcessLookupError:
                        pass
                removed.append(f"process {pid} in {name}")
            ip("netns", "del", name, check=False)
            removed.append(name)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        match = _LEFTOVER.match(name)
        if match and not pid_alive(int(match.group(1))):
            ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_third_octet() -> int:
    """A third octet X such that nothing on this machine has an address or a route in 10.231.X.0/24."""
    used = ip("-4", "-o", "addr", "show").stdout + ip("-4", "-o", "route", "show", "table", "all").stdout
    first, second = SUBNET_FIRST_OCTETS
    start = os.getpid() % 200 + 20
    for step in range(256):
        candidate = (start + step) % 256
        if f"{first}.{second}.{candidate}." not in used:
            return candidate
    raise NetworkError(f"no free /24 in {first}.{second}.0.0/16 for the test hosts")


class Network:
    """``count`` test hosts, created by :meth:`create` and all removed by :meth:`teardown` (safe to call twice)."""

    def __init__(self, count: int = 3, *, tag: str | None = None) -> None:
        self.count = count
        self.tag = tag or f"el{os.getpid()}"
        self.hosts: list[TestHost] = []
        self._made: list[tuple[str, str]] = []  # (namespace, host side) actually created, for teardown

    def create(self) -> list[TestHost]:
        third = _free_third_octet()
        first, second = SUBNET_FIRST_OCTETS
        for index in range(1, self.count + 1):
            namespace, host_if, ns_if = f"{self.tag}w{index}", f"{self.tag}w{index}h", f"{self.tag}w{index}n"
            base = 4 * (index - 1)
            host = TestHost(
                index,
                namespace,
                host_if,
                ns_if,
                f"{first}.{second}.{third}.{base + 1}",
                f"{first}.{second}.{third}.{base + 2}",
            )
            ip("netns", "add", namespace)
            self._made.append((namespace, host_if))
            ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            ip("link", "set", ns_if, "netns", namespace)
            ip("addr", "add", f"{host.host_addr}/30", "dev", host_if)
            ip("link", "set", "dev", host_if, "up")
            ip("-n", namespace, "addr", "add", f"{host.ns_addr}/30", "dev", ns_if)
            ip("-n", namespace, "link", "set", "dev", ns_if, "up")
            ip("-n", namespace, "link", "set", "dev", "lo", "up")
            self.hosts.append(host)
        return self.hosts

    def cut(self, host: TestHost) -> None:
        ip("link", "set", "dev", host.host_if, "down")

    def restore(self, host: TestHost) -> None:
        ip("link", "set", "dev", host.host_if, "up")

    def is_up(self, host: TestHost) -> bool:
        """Whether the host side is administratively up (its flags, between ``<`` and ``>``, include ``UP``)."""
        shown = ip("-o", "link", "show", "dev", host.host_if, check=False).stdout
        flags = shown.partition("<")[2].partition(">")[0].split(",")
        return "UP" in flags

    def teardown(self) -> list[str]:
        """Deletes every namespace and pair this object made (deleting a namespace destroys its end of the pair,
        which destroys the pair; the host side is deleted too in case it was never moved). Returns the errors."""
        errors = []
        for namespace, host_if in reversed(self._made):
            result = ip("netns", "del", namespace, check=False)
            if result.returncode != 0 and "No such file" not in result.stderr:
                errors.append(f"ip netns del {namespace}: {result.stderr.strip()}")
            # Deleting the namespace destroys the pair asynchronously: give it a moment before deleting it here.
            for _ in range(40):
                if ip("link", "show", "dev", host_if, check=False).returncode != 0:
                    break
                time.sleep(0.05)
            else:
                result = ip("link", "del", host_if, check=False)
                if result.returncode != 0 and "Cannot find device" not in result.stderr:
                    errors.append(f"ip link del {host_if}: {result.stderr.strip()}")
        self._made.clear()
        return errors
