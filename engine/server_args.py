"""Engine options, named as SGLang's ServerArgs names them."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError, InvalidServerArgsError
from engine.layers.weight_quant import TORCHAO_CONFIGS, WeightOnlyQuant

log = logging.getLogger(__name__)

# SGLang's switch for a --context-length beyond the model's max_position_embeddings: positions
# the model was never trained on give garbage, so it takes this explicit opt-in.
ALLOW_LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"
# The smallest KV pool that can serve one real request: a chat-templated prompt and an answer.
MIN_POOL_TOKENS = 256
SCHEDULE_POLICIES = ("lpm", "fcfs", "lof", "random")
SPECULATIVE_ALGORITHMS = (None, "NGRAM")
POOLING_METHODS = ("last", "mean", "cls")
GRAMMAR_BACKENDS = ("xgrammar", "none")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


FLIGHT_RECORDER_DIR_ENV = "ASYNCLLM_FLIGHT_RECORDER_DIR"


# The KV pool's share of free memory when `mem_fraction_static` is not given. A CPU's memory is the
# host's, shared with everything else on it: a tenth. A GPU's is the engine's alone, and a serving
# engine on a GPU is expected to fill it (SGLang's default, a share of the whole card, is 0.8-0.9):
# 0.8 of what is free after the weights and the decode graphs' reserve leaves the rest to prefill
# activations and the allocator's fragmentation.
DEFAULT_MEM_FRACTION = {"cpu": 0.1, "cuda": 0.8}


def default_mem_fraction(device_type: str) -> float:
    return DEFAULT_MEM_FRACTION.get(device_type, DEFAULT_MEM_FRACTION["cpu"])


@dataclass
class ServerArgs:
    model_path: str = "smollm2-135m"
    dtype: str = "auto"  # auto: bfloat16 where the hardware computes in it natively, else float32 (see below)
    device: str = "auto"  # auto: cuda when available, else cpu
    context_length: int | None = None  # default: the model's max_position_embeddings
    max_running_requests: int = 128
    max_total_tokens: int | None = None  # KV pool size in tokens; overrides mem_fraction_static
    # Share of the free memory (after the weights) for the KV pool; None: the device's default
    # (`default_mem_fraction`).
    mem_fraction_static: float | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = 2048  # None or -1 disables chunking
    page_size: int = 1
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    # Sliding-window models (Mistral, Gemma 2/3, Phi-3...): the local layers' KV lives in
    # a SWA pool of its own, `swa_full_tokens_ratio` the size of the full one, and a request gives
    # back the slots its window has left (engine/cache/swa_pool.py). SGLang's flags.
    disable_hybrid_swa_memory: bool = False
    swa_full_tokens_ratio: float = 0.8
    # None (auto): on for CUDA, off for CPU. On a CPU the "device" is the same cores: planning the
    # next step beside the running forward steals them (bench.overlap: 3x slower steps when the
    # machine is busy, ~20% when quiet), so there is nothing to hide the host work behind.
    enable_overlap: bool | None = None
    # SGLang's --enable-mixed-chunk: running requests decode their next token inside the forward
    # of a prefill chunk (ForwardMode.MIXED) instead of waiting for it; the chunk budget shrinks
    # by one token per running request.
    enable_mixed_chunk: bool = False
    # Attention (engine/layers/attention_backend.py), decided once at start-up. auto: triton on CUDA
    # when it imports; on a CPU the C++ kernels ("cpu") when they build and take the dtype and head
    # size, else "torch" (the pure-torch reference); or name one of "cpu", "torch", "triton".
    attention_backend: str = "auto"
    # Decode CUDA graphs (engine/model_executor/cuda_graph_runner.py).
    disable_cuda_graph: bool = False  # decode CUDA graphs are used on CUDA with the triton backend
    cuda_graph_max_bs: int | None = None  # largest decode batch captured (default: min(64, max_running_requests))
    # cpu/torch attention backends on a CPU: decode attends a prefix shared by several requests of
    # the batch once for all of them (engine/layers/cascade.py) instead of once per request.
    disable_cascade_attention: bool = False
    # CPU + bf16 + our 4-bit kernels: a decode of a few tokens runs every decoder layer in one C++
    # call (engine/layers/fused_decode.py; same kernels, same results, no Python between them).
    disable_fused_decode: bool = False
    # Threads of the forward thread. None: on a CPU, the physical cores this process may use
    # (affinity, cgroup quota: engine/device/cpu_threads.py); the event-loop thread gets 1.
    torch_threads: int | None = None
    # CPU + bf16 or fp32 only: linears of inputs up to this many rows (decode batch size) use the
    # packed 4-bit kernel on a Q4_0/Q4_1 GGUF's own weights (and the Q8_0 kernel on its LM head,
    # or on --torchao-config's blocks); more rows use the dense weights. 0 disables.
    # None: measured at start-up, where the int4 kernel stops beating the dense matmul on this
    # machine (engine/layers/int4_crossover.py; the crossover depends on the CPU and thread count).
    q4_max_tokens: int | None = None
    # CPU bf16: the 4-bit loops read x in int8 blocks, as llama.cpp's dot products do (VNNI: twice
    # the products per instruction; ~5x bf16's rounding of x, so off by default). Process-wide.
    q4_int8_activations: bool = False
    # SGLang's on-the-fly weight-only quantization of a Hugging Face checkpoint: "int8wo" or
    # "int4wo-<32|64|128|256>", into the forms our CPU kernels read (engine/layers/weight_quant.py;
    # bf16 or fp32 on a CPU; elsewhere the model computes densely with the quantized values); one rank.
    # "" (default): the weights as stored.
    torchao_config: str = ""
    # SGLang's batch-invariant mode: a request's logits are bit-identical whatever else is in the
    # batch, however its prompt was chunked, with or without a radix hit. Every projection runs
    # dense in fixed row tiles, or in decode-like forwards its GGUF blocks at every row count where
    # their loops are batch-invariant (engine/layers/linear.py `BatchInvariantLinear`, `RowTiles`;
    # no row-bounded int4 path), no cascade attention, extends on every thread.
    enable_deterministic_inference: bool = False
    # SGLang's watchdog: a forward still running after this many seconds means a hung device (or
    # kernel): every thread's stack is logged, its requests fail, the engine turns unhealthy (the
    # server then exits non-zero for its supervisor). None or <= 0 disables it.
    watchdog_timeout: float | None = 300.0
    # Structured output (json_schema / regex / ebnf, OpenAI response_format and tools), SGLang's
    # flags: "xgrammar" or "none" (such requests are then refused). A grammar that does not
    # compile within grammar_compile_timeout seconds fails its request with a 400.
    grammar_backend: str = "xgrammar"
    grammar_compile_timeout: float = 30.0
    # A JSON string the schema leaves unbounded (or any string in json_object mode) ends after
    # this many characters, so constrained JSON cannot run to max_tokens (the other default
    # caps: engine/constrained/json_bounds.py). 0: unbounded, as xgrammar alone.
    constrained_json_max_string_length: int = 256
    # Where /start_profile (Engine.start_profile) writes torch profiler traces by default
    # (None: $SGLANG_TORCH_PROFILER_DIR, else <tmp>/asyncllm-profiles).
    profile_dir: str | None = None
    # Flight recorder (engine/recorder/): the last this-many events (every actor's incoming
    # messages, every scheduling decision) kept in memory and dumped to flight_recorder_dir on a
    # crash, the watchdog, SIGUSR1 or POST /dump_flight_recorder; `python -m engine.replay DUMP`
    # replays a dump. 0 turns it off. None dir: $ASYNCLLM_FLIGHT_RECORDER_DIR, else
    # <tmp>/asyncllm-flight-recorder.
    flight_recorder_size: int = 50_000
    flight_recorder_dir: str | None = None
    # Whether dumps hold prompts' token ids, stop strings and grammar specs. Off: stand-in ids
    # (per-page keyed hashes of the prefix: replay still rebuilds every radix-cache match) and
    # lengths, so a dump holds nothing a user wrote (engine/recorder/redact.py). Off in Engine too:
    # an embedding application serves users as the server does, and replay works either way.
    flight_recorder_record_prompts: bool = False
    # Tensor parallelism (engine/distributed/): every layer sharded over tp_size ranks on
    # torch.distributed (gloo on CPU, NCCL on CUDA). Rank 0 is this process (the actors); the
    # others run a worker loop. One host: the engine spawns them. Several hosts (SGLang's flags):
    # nnodes hosts, this one is node_rank, rendezvous at dist_init_addr ("HOST:PORT" of node 0).
    tp_size: int = 1
    # Expert parallelism (SGLang's --ep-size): a mixture-of-experts layer's experts are split over
    # ep_size sets of tp_size / ep_size ranks, each set holding num_experts / ep_size whole experts
    # (sliced over its ranks as tensor parallelism slices them); 1: every rank a slice of every expert.
    ep_size: int = 1
    # Speculative decoding (engine/speculative/, SGLang's flags): "NGRAM" drafts up to
    # speculative_num_draft_tokens tokens per running greedy request from its own prompt and
    # output, verified in one forward; None: off. 7: a verify of 8 rows is one pass of the CPU
    # quantized products (copy-heavy single streams: 1.68x plain at 7, 1.48x at 4). A verify
    # forward has at most speculative_max_verify_tokens rows (None: num_draft_tokens + 1): past
    # that a forward's cost grows with its rows and drafts would cost more than they save, so the
    # running requests share what is left after their own rows, and a full batch does not draft.
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 7
    speculative_max_verify_tokens: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # Embeddings (Engine.encode, /v1/embeddings, /encode): the final hidden states (after the
    # model's last norm) pooled over the prompt by `pooling_method` (last token, mean, first
    # token) and L2-normalised. SGLang's is_embedding serves only them: generation is refused.
    is_embedding: bool = False
    # The served weights' version (SGLang's --weight-version): reported by /get_model_info and in
    # every response's meta_info; each weight update sets the version it names, or the number of
    # updates applied so far
    weight_version: str = "default"
    # SGLang's flag for release_memory_occupation (its GPU allocator hook); accepted for its users,
    # not needed here: the KV pool and weights are freed and rebuilt as tensors on CPU and CUDA alike
    enable_memory_saver: bool = False
    pooling_method: str = "last"
    # Multi-LoRA serving (engine/lora/, SGLang's flags): PEFT adapters loaded at start-up
    # (`lora_paths`: "name=path" or "path", which implies enable_lora) or at run time, one per
    # request by name (`lora_path`); a forward mixes the base model and up to max_loras_per_batch
    # adapters, resident in a device pool; max_loaded_loras bounds those kept on the host.
    # max_lora_rank None: the largest rank among lora_paths (16 without any); lora_target_modules
    # None: the modules lora_paths adapt (every one without any). Under tensor parallelism each
    # rank holds its shard of the adapters (their paths must exist on every host).
    enable_lora: bool = False
    lora_paths: list[str] | None = None
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None

    def verify(self) -> None:
        """Raise `InvalidServerArgsError` naming the first option that cannot work.

        Checked before anything loads, so a typo costs a second, not a model load. Options that
        depend on the model (the context length, the pool size) are checked by `check_context_length`
        and `check_pool` once its config is read.
        """

        def fail(name: str, rule: str) -> None:
            raise InvalidServerArgsError(f"{name} must be {rule}, got {getattr(self, name)!r}", name)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in (
            "max_running_requests",
            "max_prefill_tokens",
            "page_size",
            "tp_size",
            "ep_size",
            "nnodes",
            "speculative_num_draft_tokens",
        ):
            if not (is_int(getattr(self, name)) and getattr(self, name) >= 1):
                fail(name, "an integer >= 1")
        for name in (
            "context_length",
            "max_total_tokens",
            "torch_threads",
            "cuda_graph_max_bs",
            "speculative_max_verify_tokens",
        ):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and value >= 1):
                fail(name, "an integer >= 1")
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            fail("speculative_algorithm", "NGRAM or None (off)")
        if self.speculative_max_verify_tokens == 1:
            fail("speculative_max_verify_tokens", "at least 2 (a request's token and one draft)")
        if self.speculative_algorithm is not None and self.page_size != 1:
            fail("page_size", "1 with speculative decoding (drafts are verified slot by slot)")
        if not (is_int(self.node_rank) and 0 <= self.node_rank < self.nnodes):
            fail("node_rank", f"an integer in [0, nnodes={self.nnodes})")
        if self.tp_size % self.ep_size:
            fail("ep_size", f"a divisor of tp_size ({self.tp_size}): each expert set is tp_size / ep_size ranks")
        if self.tp_size % self.nnodes:
            fail("tp_size", f"a multiple of nnodes ({self.nnodes}): every host runs as many ranks")
        addr = self.dist_init_addr
        if addr is not None:
            host, _, port = str(addr).rpartition(":")
            if not (isinstance(addr, str) and host and port.isdigit()):
                fail("dist_init_addr", "HOST:PORT")
        elif self.nnodes > 1:
            fail("dist_init_addr", "node 0's HOST:PORT when nnodes > 1")
        size = self.flight_recorder_size
        if not (is_int(size) and size >= 0):
            fail("flight_recorder_size", "an integer >= 0 (0: off)")
        chunk = self.chunked_prefill_size
        if chunk is not None and not (is_int(chunk) and (chunk == -1 or chunk >= 1)):
            fail("chunked_prefill_size", "-1 (no chunking) or an integer >= 1")
        ratio = self.swa_full_tokens_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
            fail("swa_full_tokens_ratio", "a fraction in (0, 1]")
        frac = self.mem_fraction_static
        if frac is not None and not (isinstance(frac, (int, float)) and 0.0 < frac <= 1.0):
            fail("mem_fraction_static", "a fraction in (0, 1]")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            fail("schedule_policy", f"one of {', '.join(SCHEDULE_POLICIES)}")
        if self.pooling_method not in POOLING_METHODS:
            fail("pooling_method", f"one of {', '.join(POOLING_METHODS)}")
        if not is_int(self.constrained_json_max_string_length) or self.constrained_json_max_string_length < 0:
            fail("constrained_json_max_string_length", "an integer >= 0 (0: unbounded)")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            fail("grammar_backend", f"one of {', '.join(GRAMMAR_BACKENDS)}")
        timeout = self.grammar_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            fail("grammar_compile_timeout", "a positive number of seconds")
        self._verify_lora(fail, is_int)
        try:
            quant = WeightOnlyQuant.parse(self.torchao_config)
        except ValueError:
            fail("torchao_config", f"one of {', '.join(TORCHAO_CONFIGS)} or empty (off)")
        if quant is not None:
            self._verify_quant(fail)
        if self.enable_deterministic_inference and self.enable_mixed_chunk:
            # a mixed forward's decode rows would take the extend GEMM tiles (linear.RowTiles)
            fail("enable_mixed_chunk", "off with enable_deterministic_inference")
        try:
            self.resolved_watchdog_timeout()
            self.resolved_q4_max_tokens()
        except InvalidRequestError as e:
            raise InvalidServerArgsError(e.message, e.param) from None

    def _verify_quant(self, fail) -> None:
        """Under tensor parallelism a row-parallel rank's slice would start groups at other
        columns than one rank's do: other weights than the checkpoint's quantized ones."""
        if self.tp_size != 1:
            fail("torchao_config", "empty (off) with tp_size > 1")

    def _verify_lora(self, fail, is_int) -> None:
        if self.lora_paths:
            self.enable_lora = True  # SGLang's: adapters given at start-up turn LoRA on
        for name in ("max_loras_per_batch",):
            if not (is_int(getattr(self, name)) and getattr(self, name) >= 1):
                fail(name, "an integer >= 1")
        for name in ("max_loaded_loras", "max_lora_rank"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and value >= 1):
                fail(name, "an integer >= 1")
        for name in ("lora_paths", "lora_target_modules"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, list) and all(isinstance(v, str) and v for v in value)):
                fail(name, "a list of non-empty strings")
        if self.max_loaded_loras is not None and len(self.lora_paths or ()) > self.max_loaded_loras:
            fail("max_loaded_loras", f"at least the {len(self.lora_paths or ())} adapters of lora_paths")

    def check_context_length(self, model_context_len: int) -> int:
        """The context length to serve: the model's, or a shorter `context_length`; a longer one
        only with SGLang's opt-in environment variable."""
        if self.context_length is None:
            return model_context_len
        if self.context_length > model_context_len:
            if os.environ.get(ALLOW_LONGER_CONTEXT_ENV, "").lower() not in ("1", "true"):
                raise InvalidServerArgsError(
                    f"context_length {self.context_length} is longer than the model's {model_context_len} positions; "
                    f"set {ALLOW_LONGER_CONTEXT_ENV}=1 to use it anyway",
                    "context_length",
                )
            log.warning("context_length %d exceeds the model's %d positions", self.context_length, model_context_len)
        return self.context_length

    def check_pool(self, pool_tokens: int, context_len: int) -> None:
        """A KV pool must hold one real request (see MIN_POOL_TOKENS); one smaller than the context
        length is allowed (memory is shared and reclaimed) but longer prompts are then refused."""
        need = min(MIN_POOL_TOKENS, context_len)
        if pool_tokens < need:
            raise InvalidServerArgsError(
                f"the KV cache pool holds {pool_tokens} tokens, too few for one request (at least {need}); "
                "raise max_total_tokens or mem_fraction_static",
                "max_total_tokens",
            )
        if pool_tokens < context_len:
            log.warning(
                "the KV pool (%d tokens) is smaller than the context length (%d): prompts of "
                "%d tokens or more will be refused",
                pool_tokens,
                context_len,
                pool_tokens,
            )

    def resolved_watchdog_timeout(self) -> float | None:
        value = self.watchdog_timeout
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise InvalidRequestError(
                f"watchdog_timeout must be a number of seconds, got {value!r}", "watchdog_timeout"
            )
        return None if value is None or value <= 0 else float(value)

    def resolved_flight_recorder_dir(self) -> str:
        if self.flight_recorder_dir:
            return self.flight_recorder_dir
        default = os.path.join(tempfile.gettempdir(), "asyncllm-flight-recorder")
        return os.environ.get(FLIGHT_RECORDER_DIR_ENV) or default

    def resolved_max_verify_tokens(self) -> int:
        """Rows of a speculative verify forward at most (see speculative_max_verify_tokens)."""
        return self.speculative_max_verify_tokens or self.speculative_num_draft_tokens + 1

    def resolved_enable_overlap(self) -> bool:
        return self.resolved_device().type == "cuda" if self.enable_overlap is None else self.enable_overlap

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        """auto: bfloat16 on CUDA and on CPUs with native bf16 arithmetic (AVX512-BF16 or AMX):
        half the bytes of fp32 per weight and KV entry, and their matmuls run at bf16 rates.
        Without those instructions bf16 is converted to fp32 around every op, slower than fp32
        itself, so such CPUs get float32."""
        if self.dtype == "auto":
            native_bf16 = self.resolved_device().type == "cuda" or cpu_has_native_bf16()
            return torch.bfloat16 if native_bf16 else torch.float32
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise InvalidRequestError(f"unknown dtype {self.dtype!r}; use one of {sorted(_DTYPES)}", "dtype") from None

    def resolved_q4_max_tokens(self) -> int | None:
        """Rows up to which the packed 4-bit path runs; 0 where it does not apply (GPU, neither
        bf16 nor fp32); None: to be measured when the model loads."""
        value = self.q4_max_tokens
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise InvalidRequestError(f"q4_max_tokens must be an int >= 0, got {value!r}", "q4_max_tokens")
        if self.resolved_device().type != "cpu" or self.resolved_dtype() not in (torch.bfloat16, torch.float32):
            return 0
        return value


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX tiles)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
