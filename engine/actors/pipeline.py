"""The five actors of the design card, built around one Scheduler and wired to each other: each
holds references only to the mailboxes it sends to (docs/ARCHITECTURE.md's actor table).

    Receiver -> Dispatcher -> PrefillAdderActor <-> OverlapScheduler -> OutputProcessor -> Receiver

`Engine.start` builds one, hands its actors to the supervisor (`ActorSystem`) and, when the
flight recorder is on, attaches it to every mailbox.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.actors.dispatcher import Dispatcher, routing_table
from engine.actors.output_processor import OutputProcessor
from engine.actors.overlap_scheduler import OverlapScheduler
from engine.actors.prefill_adder import PrefillAdderActor
from engine.actors.receiver import Receiver
from engine.actors.runtime import Actor
from engine.cache.base_prefix_cache import BasePrefixCache
from engine.constrained import GrammarBackend
from engine.device import DeviceStream
from engine.model_executor.model_runner import ModelRunner
from engine.recorder.ring import FlightRecorder
from engine.scheduler.scheduler import Scheduler
from engine.server_args import ServerArgs


@dataclass
class Pipeline:
    receiver: Receiver
    dispatcher: Dispatcher
    adder: PrefillAdderActor
    output: OutputProcessor
    scheduler: OverlapScheduler

    @property
    def actors(self) -> tuple[Actor, ...]:
        """In start order: the Receiver first, the scheduler (which starts stepping) last."""
        return (self.receiver, self.dispatcher, self.adder, self.output, self.scheduler)

    def attach_recorder(self, recorder: FlightRecorder) -> None:
        """Every message each actor receives, and the scheduling decisions, go to `recorder`."""
        for actor in self.actors:
            actor.recv_listener = recorder.recv
        self.scheduler.recorder = self.adder.recorder = recorder


def build_pipeline(
    runner: ModelRunner,
    args: ServerArgs,
    stream: DeviceStream,
    tokenizer: Any,
    grammar_backend: GrammarBackend | None,
    prefix_cache: BasePrefixCache | None = None,
) -> Pipeline:
    """The actors over `runner`; `prefix_cache`: what the last pipeline's scheduler handed over."""
    cfg = runner.model_config
    pool_tokens = runner.token_to_kv_pool_allocator.size
    # it checks stop strings itself (the same text as `output`)
    sched = Scheduler(runner, args, tokenizer, prefix_cache)
    scheduler = OverlapScheduler(sched, stream, args.resolved_enable_overlap(), args.resolved_watchdog_timeout())
    adder = PrefillAdderActor(sched.new_planner(), cfg.eos_token_ids, runner.context_len, pool_tokens)
    dispatcher = Dispatcher(routing_table(adder, scheduler))
    output = OutputProcessor(tokenizer)
    receiver = Receiver(
        tokenizer,
        cfg.vocab_size,
        runner.context_len,
        pool_tokens,
        grammar_backend,
        args.grammar_compile_timeout,
        args.pooling_method,
        args.is_embedding,
    )
    receiver.dispatcher, receiver.output = dispatcher, output
    lora = getattr(runner, "lora", None)  # the LoRAManager; None: LoRA off
    receiver.loras = lora.adapters() if lora is not None else None
    output.receiver, output.dispatcher = receiver, dispatcher
    adder.scheduler, adder.output = scheduler, output
    scheduler.adder, scheduler.output, scheduler.replies = adder, output, receiver
    return Pipeline(receiver, dispatcher, adder, output, scheduler)
