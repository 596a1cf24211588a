"""What a job's process lets go of at interpreter exit, after its clients have closed.

``atexit`` runs its handlers last registered first. A client registers its own
(closing its session and its cooperative channels) when it is made; this module
registers one handler when ``timeslice`` is imported, before any client exists,
so it runs after every client's: no swap request can arrive on a channel while
what is registered here lets go of the device memory it holds.

What registers here (``on_exit``) is held weakly: an object that is gone by then
is skipped. Each handler runs once, newest first; one that fails is logged and
the rest still run (the process is on its way out either way).
"""
from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable

from timeslice.logs import get_logger

log = get_logger(__name__)

_mu = threading.Lock()
_handlers: list[weakref.WeakMethod] = []


def on_exit(method: Callable[[], object]) -> None:
    """Call the bound ``method`` at interpreter exit, after every client closed (if its object still lives)."""
    with _mu:
        _handlers.append(weakref.WeakMethod(method))


def run_handlers() -> None:
    """Run what is registered, newest first, once (atexit calls it; so may a test)."""
    with _mu:
        todo, _handlers[:] = list(reversed(_handlers)), []
    for ref in todo:
        fn = ref()
        if fn is None:
            continue
        try:
            fn()
        except Exception:  # at exit: log it and let the others run
            log.warning("exit_handler_failed", handler=getattr(fn, "__qualname__", repr(fn)), exc_info=True)


atexit.register(run_handlers)
