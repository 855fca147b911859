"""Linear layers, one module per implementation, chosen once when the model loads.

- `DenseLinear`: `F.linear` on a dense weight. Every projection is built as one (a fused q|k|v or
  gate|up projection loads its parts into row ranges, `output_sizes`) and stays one where nothing
  faster applies: fp32 (the transformers parity path; on a CPU its inputs of a few rows, decode
  steps, go through our small-batch loop, engine/kernels/cpu_gemv.py, which streams the weights
  at 2-4x MKL's rate there, with fp32 sums of its own order) and devices other than the CPU.
- `VnniLinear`: a bf16 CPU weight (AVX512-BF16, no AMX) resident in VNNI pairs, our kernel at every
  row count (engine/kernels/cpu_vnni.py): decode streams it at the memory's rate, prefill's GEMM
  runs at oneDNN's rate on the same bytes.
- `OneDNNLinear`: a bf16 CPU weight reordered once into oneDNN's blocked layout (what inductor's
  CPU freezing does) where `VnniLinear` does not apply (AMX GEMMs outrun ours). `F.linear` in bf16
  reorders the weight on every call; prepacked, a decode step's matmuls take 15-45% less time
  (measured on a 2-core CPU, batch 1 to 64) with bit-identical results.
- `QuantLinear`: a GGUF block-quantized weight (4-bit layer weights, int4.py; the Q8_0 LM head,
  q8.py; a fused projection of parts in different kinds of blocks, `QuantParts`) through a
  quantized CPU kernel for inputs of at most `max_rows` rows, where reading a quarter (half) of
  a bf16 weight's bytes wins (an eighth, a quarter of an fp32 one's); for more rows, where the
  kernel's per-row cost loses, `big`: the same blocks through dequantized tiles
  (`DequantTilesLinear`), so the blocks are the only resident form (a dense copy beside them held
  ~4x a Q4_K_M file's bytes); only torch's int4pack form keeps the dense form beside it. That
  row-count choice is this module's job; where the crossover lies is measured at start-up
  (int4_crossover.py).

- `BatchInvariantLinear` (`--enable-deterministic-inference`): the dense form called on exactly
  `rows` rows at a time, so a row's result never depends on the batch around it (see the class).

`finalize_linear` turns a loaded `DenseLinear` into the module the model keeps. The dense weight
is then referenced by nothing (a VNNI, oneDNN or quantized module holds its own form), so it is freed —
except where the dense weight is shared, as a tied LM head shares the embedding table.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_gemv, cpu_quant, cpu_vnni
from engine.layers.int4 import PackedInt4Weight, Q4Blocks, TiledQ4Weight
from engine.layers.q8 import Q8Blocks, Q8Weight


@dataclass
class QuantParts:
    """A fused projection whose parts came in blocks of different kinds, each in its own form
    (llama.cpp's Q4_K_M stores some layers' v as Q6_K beside Q4_K q and k; one kernel call cannot
    take both, and dense fp32 would read 7x the bytes of those parts): outputs side by side."""

    forms: list[TiledQ4Weight | Q8Weight]

    @property
    def in_features(self) -> int:
        return self.forms[0].in_features

    @property
    def out_features(self) -> int:
        return sum(f.out_features for f in self.forms)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.forms)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([f.matmul(x) for f in self.forms], dim=-1)

    def tiles_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([f.tiles_matmul(x) for f in self.forms], dim=-1)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([f.dequantize(dtype) for f in self.forms])


QuantWeight = TiledQ4Weight | PackedInt4Weight | Q8Weight | QuantParts  # each has matmul, nbytes, in/out_features


def pack_parts(parts: Sequence[Q4Blocks | Q8Blocks], dtype: torch.dtype) -> QuantWeight | None:
    """A fused projection's parts' blocks (rows in order) in the fastest form the kernels take for
    a model computing in `dtype`: consecutive parts of one kind fuse, kinds that differ (Q4_K_M's
    Q4_K q|k beside a Q6_K v) run side by side; None where some part has no kernel form."""
    runs = [list(run) for _, run in itertools.groupby(parts, key=lambda b: (type(b), b.group_size, b.k is None))]
    forms = [type(run[0]).cat(run).pack(dtype) for run in runs]
    if len(forms) == 1:
        return forms[0]
    return QuantParts(forms) if all(isinstance(f, (TiledQ4Weight, Q8Weight)) for f in forms) else None


def native_blocks(packed: TiledQ4Weight | Q8Weight | QuantParts) -> tuple[list[torch.Tensor], tuple]:
    """A block form as the C++ projections take it (decode_layers.h `Projection`): (its tensors,
    ()) — 4-bit tiles (codes, scales, offsets), Q8_0 (int8 codes, scales), Q6_K (int8 codes, int8
    scales, d) or Q5_K (int8 codes, sc|m, d|dmin) — or for a `QuantParts` ([], each part's
    (tensors, output width)), the pieces `set_pieces` takes."""
    if isinstance(packed, QuantParts):
        return [], tuple((native_blocks(f)[0], f.out_features) for f in packed.forms)
    if isinstance(packed, TiledQ4Weight):
        return [packed.tiles.codes, packed.tiles.scales, packed.tiles.offsets], ()
    return [packed.codes, packed.scales] + ([] if packed.supers is None else [packed.supers]), ()


def onednn_prepack_available() -> bool:
    """Whether this torch build can prepack weights for oneDNN's linear kernel."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN's bf16 prepacked linear runs on this CPU: it needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT, and on a CPU without them (AVX2 only: e.g. AMD Zen 3) prepacking raises, so
    a bf16 projection keeps `F.linear` there."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return onednn_prepack_available() and supported is not None and bool(supported())


