"""Decode forwards replayed as CUDA graphs (SGLang's CudaGraphRunner, reduced to this engine).

Why: a decode step of a small model is a few hundred small kernels; launching them one by one
from Python costs more host time than the GPU needs to run them. A CUDA graph records the whole
forward once per batch size and replays it with one launch.

- Batch sizes (`capture_batch_sizes`): 1, 2, 4, 8, then every multiple of 8 up to `max_bs`
  (SGLang's default shape), plus `max_bs` itself so every batch up to it has a graph. A batch of n
  requests replays the graph of the smallest captured size >= n (`padded_batch_size`).
- Static inputs (`StaticDecodeInputs`): one `[5, max_bs]` int64 block (input ids, positions,
  request rows, sequence lengths, KV slots); the graph of size bs reads columns [:bs]. A real
  batch's ForwardBatch (already on the device: `ForwardBatch.init_new` did every host->device
  copy) is copied into [:n] on the device; columns [n:bs] get padding that cannot disturb real requests: token
  0 at position 0, request row 0 with sequence length 1 (it reads position 0 of that row, which
  always holds a valid slot id, and never writes the table), and KV slot 0, the pool's reserved
  padding slot, as the slot its K/V are stored to. Padding logits are sliced off.
- Outputs: every graph copies its logits into one `[max_bs, vocab]` fp32 buffer, so the graphs'
  temporaries all return to the shared memory pool instead of one logits tensor staying alive per
  captured size. `replay` returns a view of it, valid until the next replay.
- Sampling stays outside the graph: the sampler branches on per-batch host flags (greedy or not,
  penalties, top-k/p), which a graph cannot; on the graph's logits it costs a handful of kernels.
- Attention metadata must be graph-safe: `TritonAttnBackend.init_cuda_graph_state(max_bs)` gives
  decode fixed scratch buffers, so building its metadata inside the captured function is slicing
  only. The Triton decode kernel reads sequence lengths from the device, so nothing on the host
  depends on the batch's lengths.
- All graphs share one memory pool and are captured largest first, so smaller graphs reuse the
  largest one's memory (SGLang does the same).

Without CUDA the same code runs eagerly: `replay` copies into the static buffers and calls the
function a graph would have captured (`run_static`). That is how CPU tests check the buffers,
padding and slicing against the ordinary eager path. Every CUDA-only call is inside `capture`.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

import torch

from engine.cache.memory_pool import KVCache, ReqToTokenPool
from engine.errors import InvalidRequestError
from engine.layers.attention_triton import TritonAttnBackend
from engine.model_executor.forward_batch_info import AttentionBackend, ForwardBatch, ForwardMode

log = logging.getLogger(__name__)

DEFAULT_MAX_BS = 64
PAD_REQ_ROW = 0  # any row works: padding reads only its position 0, which always holds a valid slot
PAD_SLOT = 0  # the KV pool's reserved padding slot: padding K/V land here and nowhere else
_IDS, _POS, _ROWS, _LENS, _LOCS = range(5)  # rows of the static input block


def capture_batch_sizes(max_bs: int) -> list[int]:
    """[1, 2, 4, 8, 16, 24, ...] up to max_bs, ending with max_bs itself."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def padded_batch_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= n (sizes ascending), or None when n is 0 or too large."""
    if n < 1:
        return None
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def resolve_cuda_graph_max_bs(cuda_graph_max_bs: int | None, max_running_requests: int) -> int:
    """Largest captured batch: the option (default 64), never above max_running_requests
    (a decode batch can hold no more requests than there are request rows)."""
    want = DEFAULT_MAX_BS if cuda_graph_max_bs is None else cuda_graph_max_bs
    if not isinstance(want, int) or isinstance(want, bool) or want < 1:
        raise InvalidRequestError(f"cuda_graph_max_bs must be an int >= 1, got {want!r}", "cuda_graph_max_bs")
    return min(want, max_running_requests)


def cuda_graphs_apply(device: torch.device, attention_backend: str, disable_cuda_graph: bool) -> bool:
    """Whether a ModelRunner captures decode graphs: CUDA, the Triton backend, not disabled.

    The torch backend is excluded because its decode metadata reads sequence lengths on the host
    (padded gather width), which a graph would freeze at capture time.
    """
    return device.type == "cuda" and attention_backend == "triton" and not disable_cuda_graph


def graph_memory_estimate(
    max_bs: int,
    num_graphs: int,
    hidden: int,
    intermediate: int,
    q_size: int,
    kv_size: int,
    vocab: int,
    dtype_bytes: int,
) -> int:
    """Bytes to leave free for decode graphs when the KV pool is sized.

    The pool is sized before capture (graphs bake in the KV buffers' addresses, so the pool cannot
    be reallocated after), hence an estimate. Captured largest first into one shared pool, the
    graphs need about the largest batch's live temporaries: per token the residual stream and
    one layer's intermediates (qkv, attention output, gate|up and its product), plus the logits
    in the model dtype and in fp32, and the fp32 static logits buffer. Doubled for the caching
    allocator's rounding and fragmentation, plus ~2 MiB of driver memory per graph and a fixed
    256 MiB margin for cuBLAS workspaces and Triton's launch state.
    """
    per_token = dtype_bytes * (4 * hidden + 2 * (q_size + 2 * kv_size) + 3 * intermediate) + vocab * (dtype_bytes + 4)
    static_logits = max_bs * vocab * 4
    return 2 * max_bs * per_token + static_logits + num_graphs * (2 << 20) + (256 << 20)


