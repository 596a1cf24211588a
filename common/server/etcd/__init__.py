"""The etcd layer shared by lockd and nodeagent: client, session, watch, FIFO queue, election."""
from timeslice.common.server.etcd.client import EtcdClient, EtcdConfig
from timeslice.common.server.etcd.election import Election, LeaderInfo, Leadership, wait_deposed
from timeslice.common.server.etcd.mirror import Reflector
from timeslice.common.server.etcd.queue import Entry, FifoQueue
from timeslice.common.server.etcd.session import Session
from timeslice.common.server.etcd.timing import ElectionTiming, SessionTiming
from timeslice.common.server.etcd.watch import DELETE, PUT, Watch, WatchEvent

__all__ = [
    "DELETE", "PUT", "Election", "ElectionTiming", "Entry", "EtcdClient", "EtcdConfig",
    "FifoQueue", "LeaderInfo", "Leadership", "Reflector", "Session", "SessionTiming",
    "Watch", "WatchEvent", "wait_deposed",
]
