"""Summarise py-spy raw (collapsed-stack) files: where the busy samples go.

    python -m benchmarks.spy_summary /tmp/prof/*.txt [--top 15]

For each file: the share of samples per innermost frame (self) and per frame
anywhere on the stack (inclusive), idle samples (the event loop waiting in
epoll, the gRPC poller thread) left out of both.
"""
from __future__ import annotations

import argparse
import collections
import sys

_IDLE = ("EpollSelector.select", "select (selectors.py", "Thread.run (threading.py")
_PLUMBING = ("runpy>", "cli.py", "runners.py", "run_until_complete", "run_forever", "_run_once",
             "Handle._run", "threading.py")


def summarise(path: str, top: int) -> str:
    self_c, incl = collections.Counter(), collections.Counter()
    total = idle = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not n.isdigit():
                continue
            n = int(n)
            total += n
            frames = stack.split(";") if stack else ["<unknown>"]
            if any(s in frames[-1] for s in _IDLE):
                idle += n
                continue
            self_c[frames[-1]] += n
            for fr in set(frames):
                incl[fr] += n
    busy = max(total - idle, 1)
    out = [(f"== {path}: {total} samples, {total - idle} busy ({100 * (total - idle) / max(total, 1):.0f}%); "
           "shares below are of busy samples")]
    out.append("  self:")
    out += [f"    {100 * n / busy:5.1f}%  {fr}" for fr, n in self_c.most_common(top)]
    out.append("  inclusive:")
    shown = [(fr, n) for fr, n in incl.most_common(top * 3) if not any(p in fr for p in _PLUMBING)][:top]
    out += [f"    {100 * n / busy:5.1f}%  {fr}" for fr, n in shown]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spy_summary")
    p.add_argument("files", nargs="+")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args(argv)
    for path in a.files:
        print(summarise(path, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
