"""One node of a chaos world: a SIMULATED device, its node agent, and the jobs that run on it.

    node = SimNode(world, etcd3, capacity=7 * MiB)         # device + agent (not started)
    kinds = [node.checkpoint_jobs(2, 4 * MiB), node.cooperative_jobs(2, COOP), ClientKind(2, groups=["g1"])]
    ...; node.agent.start(); world.start(...)
    node.kill_agent(); node.restart_agent()                # SIGKILL, then back on the same state dir

The device is made small on purpose (room for about one job), so that every handoff
between jobs is a real swap: a checkpoint (the process's arena copied to host memory)
or a cooperative pause (the job's own regions released). Copies are slowed down
(``--sim-checkpoint-gbps``, ``TIMESLICE_SIM_COOP_GBPS``) so that a scenario can catch
the agent in the middle of one. The agent runs with short timings: its lease 3 s,
refresh 0.5 s, cooperative deadline 10 s; and, as ``timeslice up`` and deploy/ run it, it
acts only on attested workers (``--require-attestation``): every job's process proves over
the channel that it is the job's (``attested=False`` turns that off).
"""
from __future__ import annotations

import time
from pathlib import Path

from chaos_tests.scenario import ClientKind, World
from timeslice.testing.agent import AgentProcess

MiB = 1 << 20
AGENT_FLAGS = ["--agent-lease-ttl", "3", "--refresh-interval", "0.5", "--lock-timeout-ms", "3000",
               "--swap-deadline-s", "10"]


class SimNode:
    def __init__(self, world: World, endpoints: str, node: str = "node-a", capacity: int = 7 * MiB,
                 checkpoint_gbps: float = 0.02, restore_gbps: float = 0.05, coop_gbps: float = 0.02,
                 agent_cls=AgentProcess, attested: bool = True, agent_flags: list[str] | None = None,
                 gpus: int = 1, **agent_kw):
        self.world, self.node = world, node
        root = Path(world.dir) / f"sim-{node}"
        self.sim, self.host = root / "dev", root / "host"
        from timeslice.common.sim.device import SimDevice

        SimDevice(self.sim, self.host, capacity_bytes=capacity, gpus=gpus)     # capacity per GPU
        self.env = {"TIMESLICE_SIM_HOST_DIR": str(self.host)}
        self.coop_env = {**self.env, "TIMESLICE_SIM_COOP_GBPS": str(coop_gbps)}
        self.agent = agent_cls(endpoints, world.prefix, node, world.log_dir, sim_dir=self.sim, env=self.env,
                               extra=["--sim-checkpoint-gbps", str(checkpoint_gbps), "--sim-restore-gbps",
                                      str(restore_gbps), *(AGENT_FLAGS if agent_flags is None else agent_flags),
                                      *(["--require-attestation"] if attested else [])], **agent_kw)
        world.on_stop.append(self._stop)
        self.restarts = 0

    def _args(self) -> list[str]:
        return ["--sim-dir", str(self.sim), "--node", self.node, "--cs-ms", "5,30", "--device-timeout", "5"]

    def checkpoint_jobs(self, count: int, nbytes: int, groups: list[str] | None = None,
                        gpu: int | None = None) -> ClientKind:
        """``count`` jobs whose process is checkpointed whole (``nbytes`` of arena each), on ``gpu``."""
        # The library's register_worker attests over the node's socket ($TIMESLICE_AGENT_SOCKET).
        return ClientKind(count, [*self._args(), "--sim-bytes", str(nbytes), "--agent-socket", self.agent.socket],
                          groups, {**self.env, **self._on(gpu), "TIMESLICE_AGENT_SOCKET": self.agent.socket})

    def cooperative_jobs(self, count: int, regions: str, groups: list[str] | None = None,
                         gpu: int | None = None) -> ClientKind:
        """``count`` jobs that pause and resume their own ``regions`` (``tag:bytes:policy,...``), on ``gpu``."""
        return ClientKind(count, [*self._args(), "--coop-regions", regions, "--agent-socket", self.agent.socket],
                          groups, {**self.coop_env, **self._on(gpu)})

    @staticmethod
    def _on(gpu: int | None) -> dict[str, str]:
        """The job's processes bind to simulated GPU ``gpu`` (as a real worker picks its device)."""
        from timeslice.common.sim.device import ENV_SIM_GPU
        return {} if gpu is None else {ENV_SIM_GPU: str(gpu)}

    # -- faults --------------------------------------------------------------------------
    def kill_agent(self) -> None:
        self.agent.kill()

    def restart_agent(self) -> None:
        """Back on the same node name, state dir and channel socket (as ``timeslice up`` restarts it)."""
        self.agent.start()
        self.restarts += 1

    def partials(self) -> list[str]:
        """Host copies being written now: a checkpoint in flight."""
        return sorted(p.name for p in self.host.iterdir() if p.name.endswith(".partial"))

    def wait_partial(self, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.partials()
            if got:
                return got
            time.sleep(0.002)
        return []

    def _stop(self) -> None:
        if self.agent.alive():
            self.agent.resume()
            self.agent.stop()


def coop_regions(offload: int, discard: int) -> str:
    return f"weights:{offload}:offload,kv:{discard}:discard"


def in_flight(world: World, begin: str, end: str, jobs: set[str] | None = None) -> list[str]:
    """Jobs whose history's newest ``begin``/``end`` event (e.g. coop_pausing/coop_paused) is a ``begin``:
    that swap runs in the job's process now."""
    return sorted(c.job for c in world.live_clients() if (jobs is None or c.job in jobs)
                  and (e := world.last_of(c, (begin, end, "coop_failed"))) and e["ev"] == begin)
