"""The layer itself: DeepSeek-V3's MoE shapes, weights drawn from a seed, and the single-device reference.

Everything here is plain torch and runs on CPU tensors and CUDA tensors alike; nothing here talks to epx.

Shapes (DeepSeek-V3 defaults): hidden 7168; 256 routed SwiGLU experts of intermediate 2048 (gate/up/down) and one
shared expert of the same size; top-8 routing over 8 groups of which the best 4 are kept (sigmoid scores plus a
score-correction bias for the choice, weights = the unbiased scores of the chosen experts normalized over the
top-k, times the routed scaling factor 2.5). Attention is a plain multi-head attention of the same hidden size
(head dim 128, torch SDPA), not DeepSeek's MLA.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # float8 e4m3fn
BLOCK = 128  # fp8 scale block along hidden


@dataclass
class Config:
    hidden: int = 7168
    num_experts: int = 256  # logical (routed) experts
    num_redundant: int = 32  # extra physical slots for EPLB replicas (rounded up to a multiple of the ranks)
    inter: int = 2048  # routed expert intermediate size
    shared_inter: int = 2048  # one shared expert (DeepSeek-V3: n_shared_experts 1 x 2048)
    topk: int = 8
    num_groups: int = 8
    topk_groups: int = 4
    routed_scaling: float = 2.5
    layers: int = 1
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return min(128, self.hidden)

    @property
    def num_heads(self) -> int:
        return self.hidden // self.head_dim

    def num_physical(self, num_ranks: int) -> int:
        p = self.num_experts + self.num_redundant
        return -(-p // num_ranks) * num_ranks

    def check(self, num_ranks: int) -> None:
        problems = []
        if self.hidden % BLOCK:
            problems.append(f"--hidden {self.hidden} must be a multiple of {BLOCK} (fp8 blocks, low-latency path)")
        if self.num_experts % self.num_groups:
            problems.append(f"--experts {self.num_experts} must divide into {self.num_groups} groups")
        elif self.num_experts // self.num_groups < 2:
            problems.append("each expert group needs >= 2 experts (group score = sum of its top-2)")
        elif self.topk_groups * (self.num_experts // self.num_groups) < self.topk:
            problems.append(f"top-{self.topk_groups} groups hold fewer than top-{self.topk} experts")
        if self.num_experts % num_ranks:
            problems.append(f"--experts {self.num_experts} must divide over {num_ranks} ranks")
        if self.inter % num_ranks or self.shared_inter % num_ranks:
            problems.append(f"--inter must divide over {num_ranks} ranks (tensor-parallel baseline)")
        if problems:
            raise SystemExit("moe_layer: " + "; ".join(problems))

    def as_dict(self) -> Dict:
        return asdict(self)


# ---- weights from a seed ------------------------------------------------------------------------------------

_KINDS = {"attn_qkv": 1, "attn_o": 2, "gate": 3, "bias": 4, "expert": 5, "shared": 6}


def _seed(cfg: Config, layer: int, kind: str, index: int = 0) -> int:
    return (cfg.seed * 1_000_003 + layer * 100_019 + _KINDS[kind] * 10_007 + index) % (2 ** 62)


def _randn(shape, seed: int, std: float, device, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)


def expert_weights(cfg: Config, layer: int, expert: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Logical expert `expert` of `layer`: w13 [2 * inter, hidden] (gate rows, then up rows), w2 [hidden, inter].

    A pure function of (seed, layer, expert) on a device type, so any rank can build any replica and the
    reference and the tensor-parallel baseline hold the same numbers.
    """
    s = _seed(cfg, layer, "expert", expert)
    w13 = _randn((2 * cfg.inter, cfg.hidden), s, 1 / math.sqrt(cfg.hidden), device)
    w2 = _randn((cfg.hidden, cfg.inter), s + 1, 1 / math.sqrt(cfg.inter), device)
    return w13, w2


