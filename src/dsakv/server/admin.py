"""The calls that change what the engine serves, between requests: the prefix cache
flushed, generation paused and continued, weights updated from disk or a trainer's group
(SGLang's model_update_lock: new calls wait, the ones in flight end first); as `Handlers`'
mixin."""

from __future__ import annotations

import asyncio
import time

from fastapi.responses import Response

from dsakv.distributed.weight_sync import GroupUpdate, WeightGroup
from dsakv.errors import DsakvError

from .protocol import APIError

# SGLang's weight version until an update names another (/update_weights_from_disk,
# /update_weight_version): /model_info's, and each /generate output's meta_info
WEIGHT_VERSION = "default"


# How long a weight update waits for the engine to be idle once no generation call is in
# flight (a /health_generate probe, a prefill server's pages awaiting their decode server).
_UPDATE_IDLE_TIMEOUT_S = 60.0


class AdminMixin:
    """`Handlers`' admin calls. Its host holds the engine (`engine`), the calls in flight
    (`in_flight`), the weight version, and the events and lock these calls share
    (`_serving`, `_unpaused`, `_updating`, made by `Handlers.__init__`)."""

    async def flush_cache(self) -> Response:
        """Drop the prefix cache (`Engine.flush_cache`); a 400 while requests run or wait,
        as SGLang's."""
        try:
            flushed = await self.engine.call(lambda e: e.flush_cache())
        except DsakvError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="server_error") from None
        if not flushed:
            raise APIError(400, "the cache was not flushed: requests are running or waiting")
        return Response("Cache flushed.\n", media_type="text/plain")

    async def weights_ready(self) -> None:
        """Until no weight update runs or waits and generation is not paused: a generation
        call awaits it right before it opens (`InFlight.open`), so that an update never runs
        under a call it did not mean to (a paused one's)."""
        while not (self._serving.is_set() and self._unpaused.is_set()):
            await self._unpaused.wait()
            await self._serving.wait()

    async def pause_generation(self, mode: str) -> None:
        """SGLang's /pause_generation: new generation calls wait until
        `continue_generation`; "abort" ends every call in flight (as /abort_request's) and
        returns once they ended, "in_place" stops the engine stepping (requests keep their
        KV) and "retract" also has the running requests give their KV back, to compute it
        again when they go on. Paused requests' clients only wait. An "abort" or "wait"
        pause over an in-place one has the engine step again (new calls still wait), so
        that its requests end."""
        was = self._unpaused.is_set()
        self._unpaused.clear()
        if mode in ("abort", "wait"):  # ("wait", vLLM's /pause: the calls in flight end first)
            if mode == "abort":
                self.in_flight.abort_all()
            if not was:  # (paused in place: its requests end only if the engine steps)
                await self.engine.resume()
            await self.in_flight.drained()
            return
        try:
            await self.engine.pause(retract=mode == "retract")
        except DsakvError as e:
            if was:
                self._unpaused.set()
            raise APIError(400, str(e)) from None

    async def continue_generation(self) -> None:
        await self.engine.resume()
        self._unpaused.set()

    @property
    def generation_paused(self) -> bool:
        return not self._unpaused.is_set()

    @property
    def disaggregated(self) -> bool:
        """Whether this is a prefill or decode server (its bridge's SGLang
        `disaggregation_mode`)."""
        return self.engine.server_info()["disaggregation_mode"] != "null"

    async def paused_requests(self) -> int:
        """The requests a pause holds in the engine (in place or retracted: a weight update
        runs under them, SGLang's num_paused_requests); none while generation goes on."""
        if self._unpaused.is_set():
            return 0
        c = await self.engine.call(lambda e: e.counters())
        return int(c["running_requests"] + c["waiting_requests"])

    async def update_weights(
        self, source: str | GroupUpdate, abort_all: bool = False, version: str | None = None
    ) -> tuple[bool, str]:
        """SGLang's /update_weights_from_disk (`source` a checkpoint path) and
        /update_weights_from_distributed (a trainer's tensors over a group `join_weight_group`
        joined): new generation calls wait, the ones in flight end first (`abort_all`:
        aborted, as /abort_request's), then the engine loads `source` between steps
        (`Engine.update_weights`: the prefix cache is dropped, an update that does not fit
        changes nothing). While generation is paused, as SGLang's, it does not wait for the
        calls in flight: paused requests go on with the new weights once generation
        continues. (success, SGLang's message)."""
        if abort_all:
            self.in_flight.abort_all()
        async with self._updating:
            paused = not self._unpaused.is_set()
            self._serving.clear()
            try:
                if not paused:
                    await self.in_flight.drained()
                self.engine.before_weight_update()  # (a PD prefill server's held KV goes)
                deadline = time.monotonic() + _UPDATE_IDLE_TIMEOUT_S
                while not await self.engine.call(lambda e: e.update_weights(source)):
                    if time.monotonic() > deadline:  # (a trainer's tensors received first)
                        busy = "the engine stayed busy"
                        await self.engine.call(lambda e, why=busy: e.refuse_update(source, why))
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(self.engine.weights_updated)
                if version is not None:
                    self.weight_version = version
            except Exception as e:  # noqa: BLE001 - the answer says it; the weights stand
                return False, f"Failed to update weights: {e}"
            finally:
                self._serving.set()
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return True, message

    async def join_weight_group(self, spec: WeightGroup) -> tuple[bool, str]:
        """SGLang's /init_weights_update_group: every engine rank joins the trainer's group
        (the engine thread waits for the trainer meanwhile: `Engine.join_weight_group`).
        Not on a prefill or decode server: their handshake compares checkpoints on disk."""
        if self.disaggregated:
            return False, (
                "Failed to init weights update group: a prefill or decode server is updated "
                "from a checkpoint (/update_weights_from_disk): their handshake compares "
                "checkpoints"
            )
        try:
            await self.engine.call(lambda e: e.join_weight_group(spec))
        except DsakvError as e:
            return False, f"Failed to init weights update group: {e}"
        return True, "Succeeded to initialize custom process group."

    async def leave_weight_group(self, name: str) -> tuple[bool, str]:
        try:
            await self.engine.call(lambda e: e.leave_weight_group(name))
        except DsakvError as e:
            return False, f"Failed to destroy weights update group: {e}"
        return True, "Succeeded to destroy custom process group."
