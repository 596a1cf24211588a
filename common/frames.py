"""The node-local channel's messages, typed: the one module the worker and the node agent both import.

The framing (a length, then one JSON object) is ``timeslice.common.channel``'s. What goes
in a frame is here: one builder per message, which is what each end sends, and
the checks the agent runs on what a worker says after its hello. Messages
(``type`` field):

    worker -> agent   hello    {job, secret, device, tags: {tag: policy}, paused,
                                region_bytes: {tag: n}, host_bytes, host_reserving, backup, version}
    agent  -> worker  welcome  {pid, node, answers}   the pid the agent sees for this peer; the requests
                                                  of the worker it answers (an older agent: none)
                      refused  {code, message}    then the agent closes
    agent  -> worker  pause    {id, tags | null, deadline_ms}
                      resume   {id, deadline_ms}
                      ping     {id}
    worker -> agent   state    {state, paused, region_bytes, host_bytes, ..., sync?}   unasked, e.g.
                                after prepin or a region that grew
    agent  -> worker  synced   {id}               answers a state with ``sync: id``: the agent's
                                                  report to etcd now counts what the state says
    worker -> agent   done     {id, ok, state, bytes_moved, device_bytes, elapsed_ms, tags,
                                paused, region_bytes, host_bytes, residue_bytes, error, code}
    worker -> agent   room     {id, device, bytes, held: [[group, token]]}   an allocation inside a hold
                                                  did not fit: move parked residue off the device
    agent  -> worker  roomed   {id, freed_bytes, free_bytes, holders: [{job | pid, bytes, what}], message}
    worker -> agent   host     {id, bytes}        admit a pinned host backup before it is made
    agent  -> worker  hosted   {id, ok, free_bytes, message}   admitted (counted from now) or why not

The checks (``check_frame``, ``check_state``) bound the *shape* of the fields the
agent reads; a frame that breaks them is a protocol violation, which the agent
refuses and answers by closing the connection and running its disconnect
handling, so nothing a peer sends escapes the handler (an unhashable request id,
a string where a count belongs). Frames of a type the agent does not know are left
alone: a newer worker may say more. No server-side import: the job imports it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from timeslice.common.channel import PROTOCOL_VERSION, ChannelError
from timeslice.common.ids import MAX_ID_LEN

HELLO, WELCOME, REFUSED = "hello", "welcome", "refused"
PAUSE, RESUME, PING = "pause", "resume", "ping"
STATE, SYNCED, DONE = "state", "synced", "done"
ROOM, ROOMED, HOST, HOSTED = "room", "roomed", "host", "hosted"
REQUESTS = (PAUSE, RESUME, PING)                # what the agent asks a worker
ASKS = (ROOM, HOST)                             # what a worker asks the agent (answered by id)
ANSWERS = (SYNCED, ROOMED, HOSTED)              # the agent's answers to a worker, by the id it sent

MAX_TAGS = 32
MAX_TAG = 64                 # characters of a tag name (the id grammar allows 64)
MAX_TEXT = 4096              # characters of an error message or code a worker reports
MAX_COUNT = (1 << 63) - 1    # bytes and ids fit a signed 64-bit integer
MAX_REFUSAL = 300            # characters of a refusal's message
MAX_HOLDERS = 16             # holders a roomed answer names
MAX_HELD = 16                # (group, token) pairs a room request names
MAX_DEVICE = 128             # characters of a device id


class Welcome(TypedDict):
    type: str
    pid: int
    node: str
    answers: list[str]


class Refused(TypedDict):
    type: str
    code: str
    message: str


class Request(TypedDict, total=False):
    type: str
    id: int
    tags: list[str] | None
    deadline_ms: int


class Synced(TypedDict):
    type: str
    id: int


# -- what the worker sends ----------------------------------------------------------------
def hello(job: str, secret: str, device: str, tags: Mapping[str, str], paused: Sequence[str],
          sizes: Mapping[str, Any]) -> dict[str, Any]:
    """The first frame: who the worker is (its job's session secret), its regions and what it has paused."""
    return {"type": HELLO, "version": PROTOCOL_VERSION, "job": job, "secret": secret, "device": device,
            "tags": dict(tags), "paused": list(paused), **sizes}


def state(fields: Mapping[str, Any], sync: int = 0) -> dict[str, Any]:
    """What changed on the worker's side, unasked; ``sync``: answer with ``synced`` once it is reported."""
    return {"type": STATE, **fields, **({"sync": sync} if sync else {})}


def room(rid: int, device: str, nbytes: int, held: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """Ask for ``nbytes`` of room on ``device`` for an allocation inside the holds ``held`` ((group, token))."""
    return {"type": ROOM, "id": rid, "device": device, "bytes": int(nbytes),
            "held": [[g, int(t)] for g, t in list(held)[:MAX_HELD]]}


def host(rid: int, nbytes: int) -> dict[str, Any]:
    """Ask the agent to admit ``nbytes`` of pinned host backup before it is made."""
    return {"type": HOST, "id": rid, "bytes": int(nbytes)}


def done(rid: Any, fields: Mapping[str, Any], *, ok: bool = True, code: str = "", error: str = "") -> dict[str, Any]:
    """The answer to request ``rid``: its figures and the worker's state, or why it failed."""
    out: dict[str, Any] = {"type": DONE, "id": rid, "ok": ok}
    if not ok:
        out.update(code=code, error=error)
    out.update(fields)
    return out


# -- what the agent sends ------------------------------------------------------------------
def welcome(pid: int, node: str, answers: Sequence[str] = ASKS) -> Welcome:
    return {"type": WELCOME, "pid": pid, "node": node, "answers": list(answers)}


def refused(code: str, message: str) -> Refused:
    return {"type": REFUSED, "code": code, "message": message[:MAX_REFUSAL]}


def request(kind: str, tags: Sequence[str] | None = None) -> Request:
    """A pause (of ``tags``; None = every region), resume or ping; the channel adds its id and deadline."""
    if kind not in REQUESTS:
        raise ValueError(f"unknown request {kind!r}")
    msg: Request = {"type": kind}
    if kind == PAUSE:
        msg["tags"] = None if tags is None else list(tags)
    return msg


def synced(rid: int) -> Synced:
    return {"type": SYNCED, "id": rid}


def roomed(rid: int, freed: int, free: int, holders: Sequence[Mapping[str, Any]], message: str = "") -> dict[str, Any]:
    return {"type": ROOMED, "id": rid, "freed_bytes": int(freed), "free_bytes": int(free),
            "holders": [dict(h) for h in list(holders)[:MAX_HOLDERS]], "message": message[:MAX_REFUSAL]}


def hosted(rid: int, ok: bool, free: int, message: str = "") -> dict[str, Any]:
    return {"type": HOSTED, "id": rid, "ok": bool(ok), "free_bytes": int(free), "message": message[:MAX_REFUSAL]}


# -- what the agent checks ----------------------------------------------------------------
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


def _id(msg: dict, what: str) -> None:
    rid = msg.get("id")
    if type(rid) is not int or not 0 < rid <= MAX_COUNT:
        raise ChannelError(f"a {what} frame needs a positive integer id")


def check_ask(msg: dict) -> None:
    """A ``room`` or ``host`` request: its id, and what it asks, bounded."""
    _id(msg, msg["type"])
    if type(msg.get("bytes")) is not int:
        raise ChannelError("'bytes' must be a non-negative integer")
    _count(msg, "bytes")
    if msg["type"] == ROOM:
        device = msg.get("device", "")
        if not isinstance(device, str) or len(device) > MAX_DEVICE:
            raise ChannelError(f"'device' must be a string of at most {MAX_DEVICE} characters")
        held = msg.get("held", [])
        if not isinstance(held, list) or len(held) > MAX_HELD or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and 0 < len(p[0]) <= MAX_ID_LEN
                and type(p[1]) is int and 0 <= p[1] <= MAX_COUNT for p in held):
            raise ChannelError(f"'held' must be at most {MAX_HELD} [group, token] pairs")


def check_frame(msg: dict) -> None:
    """ChannelError if a frame a worker sent after its hello is malformed (see the module doc)."""
    if msg["type"] == DONE:
        check_done(msg)
    elif msg["type"] == STATE:
        check_state(msg)
    elif msg["type"] in ASKS:
        check_ask(msg)
