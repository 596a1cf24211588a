"""Server-only shared code: what lockd, the node agent and the launcher share and a job never imports.

The etcd layer on aetcd (``etcd/``), the key layout (``keys``) and the values stored under
it (``records``), the admin token and its interceptor (``auth``), error-to-status mapping and
the health loop (``serving``), server logs, Prometheus metrics, loopback helpers.
"""
