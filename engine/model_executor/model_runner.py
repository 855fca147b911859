"""ModelRunner: owns the model, the KV memory and the sampler; runs one forward at a time.

It is the only code that touches model tensors. The scheduler hands it `ModelWorkerBatch`es;
it builds the `ForwardBatch`, runs the model, samples, and records each request's sampled id in
`last_token_ids[req_pool_idx]` so a decode batch planned before the previous results were read
(overlap scheduling) can gather its inputs on the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import psutil
import torch

from engine.cache.memory_pool import KVCache, ReqToTokenPool, TokenToKVPoolAllocator, kv_pool_size_from_budget
from engine.errors import ModelLoadError
from engine.model_executor.cuda_graph_runner import (
    DecodeGraphRunner, capture_batch_sizes, cuda_graphs_apply, graph_memory_estimate, resolve_cuda_graph_max_bs,
)  # fmt: skip
from engine.model_executor.forward_batch_info import ForwardBatch
from engine.model_executor.host_transfer import DeviceToHost, host_to_device
from engine.layers.attention_backend import create_attention_backend, resolve_attention_backend
from engine.model_config import ModelConfig
from engine.models.llama import MODEL_CLASSES
from engine.models.loader import ModelSource, resolve_model
from engine.sampling import Sampler, SamplerOutput
from engine.model_executor.forward_batch_info import ModelWorkerBatch
from engine.server_args import ServerArgs

log = logging.getLogger(__name__)


@dataclass
class GenerationBatchResult:
    next_token_ids: torch.Tensor  # [B] int64, on the model's device
    sampler_output: SamplerOutput
    logits: torch.Tensor | None = None  # only when prompt logits were requested
    # CUDA: next_token_ids on their way to pinned host memory (non-blocking copy + event).
    next_token_ids_host: DeviceToHost | None = None

    def next_token_ids_list(self) -> list[int]:
        """The sampled ids on the host. On CUDA this waits for this step's copy event only, never
        for the whole device (the next step may already be running)."""
        if self.next_token_ids_host is not None:
            return self.next_token_ids_host.result().tolist()
        return self.next_token_ids.tolist()


class ModelRunner:
    def __init__(self, args: ServerArgs, source: ModelSource | None = None) -> None:
        self.args = args
        self.device = args.resolved_device()
        self.dtype = args.resolved_dtype()
        # Checked before anything is loaded: an unusable backend is a typed error at start-up.
        self.attn_backend_name = resolve_attention_backend(args.attention_backend, self.device)
        self.use_cuda_graph = cuda_graphs_apply(self.device, self.attn_backend_name, args.disable_cuda_graph)
        self.cuda_graph_max_bs = resolve_cuda_graph_max_bs(args.cuda_graph_max_bs, args.max_running_requests)
        self.source = source or resolve_model(args.model_path)
        self.model_config = cfg = ModelConfig.from_hf(self.source.hf_config, self.source.architecture, self.source.generation_eos)
        self.context_len = args.context_length or cfg.context_len
        self.model = self._load_model()
        self._init_memory()
        self.attn_backend = create_attention_backend(
            self.attn_backend_name, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5,
            cascade=not args.disable_cascade_attention,
        )
        self.attn_backend.prepare(self.device)
        self.sampler = Sampler()
        self.last_token_ids = torch.zeros(args.max_running_requests, dtype=torch.int64, device=self.device)
        # Last: the graphs bake in the addresses of the KV pool, the request table and the buffers above.
        self.graph_runner: DecodeGraphRunner | None = self._init_cuda_graphs()

    def _load_model(self):
        cfg = self.model_config
        model = MODEL_CLASSES[cfg.architecture](cfg, self.source.hf_config, self.device)
        q4_rows = self.args.resolved_q4_max_tokens()
        try:
            if q4_rows > 0:  # the dense weights plus, for 4-bit GGUF layers, their packed form
                model.load_weights(self.source.iter_weights_q4(), q4_max_rows=q4_rows)
            else:
                model.load_weights(self.source.iter_weights())
        except ModelLoadError:
            raise
        except Exception as e:  # a weight file that breaks in an unforeseen way still gets named
            raise ModelLoadError(f"failed to load weights from {self.source.path}: {e}") from e
        if q4_rows > 0:
            n_packed = sum(getattr(layer, f"{a}_q4") is not None for layer in model.layers
                           for a in ("qkv", "o", "gate_up", "down"))  # fmt: skip
            log.info("int4 kernel for inputs of <= %d rows: %d of %d layer weights packed", q4_rows, n_packed,
                     4 * len(model.layers))  # fmt: skip
        # .to() leaves the packed weights alone: they are plain attributes, uint8 codes and bf16 scales.
        model = model.to(device=self.device, dtype=self.dtype).eval()
        if n := model.prepack_onednn():
            log.info("oneDNN: %d dense weights prepacked", n)
        if model.use_fused_cpu_ops():
            log.info("fused C++ RMSNorm / SiLU-and-mul / rotary on")
        return model

    def _init_memory(self) -> None:
        cfg, args = self.model_config, self.args
        per_token = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # free memory = after the weights, not counting cached blocks
            # The pool is sized before the decode graphs are captured (they bake in its address, so
            # it cannot be resized after), leaving their estimated memory out of the budget.
            free_bytes = max(torch.cuda.mem_get_info(self.device)[0] - self._graph_memory_reserve(), 0)
        else:
            free_bytes = psutil.virtual_memory().available
        mem_fraction = args.mem_fraction_static if args.mem_fraction_static is not None else 0.1
        size = kv_pool_size_from_budget(args.max_total_tokens, mem_fraction, per_token, args.page_size, free_bytes)
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests, self.context_len + 1, self.device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(size, args.page_size, self.device)
        self.kv_cache = KVCache(size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        log.info("KV pool: %d tokens (%.1f MiB)", self.token_to_kv_pool_allocator.size, size * per_token / 2**20)

    def _graph_memory_reserve(self) -> int:
        """Bytes kept out of the KV pool budget for the decode graphs (0 when none are captured)."""
        if not self.use_cuda_graph:
            return 0
        cfg, bs = self.model_config, self.cuda_graph_max_bs
        return graph_memory_estimate(
            bs, len(capture_batch_sizes(bs)), cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim, cfg.vocab_size, torch.empty((), dtype=self.dtype).element_size(),
        )  # fmt: skip

    def _init_cuda_graphs(self) -> DecodeGraphRunner | None:
        """Capture the decode graphs (CUDA + triton backend + not disabled), after the KV pool exists."""
        if not self.use_cuda_graph:
            return None
        runner = DecodeGraphRunner(self.model, self.attn_backend, self.req_to_token_pool, self.kv_cache,
                                   self.model_config.vocab_size, self.cuda_graph_max_bs, self.device)  # fmt: skip
        before = torch.cuda.mem_get_info(self.device)[0]
        runner.capture()
        used = before - torch.cuda.mem_get_info(self.device)[0]
        log.info("decode CUDA graphs: %.1f MiB used (reserved %.1f MiB)", used / 2**20,
                 self._graph_memory_reserve() / 2**20)  # fmt: skip
        return runner

    def _inputs_to_device(self, batch: ModelWorkerBatch) -> ModelWorkerBatch:
        """The batch with its host-built index tensors on the device, in one pinned non-blocking
        copy per dtype on CUDA (engine/host_transfer.py); unchanged on CPU."""
        if self.device.type != "cuda":
            return batch
        ids, rows, lens, locs = host_to_device(
            [batch.input_ids, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc], self.device
        )
        return replace(batch, input_ids=ids, req_pool_indices=rows, seq_lens=lens, out_cache_loc=locs)

    def _run_forward(self, batch: ModelWorkerBatch) -> tuple[torch.Tensor, bool]:
        """(logits, whether they are a view of the graph runner's static buffer, overwritten by the
        next replay). Decode batches that fit replay a CUDA graph; everything else runs eagerly."""
        batch = self._inputs_to_device(batch)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch, self.last_token_ids), True
        input_ids = batch.input_ids
        if input_ids is None:  # decode under overlap: last sampled ids, gathered on the device
            input_ids = self.last_token_ids[batch.req_pool_indices.to(self.device)]
        fb = ForwardBatch.init_new(batch, input_ids, self.req_to_token_pool, self.kv_cache, self.attn_backend)
        return self.model(fb), False

    def forward(self, batch: ModelWorkerBatch) -> torch.Tensor:
        """Logits of one forward, in a tensor of their own (safe to keep across steps)."""
        logits, shared = self._run_forward(batch)
        return logits.clone() if shared else logits

    @torch.inference_mode()
    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        batch = self._inputs_to_device(batch)
        logits, shared = self._run_forward(batch)
        last_logits = logits
        if batch.return_prompt_logits and batch.forward_mode.is_extend():
            last = torch.tensor(batch.extend_seq_lens, device=logits.device).cumsum(0) - 1
            last_logits = logits[last]
        out = self.sampler(last_logits, batch.sampling_info)
        self.last_token_ids[batch.req_pool_indices.to(self.device)] = out.next_token_ids
        kept = None
        if batch.return_prompt_logits:
            kept = logits.clone() if shared else logits
        return GenerationBatchResult(out.next_token_ids, out, kept, DeviceToHost.start(out.next_token_ids))
