"""The etcd layer shared by lockd and nodeagent: client, session, watch, FIFO queue, election."""
from timeslice.common.etcd.client import EtcdClient, EtcdConfig
from timeslice.common.etcd.election import Election, LeaderInfo, Leadership, wait_deposed
from timeslice.common.etcd.mirror import Reflector
from timeslice.common.etcd.queue import Entry, FifoLock, FifoQueue
from timeslice.common.etcd.session import Session
from timeslice.common.etcd.timing import ElectionTiming, SessionTiming
from timeslice.common.etcd.watch import DELETE, PUT, Watch, WatchEvent

__all__ = [
    "DELETE", "PUT", "Election", "ElectionTiming", "Entry", "EtcdClient", "EtcdConfig",
    "FifoLock", "FifoQueue", "LeaderInfo", "Leadership", "Reflector", "Session", "SessionTiming",
    "Watch", "WatchEvent", "wait_deposed",
]
