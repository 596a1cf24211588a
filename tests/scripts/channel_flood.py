"""A hostile local process: hold as many silent connections (no hello) to a Unix socket as it can.

argv: socket max_open
Connections the server closes are opened again at once, so the pressure stays on.
Prints "FLOODING <open>" once it has tried ``max_open`` connects, then every
second how many it holds and how many connects failed (EAGAIN: the backlog was full).
Runs until killed.
"""
import selectors
import socket
import sys
import time


def main(path: str, max_open: int) -> None:
    sel = selectors.DefaultSelector()
    held: set[socket.socket] = set()
    tried = failed = 0
    told = False
    last = time.monotonic()
    while True:
        while len(held) < max_open:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            tried += 1
            try:
                s.connect(path)
            except OSError:
                failed += 1
                s.close()
                break
            held.add(s)
            sel.register(s, selectors.EVENT_READ)
        if not told and tried >= max_open:
            print(f"FLOODING {len(held)}", flush=True)
            told = True
        for key, _ in sel.select(timeout=0.01):
            s = key.fileobj
            sel.unregister(s)
            held.discard(s)
            s.close()                       # the server cut it (a refusal, an eviction): open another
        if time.monotonic() - last > 1:
            print(f"HOLDING {len(held)} FAILED {failed}", flush=True)
            last = time.monotonic()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