class StaticDecodeInputs:
    """The fixed-address inputs every decode graph reads: a `[5, max_bs]` int64 block."""

    def __init__(self, max_bs: int, device: torch.device) -> None:
        self.max_bs = max_bs
        pad = torch.zeros((5, max_bs), dtype=torch.int64)
        pad[_ROWS].fill_(PAD_REQ_ROW)
        pad[_LENS].fill_(1)
        pad[_LOCS].fill_(PAD_SLOT)
        self.padding = pad.to(device)  # the padding values, copied into columns [n:bs]
        self.block = self.padding.clone()  # starts as all padding: valid to capture on
        b = self.block
        self.input_ids, self.positions, self.req_pool_indices = b[_IDS], b[_POS], b[_ROWS]
        self.seq_lens, self.out_cache_loc = b[_LENS], b[_LOCS]

    def load(self, fb: ForwardBatch, bs: int) -> None:
        """Columns [:n] <- the decode batch `fb` (tensors on the buffers' device), [n:bs] <- padding."""
        n = fb.batch_size
        if not 1 <= n <= bs <= self.max_bs:
            raise ValueError(f"cannot load {n} requests into a graph of {bs} (max {self.max_bs})")
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.req_pool_indices[:n].copy_(fb.req_pool_indices)
        self.seq_lens[:n].copy_(fb.seq_lens)
        self.out_cache_loc[:n].copy_(fb.out_cache_loc)
        if bs > n:
            self.block[:, n:bs].copy_(self.padding[:, n:bs])


class DecodeGraphRunner:
    """Decode forwards over static buffers; captured as CUDA graphs by `capture()` (CUDA only)."""

    def __init__(
        self,
        model: Callable[[ForwardBatch], torch.Tensor],
        attn_backend: AttentionBackend,
        req_to_token_pool: ReqToTokenPool,
        kv_cache: KVCache,
        vocab_size: int,
        max_bs: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.req_to_token_pool = req_to_token_pool
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.max_bs = max_bs
        self.sizes = capture_batch_sizes(max_bs)
        self.inputs = StaticDecodeInputs(max_bs, self.device)
        self.logits = torch.zeros((max_bs, vocab_size), dtype=torch.float32, device=self.device)
        if isinstance(attn_backend, TritonAttnBackend):  # fixed decode scratch (other backends: eager CPU tests)
            attn_backend.init_cuda_graph_state(max_bs, self.device)
        self.graphs: dict[int, object] = {}  # bs -> torch.cuda.CUDAGraph, filled by capture()

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def can_run(self, fb: ForwardBatch) -> bool:
        """A decode batch that fits the largest captured size, without LoRA rows (the graphs
        were captured without the adapters' deltas)."""
        return fb.forward_mode.is_decode() and 1 <= fb.batch_size <= self.max_bs and fb.lora is None

    def run_static(self, bs: int, seq_lens_cpu: list[int]) -> None:
        """What a graph captures: metadata + model forward over columns [:bs]; logits -> self.logits[:bs].

        `seq_lens_cpu` only serves backends that read lengths on the host (the torch backend, in
        eager replays on CPU); under capture it is all ones and the Triton backend ignores it.
        """
        s = self.inputs
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=s.input_ids[:bs],
            positions=s.positions[:bs],
            req_pool_indices=s.req_pool_indices[:bs],
            seq_lens=s.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=s.out_cache_loc[:bs],
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_cache,
            attn_backend=self.attn_backend,
        )
        self.attn_backend.init_forward_metadata(fb)
        self.logits[:bs].copy_(self.model(fb))

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [n, V] of a decode batch of n requests (a view, valid until the next replay)."""
        n = fb.batch_size
        bs = padded_batch_size(n, self.sizes)
        if bs is None or not fb.forward_mode.is_decode():
            raise ValueError(f"DecodeGraphRunner cannot run a {fb.forward_mode.name} batch of {n}")
        self.inputs.load(fb, bs)
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()  # type: ignore[attr-defined]
        else:  # not captured (CPU, tests): the same function, run eagerly
            self.run_static(bs, list(fb.seq_lens_cpu) + [1] * (bs - n))
        return self.logits[:n]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first, into one shared memory pool (CUDA only).

        Each size is first run twice eagerly on the capture stream: that compiles the Triton
        kernels and sets up cuBLAS state, neither of which may happen during capture. Capture
        and warm-up run on all-padding inputs, so they only ever write KV slot 0.
        """
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device; without one DecodeGraphRunner replays eagerly")
        self.inputs.block.copy_(self.inputs.padding)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for bs in reversed(self.sizes):
            ones = [1] * bs
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.run_static(bs, ones)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.run_static(bs, ones)
            self.graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), self.sizes)
