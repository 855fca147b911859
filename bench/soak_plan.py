"""The soak run's workload, drawn up front from one seed so two runs with the same seed send the
same requests with the same abort plans (only the timing, hence what a racing abort hits, varies).

Every request asks for `ignore_eos` and a random `max_tokens`, so a request that completes must
have produced exactly that many tokens per choice: the check needs no model knowledge. Prompts
are one of a few shared prefixes (so the radix cache shares, splits and evicts them) plus a random
suffix, or a random text alone. Exactly `round(abort_fraction * num_requests)` requests carry an
abort plan; each endpoint has its own ways to abort (see `ABORT_MODES`).

Requests are grouped into work units: one HTTP request, or one WebSocket session that runs
several generations concurrently on one socket; after every `invalid_every` units comes one
deliberately bad request (not counted in `num_requests`), which must get its 4xx. The first units,
covering about `warmup_fraction` of the requests, are the warm-up (the RSS baseline is taken
after them). With LoRA adapters, each request runs under one of them or the base model.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

KINDS = ("chat", "chat_stream", "generate", "generate_stream", "ws")
KIND_WEIGHTS = (0.2, 0.2, 0.15, 0.2, 0.25)
GREEDY_FRACTION = 0.5
SAMPLED_TEMPERATURE = 0.8

# How each endpoint can be aborted. "disconnect" closes the HTTP connection (after k streamed
# chunks, or after a delay for a non-streaming request); "abort_request" posts the request's rid to
# /abort_request; "ws_cancel" sends a cancel message; "ws_close" closes the whole socket.
ABORT_MODES: dict[str, tuple[str, ...]] = {
    "chat": ("disconnect",),
    "chat_stream": ("disconnect", "abort_request"),
    "generate": ("disconnect", "abort_request"),
    "generate_stream": ("disconnect", "abort_request"),
    "ws": ("ws_cancel", "ws_cancel", "ws_cancel", "ws_close"),  # a close also aborts its socket's others
}

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from it his an were are which this be or "
    "has had not first one their its new after but who they have her she two been other when there "
    "all during into school time may years more most only over city some world would where later up "
    "such used many can state about national out known university united then made river under "
    "system north between through number several music south west before since each both being "
    "three war team government found place well while people however population house three "
    "season village part game area family series early public called around station second "
    "company general church film played local major life age work own these became county"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass
class AbortPlan:
    mode: str
    after_chunks: int  # streaming: abort once this many output chunks arrived
    delay_fraction: float  # non-streaming: abort after this fraction of the expected duration


@dataclass
class SoakRequest:
    index: int
    kind: str
    prefix: int | None  # which shared prefix the prompt starts with (None: a unique prompt)
    system: str  # the shared part (a chat system message, or the start of the text)
    user: str  # the random part
    max_tokens: int
    n: int
    temperature: float
    logprobs: bool  # chat: per-token logprobs (counts tokens per choice); generate: return_logprob
    abort: AbortPlan | None = None
    ws_offset: float = 0.0  # seconds after its session opened that a ws generation is sent
    adapter: str | None = None  # a LoRA adapter's name (`model` / `lora_path`); None: the base model

    @property
    def text(self) -> str:
        """The prompt as plain text (/generate, /ws)."""
        return f"{self.system} {self.user}" if self.system else self.user

    @property
    def messages(self) -> list[dict[str, str]]:
        """The prompt as chat messages (/v1/chat/completions)."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": self.user}]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def rid(self, run_id: str) -> str:
        return f"soak-{run_id}-{self.index}"

    def without_abort(self) -> SoakRequest:
        """The same request, sent to completion (the greedy re-runs)."""
        return SoakRequest(**{**self.__dict__, "abort": None, "ws_offset": 0.0})


@dataclass
class WorkUnit:
    kind: str  # "http", "ws", or "invalid" (a deliberately bad request: a 4xx with OpenAI's body)
    requests: list[SoakRequest] = field(default_factory=list)
    invalid: int = 0  # which bad request (see `SoakClient.invalid`)


