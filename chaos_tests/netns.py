"""A network namespace for one lockd replica or node agent, so that iptables can cut it off from etcd.

    ns = Netns.create()                      # root, `ip netns`, iptables; else NetnsUnavailable(reason)
    bridges = [Relay(ep, listen_host=ns.host_ip) for ep in etcd.endpoints]
    rep = NetnsLockdProcess(ns, ",".join(b.endpoint for b in bridges), ...)
    ns.cut([b.port for b in bridges])        # iptables DROP inside the namespace: packets vanish
    ns.heal(...)                             # rules removed: TCP retransmits what was dropped
    ns.delete()

The namespace is joined to the host by a veth pair (a /30 of 10.x.y.0). etcd
listens on the host's loopback, which a namespace cannot reach, so each etcd
member is bridged by a plain ``Relay`` listening on the host end of the veth;
the relays are never cut themselves. The cut is the kernel's: iptables rules
in the namespace drop the replica's packets to and from those relays, while
the clients still reach the replica over the veth, exactly the partition in
which a replica keeps serving clients without seeing etcd.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess

from timeslice.testing.agent import AgentProcess
from timeslice.testing.lockd import LockdProcess


class NetnsUnavailable(Exception):
    """Why this machine cannot run the scenario (the test skips with this reason)."""


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=20, check=False)


class Netns:
    def __init__(self, name: str, host_if: str, ns_if: str, host_ip: str, ns_ip: str):
        self.name, self.host_if, self.ns_if, self.host_ip, self.ns_ip = name, host_if, ns_if, host_ip, ns_ip
        self._rules: list[list[str]] = []

    @classmethod
    def create(cls) -> Netns:
        if os.geteuid() != 0:
            raise NetnsUnavailable("needs root (network namespaces and iptables)")
        for tool in ("ip", "iptables"):
            if shutil.which(tool) is None:
                raise NetnsUnavailable(f"`{tool}` is not installed (Debian: apt-get install iproute2 iptables)")
        tag = secrets.token_hex(3)
        a, b = 16 + int(tag[:2], 16) % 200, int(tag[2:4], 16) % 64 * 4
        ns = cls(f"tschaos-{tag}", f"tsh{tag}", f"tsn{tag}", f"10.{a}.{b}.1", f"10.{a}.{b}.2")
        steps = [
            ["ip", "netns", "add", ns.name],
            ["ip", "link", "add", ns.host_if, "type", "veth", "peer", "name", ns.ns_if],
            ["ip", "link", "set", ns.ns_if, "netns", ns.name],
            ["ip", "addr", "add", f"{ns.host_ip}/30", "dev", ns.host_if],
            ["ip", "link", "set", ns.host_if, "up"],
            ["ip", "netns", "exec", ns.name, "ip", "addr", "add", f"{ns.ns_ip}/30", "dev", ns.ns_if],
            ["ip", "netns", "exec", ns.name, "ip", "link", "set", ns.ns_if, "up"],
            ["ip", "netns", "exec", ns.name, "ip", "link", "set", "lo", "up"],
            ["ip", "netns", "exec", ns.name, "iptables", "-S"],      # iptables usable in there?
        ]
        for argv in steps:
            r = _run(*argv)
            if r.returncode != 0:
                ns.delete()
                raise NetnsUnavailable(f"`{' '.join(argv)}` failed: {(r.stderr or r.stdout).strip()}")
        return ns

    def exec_argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def _rule_set(self, ports: list[int]) -> list[list[str]]:
        plist = ",".join(str(p) for p in ports)
        return [["OUTPUT", "-d", self.host_ip, "-p", "tcp", "-m", "multiport", "--dports", plist, "-j", "DROP"],
                ["INPUT", "-s", self.host_ip, "-p", "tcp", "-m", "multiport", "--sports", plist, "-j", "DROP"]]

    def cut(self, ports: list[int]) -> None:
        """Drop every packet between the replica and these host ports (the etcd bridges)."""
        for rule in self._rule_set(ports):
            r = _run(*self.exec_argv(["iptables", "-A", *rule]))
            if r.returncode != 0:
                raise RuntimeError(f"iptables -A {' '.join(rule)}: {r.stderr.strip()}")
            self._rules.append(rule)

    def heal(self) -> None:
        for rule in self._rules:
            _run(*self.exec_argv(["iptables", "-D", *rule]))
        self._rules = []

    def delete(self) -> None:
        _run("ip", "netns", "del", self.name)
        _run("ip", "link", "del", self.host_if)       # normally gone with the namespace already


class NetnsLockdProcess(LockdProcess):
    """A lockd replica run inside ``ns`` on ``port`` (``ip netns exec`` execs it: same pid, same signals)."""

    def __init__(self, ns: Netns, endpoints: str, prefix: str, replica_id: str, logdir: str,
                 extra: list[str], port: int):
        super().__init__(endpoints, prefix, replica_id, logdir, extra, listen_port=port)
        self.ns = ns
        self.host = ns.ns_ip
        self.wrapper = ns.exec_argv([])


class NetnsAgentProcess(AgentProcess):
    """A node agent run inside ``ns`` (``ip netns exec`` execs it: same pid, same signals).

    It reaches etcd through relays on the host end of the veth (pass their endpoints);
    its cooperative workers still reach it: the channel is a Unix socket on the file
    system, which network namespaces do not separate, and the simulated device is files.
    """

    def __init__(self, endpoints: str, prefix: str, node: str, logdir: str, *, ns: Netns, **kw):
        super().__init__(endpoints, prefix, node, logdir, **kw)
        self.ns = ns

    def command(self) -> list[str]:
        return self.ns.exec_argv(super().command())
