"""One rank's distributed layers: expert parallel over epx (prefill: normal dispatch/combine; decode: low-latency
with hooks) and the tensor-parallel baseline (DP gather -> sharded experts -> reduce-scatter).

Each micro-batch's forward pass is a list of operations cut into stages at yield points, run either in order
(one batch) or by epx.tbo.execute_two_batch_overlap (two micro-batches). Streams (CUDA): `compute` (torch's
current stream of the rank thread), `comm` for the normal dispatch/combine, `side` for the shared expert in
prefill. Low-latency calls stay on `compute`: their hooks split each call into a send launch and a receive launch,
and the shared expert runs between the two while the data is in flight.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

import epx
from epx import eplb, tbo

from model import (Config, DecodeCache, DenseWeights, Segment, attention_decode, attention_prefill, dequantize_fp8,
                   expert_weights, grouped_experts, quantize_fp8, rms_norm, route, swiglu, swiglu_batched)


@dataclass
class MicroBatch:
    rows: slice  # rows of the rank's local batch
    segments: List[Segment] = field(default_factory=list)  # prefill attention
    st: Dict[str, Any] = field(default_factory=dict)  # per-layer scratch


class Rank:
    """Everything one rank holds: weights, placement, buffer, streams."""

    def __init__(self, cfg: Config, group: epx.Group, device: torch.device, dense: List[DenseWeights],
                 location: eplb.ExpertLocation, buffer: epx.Buffer, fp8: bool, ll_max_tokens: int):
        self.cfg, self.group, self.device, self.dense = cfg, group, device, dense
        self.rank, self.num_ranks = group.rank, group.num_ranks
        self.buffer, self.fp8, self.ll_max_tokens = buffer, fp8, ll_max_tokens
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.comm, self.side = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.keep: List[Any] = []  # tensors other streams may still read: dropped after the step's sync
        self.record: Optional[Dict[int, List]] = None  # layer -> [(h, hn, moe)] when checking
        self.set_location(location)
        self.slots_w13: List[torch.Tensor] = []  # per layer [slots_per_rank, 2 * inter, hidden]
        self.slots_w2: List[torch.Tensor] = []  # per layer [slots_per_rank, hidden, inter]
        for layer in range(cfg.layers):
            w13, w2 = self.build_slots(layer, location.phy2log(layer))
            self.slots_w13.append(w13)
            self.slots_w2.append(w2)
        self.counters = [torch.zeros(self.slots_per_rank, dtype=torch.int32, device=device) for _ in dense]

    # ---- placement --------------------------------------------------------------------------------------------

    def set_location(self, location: eplb.ExpertLocation) -> None:
        self.location = location
        self.num_physical = location.num_physical
        self.slots_per_rank = location.num_physical // self.num_ranks
        # Replica choice on the device (graph-capturable) on CUDA; the same rule on the host otherwise.
        self.table = eplb.DeviceReplicaTable.upload(location, self.device.index) if self.cuda else location

    def build_slots(self, layer: int, phy2log) -> tuple:
        first = self.rank * self.slots_per_rank
        pairs = [expert_weights(self.cfg, layer, int(phy2log[first + i]), self.device)
                 for i in range(self.slots_per_rank)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def physical(self, layer: int, topk_logical: torch.Tensor) -> torch.Tensor:
        return eplb.choose_replicas(self.table, layer, topk_logical, self.rank)

    # ---- streams ----------------------------------------------------------------------------------------------

    def wait(self, waiter: str, producer: str) -> None:
        if self.cuda:
            getattr(self, waiter).wait_stream(getattr(self, producer))

    def on(self, name: str):
        return torch.cuda.stream(getattr(self, name)) if self.cuda else contextlib.nullcontext()

    def stream_arg(self, name: str):
        return getattr(self, name) if self.cuda else None

    def end_step(self) -> None:
        if self.cuda:
            for s in (self.comm, self.side):
                self.compute.wait_stream(s)
            self.compute.synchronize()
        self.keep.clear()

    def _record(self, layer: int, h, hn, moe) -> None:
        if self.record is not None:
            self.record.setdefault(layer, []).append((h.detach().clone(), hn.detach().clone(), moe.detach().clone()))

    # ---- prefill: EP over epx's normal dispatch/combine ------------------------------------------------------

    def prefill_ops(self, xs: List[torch.Tensor], mbs: List[MicroBatch]) -> list:
        """Per layer: attn gate shared dispatch | experts combine | output (the next layer's attn joins the
        last stage, as SGLang concatenates layers). xs[l]: the local batch's input of layer l [T, H]."""
        ops: list = []
        for layer in range(self.cfg.layers):
            w = self.dense[layer]

            def attn(i, layer=layer, w=w):
                mb = mbs[i]
                x = xs[layer][mb.rows]
                mb.st["h"] = h = x + attention_prefill(xs[layer], mb.segments, w, self.cfg)
                mb.st["hn"] = rms_norm(h)

            def gate(i, layer=layer, w=w):
                st = mbs[i].st
                idx, st["w"] = route(st["hn"], w, self.cfg)
                st["idx"] = self.physical(layer, idx)
                if self.fp8:
                    st["q"], st["scales"] = quantize_fp8(st["hn"])

            def shared(i, w=w):
                st = mbs[i].st
                self.wait("side", "compute")
                with self.on("side"):
                    st["shared"] = swiglu(st["hn"], w.shared_w13, w.shared_w2)
                self.keep.append(st["hn"])

            def dispatch(i):
                st = mbs[i].st
                self.wait("comm", "compute")
                x = st["q"] if self.fp8 else st["hn"]
                st["recv"] = self.buffer.dispatch(x, st["idx"], st["w"], num_experts=self.num_physical,
                                                  x_scales=st.get("scales"), stream=self.stream_arg("comm"))
                self.keep.extend([x, st["idx"], st["w"], st.get("scales")])

            def experts(i, layer=layer):
                st = mbs[i].st
                self.wait("compute", "comm")
                recv = st["recv"]
                x = dequantize_fp8(recv.recv_x, recv.recv_x_scales) if self.fp8 else recv.recv_x
                st["y"] = grouped_experts(x, recv.recv_topk_idx, recv.recv_topk_weights,
                                          recv.num_recv_tokens_per_expert,
                                          lambda e: (self.slots_w13[layer][e], self.slots_w2[layer][e]))
                self.keep.append(recv)

            def combine(i):
                st = mbs[i].st
                self.wait("comm", "compute")
                st["out"] = self.buffer.combine(st["y"], st["recv"].handle, stream=self.stream_arg("comm")).x
                self.keep.append(st["y"])

            def output(i, layer=layer):
                mb = mbs[i]
                st = mb.st
                self.wait("compute", "comm")
                self.wait("compute", "side")
                moe = (st["out"].float() + st["shared"].float()).to(st["h"].dtype)
                xs[layer + 1][mb.rows] = st["h"] + moe
                self.keep.extend([st["out"], st["shared"]])
                self._record(layer, st["h"], st["hn"], moe)

            ops += [("attn", attn), ("gate", gate), ("shared_experts", shared), ("dispatch", dispatch), tbo.YIELD,
                    ("experts", experts), ("combine", combine), tbo.YIELD, ("output", output)]
        return ops

    # ---- decode: EP over the low-latency path, hooks, CUDA graph ---------------------------------------------

    def decode_ops(self, xs: List[torch.Tensor], mbs: List[MicroBatch], caches: List[DecodeCache]) -> list:
        """Per layer: attn gate dispatch-send shared | dispatch-recv experts combine-send | combine-recv output."""
        ops: list = []
        m, cfg = self.ll_max_tokens, self.cfg
        for layer in range(cfg.layers):
            w = self.dense[layer]

            def attn_gate_send(i, layer=layer, w=w):
                mb = mbs[i]
                st = mb.st
                x = xs[layer][mb.rows]
                st["h"] = h = x + attention_decode(x, mb.rows, caches[layer], w, cfg)
                st["hn"] = hn = rms_norm(h)
                idx, st["w"] = route(hn, w, cfg)
                st["idx"] = self.physical(layer, idx)
                st["d"] = self.buffer.low_latency_dispatch(
                    hn, st["idx"], m, self.num_physical, use_fp8=self.fp8, return_recv_hook=True,
                    cumulative_recv_counts=self.counters[layer])

            def shared(i, w=w):  # runs while the dispatch's data is in flight
                st = mbs[i].st
                st["shared"] = swiglu(st["hn"], w.shared_w13, w.shared_w2)

            def recv_experts_send(i, layer=layer):
                st = mbs[i].st
                d = st["d"]
                d.recv_hook()
                x = dequantize_fp8(d.recv_x, d.recv_x_scales) if self.fp8 else d.recv_x
                # Masked grouped GEMM: rows [0, recv_count[e]) of each expert's block are the received pairs; the
                # rows past it are computed too (torch has no masked grouped GEMM) and never read by the combine.
                y = swiglu_batched(x, self.slots_w13[layer], self.slots_w2[layer])
                st["c"] = self.buffer.low_latency_combine(y, st["idx"], st["w"], d.handle, return_recv_hook=True)
                st["y"] = y

            def recv_output(i, layer=layer):
                mb = mbs[i]
                st = mb.st
                st["c"].recv_hook()
                moe = (st["c"].x.float() + st["shared"].float()).to(st["h"].dtype)
                xs[layer + 1][mb.rows] = st["h"] + moe
                self._record(layer, st["h"], st["hn"], moe)

            ops += [("attn_gate_dispatch_send", attn_gate_send), ("shared_experts", shared), tbo.YIELD,
                    ("dispatch_recv_experts_combine_send", recv_experts_send), tbo.YIELD,
                    ("combine_recv_output", recv_output)]
        return ops

    # ---- tensor-parallel baseline ----------------------------------------------------------------------------

    def build_tp(self) -> None:
        """Each rank: every expert's columns [r * I / R, (r + 1) * I / R) of gate/up and those rows of down."""
        cfg, r, n = self.cfg, self.rank, self.num_ranks
        i, si = cfg.inter // n, cfg.shared_inter // n
        self.tp_w13, self.tp_w2, self.tp_shared = [], [], []
        for layer in range(cfg.layers):
            w13s, w2s = [], []
            for e in range(cfg.num_experts):
                w13, w2 = expert_weights(cfg, layer, e, self.device)
                w13s.append(torch.cat([w13[r * i:(r + 1) * i], w13[cfg.inter + r * i:cfg.inter + (r + 1) * i]]))
                w2s.append(w2[:, r * i:(r + 1) * i].contiguous())
            self.tp_w13.append(torch.stack(w13s))
            self.tp_w2.append(torch.stack(w2s))
            d = self.dense[layer]
            self.tp_shared.append((torch.cat([d.shared_w13[r * si:(r + 1) * si],
                                              d.shared_w13[cfg.shared_inter + r * si:cfg.shared_inter + (r + 1) * si]]),
                                   d.shared_w2[:, r * si:(r + 1) * si].contiguous()))

    def tp_moe(self, layer: int, dpc, plan, hn: torch.Tensor) -> torch.Tensor:
        """DP gather -> route the global batch (identically on every rank) -> this rank's slice of every expert and
        of the shared expert, summed in fp32 -> reduce-scatter back to the DP ranks (epx.dp)."""
        g = dpc.gather(plan, hn)  # [buffer_len, H]
        idx, w = route(g, self.dense[layer], self.cfg)
        partial = grouped_experts(g, idx, w, None, lambda e: (self.tp_w13[layer][e], self.tp_w2[layer][e]),
                                  out_dtype=torch.float32)
        partial = partial + swiglu(g, *self.tp_shared[layer]).float()
        return dpc.reduce_scatter(plan, partial).to(hn.dtype)