@dataclass
class SoakPlan:
    units: list[WorkUnit]
    warmup_units: int  # the first this many units are the warm-up
    prefixes: list[str]
    adapters: list[str] = field(default_factory=list)  # the LoRA adapters the requests draw from

    @property
    def requests(self) -> list[SoakRequest]:
        return [r for u in self.units for r in u.requests]


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))


def _abort_plan(rng: random.Random, kind: str, max_tokens: int) -> AbortPlan:
    mode = rng.choice(ABORT_MODES[kind])
    return AbortPlan(mode, rng.randint(0, max(max_tokens - 1, 0)), rng.uniform(0.05, 0.9))


def build_plan(
    num_requests: int,
    seed: int,
    abort_fraction: float = 0.3,
    max_tokens: int = 64,
    num_prefixes: int = 4,
    prefix_words: tuple[int, int] = (40, 320),
    suffix_words: tuple[int, int] = (1, 60),
    shared_fraction: float = 0.8,
    ws_session: tuple[int, int] = (2, 6),
    warmup_fraction: float = 0.1,
    invalid_every: int = 50,
    adapters: Sequence[str] = (),
) -> SoakPlan:
    """The whole workload for `seed`: pure, so a run can be replayed. With `adapters`, each
    request names one of them or none (the base model), uniformly; drawn after everything else,
    so the same seed gives the same requests with or without adapters."""
    if num_requests < 1:
        raise ValueError("num_requests must be at least 1")
    if not 0.0 <= abort_fraction <= 1.0:
        raise ValueError("abort_fraction must be in [0, 1]")
    rng = random.Random(seed)
    lengths = [rng.randint(*prefix_words) for _ in range(num_prefixes)]
    prefixes = [f"Document {p}: " + _words(rng, n, n) for p, n in enumerate(lengths)]
    reqs = []
    for i in range(num_requests):
        kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
        prefix = rng.randrange(num_prefixes) if num_prefixes and rng.random() < shared_fraction else None
        n = rng.randint(1, 3) if kind.startswith("chat") else (2 if rng.random() < 0.2 else 1)
        reqs.append(
            SoakRequest(
                index=i,
                kind=kind,
                prefix=prefix,
                system=prefixes[prefix] if prefix is not None else "",
                user=f"Request {i}. " + _words(rng, *suffix_words),
                max_tokens=rng.randint(1, max_tokens),
                n=n,
                temperature=0.0 if rng.random() < GREEDY_FRACTION else SAMPLED_TEMPERATURE,
                logprobs=rng.random() < (0.5 if kind.startswith("chat") else 0.25),
            )
        )
    for i in sorted(rng.sample(range(num_requests), round(abort_fraction * num_requests))):
        reqs[i].abort = _abort_plan(rng, reqs[i].kind, reqs[i].max_tokens)
    units: list[WorkUnit] = []
    session: WorkUnit | None = None
    session_size = 0
    for r in reqs:
        if r.kind != "ws":
            units.append(WorkUnit("http", [r]))
            continue
        if session is None or len(session.requests) >= session_size:
            session, session_size = WorkUnit("ws"), rng.randint(*ws_session)
            units.append(session)
        if r.abort is not None and r.abort.mode == "ws_close":
            if any(q.abort is not None and q.abort.mode == "ws_close" for q in session.requests):
                r.abort.mode = "ws_cancel"  # one socket closes once
        r.ws_offset = rng.uniform(0.0, 0.3) if session.requests else 0.0
        session.requests.append(r)
    if invalid_every > 0:  # a few bad requests among the good ones (not counted in num_requests)
        mixed: list[WorkUnit] = []
        for k, unit in enumerate(units, 1):
            mixed.append(unit)
            if k % invalid_every == 0:
                mixed.append(WorkUnit("invalid", invalid=k // invalid_every - 1))
        units = mixed
    warm, seen = 0, 0
    while warm < len(units) and seen < warmup_fraction * num_requests:
        seen += len(units[warm].requests)
        warm += 1
    if adapters:
        for r in reqs:
            r.adapter = rng.choice([None, *adapters])
    return SoakPlan(units, warm, prefixes, list(adapters))
