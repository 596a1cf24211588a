"""The channel's messages (timeslice.common.frames): what one end builds, the other end's checks accept,
through the real framing; what they must refuse, they refuse."""
import pytest

from timeslice.common import channel as C
from timeslice.common import frames as F


def roundtrip(msg):
    data = C.encode(msg)
    return C.decode(data[4:])


def test_every_worker_frame_passes_the_agents_checks_after_the_framing():
    sizes = {"host_bytes": 4096, "region_bytes": {"weights": 1 << 20}, "host_reserving": 0}
    hello = roundtrip(F.hello("job-a", "s3cret", "sim0", {"weights": "offload"}, ["weights"], sizes))
    assert (hello["type"], hello["version"], hello["paused"]) == (F.HELLO, C.PROTOCOL_VERSION, ["weights"])
    F.check_state(hello)
    state = {"state": "paused", "paused": ["weights"], **sizes, "residue_bytes": 512}
    for msg in (F.state(state), F.state(state, sync=7),
                F.done(3, {"bytes_moved": 1 << 20, "device_bytes": 1 << 20, "elapsed_ms": 1.5, "tags": ["weights"],
                           **state}),
                F.done(4, state, ok=False, code="INTERNAL", error="OSError: gone")):
        F.check_frame(roundtrip(msg))
    assert "sync" not in F.state(state) and F.state(state, sync=7)["sync"] == 7
    # What a worker asks the agent: room inside its holds, a host backup's admission.
    F.check_frame(roundtrip(F.room(5, "GPU-1", 1 << 30, [("g", 12), ("h", 13)])))
    F.check_frame(roundtrip(F.host(6, 40 << 30)))
    assert len(F.room(7, "sim0", 1, [(f"g{i}", i) for i in range(40)])["held"]) == F.MAX_HELD


def test_agent_frames_are_what_the_worker_reads():
    assert roundtrip(F.welcome(1234, "node-a")) == {"type": F.WELCOME, "pid": 1234, "node": "node-a",
                                                    "answers": [F.ROOM, F.HOST]}
    assert len(F.refused("INVALID_ARGUMENT", "x" * 1000)["message"]) == F.MAX_REFUSAL
    assert F.request(F.PAUSE, ("kv",)) == {"type": F.PAUSE, "tags": ["kv"]}
    assert F.request(F.PAUSE) == {"type": F.PAUSE, "tags": None}           # every region
    assert F.request(F.RESUME) == {"type": F.RESUME}
    assert roundtrip(F.synced(9)) == {"type": F.SYNCED, "id": 9}
    assert F.welcome(1, "n", ())["answers"] == []                           # an agent that makes no room
    roomed = roundtrip(F.roomed(5, 2 << 20, 1 << 30, [{"job": "j", "bytes": 3, "what": "parked"}] * 40, "m" * 999))
    assert (roomed["type"], roomed["freed_bytes"], len(roomed["holders"]), len(roomed["message"])) == (
        F.ROOMED, 2 << 20, F.MAX_HOLDERS, F.MAX_REFUSAL)
    assert roundtrip(F.hosted(6, False, 7, "no")) == {"type": F.HOSTED, "id": 6, "ok": False, "free_bytes": 7,
                                                      "message": "no"}
    with pytest.raises(ValueError):
        F.request("format-disk")


@pytest.mark.parametrize("bad", [
    {"type": F.DONE, "id": [1], "ok": True},
    {"type": F.DONE, "id": 0},
    {"type": F.DONE, "id": 1, "bytes_moved": -1},
    {"type": F.STATE, "sync": 0},
    {"type": F.STATE, "region_bytes": {"w": "many"}},
    {"type": F.STATE, "paused": ["x" * (F.MAX_TAG + 1)]},
    {"type": F.ROOM, "id": 1, "bytes": -5},
    {"type": F.ROOM, "id": 1, "bytes": 5, "device": "d" * 200},
    {"type": F.ROOM, "id": 1, "bytes": 5, "held": [["g", "12"]]},
    {"type": F.ROOM, "id": 1, "bytes": 5, "held": [["g", 1]] * (F.MAX_HELD + 1)},
    {"type": F.HOST, "id": "x", "bytes": 5},
    {"type": F.HOST, "id": 2},
])
def test_malformed_worker_frames_are_refused(bad):
    with pytest.raises(C.ChannelError):
        F.check_frame(bad)
