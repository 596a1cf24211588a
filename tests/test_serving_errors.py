"""The servicers' error mapping (timeslice.common.server.serving.rpc / stream_rpc): a TimesliceError ends
the call with the status it means; any other exception with INTERNAL naming an incident, never
UNKNOWN naming a Python class; an abort the method made itself passes through. The context is the
smallest stand-in for grpc.aio's: its abort raises AbortError, as the real one does."""
import grpc
import pytest

from timeslice.common.errors import InvalidIdError
from timeslice.common.server.serving import rpc, stream_rpc


class Context:
    def __init__(self):
        self.aborted = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


class Servicer:
    def __init__(self, exc):
        self.exc = exc

    @rpc
    async def Unary(self, request, context):
        raise self.exc

    @stream_rpc
    async def Stream(self, request, context):
        yield 1
        raise self.exc


async def call(servicer, name):
    ctx = Context()
    with pytest.raises(grpc.aio.AbortError):
        if name == "Unary":
            await servicer.Unary(None, ctx)
        else:
            assert [x async for x in servicer.Stream(None, ctx)] == [1]
    return ctx.aborted


@pytest.mark.parametrize("name", ["Unary", "Stream"])
async def test_each_failure_ends_with_the_status_it_means(name):
    code, details = await call(Servicer(InvalidIdError("group id: bad")), name)
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "group id: bad")
    code, details = await call(Servicer(KeyError("x")), name)
    assert code == grpc.StatusCode.INTERNAL and details.startswith(f"internal error in {name} (incident ")
    assert "KeyError" not in details


@pytest.mark.parametrize("name", ["Unary", "Stream"])
async def test_an_abort_of_the_methods_own_passes_through(name):
    assert await call(Servicer(grpc.aio.AbortError()), name) is None   # nothing aborted again over it
