"""ModelRunner: owns the model, the KV memory and the sampler; runs one forward at a time.

It is the only code that touches model tensors. The scheduler hands it `ModelWorkerBatch`es;
it builds the `ForwardBatch`, runs the model, samples, and records each request's sampled id in
`last_token_ids[req_pool_idx]` so a decode batch planned before the previous results were read
(overlap scheduling) can gather its inputs on the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from engine.cache.memory_pool import KVCache, ReqToTokenPool, TokenToKVPoolAllocator, kv_pool_size_from_budget
from engine.errors import ModelLoadError
from engine.forward_batch import ForwardBatch
from engine.layers.attention_torch import TorchAttnBackend
from engine.model_config import ModelConfig
from engine.models.llama import MODEL_CLASSES
from engine.models.loader import ModelSource, resolve_model
from engine.sampling import Sampler, SamplerOutput
from engine.schedule_batch import ModelWorkerBatch
from engine.server_args import ServerArgs

log = logging.getLogger(__name__)


@dataclass
class GenerationBatchResult:
    next_token_ids: torch.Tensor  # [B] int64
    sampler_output: SamplerOutput
    logits: torch.Tensor | None = None  # only when prompt logits were requested


class ModelRunner:
    def __init__(self, args: ServerArgs, source: ModelSource | None = None) -> None:
        self.args = args
        self.device = args.resolved_device()
        self.dtype = args.resolved_dtype()
        self.source = source or resolve_model(args.model_path)
        self.model_config = cfg = ModelConfig.from_hf(self.source.hf_config, self.source.architecture)
        self.context_len = args.context_length or cfg.context_len
        self.model = self._load_model()
        self._init_memory()
        self.attn_backend = TorchAttnBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
        self.sampler = Sampler()
        self.last_token_ids = torch.zeros(args.max_running_requests, dtype=torch.int64, device=self.device)

    def _load_model(self):
        cfg = self.model_config
        model = MODEL_CLASSES[cfg.architecture](cfg, self.source.hf_config, self.device)
        try:
            model.load_weights(self.source.iter_weights())
        except ModelLoadError:
            raise
        except Exception as e:  # a weight file that breaks in an unforeseen way still gets named
            raise ModelLoadError(f"failed to load weights from {self.source.path}: {e}") from e
        return model.to(device=self.device, dtype=self.dtype).eval()

    def _init_memory(self) -> None:
        cfg, args = self.model_config, self.args
        per_token = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        if self.device.type == "cuda":
            free_bytes = torch.cuda.mem_get_info(self.device)[0]
        else:
            free_bytes = psutil.virtual_memory().available
        mem_fraction = args.mem_fraction_static if args.mem_fraction_static is not None else 0.1
        size = kv_pool_size_from_budget(args.max_total_tokens, mem_fraction, per_token, args.page_size, free_bytes)
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests, self.context_len + 1, self.device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(size, args.page_size, self.device)
        self.kv_cache = KVCache(size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        log.info("KV pool: %d tokens (%.1f MiB)", self.token_to_kv_pool_allocator.size, size * per_token / 2**20)

    def forward(self, batch: ModelWorkerBatch) -> torch.Tensor:
        input_ids = batch.input_ids
        if input_ids is None:  # decode under overlap: last sampled ids, gathered on the device
            input_ids = self.last_token_ids[batch.req_pool_indices.to(self.device)]
        fb = ForwardBatch.init_new(batch, input_ids, self.req_to_token_pool, self.kv_cache, self.attn_backend)
        return self.model(fb)

    @torch.inference_mode()
    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        logits = self.forward(batch)
        last_logits = logits
        if batch.return_prompt_logits and batch.forward_mode.is_extend():
            last = torch.tensor(batch.extend_seq_lens, device=logits.device).cumsum(0) - 1
            last_logits = logits[last]
        out = self.sampler(last_logits, batch.sampling_info)
        self.last_token_ids[batch.req_pool_indices.to(self.device)] = out.next_token_ids
        return GenerationBatchResult(out.next_token_ids, out, logits if batch.return_prompt_logits else None)