class DenseLinear(nn.Module):
    """`y = x @ W.T + b` with `F.linear`; W is `[sum(output_sizes), in_features]`.

    `weight`: an existing parameter to use instead of a new one (a tied LM head and its embedding).
    `small_rows` (set at load by `finalize_linear`): inputs of 1 to that many rows go through the
    fp32 small-batch loop (engine/kernels/cpu_gemv.py), which streams the weight on every thread.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
        weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = tuple(output_sizes)
        self.out_features = sum(self.output_sizes)
        if weight is None:
            weight = nn.Parameter(torch.empty(self.out_features, in_features, device=device, dtype=dtype), False)
        self.weight = weight
        self.bias = nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype), False) if bias else None
        self.small_rows = 0

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """(first row, row count) of part `shard` of a fused weight (e.g. 0/1/2 = q/k/v)."""
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < x.shape[0] <= self.small_rows and x.dim() == 2:
            return cpu_gemv.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


class OneDNNLinear(nn.Module):
    """A bf16 CPU linear on a weight prepacked for oneDNN (see the module docstring)."""

    def __init__(
        self, packed: torch.Tensor, bias: nn.Parameter | None, in_features: int, output_sizes: Sequence[int]
    ) -> None:
        super().__init__()
        self.packed = packed  # opaque mkldnn tensor: a plain attribute, never cast or saved
        self.bias = bias
        self.in_features = in_features
        self.output_sizes = tuple(output_sizes)  # the fused parts, as DenseLinear's (weight updates)
        self.out_features = sum(self.output_sizes)

    @classmethod
    def from_dense(cls, dense: DenseLinear, rows_hint: int = 32) -> OneDNNLinear | None:
        """The prepacked form of a bf16 CPU `dense`, or None where prepacking does not apply (fp32
        stays a `DenseLinear`: MKL's `F.linear`, and our small-batch loop for a few rows)."""
        weight = dense.weight
        if not (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and onednn_bf16_available()):
            return None
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows_hint)
        return cls(packed, dense.bias, dense.in_features, dense.output_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


class VnniLinear(nn.Module):
    """A bf16 CPU weight resident in VNNI pairs, our kernel at every row count
    (engine/kernels/cpu_vnni.py): a few rows stream it at the memory's rate, a prefill runs a GEMM
    on it, and each row's result is the same bits whatever the batch (so `BatchInvariantLinear`
    calls it as it is, with no row tiles)."""

    def __init__(
        self, packed: torch.Tensor, bias: nn.Parameter | None, in_features: int, output_sizes: Sequence[int]
    ) -> None:
        super().__init__()
        self.packed = packed  # a plain attribute: a layout, not a parameter to cast or save
        self.bias = bias
        self.in_features = in_features
        self.output_sizes = tuple(output_sizes)
        self.out_features = sum(self.output_sizes)

    @classmethod
    def from_dense(cls, dense: DenseLinear) -> VnniLinear | None:
        """`dense` in VNNI pairs, or None where they do not apply (cpu_vnni.available_for)."""
        if not cpu_vnni.available_for(dense.weight):
            return None
        return cls(cpu_vnni.pack(dense.weight), dense.bias, dense.in_features, dense.output_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = cpu_vnni.linear(rows, self.packed, self.bias, self.out_features)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


class DequantTilesLinear(nn.Module):
    """A block-quantized weight's products for many rows without a dense copy: tiles of the weight
    dequantized one at a time in a core's cache and multiplied there (csrc/cpu_quant_tiles.cpp;
    bf16: our dot-product kernel on AVX512-BF16, oneDNN elsewhere; fp32: MKL). `QuantLinear`'s
    `big` for our block forms, so the blocks are the projection's only resident form."""

    def __init__(
        self,
        packed: TiledQ4Weight | Q8Weight | QuantParts,
        bias: nn.Parameter | None,
        output_sizes: Sequence[int],
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.packed, self.bias, self.dtype = packed, bias, dtype
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.output_sizes = tuple(output_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.packed.tiles_matmul(x)
        return out if self.bias is None else out + self.bias

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


class QuantLinear(nn.Module):
    """Quantized kernel for inputs of 1..`max_rows` rows, `big` for any other count: our block
    forms' dequantized tiles (`DequantTilesLinear`), or the dense form beside torch's int4pack one."""

    def __init__(
        self, packed: QuantWeight, big: DenseLinear | OneDNNLinear | VnniLinear | DequantTilesLinear, max_rows: int
    ) -> None:
        super().__init__()
        self.packed = packed
        self.big = big
        self.bias = big.bias
        self.max_rows = max_rows
        self.in_features = packed.in_features
        self.out_features = packed.out_features
        self.output_sizes = big.output_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if 0 < rows <= self.max_rows:
            out = self.packed.matmul(x)
            return out if self.bias is None else out + self.bias
        return self.big(x)

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


class RowTiles:
    """The row count every `BatchInvariantLinear` of one model calls its GEMM with, set per
    forward by the model from the forward's mode (`select`). A request's tokens are computed in
    one mode each (its prompt in extend forwards, its new tokens in decode or verify forwards), so
    each mode needs only its own fixed count. Measured on 576x1728 ... 576x49152 bf16 (oneDNN,
    AMX): a call's row blocks are 32 rows, a partial block runs another kernel, and each extra
    call re-reads the weight. Decode's count (64) is a whole number of blocks and a typical
    batch: a 64-row decode costs what an untiled one does, a batch of one pays the padded rows
    (about 3x its GEMM time). Extend's (256) runs a prefill's GEMMs as fast as one call over every
    row; a short prompt alone pads to it.

    Where bf16 is emulated (a CPU without oneDNN's bf16 kernels: AVX2 only), `F.linear` costs the
    same per row from 1 row to 64 (measured: 0.11-0.12 ms a row of 576x1536, 3.6-3.8 ms of the
    LM head, one thread), so padding buys nothing there and costs a single decode 64x its GEMMs:
    `for_weights` gives such a model tiles of 4 and 16 rows (a call's fixed cost stays ~2%).

    Block forms (`decode_blocks`): a projection that has a GGUF's blocks (or --torchao-config's)
    in our kernels' form runs them in decode-like forwards at every row count instead of tiles.
    Those loops give each row the same bits whatever the batch, its position and the thread
    count (fp32: csrc/cpu_quant_gemv_f32.cpp; bf16 with AVX512-BF16: csrc/cpu_quant_gemv.cpp,
    whose per-row chains and block order do not depend on the rows beside it), so no padding:
    measured on the default model's bf16 projections (AMD EPYC, AVX512-BF16, no AMX), the blocks
    cost 5.5 ms a step at 1 row, 39 at 32 and 76 at 64, against the 64-row tile's 54 at any
    count. Decode batches below ~45 rows gain, and a lone stream most. AMX runs the tiles several
    times faster per row, so for bf16 the model measures at load which side wins
    (int4_crossover.blocks_beat_padded_tiles) and may turn `decode_blocks` off."""

    DECODE, EXTEND = 64, 256
    EMULATED_BF16 = (4, 16)  # (decode, extend) rows where bf16 GEMMs cost the same per row

    def __init__(
        self, decode: int = DECODE, extend: int = EXTEND, decode_loop: bool = False, decode_blocks: bool = False
    ) -> None:
        self.decode, self.extend = decode, extend
        self.rows = extend
        # fp32 on a CPU: decode-like forwards run the fp32 small-batch loop (cpu_gemv.py) in groups
        # of its MAX_ROWS instead of padded tiles. Its sums are fixed per row whatever the batch or
        # thread count, so no padding is needed: a lone decode step reads the weights once instead
        # of running a 64-row GEMM (2-core AVX2 CPU, default model: single stream 3.6 tok/s on the
        # tiles); a 64-row step costs ~1.4x the tile's.
        self.decode_loop = decode_loop
        self.decode_blocks = decode_blocks
        self.loop = self.use_blocks = False

    @classmethod
    def for_weights(cls, dtype: torch.dtype, device: torch.device) -> RowTiles:
        """The tiles of a model whose projections hold `dtype` weights on `device`."""
        if dtype == torch.bfloat16 and device.type == "cpu" and not onednn_bf16_available():
            return cls(*cls.EMULATED_BF16)
        loop = cpu_gemv.available_for(dtype, device)
        bf16_blocks = dtype == torch.bfloat16 and device.type == "cpu" and cpu_quant.vectorized(dtype)
        return cls(decode_loop=loop, decode_blocks=loop or bf16_blocks)

    def select(self, decode_like: bool) -> None:
        self.rows = self.decode if decode_like else self.extend
        self.loop = decode_like and self.decode_loop
        self.use_blocks = decode_like and self.decode_blocks


class BatchInvariantLinear(nn.Module):
    """`inner` on `[tiles.rows, in]` tiles only, the last one zero-padded: each row's result is
    then a function of that row alone, whatever the batch (deterministic inference).

    Why tiles: a GEMM library picks its kernel and blocking by the row count, and the sums change
    with them (measured here: oneDNN's bf16 LM head from 33 rows, the fp32 BLAS from 2), while for
    one fixed row count every row comes out the same wherever it sits and whatever its neighbours
    hold (tests/test_deterministic.py checks both)."""

    def __init__(
        self,
        inner: DenseLinear | OneDNNLinear | VnniLinear,
        tiles: RowTiles,
        blocks: TiledQ4Weight | Q8Weight | QuantParts | None = None,
    ) -> None:
        super().__init__()
        self.inner, self.tiles = inner, tiles
        # the GGUF's blocks (or --torchao-config's), for decode-like forwards at any row count
        # (`RowTiles.decode_blocks`): each row's bits are fixed whatever the batch, reading a
        # quarter or an eighth of the dense bytes (no row bound: switching forms by batch size
        # would change a row's sums)
        self.blocks = blocks
        self.bias = inner.bias
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.output_sizes = inner.output_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles.use_blocks and self.blocks is not None:
            out = self.blocks.matmul(x)
            return out if self.bias is None else out + self.bias
        if self.tiles.loop and isinstance(self.inner, DenseLinear):
            return cpu_gemv.gemv_groups(x, self.inner.weight, self.bias)
        t, rows = x.shape[0], self.tiles.rows
        if t == rows or isinstance(self.inner, VnniLinear):
            return self.inner(x)
        pad = -t % rows
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        out = x.new_empty(t + pad, self.out_features)
        for start in range(0, t + pad, rows):
            out[start : start + rows] = self.inner(x[start : start + rows])
        return out[:t]

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


Linear = DenseLinear | OneDNNLinear | VnniLinear | QuantLinear | BatchInvariantLinear


def dense_weight(linear: Linear) -> torch.Tensor:
    """The projection's weight as a plain `[out, in]` tensor, whatever form it runs as (a weight
    update rebuilds a form from it). A quantized projection gives its dense form's weight: the
    same values its quantized kernel reads, dequantized."""
    if isinstance(linear, BatchInvariantLinear):
        return dense_weight(linear.inner)
    if isinstance(linear, QuantLinear):
        big = linear.big
        return big.packed.dequantize(big.dtype) if isinstance(big, DequantTilesLinear) else dense_weight(big)
    if isinstance(linear, OneDNNLinear):
        return linear.packed.to_dense()  # the prepacked layout reordered back (exact)
    if isinstance(linear, VnniLinear):
        return cpu_vnni.unpack(linear.packed, linear.out_features)
    return linear.weight.detach()


def finalize_linear(
    dense: DenseLinear,
    packed: QuantWeight | None,
    q4_max_rows: int,
    row_tiles: RowTiles | None = None,
    shared: bool = False,
) -> Linear:
    """The module a loaded projection runs as: `QuantLinear` when it has a quantized form, the
    quantized path is on (`q4_max_rows > 0`) and the model is bf16 or (our kernels only) fp32 on
    a CPU (our block forms alone, many rows through their dequantized tiles; torch's int4pack form
    beside the dense one), else its dense form (prepacked for oneDNN where that applies; an fp32 CPU one with
    the small-batch loop for a few rows); with `row_tiles` (deterministic inference), the dense
    form in `BatchInvariantLinear` (no quantized form: the dense and quantized forms sum in
    different orders, so a row would change with which side the batch's size picked; an fp32
    model's decode-like forwards take the fixed-order loop there instead, `RowTiles.decode_loop`,
    and an fp32 or (AVX512-BF16) bf16 one its block loops where it has a block form:
    `RowTiles.decode_blocks`, `BatchInvariantLinear.blocks`). `shared`: the dense weight stays
    resident for another reader (a tied LM head's embedding table), so our block form runs beside
    that very tensor (`F.linear` for many rows: no prepacked copy, and no tiles to write)."""
    weight = dense.weight
    ours = isinstance(packed, (TiledQ4Weight, Q8Weight, QuantParts))  # torch's int4pack form takes bf16 only
    dtypes = (torch.bfloat16, torch.float32) if ours else (torch.bfloat16,)
    quantized = packed is not None and q4_max_rows > 0 and weight.dtype in dtypes and weight.device.type == "cpu"
    if quantized and ours and row_tiles is None:  # the blocks only: many rows run their dequantized tiles
        big = dense if shared else DequantTilesLinear(packed, dense.bias, dense.output_sizes, weight.dtype)
        return QuantLinear(packed, big, q4_max_rows)
    big = VnniLinear.from_dense(dense) or OneDNNLinear.from_dense(dense) or dense
    if row_tiles is not None:
        return BatchInvariantLinear(big, row_tiles, packed if ours and row_tiles.decode_blocks else None)
    if big is dense:  # fp32 on a CPU: few rows through the small-batch loop
        dense.small_rows = cpu_gemv.MAX_ROWS if cpu_gemv.available(dense.weight) else 0
    return QuantLinear(packed, big, q4_max_rows) if quantized else big


def one_row_pass(
    model: nn.Module, dtype: torch.dtype, experts: Sequence[nn.Module] = ()
) -> tuple[Callable[[], None], tuple]:
    """A call that runs every projection of `model` on one row of zeros, each in the form a
    one-token step runs it as, and each MoE layer of `experts` (modules taking `[1, in_features]`
    rows: a row of zeros routes to top-k experts whose weights it reads, as a token does): a
    decode step's weight reads (engine/device/step_threads.py times it to choose a small forward's
    threads); and a key of those forms and shapes (equal for two loads of one model)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    inner = {id(sub) for m in linears for sub in m.modules() if sub is not m}  # a QuantLinear's dense form
    linears = [m for m in linears if id(m) not in inner] + list(experts)
    device = next(model.parameters()).device
    inputs = {k: torch.zeros(1, k, dtype=dtype, device=device) for k in {m.in_features for m in linears}}

    def run() -> None:
        for m in linears:
            m(inputs[m.in_features])

    key = tuple((type(m).__name__, getattr(m, "max_rows", None), m.in_features, m.out_features) for m in linears)
    return run, (str(dtype), key)
