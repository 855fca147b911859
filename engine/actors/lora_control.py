"""Loading and unloading LoRA adapters at run time: the scheduler actor's side (`LoRAAdapterReq`).

- **load** reads and checks the adapter folder on the device stream (off the event loop, in order
  with the forwards) and registers it (engine/model_executor/lora_manager.py); the reply names
  every adapter loaded then, with its radix cache key, and the Engine lets requests name it.
- **unload** is decided here, where the held requests are: refused with an `InvalidRequestError`
  naming the adapter while one uses it; otherwise its cached prefixes are freed and it leaves the
  pool and the registry at once (engine/scheduler/lora_admission.py), and the reply comes once the
  device stream has cleared its slot. The Engine stopped accepting the name before sending it.

Neither waits for a quiet point: device work is ordered by the stream, so a forward launched
before sees the adapters as they were, one launched after sees the change.
"""

from __future__ import annotations

import asyncio

from engine.actors.messages import ControlReply, LoRAAdapterReq
from engine.errors import InvalidRequestError


class LoRAControlActions:
    """A base class of OverlapScheduler (which provides `sched`, `stream` and `replies`)."""

    def handle_lora(self, msg: LoRAAdapterReq) -> None:
        sched = self.sched
        manager = sched.runner.lora
        try:
            if manager is None:
                raise InvalidRequestError("LoRA is not enabled on this engine (enable_lora)", "lora_name")
            if msg.action == "load":
                if msg.path is None:
                    raise InvalidRequestError("loading a LoRA adapter needs its path", "lora_path")
                handle = self.stream.launch(sched.runner.load_lora_adapter, msg.name, msg.path)
            elif msg.action == "unload":
                sched.lora.unload(msg.name, sched.reqs_by_rid.values(), sched.tree_cache)
                handle = self.stream.launch(sched.runner.apply_lora_changes)
            else:
                raise InvalidRequestError(f"unknown LoRA action {msg.action!r} (load or unload)", "action")
        except InvalidRequestError as e:
            self.replies.send(_error_reply(msg.reply_id, e))
            return
        handle.future.add_done_callback(lambda fut: self._lora_done(msg, fut))

    def _lora_done(self, msg: LoRAAdapterReq, fut: asyncio.Future) -> None:
        error = fut.exception()
        if error is not None:
            self.replies.send(_error_reply(msg.reply_id, error))
            return
        self.replies.send(ControlReply(msg.reply_id, True, {"adapters": self.sched.runner.lora.adapters()}))


def _error_reply(reply_id: int, error: BaseException) -> ControlReply:
    payload = {"error_type": type(error).__name__, "param": getattr(error, "param", None)}
    if isinstance(error, InvalidRequestError):
        payload["error_type"] = "InvalidRequestError"  # LoRAError included: the caller's input
    return ControlReply(reply_id, False, payload, error=str(error))
