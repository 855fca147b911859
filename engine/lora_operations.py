"""The LoRA side of `Engine` (a base class it inherits): adapters loaded and unloaded at run time
(SGLang's `load_lora_adapter` / `unload_lora_adapter`), and the adapters loaded now.

A request names its adapter (`lora_path=` on `generate` / `stream` / `open_stream` / `submit`);
the Receiver accepts the names in `Receiver.loras`, which these calls keep in step with the
runner's registry. Unloading an adapter that an open request names (waiting or running) is
refused with an `InvalidRequestError` naming it, rather than aborting those requests or letting
them finish without it: the caller decides (abort them, or wait and retry). While an unload is
under way the name is not accepted, so no new request can slip in behind the check.
"""

from __future__ import annotations

from engine.actors.messages import ControlReply, LoRAAdapterReq
from engine.errors import EngineError, InvalidRequestError


class LoRAOperations:
    """Needs the engine's `_check()` (the Receiver of a healthy, started engine)."""

    def lora_adapters(self) -> list[str]:
        """The LoRA adapters requests may name now ([] when LoRA is off)."""
        loras = self._check().loras
        return sorted(loras) if loras is not None else []

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> list[str]:
        """Load the PEFT adapter folder `lora_path` as `lora_name`; returns the adapters loaded.
        A bad folder, a name in use, a rank or modules the pool cannot hold: InvalidRequestError."""
        receiver = self._check()
        if receiver.loras is None:
            raise InvalidRequestError("LoRA is not enabled on this engine (enable_lora)", "lora_name")
        if not isinstance(lora_name, str) or not lora_name or not isinstance(lora_path, str) or not lora_path:
            raise InvalidRequestError("lora_name and lora_path must be non-empty strings", "lora_name")
        reply = await self._lora_control(LoRAAdapterReq(0, "load", lora_name, lora_path))
        receiver.loras = dict(reply.payload["adapters"])
        return sorted(receiver.loras)

    async def unload_lora_adapter(self, lora_name: str) -> list[str]:
        """Unload adapter `lora_name` (its cached prefixes are freed); returns the adapters left.
        Refused (InvalidRequestError) while an open request uses it, or when none has that name."""
        receiver = self._check()
        loras = receiver.loras
        if loras is None:
            raise InvalidRequestError("LoRA is not enabled on this engine (enable_lora)", "lora_name")
        if lora_name not in loras:
            raise InvalidRequestError(f"no LoRA adapter named {lora_name!r} is loaded", "lora_name")
        users = receiver.lora_users(lora_name)
        if users:
            raise InvalidRequestError(f"LoRA adapter {lora_name!r} is in use by {users} request(s)", "lora_name")
        key = loras.pop(lora_name)  # no new request may name it from here on
        try:
            reply = await self._lora_control(LoRAAdapterReq(0, "unload", lora_name))
        except BaseException:
            if receiver.loras is loras:
                loras[lora_name] = key  # refused (or the engine died): it is still loaded
            raise
        receiver.loras = dict(reply.payload["adapters"])
        return sorted(receiver.loras)

    async def _lora_control(self, msg: LoRAAdapterReq) -> ControlReply:
        def make(reply_id: int) -> LoRAAdapterReq:
            msg.reply_id = reply_id
            return msg

        reply = await self._check().control(make, timeout=None)  # a load reads the adapter from disk
        if not reply.ok:
            if reply.payload.get("error_type") == "InvalidRequestError":
                raise InvalidRequestError(reply.error or "refused", reply.payload.get("param") or "lora_name")
            raise EngineError(f"LoRA {msg.action} failed: {reply.error}")
        return reply
