"""Pieces every server of the project shares: error-to-status mapping, health, flags.

- ``rpc``: decorator for thin servicer methods; a ``TimesliceError`` becomes the
  gRPC status its ``code`` names, with its message, in one place.
- ``health_loop``: SERVING only while a probe (can we reach etcd?) passes, so
  load balancers and Kubernetes send traffic only to processes that can answer.
- ``env_flag``: an argparse flag whose default comes from ``TIMESLICE_<FLAG>``.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import os
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2

from tscore.errors import TimesliceError


def status_of(e: TimesliceError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, e.code, grpc.StatusCode.INTERNAL)


def rpc(fn):
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except TimesliceError as e:
            await context.abort(status_of(e), str(e))
    return wrapper


async def health_loop(hs: health.aio.HealthServicer, service: str, probe: Callable[[], Awaitable[bool]],
                      on_result: Callable[[bool], None] | None = None, period: float = 2.0) -> None:
    while True:
        ok = await probe()
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", service):
            await hs.set(name, status)
        if on_result is not None:
            on_result(ok)
        await asyncio.sleep(period)


def env_name(flag: str) -> str:
    return "TIMESLICE_" + flag.lstrip("-").replace("-", "_").upper()


def env_flag(p: argparse.ArgumentParser, name: str, *fallback_env: str, **kw) -> None:
    """Add ``name``; its default is taken from TIMESLICE_<NAME> (or ``fallback_env``) when set."""
    envs = (env_name(name), *fallback_env)
    for env in envs:
        if env in os.environ:
            kw["default"] = os.environ[env]
            break
    kw["help"] = (kw.get("help", "") + f" [env {' or '.join(envs)}]").strip()
    p.add_argument(name, **kw)