@dataclass
class DenseWeights:
    """The non-expert weights of one layer (every rank holds them all: DP attention)."""

    wqkv: torch.Tensor  # [3 * hidden, hidden]
    wo: torch.Tensor  # [hidden, hidden]
    gate: torch.Tensor  # [num_experts, hidden] fp32
    bias: torch.Tensor  # [num_experts] fp32: DeepSeek-V3's e_score_correction_bias
    shared_w13: torch.Tensor  # [2 * shared_inter, hidden]
    shared_w2: torch.Tensor  # [hidden, shared_inter]


def dense_weights(cfg: Config, layer: int, device) -> DenseWeights:
    h = cfg.hidden
    s = _seed(cfg, layer, "shared")
    return DenseWeights(
        wqkv=_randn((3 * h, h), _seed(cfg, layer, "attn_qkv"), 1 / math.sqrt(h), device),
        wo=_randn((h, h), _seed(cfg, layer, "attn_o"), 1 / math.sqrt(h), device),
        gate=_randn((cfg.num_experts, h), _seed(cfg, layer, "gate"), 1 / math.sqrt(h), device, torch.float32),
        bias=_randn((cfg.num_experts,), _seed(cfg, layer, "bias"), 0.01, device, torch.float32),
        shared_w13=_randn((2 * cfg.shared_inter, h), s, 1 / math.sqrt(h), device),
        shared_w2=_randn((h, cfg.shared_inter), s + 1, 1 / math.sqrt(cfg.shared_inter), device))


def zipf_bias(cfg: Config, exponent: float, strength: float, seed: int, device) -> torch.Tensor:
    """A score-correction bias that skews the choice toward a Zipf popularity (random expert order).

    bias[e] = strength * log(p[e]) with p ~ 1 / rank^exponent, shifted to mean 0: hot experts win the top-k more
    often while the weights (unbiased scores) stay as they were, as DeepSeek-V3's bias does.
    """
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(cfg.num_experts, generator=g)
    logp = -exponent * torch.log(torch.arange(1, cfg.num_experts + 1, dtype=torch.float64))
    bias = torch.empty(cfg.num_experts, dtype=torch.float64)
    bias[order] = strength * (logp - logp.mean())
    return bias.to(torch.float32).to(device)


# ---- building blocks ----------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """[n, hidden] bf16 -> [n, hidden] bf16 through one SwiGLU expert (w13 may be a tensor-parallel slice)."""
    gu = x @ w13.t()
    g, u = gu.chunk(2, dim=-1)
    return (F.silu(g.float()) * u.float()).to(x.dtype) @ w2.t()


