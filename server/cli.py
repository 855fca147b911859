"""Command line: flags named as SGLang's `launch_server` names them, split into the engine's
options (`Engine(**options)`, i.e. `engine.server_args.ServerArgs`) and the HTTP layer's
`ServerConfig`.

Nothing heavy is imported here: `--help` and a bad flag answer in a fraction of a second. An
engine option the user did not give is left out, so `ServerArgs` keeps its own default.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from server.arg_types import (
    chunk_size,
    device,
    fraction,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
)
from server.config import ServerConfig
from server.kernel_args import add_kernel_args, kernel_engine_options
from server.kv_args import add_kv_args, kv_engine_options
from server.lora_args import add_lora_args, lora_engine_options
from server.reasoning import REASONING_PARSERS

# Mirror engine.server_args.SCHEDULE_POLICIES, POOLING_METHODS and GRAMMAR_BACKENDS (importing the
# engine would import torch, seconds before `--help` could answer).
SCHEDULE_POLICIES = ("lpm", "fcfs", "lof", "random")
POOLING_METHODS = ("last", "mean", "cls")
GRAMMAR_BACKENDS = ("xgrammar", "none")
# SGLang's dtype spellings; the engine knows the canonical ones.
DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
# Mirrors server.tool_parsers.PARSER_NAMES (importing it would import xgrammar).
TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3", "mistral", "qwen3_coder", "pythonic", "generic")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# Mirrors engine.layers.attention_backend.ATTENTION_BACKENDS (importing it would import torch).
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
# Mirrors server.router.policy.POLICIES (the router's policies serve the --dp-size front end).
LOAD_BALANCE_METHODS = ("cache_aware", "round_robin", "shortest_queue")


class _Parser(argparse.ArgumentParser):
    """Errors in one line (no usage dump), exit status 2 as argparse does."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m server",
        description="Serve an LLM over an OpenAI-compatible and SGLang-native "
        "HTTP API (plus WebSocket streaming and Prometheus metrics).",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model-path",
        default="smollm2-135m",
        help="'smollm2-135m' (the bundled default), a Hugging Face model folder, or a .gguf file",
    )
    g.add_argument("--served-model-name", help="the name clients pass as `model` (default: the model path)")
    g.add_argument(
        "--context-length",
        type=positive_int,
        help="maximum tokens per sequence (default: the model's max_position_embeddings)",
    )
    g.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="weights and KV dtype (default: auto = bfloat16 on GPUs and CPUs with AVX512-BF16 or AMX, else float32)",
    )
    g.add_argument(
        "--device",
        type=device,
        help="auto, cpu, cuda or cuda:N, where to run (default: auto = cuda if present)",
    )
    g.add_argument(
        "--is-embedding",
        action="store_true",
        help="serve embeddings only (/v1/embeddings, /encode); generation requests are refused. Without it "
        "embeddings are served beside generation",
    )
    g.add_argument(
        "--pooling-method",
        choices=POOLING_METHODS,
        help="how an embedding pools the prompt's final hidden states before L2 normalisation: last token "
        "(default), mean, or cls (first token)",
    )
    g = p.add_argument_group("gpu")
    g.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        help="attention kernels: cpu = the C++ kernels, torch = the plain-torch reference, triton = GPU kernels; "
        "auto = triton on CUDA when triton imports, the C++ kernels on a CPU where they build, else torch "
        "(default: auto)",
    )
    g.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="run decode eagerly instead of replaying CUDA graphs (graphs need CUDA and triton attention)",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        type=positive_int,
        help="largest decode batch captured as a CUDA graph (default: min(64, --max-running-requests))",
    )
    g = p.add_argument_group("http")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=port, default=30000, help="port to listen on (default: 30000)")
    g.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every endpoint but /health* and /metrics")
    # Metrics are on by default, as in vLLM; SGLang's --enable-metrics is kept so its command lines
    # still start (it changes nothing), and --disable-metrics turns GET /metrics off.
    g.add_argument("--enable-metrics", action="store_true", help="accepted for SGLang; metrics are on by default")
    g.add_argument("--disable-metrics", action="store_true", help="do not serve Prometheus metrics at GET /metrics")
    g.add_argument(
        "--max-queued-requests",
        type=non_negative_int,
        help="generations that may wait beyond --max-running-requests; more get 503 (default: no limit)",
    )
    g.add_argument(
        "--max-body-size",
        type=positive_int,
        default=ServerConfig.max_body_size,
        help=f"largest request body in bytes; larger ones get 413 (default: {ServerConfig.max_body_size})",
    )
    g.add_argument(
        "--graceful-shutdown-timeout",
        type=positive_float,
        default=ServerConfig.graceful_shutdown_timeout,
        help="seconds in-flight requests may take to finish after SIGTERM (default: %(default)s)",
    )
    g.add_argument(
        "--health-check-timeout",
        type=positive_float,
        default=ServerConfig.health_check_timeout,
        help="seconds GET /health_generate waits for its token before answering 503 (default: %(default)s)",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=positive_float,
        default=ServerConfig.timeout_keep_alive,
        help="seconds an idle connection, or one whose request headers are still arriving, stays open "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--body-read-timeout",
        type=positive_float,
        default=ServerConfig.body_read_timeout,
        help="seconds a request body may take to arrive; slower ones get 408 (default: %(default)s)",
    )
    g.add_argument(
        "--max-connections",
        type=positive_int,
        default=ServerConfig.max_connections,
        help="open connections (HTTP and WebSocket) beyond this many get 503 and are closed (default: %(default)s)",
    )
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="logging level (default: info)")
    g.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="reasoning models: split the <think>...</think> block of chat completions out of `content` into "
        "`reasoning_content` (deepseek-r1 and qwen3-thinking: the output starts inside the block; qwen3: only "
        "when it opens with <think>; default: off)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="the format tool calls of chat completions are prompted, constrained and parsed in (qwen25 = hermes; "
        "generic: a JSON envelope any model can follow; default: detected from the chat template, generic when it "
        "does not render tools)",
    )
    g = p.add_argument_group("scheduling and memory")
    g.add_argument("--max-running-requests", type=positive_int, help="requests decoded together (default: 128)")
    g.add_argument(
        "--max-total-tokens", type=positive_int, help="KV cache pool size in tokens; overrides --mem-fraction-static"
    )
    g.add_argument(
        "--mem-fraction-static",
        type=fraction,
        help="share of free memory after the weights for the KV cache pool (default: 0.1 on a CPU, 0.8 on a GPU)",
    )
    g.add_argument("--max-prefill-tokens", type=positive_int, help="token budget of one prefill batch (default: 16384)")
    g.add_argument(
        "--chunked-prefill-size",
        type=chunk_size,
        help="split long prompts into chunks of this many tokens; -1 disables (default: 2048)",
    )
    g.add_argument("--page-size", type=positive_int, help="tokens per KV page (default: 1)")
    g.add_argument(
        "--schedule-policy",
        choices=SCHEDULE_POLICIES,
        help="waiting-queue order: lpm = longest cached prefix first (default), fcfs, lof, random",
    )
    g.add_argument("--disable-radix-cache", action="store_true", help="no prefix reuse between requests")
    g.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        help="running requests decode inside the forward of a prefill chunk (ForwardMode.MIXED) instead of "
        "waiting for it; the chunk budget shrinks by one token per running request",
    )
    g.add_argument(
        "--disable-cascade-attention",
        action="store_true",
        help="cpu/torch attention: attend prefixes shared by several decoding requests once per request "
        "instead of once per group",
    )
    g.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="process each batch's results before planning the next (no CPU/device overlap; "
        "overlap is on by default on CUDA only)",
    )
    g.add_argument(
        "--enable-overlap-schedule",
        action="store_true",
        help="overlap scheduling also on CPU (off there by default: it competes for the same cores)",
    )
    g.add_argument(
        "--watchdog-timeout",
        type=non_negative_float,
        help="seconds a forward may run before the engine is declared hung: every thread's stack is "
        "logged, its requests fail and the server exits with status 3 for its supervisor; 0 disables "
        "(default: 300)",
    )
    g.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="SGLang's flag for /release_memory_occupation; accepted, not needed (memory can always be released)",
    )
    g.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant inference: a request's logits are bit-identical alone or in any batch, "
        "chunked or not, with or without a radix hit (dense weights in fixed row tiles, no int4 path, "
        "no cascade attention; costs throughput)",
    )
    g.add_argument(
        "--weight-version",
        help="the served weights' version, reported by /get_model_info and in every meta_info; each "
        "/update_weights_from_disk sets its own (default: default)",
    )
    g.add_argument(
        "--profile-dir",
        help="where POST /start_profile writes torch profiler traces (default: $SGLANG_TORCH_PROFILER_DIR, "
        "else <tmp>/asyncllm-profiles)",
    )
    g.add_argument(
        "--flight-recorder-size",
        type=int,
        metavar="EVENTS",
        help="events the flight recorder keeps in memory (every actor's messages and scheduling "
        "decisions; dumped on a crash, the watchdog, SIGUSR1 or POST /dump_flight_recorder); "
        "0 turns it off (default: 50000)",
    )
    g.add_argument(
        "--flight-recorder-dir",
        help="where flight recorder dumps are written (default: $ASYNCLLM_FLIGHT_RECORDER_DIR, "
        "else <tmp>/asyncllm-flight-recorder)",
    )
    g.add_argument(
        "--flight-recorder-record-prompts",
        action="store_true",
        default=None,  # absent: the engine's default (off)
        help="keep prompts' token ids, stop strings and grammar specs in flight recorder dumps "
        "(default: off; dumps then hold per-page hashes and lengths, enough for replay)",
    )
    g.add_argument(
        "--grammar-backend",
        choices=GRAMMAR_BACKENDS,
        help="structured output (response_format, tools, json_schema/regex/ebnf): xgrammar, or none to "
        "refuse such requests (default: xgrammar)",
    )
    g.add_argument(
        "--grammar-compile-timeout",
        type=positive_float,
        help="seconds a request's grammar may take to compile before the request fails with a 400 (default: 30)",
    )
    g.add_argument(
        "--constrained-json-max-string-length",
        type=non_negative_int,
        metavar="CHARS",
        help="JSON strings a schema leaves unbounded (and every string in json_object mode) end after this "
        "many characters, so structured output cannot run to max_tokens; a schema's own maxLength wins; "
        "0: unbounded (default: 256)",
    )
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative-algorithm",
        choices=["NGRAM"],
        help="NGRAM: each greedy request drafts tokens from its own prompt and output (prompt lookup) and the "
        "model verifies them in one forward; output unchanged, fewer forwards when text repeats (default: off)",
    )
    g.add_argument(
        "--speculative-num-draft-tokens",
        type=positive_int,
        help="most tokens drafted per request and step (adapted down per request by its acceptance; default: 7)",
    )
    g.add_argument(
        "--speculative-max-verify-tokens",
        type=positive_int,
        help="most rows of a verify forward, the running requests' own included: they share what is left "
        "after their own rows, and a batch that fills them does not draft (default: num draft tokens + 1; "
        "raise it where a forward's cost stays flat over more rows, as on a GPU)",
    )
    add_lora_args(p)
    add_kernel_args(p)
    add_kv_args(p)
    g = p.add_argument_group("scale-out")
    g.add_argument(
        "--tp-size",
        type=positive_int,
        help="tensor parallelism: shard every layer over this many ranks (torch.distributed: gloo on CPU, "
        "NCCL on CUDA); rank 0 runs the scheduler, the others a worker loop (default: 1)",
    )
    g.add_argument(
        "--ep-size",
        "--expert-parallel-size",
        type=positive_int,
        help="expert parallelism for mixture-of-experts models: the experts split over this many sets of "
        "tp-size / ep-size ranks, each set holding its experts whole or sliced over its ranks (default: 1)",
    )
    g.add_argument("--nnodes", type=positive_int, help="hosts the tensor-parallel ranks span (default: 1)")
    g.add_argument("--node-rank", type=non_negative_int, help="this host's index among --nnodes (default: 0)")
    g.add_argument(
        "--dist-init-addr",
        help="HOST:PORT of node 0 for the torch.distributed rendezvous (needed when --nnodes > 1; "
        "default on one host: a free loopback port)",
    )
    g.add_argument(
        "--dp-size",
        type=positive_int,
        default=ServerConfig.dp_size,
        help="data parallelism: this many engine replicas (each its own process and KV pool) behind one "
        "front end that routes requests (default: %(default)s)",
    )
    g.add_argument(
        "--load-balance-method",
        choices=LOAD_BALANCE_METHODS,
        default=ServerConfig.load_balance_method,
        help="how the --dp-size front end picks a replica (default: %(default)s)",
    )
    g.add_argument(
        "--ray-address",
        help="place the --dp-size replicas as Ray actors on this cluster ('auto' or HOST:PORT; needs "
        "`pip install .[ray]`)",
    )
    return p


