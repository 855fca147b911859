"""Synthetic workloads for the serving benchmark (`python -m bench.serving`), usable on their own
(e.g. by an offline benchmark that wants the same prompts).

Everything here is generated locally from a seed, so a run needs no downloads and two runs with
the same seed and tokenizer send the same prompts. Prompts are made of random token ids drawn
from the tokenizer's vocabulary (special and added tokens excluded, so no chat-control tokens leak
in), decoded to text. Decoding then re-encoding does not always give back the same number of
tokens (byte-level BPE merges across the random boundaries), so the text is nudged towards the
target length a few times and the length it finally re-encodes to is recorded as `prompt_len`.
Token counts here are of the text alone (`add_special_tokens=False`); a server that prepends a
BOS token counts one more.

Length convention (as SGLang's bench_serving): a length `L` with range ratio `r` is drawn
uniformly from the integers in [max(1, floor(L * r)), L], both ends included. r = 1 means every
length is exactly L; r = 0 means anything from 1 to L.

Datasets:
- random: independent prompts and output lengths by the convention above.
- shared-prefix (SGLang's generated-shared-prefix): G groups x P prompts; each group has one
  random system prefix, each prompt appends its own random question; lengths are fixed.
  The prompts come group by group, in order.
- sharegpt-synthetic: lognormal input and output lengths imitating ShareGPT conversations (see
  `ShareGPTSynthetic`), rejection-sampled into the ranges SGLang keeps from the real data set.
- multi-turn: conversations of T user turns; the runner sends turn k+1 (with the whole history)
  after turn k's reply has arrived, so a prefix cache can reuse the history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# How many times a prompt is re-decoded to bring its re-encoded length onto the target.
_FIXUP_ROUNDS = 6


@dataclass
class Turn:
    """One request's worth of prompt: `text` (for multi-turn, the new user message only)."""

    text: str
    prompt_len: int  # tokens `text` re-encodes to
    output_len: int  # max tokens requested for the reply
    target_len: int  # the length that was drawn (prompt_len is usually equal, see the module doc)


@dataclass
class Conversation:
    """What one client sends: a single request, or several turns sent one after another."""

    turns: list[Turn]
    group: int | None = None  # shared-prefix group


@dataclass(frozen=True)
class ShareGPTSynthetic:
    """Length model for sharegpt-synthetic. Lognormal: log(length) ~ Normal(log(median), sigma).

    The medians and sigmas give means of about 210 input and 195 output tokens before filtering,
    near what ShareGPT V3 averages after SGLang's filter (roughly 200-230 input and 190-200 output
    tokens per conversation with Llama-style tokenizers), with ShareGPT's long right tail. Pairs
    outside SGLang's filter (either side < 4 tokens, input > 1024, input + output > 2048) are
    drawn again rather than clipped, so no spike forms at the bounds.
    """

    input_median: float = 130.0
    input_sigma: float = 1.0
    output_median: float = 130.0
    output_sigma: float = 0.9
    min_len: int = 4
    max_input_len: int = 1024
    max_total_len: int = 2048


def sample_lengths(rng: np.random.Generator, length: int, range_ratio: float, n: int) -> list[int]:
    """n lengths uniform over the integers in [max(1, floor(length * range_ratio)), length]."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    lo = max(1, math.floor(length * range_ratio))
    return [int(x) for x in rng.integers(lo, length + 1, size=n)]


class RandomText:
    """Random-token text of a requested token length, for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        excluded = set(getattr(tokenizer, "all_special_ids", []) or [])
        excluded |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.ids = np.array([i for i in range(len(tokenizer)) if i not in excluded], dtype=np.int64)
        if self.ids.size == 0:
            raise ValueError("the tokenizer has no ordinary tokens to build prompts from")

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def make(self, rng: np.random.Generator, n: int) -> tuple[str, int]:
        """(text, its re-encoded length), the length as close to n as a few rounds get it."""
        ids = rng.choice(self.ids, size=n).tolist()
        for _ in range(_FIXUP_ROUNDS):
            text = self.tokenizer.decode(ids)
            enc = self.tokenizer.encode(text, add_special_tokens=False)
            if len(enc) == n:
                return text, n
            # Too long: keep the re-encoded prefix. Too short: top it up with fresh random tokens.
            ids = enc[:n] if len(enc) > n else enc + rng.choice(self.ids, size=n - len(enc)).tolist()
        text = self.tokenizer.decode(ids)
        return text, self.count(text)


