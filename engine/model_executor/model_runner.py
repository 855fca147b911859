"""ModelRunner: owns the model, the KV memory and the sampler; runs one forward at a time.

It is the only code that touches model tensors. The scheduler hands it `ModelWorkerBatch`es;
it builds the `ForwardBatch` (the one place a forward's host tensors move to the device), runs
the model, samples, and records each request's sampled id in `last_token_ids[req_pool_idx]` so a
decode batch planned before the previous results were read (overlap scheduling) can gather its
inputs on the device.

Everything that depends on the machine is decided here, once, at start-up: the attention backend
(engine/layers/attention_backend.py), each layer's implementation (the model is built for its
device and dtype), the linear forms after loading, including up to how many rows the int4 path
runs (measured unless `q4_max_tokens` is given), and the decode CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from dataclasses import dataclass, field

import psutil
import torch

from engine.cache.memory_pool import KVCache, ReqToTokenPool, TokenToKVPoolAllocator, kv_pool_size_from_budget
from engine.cache.swa_pool import build_hybrid_memory
from engine.device.step_threads import StepThreads, measure_small_step_threads
from engine.distributed.parallel_state import TPGroup
from engine.distributed.step_message import TPStep, encode
from engine.errors import InvalidRequestError, InvalidServerArgsError, ModelLoadError
from engine.kernels import cpu_quant
from engine.layers.attention_backend import check_attention_backend, create_attention_backend, resolve_attention_backend
from engine.layers.attention_ops import HeadLayout
from engine.layers.fused_decode import FusedDecodeLayers
from engine.layers.int4 import int4_kernel_available
from engine.layers.int4_crossover import bound_text
from engine.layers.linear import QuantLinear, RowTiles, one_row_pass
from engine.layers.moe import FusedMoE
from engine.layers.weight_quant import WeightOnlyQuant
from engine.model_config import ModelConfig
from engine.model_executor.cuda_graph_runner import (
    DecodeGraphRunner,
    capture_batch_sizes,
    cuda_graphs_apply,
    graph_memory_estimate,
    resolve_cuda_graph_max_bs,
)
from engine.model_executor.forward_batch_info import ForwardBatch, ModelWorkerBatch, PromptLogprobPlan
from engine.model_executor.host_transfer import DeviceToHost
from engine.model_executor.lora_manager import LoRAManager
from engine.model_executor.prompt_logprobs import PromptLogprobsOut, score_prompt
from engine.model_executor.runner_weights import RunnerWeights
from engine.models.llama import MODEL_CLASSES, LlamaForCausalLM
from engine.models.loader import ModelSource, resolve_model
from engine.sampling import Sampler, SamplerOutput
from engine.server_args import ServerArgs, default_mem_fraction
from engine.speculative.verify import verify_batch

log = logging.getLogger(__name__)


@dataclass
class GenerationBatchResult:
    next_token_ids: torch.Tensor  # [B] int64, on the model's device
    sampler_output: SamplerOutput
    logits: torch.Tensor | None = None  # only when prompt logits were requested
    prompt_logprobs: PromptLogprobsOut | None = None  # the batch's PromptLogprobPlan, scored
    # Embedding requests: the final hidden states of the batch's embed_rows ([R, hidden] float32,
    # after the last norm) and the rows per request (the batch's embed_counts)
    embed_hidden: tuple[torch.Tensor, list[int]] | None = None
    # CUDA: next_token_ids on their way to pinned host memory (non-blocking copy + event).
    next_token_ids_host: DeviceToHost | None = None
    # TARGET_VERIFY: drafts accepted per request; next_token_ids is then each one's next token
    # after them (engine/speculative/verify.py)
    accept_lens: list[int] | None = None

    _host_ids: list[int] | None = field(default=None, repr=False)  # next_token_ids_list, once read

    def next_token_ids_list(self) -> list[int]:
        """The sampled ids on the host, read once (the scheduler and the flight recorder both
        want them). On CUDA this waits for this step's copy event only, never for the whole
        device (the next step may already be running)."""
        if self._host_ids is None:
            ids = self.next_token_ids_host.result() if self.next_token_ids_host is not None else self.next_token_ids
            self._host_ids = ids.tolist()
        return self._host_ids


class ModelRunner(RunnerWeights):
    """`tp`: this process's place in a tensor-parallel group (engine/distributed/); rank 0 is the
    runner the scheduler drives, ranks 1..N-1 run `run_worker_step` for each of its forwards.
    Under tensor parallelism the int4 path and the decode CUDA graphs are off (neither is
    sharded yet: the projections run dense, decode eagerly)."""

    def __init__(self, args: ServerArgs, source: ModelSource | None = None, tp: TPGroup | None = None) -> None:
        self.args = args
        args.verify()
        self.tp = tp if tp is not None else TPGroup.single()
        self.device = args.resolved_device()
        self.dtype = args.resolved_dtype()
        # Checked before anything is loaded: an unusable option is a typed error at start-up.
        check_attention_backend(args.attention_backend, self.device)
        self.cuda_graph_max_bs = resolve_cuda_graph_max_bs(args.cuda_graph_max_bs, args.max_running_requests)
        deterministic = args.enable_deterministic_inference
        q4_max_tokens = args.resolved_q4_max_tokens() if self.tp.size == 1 and not deterministic else 0
        self.source = source or resolve_model(args.model_path)
        self.model_config = cfg = ModelConfig.from_hf(
            self.source.hf_config, self.source.architecture, self.source.generation_eos
        )
        self.context_len = args.check_context_length(cfg.context_len)
        LoRAManager.check_model(args, cfg)
        if deterministic and cfg.moe_layers:  # an expert's GEMM rows depend on the batch's routing
            raise InvalidServerArgsError(
                "enable_deterministic_inference is not supported on mixture-of-experts models yet",
                "enable_deterministic_inference",
            )
        self.attn_backend_name = resolve_attention_backend(
            args.attention_backend, self.device, self.dtype, cfg.head_dim
        )
        # A windowed or soft-capped model's attention partly runs in torch ops that re-plan per
        # forward (attention_window.py): no graph can capture that. Nor a MoE layer's loop over the
        # experts that have tokens (engine/layers/moe.py reads the group sizes on the host).
        self.use_cuda_graph = (
            self.tp.size == 1
            and not (cfg.layer_windows or cfg.attn_logit_softcap is not None or cfg.moe_layers)
            and cuda_graphs_apply(self.device, self.attn_backend_name, args.disable_cuda_graph)
        )
        # Hybrid SWA memory (engine/cache/swa_pool.py): the local layers' KV in a pool of its own.
        self.swa_memory = bool(cfg.layer_windows) and not args.disable_hybrid_swa_memory
        self.q4_requested, (self.model, self.q4_max_tokens) = q4_max_tokens, self._load_model(q4_max_tokens)
        self.shard = shard = self.model.shard
        self.lora = LoRAManager.build(args, cfg, self.device, self.dtype, shard)  # None: LoRA off
        self._init_memory()
        if self.tp.size > 1 and self.tp.is_driver:  # the other ranks replay its table writes
            self.req_to_token_pool.record_writes()
        layout = HeadLayout(shard.num_heads, shard.num_kv_heads, cfg.head_dim, cfg.softmax_scale)
        # Cascade planning is host work on the slot table: CPU pools only (no device round trip).
        # Deterministic inference: a request's attention must not depend on which others share its prefix.
        cascade = not args.disable_cascade_attention and self.device.type == "cpu" and not deterministic
        windows = cfg.layer_windows or (0,) * cfg.num_layers
        self.attn_backend = create_attention_backend(
            self.attn_backend_name, layout, cascade, windows, cfg.attn_logit_softcap, self.swa_memory
        )
        log.info("attention backend: %s", self.attn_backend_name)
        self._init_fused_decode()
        self.sampler = Sampler()
        self.weight_update_groups = {}  # trainers' groups by name (runner_weights.py)
        # CPU, default threads: a forward of a few tokens may leave one core to the event loop
        # (`StepThreads`, measured per model); a user's explicit `torch_threads` is kept for every forward, and a
        # worker rank has no event loop to make room for.
        adapt = self.device.type == "cpu" and args.torch_threads is None and self.tp.is_driver
        self.step_threads: StepThreads | None = None
        if adapt:
            experts = [m for m in self.model.modules() if isinstance(m, FusedMoE)]  # a step reads the routed ones
            run, key = one_row_pass(self.model, self.dtype, experts)
            gil_free = self.model.fused_decode is not None  # else the event loop waits on the GIL anyway
            every_core = measure_small_step_threads(run, torch.get_num_threads(), key, gil_free)
            self.step_threads = StepThreads(pin_extend=deterministic, every_core_tokens=every_core)
        self.last_token_ids = torch.zeros(args.max_running_requests, dtype=torch.int64, device=self.device)
        # Last: the graphs bake in the addresses of the KV pool, the request table and the buffers above.
        self.graph_runner: DecodeGraphRunner | None = self._init_cuda_graphs()
        # Every rank's placement, weights and KV pool, known on every rank (start-up logs, state).
        self.tp_ranks: list[dict[str, object]] = self.tp.all_gather_object(self.rank_info())
        if self.tp.size > 1 and self.tp.is_driver:
            for info in self.tp_ranks:
                log.info("tensor-parallel %s", ", ".join(f"{k}={v}" for k, v in info.items()))

    def _init_fused_decode(self) -> None:
        if not self.args.disable_fused_decode and self.attn_backend_name == "cpu":
            lora = self.lora.pool if self.lora is not None else None
            self.model.fused_decode = FusedDecodeLayers.build(self.model, self.kv_cache, lora)
            if self.model.fused_decode is not None:
                log.info("fused C++ decode layers for any row count")

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights in the forms the forward reads: parameters, buffers and
        the prepacked oneDNN / int4 forms the linears hold as plain attributes (each tensor once:
        a tied LM head is the embedding)."""
        tensors: dict[int, torch.Tensor] = {}

        def collect(v: object) -> None:  # a weight form may nest (TiledQ4Weight holds a Q4Packed)
            if isinstance(v, torch.Tensor):
                tensors[id(v)] = v
            elif dataclasses.is_dataclass(v) and not isinstance(v, type):
                for f in dataclasses.fields(v):
                    collect(getattr(v, f.name))
            elif isinstance(v, (list, tuple)):  # QuantParts' forms
                for item in v:
                    collect(item)

        for module in self.model.modules():
            for v in [*module.parameters(recurse=False), *module.buffers(recurse=False), *vars(module).values()]:
                collect(v)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def rank_info(self) -> dict[str, object]:
        """This rank's placement and memory, as start-up reports it."""
        return {
            "rank": self.tp.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device": str(self.device),
            "weight_bytes": self.weight_bytes(),
            "kv_pool_tokens": self.token_to_kv_pool_allocator.size,
            "kv_bytes": self.kv_cache.nbytes,
            "kv_heads": self.shard.num_kv_heads,
        }

    def _load_model(self, q4_max_tokens: int | None, source: ModelSource | None = None) -> tuple[LlamaForCausalLM, int]:
        """Build the model for this device and dtype, load it, and give each projection its form.

        `q4_max_tokens`: 0 = no int4 path, None = measure the crossover, n = up to n rows.
        Returns the model and the int4 path's row bound in force (0: off).
        """
        cfg, source = self.model_config, source or self.source
        model = MODEL_CLASSES[cfg.architecture](cfg, source.hf_config, self.device, self.dtype, self.tp).eval()
        # deterministic inference runs no row-bounded quantized path (q4_max_tokens 0), but decode-
        # like forwards take the block forms at every row count where their loops are batch-
        # invariant (linear.RowTiles.decode_blocks) unless the user turned the quantized path off
        invariant_blocks = (
            self.args.enable_deterministic_inference
            and self.args.resolved_q4_max_tokens() != 0
            and self.tp.size == 1
            and RowTiles.for_weights(self.dtype, self.device).decode_blocks
        )
        want_q4 = (q4_max_tokens != 0 or invariant_blocks) and int4_kernel_available(self.dtype)
        cpu_quant.set_int8_activations(want_q4 and self.args.q4_int8_activations and not invariant_blocks)
        quant = WeightOnlyQuant.parse(self.args.torchao_config)  # verified by ServerArgs
        if quant is not None and source.gguf_file is not None:
            raise InvalidServerArgsError(
                "torchao_config applies to Hugging Face checkpoints; a GGUF is quantized already", "torchao_config"
            )
        try:
            if want_q4:  # the dense weights plus, for 4-bit GGUF layers (or --torchao-config), their blocks
                q4 = model.load_weights(source.iter_weights_q4(), quant)
            else:  # under tensor parallelism, this rank's slice of each weight only
                select = model.shard.weight_slice if self.tp.size > 1 else None
                q4 = model.load_weights(((name, t, None) for name, t in source.iter_weights(select)), quant)
        except ModelLoadError:
            raise
        except Exception as e:  # a weight file that breaks in an unforeseen way still gets named
            raise ModelLoadError(f"failed to load weights from {source.path}: {e}") from e
        # Measured with this (loading) thread's torch thread count, torch's default: what the forward
        # uses unless `torch_threads` says otherwise. Not set here on purpose: calling
        # torch.set_num_threads on a second thread slowed every later forward on the device
        # stream's thread by ~1.5x (bf16 decode at batch 64: 52 -> 77 ms, bench.offline W2).
        q4_rows = model.process_weights_after_loading(q4, q4_max_tokens, self.args.enable_deterministic_inference)
        head = model.lm_head
        if self.args.speculative_algorithm is not None and isinstance(head, QuantLinear) and head.max_rows > 0:
            # a verify forward's rows take the decode's head: the same logits with and without
            # speculation (Q8_0 at 5 rows is on par with dense: 1.9 vs 2.0 ms on one core)
            head.max_rows = max(head.max_rows, self.args.resolved_max_verify_tokens())
        if q4:
            layers = sum(name != "lm_head" for name in q4)
            head_blocks = q4.get("lm_head")
            head_form = "dense" if head_blocks is None else "Q8_0"
            if getattr(head_blocks, "supers", None) is not None:
                head_form = "Q6_K"
            packed = f"{layers} of {4 * cfg.num_layers} layer weights packed, LM head {head_form}"
            if invariant_blocks:
                log.info("quantized kernels for decode-like forwards of any size (deterministic): %s", packed)
            else:
                how = "measured" if q4_max_tokens is None else "set"
                log.info("quantized kernels for inputs of %s rows (%s): %s", bound_text(q4_rows), how, packed)
        if model.fused:
            log.info("fused C++ RMSNorm / SiLU-and-mul / rotary on")
        return model, q4_rows

    def _init_memory(self) -> None:
        cfg, args = self.model_config, self.args
        kv_heads = self.shard.num_kv_heads  # this rank's (all of them at tp size 1)
        per_token = KVCache.bytes_per_token(cfg.num_layers, kv_heads, cfg.head_dim, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # free memory = after the weights, not counting cached blocks
            # The pool is sized before the decode graphs are captured (they bake in its address, so
            # it cannot be resized after), leaving their estimated memory out of the budget.
            free_bytes = max(torch.cuda.mem_get_info(self.device)[0] - self._graph_memory_reserve(), 0)
        else:
            # The tensor-parallel ranks on this host share its memory: each budgets its part.
            free_bytes = psutil.virtual_memory().available // self.tp.local_size
        mem_fraction = args.mem_fraction_static
        if mem_fraction is None:
            mem_fraction = default_mem_fraction(self.device.type)
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests, self.context_len + 1, self.device)
        if self.swa_memory:  # the local layers' KV in a pool of its own
            self.token_to_kv_pool_allocator, self.kv_cache = build_hybrid_memory(
                args, cfg, kv_heads, self.dtype, self.device, int(free_bytes * mem_fraction), self.req_to_token_pool,
                lambda n: min(self.tp.all_gather_object(n)),
            )  # fmt: skip
            return
        size = kv_pool_size_from_budget(args.max_total_tokens, mem_fraction, per_token, args.page_size, free_bytes)
        # Slots are allocated on rank 0 and name the same slot on every rank: one size for all.
        size = min(self.tp.all_gather_object(size))
        args.check_pool(size - args.page_size, self.context_len)  # usable slots; before the buffers exist
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(size, args.page_size, self.device)
        self.kv_cache = KVCache(size, cfg.num_layers, kv_heads, cfg.head_dim, self.dtype, self.device)
        log.info("KV pool: %d tokens (%.1f MiB)", self.token_to_kv_pool_allocator.size, size * per_token / 2**20)

    def _graph_memory_reserve(self) -> int:
        """Bytes kept out of the KV pool budget for the decode graphs (0 when none are captured)."""
        if not self.use_cuda_graph:
            return 0
        cfg, bs = self.model_config, self.cuda_graph_max_bs
        return graph_memory_estimate(
            bs,
            len(capture_batch_sizes(bs)),
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.vocab_size,
            torch.empty((), dtype=self.dtype).element_size(),
        )

    def _init_cuda_graphs(self) -> DecodeGraphRunner | None:
        """Capture the decode graphs (CUDA + triton backend + not disabled), after the KV pool exists."""
        if not self.use_cuda_graph:
            return None
        runner = DecodeGraphRunner(
            self.model,
            self.attn_backend,
            self.req_to_token_pool,
            self.kv_cache,
            self.model_config.vocab_size,
            self.cuda_graph_max_bs,
            self.device,
        )
        before = torch.cuda.mem_get_info(self.device)[0]
        runner.capture()
        used = before - torch.cuda.mem_get_info(self.device)[0]
        reserved = self._graph_memory_reserve()
        log.info("decode CUDA graphs: %.1f MiB used (reserved %.1f MiB)", used / 2**20, reserved / 2**20)
        return runner

    def init_forward_batch(self, batch: ModelWorkerBatch) -> ForwardBatch:
        """`batch` on the device (`ForwardBatch.init_new`), before any attention metadata."""
        fb = ForwardBatch.init_new(batch, self.req_to_token_pool, self.kv_cache, self.attn_backend, self.last_token_ids)
        if self.lora is not None:
            fb.lora = self.lora.batch_info(batch)
        return fb

    def _run_forward(self, batch: ModelWorkerBatch, sampled: bool) -> tuple[torch.Tensor, bool, ForwardBatch]:
        """(logits, whether they are a view of the graph runner's static buffer, overwritten by the
        next replay, the ForwardBatch). Decode batches that fit replay a CUDA graph; everything
        else runs eagerly. Under tensor parallelism the other ranks get the step first."""
        self.apply_lora_changes()  # the slots as the scheduler left them, on every rank
        if self.tp.size > 1:
            self.tp.broadcast_bytes(encode(TPStep.of(batch, self.req_to_token_pool.take_writes(), sampled)))
        fb = self.init_forward_batch(batch)
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb), True, fb
        self.attn_backend.init_forward_metadata(fb)
        logits = self.model(fb)
        assert logits is not None  # rank 0 always gets the gathered logits
        return logits, False, fb

    # ---- multi-LoRA (lora_manager.py): calls every rank makes, rank 0 first -----------------------

    def load_lora_adapter(self, name: str, path: str) -> int:
        """On the device stream: register the PEFT adapter at `path` as `name` (every rank reads
        it); its radix cache key."""
        if self.lora is None:
            raise InvalidRequestError("LoRA is not enabled on this engine (enable_lora)", "lora_name")
        self._tell_ranks("load_lora_adapter", name=name, path=path)
        return self.lora.load_adapter(name, path)

    def apply_lora_changes(
        self, slots: list[tuple[int, str | None]] | None = None, forgotten: list[str] | None = None
    ) -> None:
        """On the device stream: the LoRA slot writes and clears the scheduler decided since the
        last call. Rank 0 applies its own and has the other ranks replay them (`slots`, `forgotten`)."""
        if self.lora is None:
            return
        if not self.tp.is_driver:
            self.lora.apply_changes(slots or [], forgotten or [])
            return
        changes = self.lora.apply_pending()
        if changes:
            self._tell_ranks("apply_lora_changes", slots=changes.slots, forgotten=changes.forgotten)

    def forward(self, batch: ModelWorkerBatch) -> torch.Tensor:
        """float32 logits of one forward, in a tensor of their own (safe to keep across steps)."""
        logits, shared, _ = self._run_forward(batch, sampled=False)
        return _owned_float(logits, shared)

    @torch.inference_mode()
    def run_worker_step(self, step: TPStep) -> None:
        """Ranks 1..N-1: rank 0's forward `step` on this shard (engine/distributed/worker.py)."""
        self.req_to_token_pool.apply_writes(step.writes)
        fb = self.init_forward_batch(step.worker_batch())
        self.attn_backend.init_forward_metadata(fb)
        self.model(fb)
        if step.prompt_logprob_rows:  # rank 0 scores these: the LM head's gathers need every rank
            plan = PromptLogprobPlan(step.prompt_logprob_rows, [0] * len(step.prompt_logprob_rows), [])
            assert fb.prompt_hidden is not None
            score_prompt(self.model, fb.prompt_hidden, plan)
        if step.sampled:  # rank 0's sampled ids: an overlapped decode reads its inputs from them
            ids = self.tp.broadcast_ids(torch.empty(fb.batch_size, dtype=torch.int64, device=self.device))
            self.last_token_ids[fb.req_pool_indices] = ids

    @torch.inference_mode()
    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        if self.step_threads is not None:
            mode = batch.forward_mode
            self.step_threads.before(len(batch.out_cache_loc), mode.is_extend() and not mode.is_verify())
        logits, shared, fb = self._run_forward(batch, sampled=True)
        prompt_lps = None
        if batch.prompt_logprobs is not None:  # before the ids' broadcast: the worker ranks' order
            assert fb.prompt_hidden is not None
            prompt_lps = score_prompt(self.model, fb.prompt_hidden, batch.prompt_logprobs)
        verify = batch.forward_mode.is_verify()
        last_logits = logits
        if (
            (batch.return_prompt_logits or verify)
            and fb.extend_start_loc is not None
            and fb.extend_seq_lens is not None
        ):
            last_logits = logits[fb.extend_start_loc + fb.extend_seq_lens - 1]
        out = self.sampler(last_logits, batch.sampling_info)
        next_ids, accepted = out.next_token_ids, None
        if verify:  # the drafts checked (engine/speculative/verify.py); requests without keep the sampler's pick
            assert batch.input_ids is not None
            assert batch.sampling_info is not None
            ids, accepted = verify_batch(
                logits, batch.input_ids.tolist(), batch.extend_seq_lens, next_ids.tolist(), batch.sampling_info
            )
            next_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        if self.tp.size > 1:
            self.tp.broadcast_ids(next_ids)
        self.last_token_ids[fb.req_pool_indices] = next_ids
        kept = None
        if batch.return_prompt_logits:
            kept = _owned_float(logits, shared)
        return GenerationBatchResult(
            next_ids,
            out,
            kept,
            prompt_lps,
            (fb.embed_hidden, batch.embed_counts) if fb.embed_hidden is not None else None,
            DeviceToHost.start(next_ids),
            accept_lens=accepted,
        )


def _owned_float(logits: torch.Tensor, shared: bool) -> torch.Tensor:
    """`logits` as float32 in a tensor of their own (a graph runner's buffer is `shared`)."""
    if logits.dtype != torch.float32:
        return logits.float()
    return logits.clone() if shared else logits
