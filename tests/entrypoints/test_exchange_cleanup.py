"""``CloseAtExchangeEnd``: an HTTP exchange's clean-ups run when it ends, however it ends
(answered, failed, cancelled), with the garbage collector off, so nothing but the wrapper can
run them; a failing clean-up does not skip the others; outside the wrapper registering is
refused."""

from __future__ import annotations

import gc

import pytest
import trio

from trillm.entrypoints.openai.http.exchange import CloseAtExchangeEnd
from trillm.entrypoints.openai.http.exchange_cleanups import at_exchange_end


def _app(ran: list[str], ending: str):
    async def app(scope, receive, send) -> None:
        async def note(name: str) -> None:
            await trio.lowlevel.checkpoint()  # an async clean-up that waits, shielded
            ran.append(name)

        async def broken() -> None:
            raise OSError("clean-up failed")

        async def child() -> None:  # a task of the handler registers too (inherited context)
            at_exchange_end(lambda: note("child"))

        at_exchange_end(lambda: note("first"))
        at_exchange_end(broken)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
        if ending == "error":
            raise KeyError("handler failed")
        if ending == "cancel":
            await trio.sleep_forever()

    return app


@pytest.mark.parametrize("ending", ["return", "error", "cancel"])
def test_cleanups_run_however_the_exchange_ends(ending):
    ran: list[str] = []
    wrapped = CloseAtExchangeEnd(_app(ran, ending))

    async def main() -> None:
        with trio.move_on_after(0.05):
            await wrapped({"type": "http"}, None, None)

    gc.disable()
    try:
        if ending == "error":
            with pytest.raises(KeyError):
                trio.run(main)
        else:
            trio.run(main)
    finally:
        gc.enable()
    assert ran == ["first", "child"]


def test_registering_outside_an_exchange_is_refused():
    async def cleanup() -> None:
        pass

    with pytest.raises(RuntimeError, match="CloseAtExchangeEnd"):
        at_exchange_end(cleanup)
