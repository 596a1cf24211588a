"""What a cooperative worker may say after its hello, checked field by field before the agent uses it.

The channel's framing (``timeslice.channel``) already bounds a frame's size and
nesting; this module checks the *shape* of the fields the agent reads from a
``done`` or ``state`` frame (and the same state fields in a hello). A frame
that breaks it is a protocol violation: the channel server refuses it with a
refusal frame, closes the connection and runs its disconnect handling, so
nothing a peer sends can escape the handler (an unhashable request id, a
string where a count belongs). Frames of a type this agent does not know are
left alone: a newer worker may say more.
"""
from __future__ import annotations

from timeslice.channel import ChannelError

MAX_TAGS = 32
MAX_TAG = 64                 # characters of a tag name (the id grammar allows 64)
MAX_TEXT = 4096              # characters of an error message or code a worker reports
MAX_COUNT = (1 << 63) - 1    # bytes and ids fit a signed 64-bit integer


def _count(msg: dict, key: str) -> None:
    v = msg.get(key)
    if v is not None and (type(v) is not int or not 0 <= v <= MAX_COUNT):
        raise ChannelError(f"{key!r} must be a non-negative integer")


def _tags(msg: dict, key: str) -> None:
    v = msg.get(key)
    if v is None:
        return
    if not isinstance(v, list) or len(v) > MAX_TAGS or \
            not all(isinstance(t, str) and 0 < len(t) <= MAX_TAG for t in v):
        raise ChannelError(f"{key!r} must be a list of at most {MAX_TAGS} tag names")


def _text(msg: dict, key: str) -> None:
    v = msg.get(key)
    if v is not None and (not isinstance(v, str) or len(v) > MAX_TEXT):
        raise ChannelError(f"{key!r} must be a string of at most {MAX_TEXT} characters")


def check_state(msg: dict) -> None:
    """The fields that say what a worker holds: ``paused``, ``region_bytes``, the host and residue
    counts, ``backup`` (its copy counters), ``state``."""
    _tags(msg, "paused")
    rb = msg.get("region_bytes")
    if rb is not None:
        if not isinstance(rb, dict) or len(rb) > MAX_TAGS:
            raise ChannelError(f"'region_bytes' must be an object of at most {MAX_TAGS} tags")
        for t, n in rb.items():
            if len(t) > MAX_TAG or type(n) is not int or not 0 <= n <= MAX_COUNT:
                raise ChannelError("'region_bytes' maps tag names to non-negative integers")
    for key in ("host_bytes", "host_reserving", "residue_bytes"):
        _count(msg, key)
    backup = msg.get("backup")
    if backup is not None and (not isinstance(backup, dict) or len(backup) > MAX_TAGS):
        raise ChannelError(f"'backup' must be an object of at most {MAX_TAGS} counters")
    _text(msg, "state")
    sync = msg.get("sync")
    if sync is not None and (type(sync) is not int or not 0 < sync <= MAX_COUNT):
        raise ChannelError("'sync' must be the positive integer id the synced answer carries")


def check_done(msg: dict) -> None:
    """A ``done``: the answer to request ``id``."""
    rid = msg.get("id")
    if type(rid) is not int or not 0 < rid <= MAX_COUNT:
        raise ChannelError("a done frame needs the positive integer id of the request it answers")
    ok = msg.get("ok")
    if ok is not None and not isinstance(ok, bool):
        raise ChannelError("'ok' must be true or false")
    for key in ("bytes_moved", "device_bytes"):
        _count(msg, key)
    ms = msg.get("elapsed_ms")
    if ms is not None and (type(ms) not in (int, float) or not 0 <= ms < 1e12):
        raise ChannelError("'elapsed_ms' must be a non-negative number")
    _tags(msg, "tags")
    for key in ("error", "code"):
        _text(msg, key)
    check_state(msg)


def check_frame(msg: dict) -> None:
    """ChannelError if a frame a worker sent after its hello is malformed (see the module doc)."""
    if msg["type"] == "done":
        check_done(msg)
    elif msg["type"] == "state":
        check_state(msg)
