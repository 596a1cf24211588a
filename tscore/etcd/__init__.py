"""The etcd layer shared by lockd and nodeagent: client, session, watch, FIFO queue, election."""
from tscore.etcd.client import EtcdClient, EtcdConfig
from tscore.etcd.election import Election, LeaderInfo, Leadership, wait_deposed
from tscore.etcd.mirror import Reflector
from tscore.etcd.queue import Entry, FifoLock, FifoQueue
from tscore.etcd.session import Session
from tscore.etcd.timing import ElectionTiming, SessionTiming
from tscore.etcd.watch import DELETE, PUT, Watch, WatchEvent

__all__ = [
    "DELETE", "PUT", "Election", "ElectionTiming", "Entry", "EtcdClient", "EtcdConfig",
    "FifoLock", "FifoQueue", "LeaderInfo", "Leadership", "Reflector", "Session", "SessionTiming",
    "Watch", "WatchEvent", "wait_deposed",
]
