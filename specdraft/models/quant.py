"""A quantized Llama-family runtime that runs a GGUF file's own weight blocks.

The compact runtime (:mod:`specdraft.models.llama`) takes its weights from a transformers model
that de-quantized the GGUF to floats; this one multiplies the file's Q4_0 / Q4_1 / Q8_0 blocks
directly (``specdraft/kernels/quant.c``), read in place through a memory map: no transformers
model, no de-quantized copy. Activations are quantized per row (8-bit blocks of 32, one scale
each) and multiplied with integer dot products, so each output row depends on its own input row
only and a (k + 1)-token verification gives bit-identical logits to k + 1 one-token steps.

What it shares with the compact runtime: the position-indexed cache (:class:`LlamaKV`, here with
fp16 keys and values: :data:`KV_DTYPE`) and the fused RoPE + cache write + attention and RMSNorm
kernels of ``fewrows.c`` (their fp16-cache forms, passed to the quantized layer loop as function
pointers). A token-tree step (``attn_mask`` and ``slots``) runs
the same layer loop with fewrows.c's tree attention (:class:`TreeAttention`), each node's row bit
for bit a chain step's, at a chain step's cost.
A ragged step (``lengths``) packs each row's own tokens into one block for the matmuls and attends
per row (``attend_step`` in quant.c): a batch whose rows verify different draft lengths pays for
its tokens only, not for every row padded to the longest.
Not supported (refused with a clear error): biases (Qwen2), other block types (K-quants, F16
matrices).

Drafts run on it too (``--draft-dtype q``): a layer-pruned draft is a runtime over
:meth:`QuantWeights.with_layers` (the target's own :class:`QuantMatrix` blocks, nothing copied; a
smaller head takes the head's rows, :meth:`QuantMatrix.take_rows`), a designed draft's matrices
are quantized to Q8_0 at load beside the target's embedding (:meth:`QuantWeights.from_llama`).

The GGUF's tensor table is read with the ``gguf`` library once and kept as a small JSON index in
the cache (``<cache>/quant/<key>.json``, keyed by the file's path, size and mtime): parsing the
file's 49k-entry vocabulary with ``gguf.GGUFReader`` takes 15-30 s on this project's machine,
reading the index a millisecond.

Shapes: B batch rows, T new tokens, C hidden size, H query heads, G key/value heads, D head dim,
F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import subprocess
import tempfile
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from specdraft import kernels
from specdraft.errors import SpecdraftError
from specdraft.kernels import build
from specdraft.models.llama import LlamaKV
from specdraft.models.runtime import ForwardOutput

QTYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}  # ggml type id -> name: the matmul types quant.c takes
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # bytes per 32 weights
F32 = 0
VARIANTS = {"ref": 0, "avx2": 1, "avxvnni": 2, "avx512vnni": 3}  # kernel variants; "ref": scalar
# Keys and values are cached in fp16 by default, as llama.cpp caches them (rope_attend16 in
# fewrows.c): each is rounded once when written and read back exactly widened, by every step alike,
# so a verification still gives each row a one-token step's bits. Half the bytes of fp32: a decode
# step of SmolLM2-135M at a 1,000-token context read 46 MB of fp32 keys and values beside the
# weights' 97 MB. ``QuantRuntime(kv_dtype=torch.float32)`` keeps fp32 (the runtime before).
KV_DTYPE = torch.float16
_ATTEND = {
    torch.float16: ("rope_attend16", "rope_attend_tree16"),
    torch.float32: ("rope_attend", "rope_attend_tree"),
}
# the VNNI variants and the /proc/cpuinfo flags each needs, the fastest last
VNNI_FLAGS = {"avx512vnni": {"avx512_vnni", "avx512vl"}, "avxvnni": {"avx_vnni"}}
SOURCE = Path(kernels.__file__).with_name("quant.c")
_INDEX_FORMAT = 1

_lib: ctypes.CDLL | None = None


class QMat(ctypes.Structure):
    """``qmat`` in quant.c: one (N, K) weight matrix in GGUF blocks."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("type", ctypes.c_int),
        ("rows", ctypes.c_int),
        ("cols", ctypes.c_int),
        ("row_bytes", ctypes.c_long),
        ("omap", ctypes.c_void_p),
        ("x8", ctypes.c_int),
    ]


MATRICES = ("q", "k", "v", "o", "gate", "up", "down")  # per layer, in qlayer's order