def random_dataset(
    tokenizer: Any, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    maker = RandomText(tokenizer)
    in_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    convs = []
    for target, out in zip(in_lens, out_lens):
        text, actual = maker.make(rng, target)
        convs.append(Conversation([Turn(text, actual, out, target)]))
    return convs


def shared_prefix_dataset(
    tokenizer: Any,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    maker = RandomText(tokenizer)
    convs = []
    for g in range(num_groups):
        system, _ = maker.make(rng, system_prompt_len)
        for _ in range(prompts_per_group):
            question, _ = maker.make(rng, question_len)
            text = f"{system}\n\n{question}"
            convs.append(
                Conversation([Turn(text, maker.count(text), output_len, system_prompt_len + question_len)], group=g)
            )
    return convs


def sharegpt_synthetic_lengths(
    rng: np.random.Generator, n: int, params: ShareGPTSynthetic = ShareGPTSynthetic()
) -> list[tuple[int, int]]:
    """n (input_len, output_len) pairs from the lognormal model, filtered as SGLang filters ShareGPT."""
    out: list[tuple[int, int]] = []
    while len(out) < n:
        m = 2 * (n - len(out)) + 8
        ins = np.rint(rng.lognormal(math.log(params.input_median), params.input_sigma, m)).astype(np.int64)
        outs = np.rint(rng.lognormal(math.log(params.output_median), params.output_sigma, m)).astype(np.int64)
        for i, o in zip(ins.tolist(), outs.tolist()):
            if (
                i >= params.min_len
                and o >= params.min_len
                and i <= params.max_input_len
                and i + o <= params.max_total_len
            ):
                out.append((i, o))
    return out[:n]


def sharegpt_synthetic_dataset(
    tokenizer: Any, num_prompts: int, seed: int, params: ShareGPTSynthetic = ShareGPTSynthetic()
) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    maker = RandomText(tokenizer)
    convs = []
    for target, out in sharegpt_synthetic_lengths(rng, num_prompts, params):
        text, actual = maker.make(rng, target)
        convs.append(Conversation([Turn(text, actual, out, target)]))
    return convs


def multi_turn_dataset(
    tokenizer: Any,
    num_conversations: int,
    num_turns: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[Conversation]:
    """Each turn's new user message and reply length follow the random dataset's convention."""
    if num_turns < 1:
        raise ValueError(f"num_turns must be >= 1, got {num_turns}")
    rng = np.random.default_rng(seed)
    maker = RandomText(tokenizer)
    n = num_conversations * num_turns
    in_lens = sample_lengths(rng, input_len, range_ratio, n)
    out_lens = sample_lengths(rng, output_len, range_ratio, n)
    convs = []
    for c in range(num_conversations):
        turns = []
        for k in range(c * num_turns, (c + 1) * num_turns):
            text, actual = maker.make(rng, in_lens[k])
            turns.append(Turn(text, actual, out_lens[k], in_lens[k]))
        convs.append(Conversation(turns))
    return convs


@dataclass
class DatasetSpec:
    """The dataset flags of the command line, in one place (see `build_dataset`)."""

    name: str = "random"
    num_prompts: int = 100
    seed: int = 1
    random_input_len: int = 1024
    random_output_len: int = 1024
    random_range_ratio: float = 0.0
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    multi_turn_num_turns: int = 4
    sharegpt: ShareGPTSynthetic = field(default_factory=ShareGPTSynthetic)


DATASETS = ("random", "shared-prefix", "sharegpt-synthetic", "multi-turn")


def build_dataset(tokenizer: Any, spec: DatasetSpec) -> list[Conversation]:
    if spec.name == "random":
        return random_dataset(
            tokenizer,
            spec.num_prompts,
            spec.random_input_len,
            spec.random_output_len,
            spec.random_range_ratio,
            spec.seed,
        )
    if spec.name == "shared-prefix":
        return shared_prefix_dataset(
            tokenizer,
            spec.gsp_num_groups,
            spec.gsp_prompts_per_group,
            spec.gsp_system_prompt_len,
            spec.gsp_question_len,
            spec.gsp_output_len,
            spec.seed,
        )
    if spec.name == "sharegpt-synthetic":
        return sharegpt_synthetic_dataset(tokenizer, spec.num_prompts, spec.seed, spec.sharegpt)
    if spec.name == "multi-turn":
        return multi_turn_dataset(
            tokenizer,
            spec.num_prompts,
            spec.multi_turn_num_turns,
            spec.random_input_len,
            spec.random_output_len,
            spec.random_range_ratio,
            spec.seed,
        )
    raise ValueError(f"unknown dataset {spec.name!r}; choose from {', '.join(DATASETS)}")