# CLI dest -> ServerArgs field, for the options passed straight through.
_ENGINE_OPTIONS = (
    "context_length",
    "device",
    "max_running_requests",
    "max_total_tokens",
    "mem_fraction_static",
    "max_prefill_tokens",
    "chunked_prefill_size",
    "page_size",
    "schedule_policy",
    "watchdog_timeout",
    "weight_version",
    "grammar_backend",
    "grammar_compile_timeout",
    "constrained_json_max_string_length",
    "profile_dir",
    "flight_recorder_size",
    "flight_recorder_dir",
    "flight_recorder_record_prompts",
    "tp_size",
    "ep_size",
    "speculative_algorithm",
    "speculative_num_draft_tokens",
    "speculative_max_verify_tokens",
    "nnodes",
    "node_rank",
    "dist_init_addr",
    "pooling_method",
)


def parse_args(argv: list[str] | None = None) -> tuple[dict[str, Any], ServerConfig]:
    """Parse the command line into (engine options, server config); exits 2 on a bad flag."""
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    engine: dict[str, Any] = {k: getattr(ns, k) for k in _ENGINE_OPTIONS if getattr(ns, k) is not None}
    engine.update(lora_engine_options(ns))
    engine.update(kernel_engine_options(ns))
    engine.update(kv_engine_options(ns))
    if ns.dtype is not None:
        engine["dtype"] = DTYPES[ns.dtype]
    for flag in (
        "enable_memory_saver",
        "enable_deterministic_inference",
        "disable_radix_cache",
        "disable_cascade_attention",
        "enable_mixed_chunk",
        "is_embedding",
    ):
        if getattr(ns, flag):
            engine[flag] = True
    if ns.disable_overlap_schedule:
        engine["enable_overlap"] = False
    elif ns.enable_overlap_schedule:
        engine["enable_overlap"] = True
    for key in ("attention_backend", "cuda_graph_max_bs"):  # the gpu group, passed through when given
        if getattr(ns, key) is not None:
            engine[key] = getattr(ns, key)
    if ns.disable_cuda_graph:
        engine["disable_cuda_graph"] = True
    config = ServerConfig(
        model_path=ns.model_path,
        host=ns.host,
        port=ns.port,
        served_model_name=ns.served_model_name,
        api_key=ns.api_key,
        enable_metrics=not ns.disable_metrics,
        max_queued_requests=ns.max_queued_requests,
        max_body_size=ns.max_body_size,
        graceful_shutdown_timeout=ns.graceful_shutdown_timeout,
        health_check_timeout=ns.health_check_timeout,
        timeout_keep_alive=ns.timeout_keep_alive,
        body_read_timeout=ns.body_read_timeout,
        max_connections=ns.max_connections,
        log_level=ns.log_level,
        dp_size=ns.dp_size,
        load_balance_method=ns.load_balance_method,
        ray_address=ns.ray_address,
        reasoning_parser=ns.reasoning_parser,
        tool_call_parser=ns.tool_call_parser,
    )
    return engine, config