class QLayer(ctypes.Structure):
    """``qlayer`` in quant.c: one decoder layer's norms and matrices."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p)] + [(n, QMat) for n in MATRICES]


def lib() -> ctypes.CDLL:
    """quant.c, built on first use like fewrows.c (which it needs for attention and RMSNorm)."""
    global _lib
    if _lib is not None:
        return _lib
    if not kernels.available():
        raise SpecdraftError(f"the quantized runtime needs the native kernels ({kernels.status()})")

    def setup(so: ctypes.CDLL) -> None:
        vp, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        so.quant_quantize.argtypes = [vp, vp, i, i]
        so.quant_matmul.argtypes = [vp, vp, vp, i, ctypes.c_long, i, i]
        so.quant_dequant.argtypes = [vp, vp, i, vp]
        so.quant_layers.argtypes = [vp, vp, vp] + [i] * 8 + [f, i] + [vp] * 8 + [i, i, i]
        so.quant_repack.argtypes = [vp, vp]
        so.quant_file_rows.argtypes = [vp, vp, i, vp]
        for fn in (so.quant_quantize, so.quant_matmul, so.quant_dequant, so.quant_layers, so.quant_repack):
            fn.restype = None

    try:  # checked and rebuilt when damaged, as fewrows.c is (kernels.build.open_library)
        _lib = build.open_library(SOURCE, setup)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        raise SpecdraftError(f"the quantized kernels did not build: {e}") from e
    return _lib


def variants() -> list[str]:
    """The kernel variants this CPU runs (the fastest last): the VNNI ones are the AVX2 tiles with
    one ``vpdpbusd`` for their integer products (quant.c, ``dpbusd``), the same bits as ``avx2``."""
    flags = build.cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        return ["ref"]
    vnni = [v for v, need in VNNI_FLAGS.items() if need <= flags]
    return ["ref", "avx2", *vnni]


@dataclass(frozen=True)
class QuantMatrix:
    """One weight matrix in GGUF blocks: as the file stores it, or its rows repacked in groups of 8.

    Attributes:
        data: ``(N, row_bytes)`` uint8, the blocks (a view of the memory-mapped file, or its x8 copy).
        type: ggml type id (see :data:`QTYPES`).
        cols: K, the input width (a multiple of 32).
        omap: optional ``(N,)`` int32: output column n is written at ``omap[n]``.
        x8: the first ``8 (N // 8)`` rows are in the x8 layout (:meth:`repacked`; quant.c).
    """

    data: np.ndarray
    type: int
    cols: int
    omap: torch.Tensor | None = None
    x8: bool = False

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def struct(self) -> QMat:
        """The kernels' view of the matrix (:class:`QMat`), made once: building it reads numpy's
        ``ctypes`` interface, slow right after a forward, and every matmul and embedding read asks
        (results/feature-draft-cost-2026-12-05/)."""
        return self._qmat

    @cached_property
    def _qmat(self) -> QMat:
        omap = None if self.omap is None else self.omap.data_ptr()
        return QMat(self.data.ctypes.data, self.type, self.rows, self.cols, self.data.shape[1], omap, self.x8)

    def repacked(self) -> QuantMatrix:
        """The same matrix with its rows in groups of 8 interleaved (the x8 layout of quant.c, which
        its kernels read without transposing anything): a copy of the same size, bit-identical
        products. The last ``N % 8`` rows stay as they are."""
        if self.x8 or self.rows < 8:
            return self
        out = np.empty_like(self.data, order="C")
        out[self.rows // 8 * 8 :] = self.data[self.rows // 8 * 8 :]
        s = self.struct()
        lib().quant_repack(ctypes.byref(s), out.ctypes.data)
        return QuantMatrix(out, self.type, self.cols, self.omap, x8=True)

    def take_rows(self, ids: torch.Tensor) -> QuantMatrix:
        """Rows ``ids`` ``(N,)`` of W, in that order, in the file's layout: a copy of their blocks only
        (each row's blocks are its own, so the product's row n is exactly row ``ids[n]`` of the full one)."""
        if self.omap is not None:
            raise SpecdraftError("taking rows of a matrix with an output map is not supported")
        ids64 = ids.to(torch.int64).contiguous()
        out = np.empty((ids64.numel(), self.data.shape[1]), dtype=np.uint8)
        s = self.struct()
        lib().quant_file_rows(ctypes.byref(s), ids64.data_ptr(), ids64.numel(), out.ctypes.data)
        return QuantMatrix(out, self.type, self.cols)


def quantize_matrix(w: torch.Tensor, qtype: int = 8) -> QuantMatrix:
    """``w (N, K)`` as GGUF blocks of ``qtype`` (default Q8_0), by the ``gguf`` library's reference
    quantizer (ggml's rounding)."""
    import gguf

    data = gguf.quants.quantize(w.detach().float().numpy(), gguf.GGMLQuantizationType(qtype))
    return QuantMatrix(np.ascontiguousarray(data), qtype, w.shape[1])


def quant_matmul(
    w: QuantMatrix, x: torch.Tensor, variant: str = "avx2", threads: int | None = None
) -> torch.Tensor:
    """``quantize(x) @ W^T`` for fp32 ``x (..., K)``: each row quantized on its own; ``(..., N)``."""
    if x.dtype != torch.float32 or x.shape[-1] != w.cols:
        raise ValueError(f"quant_matmul: x must be float32 (..., {w.cols})")
    x = x.contiguous()
    M = x.numel() // w.cols
    y = torch.empty(*x.shape[:-1], w.rows, dtype=torch.float32)
    s = w.struct()
    lib().quant_matmul(
        ctypes.byref(s),
        x.data_ptr(),
        y.data_ptr(),
        M,
        w.rows,
        VARIANTS[variant],
        threads or torch.get_num_threads(),
    )
    return y


def dequantize_rows(w: QuantMatrix, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of W as fp32, ``ids.shape + (K,)``: the exact block values (the embedding)."""
    ids64 = ids.to(torch.int64).contiguous()
    flat = ids64.view(-1).tolist()  # a list: two tensor reductions cost more at a step's few ids
    if flat and (min(flat) < 0 or max(flat) >= w.rows):
        raise SpecdraftError(f"token id out of range for a {w.rows}-row embedding")
    out = torch.empty(*ids.shape, w.cols, dtype=torch.float32)
    s = w.struct()
    lib().quant_dequant(ctypes.byref(s), ids64.data_ptr(), ids64.numel(), out.data_ptr())
    return out


def embed_rows(embed: QuantMatrix | torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of an embedding table as fp32 ``ids.shape + (C,)``: a GGUF matrix's blocks
    de-quantized, or a float table's own rows (a feature draft hands its runtime the inputs it should
    read as the table: :class:`specdraft.drafters.feature_base.FeatureDrafterBase`)."""
    if isinstance(embed, QuantMatrix):
        return dequantize_rows(embed, ids)
    return embed[ids].float()


def _drop_pages(mm: np.memmap, view: np.ndarray) -> None:
    """Let the kernel drop this process's resident pages of ``view``, a part of the read-only file
    map ``mm`` (``MADV_DONTNEED``: read again from the file if touched), so that a matrix's file
    bytes and its repacked copy are not resident at once (the whole pages inside it)."""
    m = getattr(mm, "_mmap", None)
    if m is None or not hasattr(m, "madvise"):
        return
    offset = view.ctypes.data - mm.ctypes.data
    start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (offset + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        m.madvise(mmap.MADV_DONTNEED, start, end - start)


def llama_rope_map(n_heads: int, head_dim: int) -> torch.Tensor:
    """Where the GGUF llama converter's q / k row r' belongs in the transformers layout.

    The converter reorders each head's rows from half-split ``(j, i)`` (r = j D/2 + i, j in {0, 1})
    to interleaved ``(i, j)`` (r' = 2 i + j) for ggml's RoPE; the runtime's attention kernel
    rotates half-split pairs, so the matmul writes output r' at r.
    """
    D = head_dim
    i = torch.arange(D // 2).repeat_interleave(2)
    j = torch.arange(2).repeat(D // 2)
    within = j * (D // 2) + i  # (D,) r for r' = 0..D-1
    return (torch.arange(n_heads).unsqueeze(1) * D + within).reshape(-1).to(torch.int32)


# --------------------------------------------------------------------------------------------
# The GGUF index: config and tensor table, cached as JSON
# --------------------------------------------------------------------------------------------


def _index_path(gguf: Path) -> Path:
    from specdraft.models.loading import cache_root

    st = gguf.stat()
    key = hashlib.sha256(
        f"{_INDEX_FORMAT}\0{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    return cache_root() / "quant" / f"{gguf.stem}-{key}.json"


def _read_index(gguf: Path) -> dict:
    """Config and tensor table of a GGUF file (``gguf.GGUFReader``; slow for large vocabularies).

    Raises:
        SpecdraftError: a truncated or corrupt file (:func:`specdraft.models.loading.check_gguf`).
    """
    from specdraft.models.loading import read_gguf

    reader = read_gguf(gguf)
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith(("tokenizer.", "GGUF.")):
            continue
        value = field.contents()
        if isinstance(value, (int, float, str)):
            fields[name] = value
    tensors = {
        t.name: {
            "type": int(t.tensor_type),
            "shape": [int(n) for n in t.shape],
            "offset": int(t.data_offset),
            "bytes": int(t.n_bytes),
        }
        for t in reader.tensors
    }
    return {"format": _INDEX_FORMAT, "fields": fields, "tensors": tensors}


def gguf_index(gguf: Path) -> dict:
    """:func:`_read_index`, from the cache when this file was indexed before (written atomically)."""
    path = _index_path(gguf)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    index = _read_index(gguf)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(index, f)
    os.replace(tmp, path)
    return index


@dataclass
class QuantLayer:
    attn_norm: torch.Tensor  # (C,) fp32
    ffn_norm: torch.Tensor  # (C,) fp32
    q: QuantMatrix  # (H D, C)
    k: QuantMatrix  # (G D, C)
    v: QuantMatrix  # (G D, C)
    o: QuantMatrix  # (C, H D)
    gate: QuantMatrix  # (F, C)
    up: QuantMatrix  # (F, C)
    down: QuantMatrix  # (C, F)


def _check_llama(fields: dict, tensors: dict) -> str:
    """The GGUF's architecture, if the quantized runtime takes it (llama, no biases, no RoPE scaling)."""
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise SpecdraftError(f"the quantized runtime takes llama-architecture GGUFs, not {arch!r}")
    if any(name.endswith(".bias") for name in tensors):
        raise SpecdraftError("the quantized runtime does not take biases (Qwen2-style q/k/v biases)")
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise SpecdraftError(f"the quantized runtime does not take RoPE scaling {scaling!r}")
    return arch


@dataclass
class _GGUFTensors:
    """A GGUF's tensors, read in place through its memory map."""

    path: Path
    mm: np.ndarray
    tensors: dict

    def raw(self, name: str) -> tuple[dict, np.ndarray]:
        info = self.tensors.get(name)
        if info is None:
            raise SpecdraftError(f"{self.path.name}: tensor {name} missing")
        return info, self.mm[info["offset"] : info["offset"] + info["bytes"]]

    def vector(self, name: str) -> torch.Tensor:
        info, data = self.raw(name)
        if info["type"] != F32:
            raise SpecdraftError(f"{self.path.name}: {name} is type {info['type']}, expected F32")
        return torch.from_numpy(np.array(data.view(np.float32)))  # small: copied

    def matrix(self, name: str, omap: torch.Tensor | None = None) -> QuantMatrix:
        info, data = self.raw(name)
        t = info["type"]
        if t not in QTYPES:
            raise SpecdraftError(
                f"{self.path.name}: {name} has ggml type {t}; the quantized runtime takes "
                f"{', '.join(QTYPES.values())}"
            )
        K, N = info["shape"][0], info["shape"][-1]
        row_bytes = K // 32 * BLOCK_BYTES[t]
        if K % 32 or row_bytes * N != info["bytes"]:
            raise SpecdraftError(f"{self.path.name}: {name} has an unexpected size")
        return QuantMatrix(data.reshape(N, row_bytes), t, K, omap)


_HF_MATRICES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}  # QuantLayer field -> a transformers Llama layer's module
_HF_NORMS = ("input_layernorm", "post_attention_layernorm")  # attn_norm, ffn_norm


def _check_widths(name: str, C: int, F: int, D: int, H: int, G: int) -> None:
    if D % 16 or C % 32 or F % 32 or H % G or H * D % 32:
        raise SpecdraftError(f"{name}: widths the quantized kernels do not take (C={C}, F={F}, D={D})")


@dataclass
class QuantWeights:
    """A Llama-family GGUF's weights, in place in the file.

    Attributes:
        path: the GGUF file; ``mm`` its read-only memory map (every matrix is a view of it).
        embed: ``(V, C)`` token embedding (a float table when a feature draft sets its inputs:
            :func:`embed_rows`); ``head`` the LM head (the same matrix when tied).
        inv_freq: ``(D/2,)`` RoPE inverse frequencies (llama3-style ``rope_freqs`` applied).
    """

    path: Path
    mm: np.ndarray
    embed: QuantMatrix | torch.Tensor
    head: QuantMatrix
    norm: torch.Tensor
    layers: list[QuantLayer]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    eps: float
    inv_freq: torch.Tensor
    max_context: int

    @classmethod
    def from_gguf(cls, path: str | Path, repack: bool = True) -> QuantWeights:
        """Map a GGUF file's Llama-family weights (Q4_0 / Q4_1 / Q8_0 matrices, F32 norms), repacked
        into the x8 layout the kernels multiply fastest (``repack=False``: the file's blocks in place,
        for comparisons).

        Raises:
            SpecdraftError: not a GGUF, an architecture other than llama, biases, or block types
                the kernels do not take.
        """
        path = Path(path)
        if not path.is_file():
            raise SpecdraftError(f"GGUF file not found: {path}")
        index = gguf_index(path)
        fields, tensors = index["fields"], index["tensors"]
        arch = _check_llama(fields, tensors)

        def num(key: str, default=None):
            value = fields.get(f"{arch}.{key}", default)
            if value is None:
                raise SpecdraftError(f"{path.name}: GGUF field {arch}.{key} missing")
            return value

        H, G = (
            int(num("attention.head_count")),
            int(num("attention.head_count_kv", num("attention.head_count"))),
        )
        C, L = int(num("embedding_length")), int(num("block_count"))
        D = int(num("attention.key_length", C // H))
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        file = _GGUFTensors(path, mm, tensors)
        vector = file.vector

        def matrix(name: str, omap: torch.Tensor | None = None) -> QuantMatrix:
            m = file.matrix(name, omap)
            if not repack:
                return m
            x8 = m.repacked()  # what the kernels multiply by; the file's pages, read once, are let go
            _drop_pages(mm, m.data)
            return x8

        qmap, kmap = llama_rope_map(H, D), llama_rope_map(G, D)
        layers = [
            QuantLayer(
                attn_norm=vector(f"blk.{i}.attn_norm.weight"),
                ffn_norm=vector(f"blk.{i}.ffn_norm.weight"),
                q=matrix(f"blk.{i}.attn_q.weight", qmap),
                k=matrix(f"blk.{i}.attn_k.weight", kmap),
                v=matrix(f"blk.{i}.attn_v.weight"),
                o=matrix(f"blk.{i}.attn_output.weight"),
                gate=matrix(f"blk.{i}.ffn_gate.weight"),
                up=matrix(f"blk.{i}.ffn_up.weight"),
                down=matrix(f"blk.{i}.ffn_down.weight"),
            )
            for i in range(L)
        ]
        embed = matrix("token_embd.weight")
        head = matrix("output.weight") if "output.weight" in tensors else embed
        base = float(num("rope.freq_base", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
        if "rope_freqs.weight" in tensors:  # llama3-style per-frequency factors: theta / factor
            inv_freq = inv_freq / vector("rope_freqs.weight")
        _check_widths(path.name, C, layers[0].gate.rows, D, H, G)
        return cls(
            path=path,
            mm=mm,
            embed=embed,
            head=head,
            norm=vector("output_norm.weight"),
            layers=layers,
            n_heads=H,
            n_kv_heads=G,
            head_dim=D,
            hidden=C,
            ffn=layers[0].gate.rows,
            eps=float(num("attention.layer_norm_rms_epsilon")),
            inv_freq=inv_freq,
            max_context=int(num("context_length", 2048)),
        )

    @classmethod
    def from_llama(
        cls,
        tensors: dict[str, torch.Tensor],
        config: dict,
        target: QuantWeights,
        head_tokens: torch.Tensor | None = None,
        qtype: int = 8,
    ) -> QuantWeights:
        """A transformers Llama's own tensors (a designed draft's layers and final norm, in
        transformers' names and half-split q / k row order) as ``qtype`` blocks (default Q8_0) made
        here, with ``target``'s embedding (shared, not copied) and its head's rows ``head_tokens``
        (the whole head when None): a designed draft shares the target's embedding and head.

        Args:
            tensors: the draft's tensors (``model.layers.{i}.*``, ``model.norm.weight``).
            config: the draft's ``config.json`` as a dict (no transformers model is built).

        Raises:
            SpecdraftError: a hidden size other than the target's, a tensor missing, biases, RoPE
                scaling, or widths the kernels do not take.
        """
        C, H = int(config["hidden_size"]), int(config["num_attention_heads"])
        G, D = int(config.get("num_key_value_heads") or H), int(config.get("head_dim") or C // H)
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if C != target.hidden:
            raise SpecdraftError(f"draft hidden size {C} is not the target's {target.hidden}")
        if (
            config.get("attention_bias")
            or config.get("mlp_bias")
            or rope.get("rope_type", "default") != "default"
        ):
            raise SpecdraftError("the quantized runtime takes Llama drafts without biases or RoPE scaling")

        def tensor(name: str) -> torch.Tensor:
            if name not in tensors:
                raise SpecdraftError(f"draft tensor {name} missing")
            return tensors[name]

        def layer(i: int) -> QuantLayer:
            p = f"model.layers.{i}."
            mats = {
                m: quantize_matrix(tensor(f"{p}{n}.weight"), qtype).repacked()
                for m, n in _HF_MATRICES.items()
            }
            norms = [tensor(f"{p}{n}.weight").float().contiguous() for n in _HF_NORMS]
            return QuantLayer(*norms, **mats)

        layers = [layer(i) for i in range(int(config["num_hidden_layers"]))]
        _check_widths("draft", C, layers[0].gate.rows, D, H, G)
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        return cls(
            path=target.path,
            mm=target.mm,
            embed=target.embed,
            head=target.head if head_tokens is None else target.head.take_rows(head_tokens).repacked(),
            norm=tensor("model.norm.weight").float().contiguous(),
            layers=layers,
            n_heads=H,
            n_kv_heads=G,
            head_dim=D,
            hidden=C,
            ffn=layers[0].gate.rows,
            eps=float(config["rms_norm_eps"]),
            inv_freq=1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)),
            max_context=int(config.get("max_position_embeddings", target.max_context)),
        )

    def with_layers(self, layer_ids: list[int], head_tokens: torch.Tensor | None = None) -> QuantWeights:
        """These weights' layers ``layer_ids`` (in that order), the same :class:`QuantMatrix` blocks
        (nothing copied), and the head's rows ``head_tokens`` (copied: N rows' blocks) when given:
        a layer-pruned draft of a quantized target."""
        L = len(self.layers)
        if not layer_ids or any(not 0 <= i < L for i in layer_ids) or len(set(layer_ids)) != len(layer_ids):
            raise SpecdraftError(
                f"layer ids {layer_ids} invalid for a {L}-layer target (distinct, in 0..{L - 1})"
            )
        head = self.head if head_tokens is None else self.head.take_rows(head_tokens).repacked()
        return replace(self, layers=[self.layers[i] for i in layer_ids], head=head)

    def embedding_fingerprint(self, block: int = 4096) -> list[float]:
        """:func:`specdraft.design.artifact.fingerprint` of the de-quantized embedding (mean, std,
        the sums of 8 fixed rows), ``block`` rows at a time: never the whole fp32 matrix at once."""
        V, C = self.embed.rows, self.embed.cols
        total = torch.zeros(2, dtype=torch.float64)  # sum, sum of squares
        for a in range(0, V, block):
            e = dequantize_rows(self.embed, torch.arange(a, min(a + block, V))).double()  # (n, C)
            total += torch.stack([e.sum(), (e * e).sum()])
        n = V * C
        mean = total[0] / n
        std = ((total[1] - n * mean * mean) / (n - 1)).sqrt()
        rows = dequantize_rows(self.embed, torch.linspace(0, V - 1, 8).long())  # (8, C)
        return [float(mean), float(std)] + [float(r.sum()) for r in rows]

    @property
    def types(self) -> dict[str, int]:
        """How many matrices of each block type (the embedding's only while it is GGUF blocks)."""
        out: dict[str, int] = {}
        for m in [self.embed, *(getattr(ly, n) for ly in self.layers for n in MATRICES)]:
            if isinstance(m, QuantMatrix):
                out[QTYPES[m.type]] = out.get(QTYPES[m.type], 0) + 1
        return out

    @property
    def precision(self) -> str:
        """What the runtime computes in, for reports: the GGUF block types (``q4_1+q8_0``)."""
        return "+".join(sorted(t.lower() for t in self.types))


def _tree_plan(positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> kernels.TreeLayout:
    """Where each query of a tree step reads its keys: its prefix in chain form, as the native
    attention takes it (:class:`specdraft.kernels.TreeLayout`).

    A query at position p must see the cache's slots ``0 .. c - 1`` (its context) and one token at
    each position ``c .. p``, itself at p: what a chain step over that prefix sees. Those tokens are
    new ones (at their positions) and, first, cached ancestors at slots beyond the context (a tree
    grown over several forwards, such as a draft's), taken in slot order for positions c, c + 1,
    ...; their keys were rotated when written, so the order only sets how the attention sums. Row
    b's map starts at ``lo[b]``, the shortest context among its queries; a query with a longer one
    reads the slots from there to its own ``c`` in place.

    Raises:
        SpecdraftError: a mask that is not such a tree (a query would not equal a chain step).
    """
    B, T = positions.shape
    S = mask.shape[-1]
    pos, slots = positions.to(torch.int64), slots.to(torch.int64)
    sees_new = mask.gather(2, slots.unsqueeze(1).expand(B, T, T))  # (B, T, T): query t sees new token j
    old = mask.clone()
    old[torch.arange(B).unsqueeze(1), :, slots] = False  # (B, T, S): slots written before this step
    ctx = old.to(torch.int64).cumprod(2).sum(2)  # (B, T) c: the leading run of slots 0 .. c - 1
    n_old = old.sum(2)  # (B, T): positions 0 .. n_old - 1 are the cached slots, in slot order
    # ... and positions n_old .. p the new tokens it sees, one at each (counted from c0 on: every
    # query's context covers 0 .. c0 - 1)
    lo = ctx.amin(1)  # (B,)
    c0 = int(lo.min())
    b, t, j = sees_new.nonzero(as_tuple=True)
    rel = pos[b, j] - c0
    ok = bool(sees_new.diagonal(dim1=1, dim2=2).all()) and bool((rel >= 0).all())
    if ok:
        top = int(pos.max()) + 1 - c0
        count = torch.zeros(B, T, top, dtype=torch.int64).index_put_(
            (b, t, rel), torch.ones_like(b), accumulate=True
        )
        at = torch.zeros(B, T, top, dtype=torch.int64)  # the slot of the new token it sees at each position
        at[b, t, rel] = slots[b, j]
        q = c0 + torch.arange(top)
        ok = torch.equal(count, ((q >= n_old.unsqueeze(2)) & (q <= pos.unsqueeze(2))).to(torch.int64))
    if not ok:
        raise SpecdraftError(
            "the quantized runtime takes tree masks only: each query sees the slots before "
            "its context length and one token per position up to its own"
        )
    # (B, T, S - c0): each query's cached slots from c0 on, ascending, then the others
    ranked = torch.sort((~old[..., c0:]).to(torch.int8), dim=2, stable=True).indices + c0
    W = int((pos + 1 - lo.unsqueeze(1)).max())  # the most slots a query reads through the map
    v = (lo.view(B, 1, 1) + torch.arange(W)).expand(B, T, W)  # the positions lo .. lo + W - 1
    cached = ranked.gather(2, (v - c0).clamp(max=S - c0 - 1))
    new = at.gather(2, (v - c0).clamp(max=top - 1))
    vmap = torch.where(v < n_old.unsqueeze(2), cached, torch.where(v <= pos.unsqueeze(2), new, 0))
    return kernels.TreeLayout(slots.contiguous(), lo, vmap.contiguous())


class TreeAttention(ctypes.Structure):
    """``tree_attend`` in quant.c: the attention of a token-tree step (:mod:`specdraft.tree`), bit
    for bit a chain step's.

    quant_layers calls ``rope_attend_tree`` (fewrows.c) in place of ``rope_attend`` once per layer:
    it writes each new token's key and value at its slot and attends each query over its
    :func:`_tree_plan` slots (the context in place, then its ancestors through a slot map) in a
    chain step's order, with a chain step's exact operations (``rope_attend`` is the same kernel
    without the map). So a tree step of n tokens costs a chain step of n tokens plus the plan.

    Args:
        positions, slots: ``(B, T)``; attn_mask: ``(B, T, S)``.
    """

    _fields_ = [
        ("fn", ctypes.c_void_p),
        *[(n, ctypes.c_void_p) for n in ("slot", "lo", "vmap")],
        ("W", ctypes.c_int),
    ]

    def __init__(
        self, positions: torch.Tensor, slots: torch.Tensor, attn_mask: torch.Tensor, kv_dtype=KV_DTYPE
    ):
        self.layout = _tree_plan(positions, slots, attn_mask)  # kept alive: the kernel reads it
        fn = ctypes.cast(getattr(kernels._load(), _ATTEND[kv_dtype][1]), ctypes.c_void_p).value
        super().__init__(fn, *self.layout.pointers())


class QuantRuntime:
    """A Llama-family GGUF run on its own quantized blocks (the :class:`Runtime` protocol).

    Args:
        weights: :class:`QuantWeights` (or a GGUF path).
        variant: kernel variant, ``"avx2"`` or ``"ref"`` (scalar reference; slow, for tests).
        kv_dtype: the key/value cache's dtype, ``torch.float16`` (:data:`KV_DTYPE`) or ``torch.float32``.
    """

    def __init__(self, weights: QuantWeights | str | Path, variant: str | None = None, kv_dtype=KV_DTYPE):
        self.w = weights if isinstance(weights, QuantWeights) else QuantWeights.from_gguf(weights)
        self.variant = variant or variants()[-1]
        if self.variant not in variants():
            raise SpecdraftError(
                f"kernel variant {self.variant!r} not available here: {', '.join(variants())}"
            )
        self.vocab_size = self.w.head.rows
        self.max_context = self.w.max_context
        if kv_dtype not in _ATTEND:
            raise SpecdraftError(f"key/value cache dtype must be float16 or float32, got {kv_dtype}")
        self.dtype = torch.float32  # activations and logits
        self.kv_dtype = kv_dtype
        self._kv_bytes = torch.finfo(kv_dtype).bits // 8
        self._lib = lib()
        fewrows = kernels._load()
        self._attend = ctypes.cast(getattr(fewrows, _ATTEND[kv_dtype][0]), ctypes.c_void_p).value
        self._rmsnorm_fn = fewrows.rmsnorm_f32
        self._rmsnorm = ctypes.cast(fewrows.rmsnorm_f32, ctypes.c_void_p).value
        L = len(self.w.layers)
        self._layers = (QLayer * L)(
            *[
                QLayer(
                    ly.attn_norm.data_ptr(),
                    ly.ffn_norm.data_ptr(),
                    *[getattr(ly, n).struct() for n in MATRICES],
                )
                for ly in self.w.layers
            ]
        )
        self._head = self.w.head.struct()
        self._rope_len = 0
        self._cos = self._sin = None

    def __repr__(self) -> str:
        types = ", ".join(f"{n} {t}" for t, n in self.w.types.items())
        return f"QuantRuntime({len(self.w.layers)} layers, {types}, {self.variant})"

    def new_state(self, batch_size: int, capacity: int) -> LlamaKV:
        w = self.w
        return LlamaKV(len(w.layers), batch_size, w.n_kv_heads, capacity, w.head_dim, self.kv_dtype)

    def _rope_tables(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(n, D)`` half-split cos and sin tables covering positions below ``need``."""
        if need > self._rope_len:
            n = max(need, 2 * self._rope_len, 1024)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.w.inv_freq)  # (n, D/2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (n, D)
            self._cos, self._sin = emb.cos().contiguous(), emb.sin().contiguous()
            self._rope_len = n
        return self._cos, self._sin

    def _layers_call(self, x, pos, off, B, T, cap, first, last, kc, vc, cos, sin, tree):
        w = self.w
        L = last - first
        layers = ctypes.byref(self._layers, first * ctypes.sizeof(QLayer))
        kcs = ctypes.byref(kc, first * ctypes.sizeof(ctypes.c_void_p))
        vcs = ctypes.byref(vc, first * ctypes.sizeof(ctypes.c_void_p))
        kernels._call(
            "specdraft::quant_layers",
            self._lib.quant_layers,
            x.data_ptr(),
            pos.data_ptr(),
            None if off is None else off.data_ptr(),
            B,
            T,
            w.hidden,
            w.n_heads,
            w.n_kv_heads,
            w.head_dim,
            w.ffn,
            cap,
            w.eps,
            L,
            layers,
            kcs,
            vcs,
            cos.data_ptr(),
            sin.data_ptr(),
            self._attend,
            None if tree is None else ctypes.byref(tree),
            self._rmsnorm,
            VARIANTS[self.variant],
            torch.get_num_threads(),
            self._kv_bytes,
        )

    def _run_layers(self, x, pos, off, B, T, state, tree, hidden_layers) -> dict[int, torch.Tensor]:
        """The decoder layers over ``x`` in place, split where ``hidden_layers`` are read; returns them."""
        w = self.w
        cos, sin = self._rope_tables(int(pos.max()) + 1)
        kc, vc = state.pointers()
        hidden: dict[int, torch.Tensor] = {}
        first = 0
        for li in sorted({i for i in hidden_layers if i >= 0}) + [len(w.layers) - 1]:
            if li >= len(w.layers):
                raise SpecdraftError(f"hidden layer {li} beyond the model's {len(w.layers)} layers")
            if li + 1 > first:
                self._layers_call(x, pos, off, B, T, state.capacity, first, li + 1, kc, vc, cos, sin, tree)
                first = li + 1
            if li in hidden_layers:
                hidden[li] = x.clone()
        return hidden

    @torch.inference_mode()
    def forward(
        self,
        state: LlamaKV,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        hidden_layers: tuple[int, ...] = (),
        attn_mask: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Run the layers over new tokens (see :class:`specdraft.models.runtime.Runtime`).

        ``attn_mask`` ``(B, T, S)`` and ``slots`` ``(B, T)``: a token-tree step
        (:mod:`specdraft.tree`, as :meth:`specdraft.models.llama.LlamaRuntime.forward`); each
        node's row is bit for bit a chain step's over the same prefix (:class:`TreeAttention`).

        ``lengths`` ``(B,)``: a ragged step: row b feeds only its first ``lengths[b]`` tokens, the
        rest is padding that costs nothing (not computed, not written to the cache; its logits and
        hidden states are 0). The rows' tokens are packed into one block for the matmuls and each
        row attends over its own cache row (``attend_step`` in quant.c): each row's logits are bit
        for bit those of its own chain step.
        """
        w = self.w
        B, T = tokens.shape
        top = int(positions.max()) if slots is None else max(int(positions.max()), int(slots.max()))
        if slots is not None and attn_mask is None:
            raise SpecdraftError("slots apart from positions need an attention mask over the slots")
        if top >= state.capacity:
            raise SpecdraftError(f"position {top} beyond cache capacity {state.capacity}")
        if state.batch_size != B:
            raise SpecdraftError(f"cache has {state.batch_size} rows, tokens {B}")
        if state.k and state.k[0].dtype != self.kv_dtype:
            raise SpecdraftError(f"cache of {state.k[0].dtype}, this runtime's is {self.kv_dtype}")
        keep = _ragged_rows(lengths, B, T, attn_mask is not None or logits_index is not None)  # (B, T)
        pos = (positions if keep is None else positions[keep]).to(torch.int64).contiguous()
        x = embed_rows(w.embed, tokens if keep is None else tokens[keep])  # (B, T, C) or (N, C)
        off = None if keep is None else torch.cat([torch.zeros(1), lengths.cumsum(0)]).to(torch.int64)
        tree = (
            None
            if attn_mask is None
            else TreeAttention(pos, positions if slots is None else slots, attn_mask, self.kv_dtype)
        )
        hidden = self._run_layers(x, pos, off, B, T, state, tree, hidden_layers)
        normed = torch.empty_like(x)
        kernels._call(
            "specdraft::rms_norm",
            self._rmsnorm_fn,
            x.data_ptr(),
            w.norm.data_ptr(),
            normed.data_ptr(),
            x.numel() // w.hidden,
            w.hidden,
            w.eps,
        )
        if -1 in hidden_layers:
            hidden[-1] = normed
        if logits_index is not None:
            normed = normed.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, w.hidden))
        logits = quant_matmul(w.head, normed, self.variant)  # (B, n, V) or (N, V)
        if keep is not None:
            logits, hidden = _unpack(logits, keep), {i: _unpack(h, keep) for i, h in hidden.items()}
        return ForwardOutput(logits=logits, hidden=hidden)


def _ragged_rows(lengths: torch.Tensor | None, B: int, T: int, masked: bool) -> torch.Tensor | None:
    """``(B, T)`` the tokens a ragged step feeds (row b: its first ``lengths[b]``), or None when
    every row feeds all T (a chain step).

    Raises:
        SpecdraftError: lengths outside 1..T, or a ragged step with a tree mask or ``logits_index``.
    """
    if lengths is None:
        return None
    given = lengths.tolist()  # a list, not tensor reductions: this runs at every speculative step
    if lengths.shape != (B,) or any(n < 1 or n > T for n in given):
        raise SpecdraftError(f"ragged lengths must be ({B},) in 1..{T}, got {given}")
    if all(n == T for n in given):
        return None
    if masked:
        raise SpecdraftError("a ragged step takes neither a tree mask nor logits_index")
    return torch.arange(T) < lengths.unsqueeze(1)


def _unpack(y: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """A ragged step's packed rows ``(N, n)`` back in ``(B, T, n)``, zeros at the padding."""
    out = y.new_zeros(*keep.shape, y.shape[-1])
    out[keep] = y
    return out


def gguf_path(name: str) -> Path:
    """The GGUF file a target name refers to (an alias that ships one, or a ``.gguf`` path).

    Raises:
        SpecdraftError: the name is not a GGUF (a transformers directory, ``tiny``).
    """
    from specdraft.models.loading import resolve_model_path

    ref = resolve_model_path(name)
    if ref.kind == "gguf":
        return ref.path
    if ref.kind == "alias":
        files = ref.package.fingerprint_files()
        if len(files) == 1 and files[0].suffix == ".gguf":  # shipped whole (gemma3-270m ships chunks)
            return files[0]
        raise SpecdraftError(f"{name} ships its GGUF in chunks; give the assembled .gguf file's path")
    raise SpecdraftError(f"the quantized runtime needs a GGUF target, not {name!r}")
