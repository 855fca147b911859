"""Which part of each weight a tensor-parallel rank holds (Megatron's split, as SGLang does it).

- Column-parallel (split the output rows): q/k/v and gate/up. Rank r holds query heads
  `[r*H/N, (r+1)*H/N)` and the KV heads they read: `KVH/N` of them when `N` divides `KVH`, else
  (fewer KV heads than ranks) one KV head replicated on `N/KVH` ranks.
- Row-parallel (split the input columns): o and down. Each rank's partial products are summed by
  an all-reduce; a bias is added once (rank 0 loads it, the others hold zeros).
- Vocab-parallel: the embedding and the LM head hold `ceil(V/N)` vocabulary rows each (the last
  shard padded with zero rows); the lookup is masked and all-reduced, the logits gathered.
- Mixture of experts: each expert's gate/up rows and down columns are split as the MLP's (every
  rank holds its slice of every expert); the router is replicated. With expert parallelism
  (`ep_size`, SGLang's layout) the ranks form `ep_size` sets of `size / ep_size` consecutive
  ranks; set k holds experts `[k*E/ep, (k+1)*E/ep)`, each sliced over the set's ranks as above,
  and reads no tensor of another set's experts. Either way every rank's partial output is summed
  by the layer's all-reduce.
- Everything else (norms, q/k norms) is replicated.

`weight_slice` tells the loader which slice of a checkpoint tensor to read, so a rank reads its
shard only (safetensors `get_slice`) instead of loading every weight and cutting it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import InvalidServerArgsError
from engine.model_config import ModelConfig

# (dim, start, stop): read `tensor.narrow(dim, start, stop - start)` of a checkpoint tensor
Slice = tuple[int, int, int]

_COLUMN_Q = ("self_attn.q_proj",)
_COLUMN_KV = ("self_attn.k_proj", "self_attn.v_proj")
_COLUMN_MLP = ("mlp.gate_proj", "mlp.up_proj")
_ROW_ATTN = "self_attn.o_proj"
_ROW_MLP = "mlp.down_proj"
# an expert's projection inside a layer, as Qwen3-MoE and Mixtral checkpoints name them
# (`mlp.experts.<e>.gate_proj`, `block_sparse_moe.experts.<e>.w1`): module -> column (True) or row
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|w1|w3|down_proj|w2)")
_EXPERT_COLUMN = ("gate_proj", "up_proj", "w1", "w3")
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")  # checkpoint names split by vocabulary row


def check_tp_size(cfg: ModelConfig, size: int, ep_size: int = 1) -> None:
    """Raise InvalidServerArgsError unless the model splits evenly over `size` ranks (its experts
    over `ep_size` sets of them)."""
    if ep_size > 1 and not cfg.num_experts:
        raise InvalidServerArgsError(f"ep_size {ep_size} needs a mixture-of-experts model", "ep_size")
    if ep_size > 1 and cfg.num_experts % ep_size:
        raise InvalidServerArgsError(
            f"ep_size {ep_size} does not divide the model's {cfg.num_experts} experts", "ep_size"
        )
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (a multiple or a divisor of the size is needed)")
    if cfg.intermediate_size % size:
        problems.append(f"an MLP width of {cfg.intermediate_size}")
    if cfg.num_experts and cfg.moe_intermediate_size % (size // ep_size):
        problems.append(f"an expert width of {cfg.moe_intermediate_size}")
    if problems:
        raise InvalidServerArgsError(f"tp_size {size} does not divide the model's {' and '.join(problems)}", "tp_size")


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size`: its head, MLP and vocabulary ranges for one model."""

    rank: int
    size: int
    head_dim: int
    num_heads: int  # query heads on this rank
    q_head_start: int
    num_kv_heads: int  # KV heads on this rank (1 replicated head when KVH < size)
    kv_head_start: int
    intermediate_size: int  # MLP columns on this rank
    vocab_size: int  # the whole vocabulary
    vocab_rows: int  # rows of this rank's embedding / LM head shard (ceil(V / size), padded)
    vocab_start: int
    moe_intermediate_size: int = 0  # each expert's columns on this rank (0: a dense model)
    expert_start: int = 0  # this rank's experts: [expert_start, expert_start + num_local_experts)
    num_local_experts: int = 0
    moe_tp_rank: int = 0  # this rank's place in its expert set (which columns of each expert)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, size: int = 1, ep_size: int = 1) -> TPShard:
        check_tp_size(cfg, size, ep_size)
        moe_tp_size = size // ep_size  # ranks per expert set
        local_experts = cfg.num_experts // ep_size
        heads = cfg.num_heads // size
        kv_heads = max(1, cfg.num_kv_heads // size)
        rows = -(-cfg.vocab_size // size)
        return cls(
            rank=rank,
            size=size,
            head_dim=cfg.head_dim,
            num_heads=heads,
            q_head_start=rank * heads,
            num_kv_heads=kv_heads,
            kv_head_start=rank * cfg.num_kv_heads // size,
            intermediate_size=cfg.intermediate_size // size,
            vocab_size=cfg.vocab_size,
            vocab_rows=rows,
            vocab_start=rank * rows,
            moe_intermediate_size=cfg.moe_intermediate_size // moe_tp_size,
            expert_start=rank // moe_tp_size * local_experts,
            num_local_experts=local_experts,
            moe_tp_rank=rank % moe_tp_size,
        )

    def holds_expert(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.num_local_experts

    @property
    def vocab_end(self) -> int:
        """One past this rank's last real vocabulary row (the shard may be shorter than `vocab_rows`)."""
        return min(self.vocab_size, self.vocab_start + self.vocab_rows)

    def weight_slice(self, hf_name: str) -> Slice | None:
        """The part of checkpoint tensor `hf_name` this rank holds; None = all of it."""
        if self.size == 1:
            return None
        if hf_name in VOCAB_PARALLEL:
            return 0, self.vocab_start, self.vocab_end
        if not hf_name.startswith("model.layers."):
            return None
        module, _, kind = hf_name.split(".", 3)[3].rpartition(".")
        d = self.head_dim
        expert = _EXPERT.fullmatch(module)
        if expert is not None and kind == "weight":
            dim = 0 if expert.group(2) in _EXPERT_COLUMN else 1
            if not self.holds_expert(int(expert.group(1))):
                return dim, 0, 0  # another expert set's: nothing is read
            first = self.moe_tp_rank * self.moe_intermediate_size
            return dim, first, first + self.moe_intermediate_size
        if module in _COLUMN_Q:
            return 0, self.q_head_start * d, (self.q_head_start + self.num_heads) * d
        if module in _COLUMN_KV:
            return 0, self.kv_head_start * d, (self.kv_head_start + self.num_kv_heads) * d
        if module in _COLUMN_MLP:
            first = self.rank * self.intermediate_size
            return 0, first, first + self.intermediate_size
        if kind == "weight" and module == _ROW_ATTN:
            return 1, self.q_head_start * d, (self.q_head_start + self.num_heads) * d
        if kind == "weight" and module == _ROW_MLP:
            first = self.rank * self.intermediate_size
            return 1, first, first + self.intermediate_size
        return None  # norms, and row-parallel biases (added once: see `zero_bias`)

    def zero_bias(self, hf_name: str) -> bool:
        """Whether this rank holds zeros for bias `hf_name`: a row-parallel bias is added by rank 0
        only, so the all-reduced sum carries it once."""
        return self.rank > 0 and hf_name.endswith(".bias") and any(f".{m}." in hf_name for m in (_ROW_ATTN, _ROW_MLP))
