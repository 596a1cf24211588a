"""What both ends share: the job library and the servers (lockd, the node agent, the launcher).

The modules here need only the job library's own dependencies (grpcio, protobuf, tenacity,
structlog), so an RL job may import them: the id grammar, the error trees, defaults, the
node-local channel (framing and typed frames), tracing, the local cluster's pointers, /proc
reads, atomic files, and the SIMULATED device that workers and the agent both open
(``common/sim/``). What only the servers use is in ``common/server/`` (the etcd layer, the
key layout and stored records, serving, metrics, server logs); a job never imports it
(``tests/test_import_boundary.py``).
"""