def swiglu_batched(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """[E, n, hidden] through E experts at once (w13 [E, 2I, H], w2 [E, H, I]): the masked grouped GEMM."""
    gu = torch.bmm(x, w13.transpose(1, 2))
    g, u = gu.chunk(2, dim=-1)
    return torch.bmm((F.silu(g.float()) * u.float()).to(x.dtype), w2.transpose(1, 2))


def route(h: torch.Tensor, w: DenseWeights, cfg: Config) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 grouped top-k ("noaux_tc"): h [T, hidden] -> (topk_idx int64 [T, K], topk_weights fp32 [T, K]).

    NOTE: the scores are computed in float64 so that the choice does not depend on the batch shape (a TBO half,
    the gathered batch of the TP baseline and the reference see the same token in differently sized GEMMs; in
    fp32 a near-tie between the 8th and 9th expert would flip in about one token of 10^4).
    """
    t = h.shape[0]
    scores = torch.sigmoid(h.double() @ w.gate.double().t())  # [T, E]
    choice = scores + w.bias.double()
    groups = choice.view(t, cfg.num_groups, -1)
    group_scores = groups.topk(2, dim=-1).values.sum(-1)  # [T, G]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(cfg.topk_groups, dim=-1).indices, True)
    masked = groups.masked_fill(~keep[:, :, None], float("-inf")).view(t, -1)
    idx = masked.topk(cfg.topk, dim=-1).indices
    weights = scores.gather(1, idx)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling
    return idx, weights.float()


def quantize_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-channel blocks: (e4m3 [T, H], fp32 scales [T, H / 128]), scale = amax / 448."""
    t, h = x.shape
    blocks = x.float().view(t, h // BLOCK, BLOCK)
    scales = blocks.abs().amax(-1).clamp_min(1e-10) / FP8_MAX
    q = (blocks / scales[:, :, None]).to(torch.float8_e4m3fn).view(t, h)
    return q, scales.contiguous()


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """Inverse of quantize_fp8 for [..., H] data and [..., H / 128] scales (any leading dims)."""
    blocks = q.float().unflatten(-1, (-1, BLOCK)) * scales.float()[..., None]
    return blocks.flatten(-2).to(dtype)


def qdq_fp8(x: torch.Tensor) -> torch.Tensor:
    return dequantize_fp8(*quantize_fp8(x))


def grouped_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    counts: Optional[Sequence[int]], weights_of, out_dtype=None) -> torch.Tensor:
    """sum_k w[t, k] * expert_{idx[t, k]}(x[t]) for rows x [N, H]; idx -1 = none. fp32 sums, bf16 result.

    A grouped GEMM written as one GEMM pair per expert over that expert's rows (sorted once). `counts`: the rows
    per expert id when known on the host (the normal dispatch reports them), else computed here (one host sync).
    `weights_of(e)` gives (w13, w2) of expert id e. out_dtype: the result's (default x's).
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    valid = topk_idx >= 0
    rows, ks = valid.nonzero(as_tuple=True)
    experts = topk_idx[rows, ks]
    order = torch.argsort(experts, stable=True)
    rows, ks, experts = rows[order], ks[order], experts[order]
    if counts is None:
        num = int(topk_idx.max().item()) + 1 if rows.numel() else 0
        counts = torch.bincount(experts, minlength=num).tolist()
    xs = x[rows]
    ws = topk_weights[rows, ks].float()
    ys = torch.empty_like(xs)
    begin = 0
    for e, c in enumerate(counts):
        if c:
            w13, w2 = weights_of(e)
            ys[begin:begin + c] = swiglu(xs[begin:begin + c], w13, w2)
            begin += c
    out.index_add_(0, rows, ys.float() * ws[:, None])
    return out.to(out_dtype or x.dtype)


# ---- attention ------------------------------------------------------------------------------------------------


@dataclass
class Segment:
    """Query rows [q_begin, q_end) of the local batch attend to key rows [k_begin, q_end) (causal)."""

    q_begin: int
    q_end: int
    k_begin: int


def segments_of(seq_lens: Sequence[int]) -> List[Segment]:
    out, pos = [], 0
    for n in seq_lens:
        out.append(Segment(pos, pos + n, pos))
        pos += n
    return out


def attention_prefill(x: torch.Tensor, segments: Sequence[Segment], w: DenseWeights, cfg: Config) -> torch.Tensor:
    """Causal self-attention of the query rows of `segments` of the local batch x [T, H] -> [rows, H].

    A segment whose keys start before its queries (the second half of a sequence cut by a two-chunk TBO split)
    recomputes the projections of its prefix rows: they belong to the other micro-batch.
    """
    outs = []
    d, nh = cfg.head_dim, cfg.num_heads
    for s in segments:
        qkv = rms_norm(x[s.k_begin:s.q_end]) @ w.wqkv.t()
        q, k, v = (t.view(-1, nh, d).transpose(0, 1) for t in qkv.chunk(3, dim=-1))  # [nh, L, d]
        prefix = s.q_begin - s.k_begin
        q = q[:, prefix:]
        if prefix:
            lq, lk = q.shape[1], k.shape[1]
            mask = torch.arange(lk, device=x.device)[None, :] <= prefix + torch.arange(lq, device=x.device)[:, None]
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
        else:
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        outs.append(o.transpose(0, 1).reshape(-1, cfg.hidden))
    if not outs:
        return x.new_zeros((0, cfg.hidden))
    return torch.cat(outs) @ w.wo.t()


class DecodeCache:
    """A fixed-shape KV cache for decode steps (CUDA-graph friendly): `num_seqs` sequences, each with a prefix of
    `prefix_lens[i]` cached tokens; each step writes the new token's k/v at position prefix_lens[i] (the same slot
    every step: the steps benchmark the same position rather than growing the sequences)."""

    def __init__(self, cfg: Config, layer_x: torch.Tensor, prefix_lens: Sequence[int], w: DenseWeights):
        nh, d = cfg.num_heads, cfg.head_dim
        self.num_seqs = len(prefix_lens)
        cap = max(prefix_lens, default=0) + 1
        dev = layer_x.device
        self.k = torch.zeros(max(self.num_seqs, 1), nh, cap, d, dtype=layer_x.dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        pos = 0
        for i, n in enumerate(prefix_lens):  # the prefix's keys and values from a prefill of layer_x rows
            qkv = rms_norm(layer_x[pos:pos + n]) @ w.wqkv.t()
            _, k, v = (t.view(-1, nh, d).transpose(0, 1) for t in qkv.chunk(3, dim=-1))
            self.k[i, :, :n], self.v[i, :, :n] = k, v
            pos += n
        lens = torch.tensor(list(prefix_lens) or [0], device=dev)
        self.pos = lens  # [num_seqs]: where the new token goes
        self.mask = torch.arange(cap, device=dev)[None, :] <= lens[:, None]  # [num_seqs, cap]


def attention_decode(x: torch.Tensor, rows: slice, cache: DecodeCache, w: DenseWeights, cfg: Config) -> torch.Tensor:
    """One new token per sequence, x [B, H] (sequences `rows` of the cache) -> [B, H]. Fixed shapes."""
    nh, d = cfg.num_heads, cfg.head_dim
    b = x.shape[0]
    qkv = rms_norm(x) @ w.wqkv.t()
    q, k, v = (t.view(b, nh, 1, d) for t in qkv.chunk(3, dim=-1))
    kc, vc, pos = cache.k[rows], cache.v[rows], cache.pos[rows]
    sel = torch.arange(b, device=x.device)
    kc[sel, :, pos] = k[:, :, 0]  # kc is a view of the cache: the step writes its token in place
    vc[sel, :, pos] = v[:, :, 0]
    o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=cache.mask[rows][:, None, None, :])
    return o.reshape(b, cfg.hidden) @ w.wo.t()


# ---- the reference --------------------------------------------------------------------------------------------


class Reference:
    """The same layer on one device with the same weights: routed experts by logical id, no communication.

    Expert weights are regenerated on demand (cached when small), so the full DeepSeek-V3 layer needs no second
    copy of its 22.5 GB of expert weights per layer.
    """

    def __init__(self, cfg: Config, device, dense: List[DenseWeights], cache_experts: bool):
        self.cfg, self.device, self.dense = cfg, device, dense
        self.cache = {} if cache_experts else None

    def expert(self, layer: int, e: int):
        if self.cache is None:
            return expert_weights(self.cfg, layer, e, self.device)
        key = (layer, e)
        if key not in self.cache:
            self.cache[key] = expert_weights(self.cfg, layer, e, self.device)
        return self.cache[key]

    def moe(self, layer: int, h: torch.Tensor, fp8: bool = False) -> torch.Tensor:
        """The MoE block's output for normalized hidden states h [T, H]: routed experts + the shared expert."""
        w = self.dense[layer]
        idx, weights = route(h, w, self.cfg)
        xin = qdq_fp8(h) if fp8 else h
        routed = grouped_experts(xin, idx, weights, None, lambda e: self.expert(layer, e))
        return (routed.float() + swiglu(h, w.shared_w13, w.shared_w2).float()).to(h.dtype)

    def attention(self, layer: int, x: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        return attention_prefill(x, segments_of(seq_lens), self.dense[layer], self.cfg)


def error_stats(out: torch.Tensor, ref: torch.Tensor) -> Dict[str, float]:
    diff = (out.float() - ref.float()).abs()
    scale = ref.float().abs().max().item() if ref.numel() else 0.0
    return {"max_abs_err": diff.max().item() if diff.numel() else 0.0,
            "mean_abs_err": diff.mean().item() if diff.numel() else 0.0,
            "max_abs_ref": scale, "rows": int(ref.shape[0])}
