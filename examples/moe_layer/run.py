"""An end-to-end DeepSeek-V3-shaped MoE decoder layer in PyTorch on epx (issue 18).

Ranks are Python threads of this process (epx.cuda_groups / epx.host_groups): `--devices 0,1` puts one rank on each
GPU, `--devices 0,0` two ranks on one GPU, `--backend host` runs everything on the CPU with epx's host backend.
Steps: prefill (DP attention, normal dispatch -> experts -> combine, the shared expert on a side stream, bf16 and
fp8, with and without TBO), decode (low-latency dispatch with hooks, masked grouped GEMM, low-latency combine,
CUDA graph, with and without TBO), the tensor-parallel baseline, and EPLB live on Zipf-skewed decode steps. Every
distributed output is checked against a single-device reference with the same weights.

    python examples/moe_layer/run.py --devices 0,1 --json out.json --plot out.png
    python examples/moe_layer/run.py --backend host --ranks 2 --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Dict, List


def _prepare_for_a_shared_gpu(argv: List[str]) -> None:
    """Two rank threads on one GPU: CUDA serializes the whole GPU for some host calls, and a peer rank's epx kernel
    that spins until this rank joins the call then never ends (until the timeout): a deadlock. Seen on 1x H200:
    - the first launch of a lazily loaded module (SDPA's first launch): loads modules up front instead;
    - device memory allocations (the CUDA programming guide's "implicit synchronization": commands of two streams
      cannot overlap across a cudaMalloc), which torch's caching allocator makes whenever its pool grows: the
      first prefill's dispatch timed out in notify with the peer's notify never started. torch's cudaMallocAsync
      backend allocates in stream order instead;
    - hardware work queues: CUDA maps streams onto CUDA_DEVICE_MAX_CONNECTIONS queues (8 by default), and a queue
      runs in order, so with more streams than queues (two ranks use ~16 here) one rank's stream can wait behind a
      peer's spinning kernel that waits for it: the prefill still timed out in notify and in the combine's receive
      with the two fixes above. 32 queues give every stream its own.
    All must be set before CUDA starts, so this runs before torch is imported; warm_up_alone covers the rest."""
    devices = None
    for i, a in enumerate(argv):
        if a == "--devices" and i + 1 < len(argv):
            devices = argv[i + 1]
        elif a.startswith("--devices="):
            devices = a.split("=", 1)[1]
    if devices is not None:
        ids = [d.strip() for d in devices.split(",") if d.strip()]
        if len(ids) != len(set(ids)):
            os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")


_prepare_for_a_shared_gpu(sys.argv[1:])

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import epx  # noqa: E402
from epx import dp, eplb, tbo  # noqa: E402

import eplb_live  # noqa: E402
from collectives import DpComm, Exchange, plan_step, record  # noqa: E402
from layers import MicroBatch, Rank  # noqa: E402
from model import (Config, DecodeCache, Reference, Segment, attention_decode, attention_prefill, dense_weights,  # noqa: E402
                   dequantize_fp8, error_stats, grouped_experts, quantize_fp8, rms_norm, route, segments_of, swiglu,
                   swiglu_batched, zipf_bias)

TOLERANCE = {"bf16": 2 ** -6, "fp8": 2 ** -4}  # max |out - ref| <= tol * max |ref|


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["cuda", "host"], default=None, help="default: cuda when available")
    p.add_argument("--devices", default="0", help="cuda: one GPU ordinal per rank, e.g. 0,1 or 0,0")
    p.add_argument("--ranks", type=int, default=2, help="host: number of ranks")
    p.add_argument("--tiny", action="store_true", help="small shapes for tests: hidden 256, 16 experts, inter 64")
    p.add_argument("--hidden", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--redundant", type=int)
    p.add_argument("--inter", type=int)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-tokens", type=int, help="tokens of rank 0 (later ranks get fewer)")
    p.add_argument("--seqs", type=int, default=4, help="prefill sequences per rank")
    p.add_argument("--decode-tokens", type=int, help="decode batch of rank 0 (= low-latency max tokens per rank)")
    p.add_argument("--decode-context", type=int, help="cached prefix length per decode sequence (at most)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--eplb-steps", type=int, help="Zipf decode steps; a rebalance after the first half")
    p.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the expert popularity")
    p.add_argument("--zipf-strength", type=float, default=0.15,
                   help="bias = strength * log(popularity); the sigmoid scores spread about 0.2")
    p.add_argument("--sms", type=int, default=24)
    p.add_argument("--no-copy-engines", action="store_true",
                   help="cuda: normal dispatch/combine on the SM rings instead of the copy engines")
    p.add_argument("--stage-timeline", action="store_true",
                   help="cuda: print each copy-engine call's stage times to stderr (a debug aid)")
    p.add_argument("--timeout-ms", type=int, default=120_000)
    p.add_argument("--no-tbo", action="store_true")
    p.add_argument("--no-fp8", action="store_true")
    p.add_argument("--no-tp", action="store_true")
    p.add_argument("--no-graph", action="store_true", help="cuda: run decode eagerly")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    if args.backend is None:
        args.backend = "cuda" if torch.cuda.is_available() and epx.built_with_cuda() else "host"
    tiny = args.tiny or args.backend == "host"
    defaults = dict(hidden=256 if tiny else 7168, experts=16 if tiny else 256, redundant=4 if tiny else 32,
                    inter=64 if tiny else 2048, prefill_tokens=48 if tiny else 4096, decode_tokens=8 if tiny else 64,
                    decode_context=16 if tiny else 512, eplb_steps=8 if tiny else 40)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def make_inputs(args, cfg: Config, num_ranks: int) -> List[Dict]:
    """Per rank (CPU tensors): prefill batch of different length per rank, decode batch and its cached prefixes."""
    g = torch.Generator().manual_seed(args.seed + 7)
    out = []
    for r in range(num_ranks):
        total = max(args.seqs, int(args.prefill_tokens * (1 - 0.5 * r / max(1, num_ranks - 1))))
        cuts = torch.randperm(total - 1, generator=g)[:args.seqs - 1].sort().values + 1
        bounds = [0] + cuts.tolist() + [total]
        seq_lens = [b - a for a, b in zip(bounds, bounds[1:])]
        b = max(1, args.decode_tokens - r * args.decode_tokens // (2 * num_ranks))
        prefix = (torch.randint(1, args.decode_context + 1, (b,), generator=g)).tolist()
        out.append(dict(x=torch.randn(total, cfg.hidden, generator=g).to(torch.bfloat16), seq_lens=seq_lens,
                        xd=torch.randn(b, cfg.hidden, generator=g).to(torch.bfloat16), prefix=prefix,
                        prefix_x=torch.randn(sum(prefix), cfg.hidden, generator=g).to(torch.bfloat16),
                        pool=[torch.randn(b, cfg.hidden, generator=g).to(torch.bfloat16) for _ in range(4)]))
    return out


def run_ops(ops, two_batches: bool, delta: int) -> None:
    if two_batches:
        tbo.execute_two_batch_overlap(ops, ops, delta)
    else:
        for op in ops:
            if op is not tbo.YIELD:
                op[1](0)


def prefill_micro_batches(seq_lens: List[int], use_tbo: bool) -> List[MicroBatch]:
    total = sum(seq_lens)
    if not use_tbo:
        return [MicroBatch(slice(0, total), segments_of(seq_lens))]
    split = tbo.compute_tbo_split("EXTEND", total, extend_lens=seq_lens)
    cut = split.split_token_index
    a, b = [], []
    for s in segments_of(seq_lens):  # a sequence that straddles the cut (two_chunk) is split, keys shared
        if s.q_end <= cut:
            a.append(s)
        elif s.q_begin >= cut:
            b.append(s)
        else:
            a.append(Segment(s.q_begin, cut, s.k_begin))
            b.append(Segment(cut, s.q_end, s.k_begin))
    return [MicroBatch(slice(0, cut), a), MicroBatch(slice(cut, total), b)]


def warm_up_alone(rank: Rank, x: torch.Tensor, seq_lens) -> None:
    """Runs each torch op of the steps once on each stream this rank uses, before its first epx call, then waits for
    the GPU: first launches create cuBLAS handles and workspaces, load modules and grow the allocator's pool, and on
    a GPU that ranks share such a call can wait for the peer's spinning epx kernel (see _prepare_for_a_shared_gpu)."""
    w, cfg = rank.dense[0], rank.cfg
    for stream in (rank.compute, rank.side, rank.comm):
        with torch.cuda.stream(stream):
            h = x + attention_prefill(x, segments_of(seq_lens), w, cfg)
            hn = rms_norm(h)
            idx, weights = route(hn, w, cfg)
            local = torch.where(idx < rank.slots_per_rank, idx, -1)
            grouped_experts(dequantize_fp8(*quantize_fp8(hn)), local, weights, None,
                            lambda e: (rank.slots_w13[0][e], rank.slots_w2[0][e]))
            swiglu(hn, w.shared_w13, w.shared_w2)
            swiglu_batched(hn[None], rank.slots_w13[0][:1], rank.slots_w2[0][:1])
    torch.cuda.synchronize(rank.device)


def rank_main(rank_idx: int, group: epx.Group, args, cfg: Config, inputs: List[Dict], exchange: Exchange,
              devices: List[str], use_epx_dp: bool, log) -> Dict:
    try:
        return _rank_main(rank_idx, group, args, cfg, inputs, exchange, devices, use_epx_dp, log)
    except BaseException:
        # NOTE: run_host_ranks raises a rank's exception only when it joins that rank, after the ranks before it;
        # a peer left waiting in an epx call would hide it until its timeout, so say it now.
        print(f"rank {rank_idx} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise


def _rank_main(rank_idx: int, group: epx.Group, args, cfg: Config, inputs: List[Dict], exchange: Exchange,
               devices: List[str], use_epx_dp: bool, log) -> Dict:
    device = torch.device(devices[rank_idx])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # NOTE: ranks sharing a GPU must not share its legacy default stream (a spinning kernel would block
        # the peer's work queued behind it), so each rank thread runs on a stream of its own.
        with torch.cuda.stream(torch.cuda.Stream(device)):
            return _rank_body(rank_idx, group, args, cfg, inputs, exchange, device, use_epx_dp, log)
    return _rank_body(rank_idx, group, args, cfg, inputs, exchange, device, use_epx_dp, log)


def _rank_body(rank_idx, group, args, cfg, inputs, exchange, device, use_epx_dp, log) -> Dict:
    num_ranks = group.num_ranks
    mine = {k: ([t.to(device) for t in v] if k == "pool" else v.to(device) if torch.is_tensor(v) else v)
            for k, v in inputs[rank_idx].items()}
    m = max(len(i["prefix"]) for i in inputs)  # low-latency max tokens per rank: the largest decode batch
    p = cfg.num_physical(num_ranks)
    dense = [dense_weights(cfg, layer, device) for layer in range(cfg.layers)]
    location = eplb.ExpertLocation.trivial(cfg.layers, cfg.num_experts, p, num_ranks)
    max_tokens = max(i["x"].shape[0] for i in inputs)
    normal = epx.NormalConfig()
    normal.copy_engines = not args.no_copy_engines
    normal.stage_timeline = args.stage_timeline
    buffer = epx.Buffer(group, num_sms=args.sms, normal=normal,
                        num_normal_bytes=epx.normal_buffer_size_hint(cfg.hidden, num_ranks, args.sms, max_tokens),
                        num_low_latency_bytes=epx.low_latency_buffer_size_hint(m, cfg.hidden, num_ranks, p))
    rank = Rank(cfg, group, device, dense, location, buffer, fp8=False, ll_max_tokens=m)
    if not args.no_tp:
        rank.build_tp()
    dpc = DpComm(group, exchange, use_epx_dp)
    out: Dict = {"records": {}, "prefill": {}, "decode": {}}

    def timed(fn, iters=args.iters, warmup=args.warmup) -> float:
        """Median over iterations of the slowest rank's wall time of one synchronized step (seconds)."""
        times = []
        for i in range(warmup + iters):
            exchange.barrier.wait()
            t0 = time.perf_counter()
            fn()
            rank.end_step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        every = exchange.all_gather(rank_idx, times)
        return statistics.median(max(ts[i] for ts in every) for i in range(iters))

    # ---- prefill ------------------------------------------------------------------------------------------
    seq_lens, x0 = mine["seq_lens"], mine["x"]
    xs = [x0] + [torch.empty_like(x0) for _ in range(cfg.layers)]
    if rank.cuda:
        warm_up_alone(rank, x0, seq_lens)
        exchange.barrier.wait()

    def prefill(kind: str, use_tbo: bool, fp8: bool):
        info = dpc.sync(record(x0.shape[0], dp.ForwardMode.EXTEND))
        if kind == "tp":
            plan = plan_step(info.num_tokens, is_extend=info.is_extend_in_batch)
            for layer in range(cfg.layers):
                w = dense[layer]
                h = xs[layer] + attention_prefill(xs[layer], segments_of(seq_lens), w, cfg)
                hn = rms_norm(h)
                moe = rank.tp_moe(layer, dpc, plan, hn)
                xs[layer + 1] = h + moe
                rank._record(layer, h, hn, moe)
            return plan.mode.name
        rank.fp8 = fp8
        two = use_tbo and info.can_run_tbo
        run_ops(rank.prefill_ops(xs, prefill_micro_batches(seq_lens, two)), two, delta=0)
        return "two batches" if two else "one batch"

    modes = [("ep", False, False)]
    if not args.no_tbo:
        modes.append(("ep", True, False))
    if not args.no_fp8:
        modes += [("ep", False, True)] + ([("ep", True, True)] if not args.no_tbo else [])
    if not args.no_tp:
        modes.append(("tp", False, False))
    for kind, use_tbo, fp8 in modes:
        name = f"{kind}{'_fp8' if fp8 else ''}{'_tbo' if use_tbo else ''}"
        rank.record = {}
        how = prefill(kind, use_tbo, fp8)
        rank.end_step()
        out["records"][f"prefill_{name}"] = dict(layers=rank.record, inputs=[t.clone() for t in xs[:-1]],
                                                 seq_lens=seq_lens, fp8=fp8)
        rank.record = None
        seconds = timed(lambda: prefill(kind, use_tbo, fp8))
        out["prefill"][name] = {"seconds": seconds, "how": how}
    rank.fp8 = False

    # ---- decode -------------------------------------------------------------------------------------------
    xd = mine["xd"].clone()
    caches = [DecodeCache(cfg, mine["prefix_x"], mine["prefix"], dense[layer]) for layer in range(cfg.layers)]
    xsd = [xd] + [torch.empty_like(xd) for _ in range(cfg.layers)]
    use_graph = rank.cuda and not args.no_graph
    b = xd.shape[0]

    def decode_eager(use_tbo: bool):
        if use_tbo:
            s = tbo.compute_tbo_split_decode(b).split_token_index
            mbs = [MicroBatch(slice(0, s)), MicroBatch(slice(s, b))]
        else:
            mbs = [MicroBatch(slice(0, b))]
        run_ops(rank.decode_ops(xsd, mbs, caches), use_tbo, delta=1)

    def capture(use_tbo: bool):
        """Each rank captures in turn (capture runs nothing, so no rank waits for a peer)."""
        graph = torch.cuda.CUDAGraph()
        for r in range(num_ranks):
            if r == rank_idx:
                with torch.cuda.graph(graph, stream=rank.compute, capture_error_mode="thread_local"):
                    decode_eager(use_tbo)
            exchange.barrier.wait()
        return graph

    def decode_tp():
        info = dpc.sync(record(b, dp.ForwardMode.DECODE))
        plan = plan_step(info.num_tokens, is_extend=False)
        for layer in range(cfg.layers):
            w = dense[layer]
            h = xsd[layer] + attention_decode(xsd[layer], slice(0, b), caches[layer], w, cfg)
            hn = rms_norm(h)
            moe = rank.tp_moe(layer, dpc, plan, hn)
            xsd[layer + 1] = h + moe
            rank._record(layer, h, hn, moe)
        return plan.mode.name

    dmodes = [(False, False)] + ([(True, False)] if not args.no_tbo else []) + \
        ([(False, True)] if not args.no_fp8 else [])
    for use_tbo, fp8 in dmodes:
        name = f"ep{'_fp8' if fp8 else ''}{'_tbo' if use_tbo else ''}"
        rank.fp8 = fp8
        info = dpc.sync(record(b, dp.ForwardMode.DECODE, can_run_graph=use_graph))
        use_tbo = use_tbo and info.can_run_tbo
        rank.record = {}
        decode_eager(use_tbo)
        rank.end_step()
        out["records"][f"decode_{name}"] = dict(layers=rank.record, fp8=fp8)
        rank.record = None
        eager_out = xsd[-1].clone()
        entry = {"graph": False}
        if use_graph and info.can_run_decode_graph:
            graph = capture(use_tbo)
            graph.replay()
            rank.end_step()
            entry["graph_vs_eager_max_abs"] = (xsd[-1].float() - eager_out.float()).abs().max().item()
            limit = TOLERANCE["bf16"] * eager_out.float().abs().max().item()
            assert entry["graph_vs_eager_max_abs"] <= limit, \
                f"rank {rank_idx}: decode {name}: the CUDA graph's output differs from the eager step's: {entry}"
            entry["seconds"] = timed(lambda: (dpc.sync(record(b, dp.ForwardMode.DECODE)), graph.replay()))
            entry["graph"] = True
            del graph
        else:
            entry["seconds"] = timed(lambda: (dpc.sync(record(b, dp.ForwardMode.DECODE)), decode_eager(use_tbo)))
        out["decode"][name] = entry
    rank.fp8 = False
    if not args.no_tp:
        rank.record = {}
        how = decode_tp()
        rank.end_step()
        out["records"]["decode_tp"] = dict(layers=rank.record, fp8=False)
        rank.record = None
        out["decode"]["tp"] = {"graph": False, "how": how, "seconds": timed(decode_tp)}

    # ---- EPLB live ----------------------------------------------------------------------------------------
    if args.eplb_steps:
        bias = zipf_bias(cfg, args.zipf, args.zipf_strength, args.seed + 11, device)
        for w in dense:
            w.bias = bias
        state = {"graph": capture(False) if use_graph else None}

        def step_fn(i: int) -> float:
            xd.copy_(mine["pool"][i % len(mine["pool"])])
            dpc.sync(record(b, dp.ForwardMode.DECODE))
            exchange.barrier.wait()
            t0 = time.perf_counter()
            state["graph"].replay() if state["graph"] is not None else decode_eager(False)
            rank.end_step()
            return max(exchange.all_gather(rank_idx, time.perf_counter() - t0))

        def recapture():
            state["graph"] = None  # the old graph reads the old slots and replica table: drop it first
            state["graph"] = capture(False) if use_graph else None

        max_check = rank.slots_per_rank if cfg.hidden * cfg.inter <= 1 << 24 else 8
        out["eplb"] = eplb_live.run(rank, args.eplb_steps, max(1, args.eplb_steps // 2), step_fn, recapture,
                                    max_check, log if rank_idx == 0 else (lambda s: None))
        rank.record = {}
        xd.copy_(mine["pool"][0])
        decode_eager(False)  # one step on the final placement, checked against the reference below
        rank.end_step()
        out["records"]["decode_ep_after_eplb"] = dict(layers=rank.record, fp8=False, zipf=True)
        rank.record = None
        state["graph"] = None
    out["num_tokens"] = int(x0.shape[0])
    out["decode_tokens"] = b
    return out


def check(args, cfg, results: List[Dict], ref_device) -> Dict:
    """Every recorded layer of every rank against the reference on the same inputs (asserted)."""
    dense = [dense_weights(cfg, layer, ref_device) for layer in range(cfg.layers)]
    ref = Reference(cfg, ref_device, dense, cache_experts=cfg.hidden * cfg.inter * cfg.num_experts <= 1 << 26)
    zipf = zipf_bias(cfg, args.zipf, args.zipf_strength, args.seed + 11, ref_device)
    base_bias = [w.bias for w in dense]
    checks = {}
    for name in results[0]["records"]:
        fp8 = results[0]["records"][name]["fp8"]
        tol = TOLERANCE["fp8" if fp8 else "bf16"]
        for w, b in zip(dense, base_bias):
            w.bias = zipf if results[0]["records"][name].get("zipf") else b
        worst = {"moe_max_abs_err": 0.0, "moe_mean_abs_err": 0.0, "attn_max_abs_err": 0.0, "max_abs_ref": 0.0}
        means = []
        for res in results:
            rec = res["records"][name]
            for layer, parts in rec["layers"].items():
                h, hn, moe = (torch.cat([p[i] for p in parts]).to(ref_device) for i in range(3))
                s = error_stats(moe, ref.moe(layer, hn, fp8=fp8))
                assert s["max_abs_err"] <= tol * s["max_abs_ref"] + 1e-6, \
                    f"{name}: rank {res['rank']} layer {layer}: MoE output differs from the reference: {s}"
                worst["moe_max_abs_err"] = max(worst["moe_max_abs_err"], s["max_abs_err"])
                worst["max_abs_ref"] = max(worst["max_abs_ref"], s["max_abs_ref"])
                means.append(s["mean_abs_err"])
                if "inputs" in rec:  # prefill: attention of the layer's input too
                    x = rec["inputs"][layer].to(ref_device)
                    a = error_stats(h, x + ref.attention(layer, x, rec["seq_lens"]))
                    assert a["max_abs_err"] <= tol * a["max_abs_ref"] + 1e-6, \
                        f"{name}: rank {res['rank']} layer {layer}: attention output differs: {a}"
                    worst["attn_max_abs_err"] = max(worst["attn_max_abs_err"], a["max_abs_err"])
        worst["moe_mean_abs_err"] = sum(means) / max(1, len(means))
        worst["tolerance"] = tol
        checks[name] = worst
    return checks


def report(args, cfg, results, checks, fallbacks) -> Dict:
    total_tokens = sum(r["num_tokens"] for r in results)
    summary = {"config": cfg.as_dict(), "backend": args.backend, "devices": args.devices if args.backend == "cuda"
               else f"{len(results)} host ranks", "fallbacks": fallbacks, "checks": checks,
               "prefill": {}, "decode": {}}
    print("\ncorrectness (max |out - ref|, mean, tolerance x max |ref|): all passed")
    for name, c in checks.items():
        print(f"  {name:28} moe max {c['moe_max_abs_err']:.3e} mean {c['moe_mean_abs_err']:.3e} "
              f"(max |ref| {c['max_abs_ref']:.3g}, tol {c['tolerance']:.4f})"
              + (f"  attention max {c['attn_max_abs_err']:.3e}" if name.startswith("prefill") else ""))
    print(f"\nprefill: {total_tokens} tokens over {len(results)} ranks (per rank: "
          f"{[r['num_tokens'] for r in results]})")
    for name, e in results[0]["prefill"].items():
        tps = total_tokens / e["seconds"]
        summary["prefill"][name] = {"tokens_per_s": tps, "step_ms": e["seconds"] * 1e3, "how": e["how"]}
        print(f"  {name:12} {e['seconds'] * 1e3:9.2f} ms  {tps:12.0f} tokens/s  ({e['how']})")
    print(f"\ndecode: batch per rank {[r['decode_tokens'] for r in results]}")
    for name, e in results[0]["decode"].items():
        summary["decode"][name] = {"step_us": e["seconds"] * 1e6, **{k: v for k, v in e.items() if k != "seconds"}}
        extra = " (CUDA graph" + (f", replay vs eager max |diff| {e['graph_vs_eager_max_abs']:.2e})"
                                  if "graph_vs_eager_max_abs" in e else ")") if e.get("graph") else " (eager)"
        print(f"  {name:12} {e['seconds'] * 1e6:9.1f} us per step{extra}")
    if "eplb" in results[0]:
        ev = results[0]["eplb"]
        tl = ev["timeline"]
        cut = ev["relocations"][0]["step"] if ev["relocations"] else len(tl)
        before, after = tl[:cut + 1], tl[cut + 1:]
        mean = lambda xs, k: sum(x[k] for x in xs) / len(xs) if xs else float("nan")  # noqa: E731
        summary["eplb"] = {"timeline": tl, "rebalances": ev["rebalances"],
                           "utilization_before": mean(before, "utilization"),
                           "utilization_after": mean(after, "utilization"),
                           "step_us_before": mean(before, "latency_us"), "step_us_after": mean(after, "latency_us"),
                           "relocations": [{k: v for k, v in r.items()} for r in ev["relocations"]]}
        s = summary["eplb"]
        print(f"\nEPLB live (Zipf {args.zipf}, {len(tl)} decode steps, rebalance after step {cut}):")
        print(f"  GPU utilization (mean/max pairs per GPU) before {s['utilization_before']:.3f} -> after "
              f"{s['utilization_after']:.3f}; step {s['step_us_before']:.1f} -> {s['step_us_after']:.1f} us")
        for i, r in enumerate(ev["relocations"]):
            received = sum(res["eplb"]["relocations"][i]["bytes_received"] for res in results)
            checked = sum(res["eplb"]["relocations"][i]["checked_slots"] for res in results)
            summary["eplb"]["relocations"][i]["bytes_received_all_ranks"] = received
            print(f"  relocation at step {r['step']}: {r['moved_experts']} slots moved, {received / 1e6:.2f} MB "
                  f"received over all ranks, {r['seconds'] * 1e3:.1f} ms on rank 0; {checked} slots checked "
                  "byte for byte against their new expert")
    for f in fallbacks:
        print(f"note: {f}")
    return summary


def plot(path: str, summary: Dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed; no plot written")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = list(summary["prefill"])
    axes[0].bar(names, [summary["prefill"][n]["tokens_per_s"] for n in names])
    axes[0].set_title("prefill tokens/s")
    axes[0].tick_params(axis="x", rotation=30)
    names = list(summary["decode"])
    axes[1].bar(names, [summary["decode"][n]["step_us"] for n in names])
    axes[1].set_title("decode step (us)")
    if "eplb" in summary:
        tl = summary["eplb"]["timeline"]
        axes[2].plot([t["step"] for t in tl], [t["utilization"] for t in tl], label="utilization")
        for r in summary["eplb"]["relocations"]:
            axes[2].axvline(r["step"], color="red", linestyle="--", label="rebalance + relocation")
        axes[2].set_ylim(0, 1.05)
        axes[2].set_title("EPLB: per-step GPU utilization")
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = Config(hidden=args.hidden, num_experts=args.experts, num_redundant=args.redundant, inter=args.inter,
                 shared_inter=args.inter, layers=args.layers, seed=args.seed)
    fallbacks = []
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast for the DP communicators
    if args.backend == "host":
        torch.set_num_threads(1)  # ranks are threads: one torch thread each
        devices = ["cpu"] * args.ranks
        groups = epx.host_groups(args.ranks, timeout_ms=args.timeout_ms)
        use_epx_dp = True
    else:
        ordinals = [int(d) for d in args.devices.split(",")]
        devices = [f"cuda:{d}" for d in ordinals]
        groups = epx.cuda_groups(ordinals, timeout_ms=args.timeout_ms)
        use_epx_dp = len(set(ordinals)) == len(ordinals)
        if not use_epx_dp:
            fallbacks.append("ranks share a GPU: epx's CUDA DP path (NCCL) needs one GPU per rank, so the DP "
                             "metadata sync, gather and reduce-scatter ran through an in-process stand-in")
    num_ranks = len(groups)
    cfg.check(num_ranks)
    print(f"moe_layer: {args.backend}, {num_ranks} ranks on {devices}; hidden {cfg.hidden}, {cfg.num_experts} experts "
          f"(+{cfg.num_physical(num_ranks) - cfg.num_experts} redundant slots), top-{cfg.topk} of {cfg.num_groups} "
          f"groups (top-{cfg.topk_groups}), inter {cfg.inter}, {cfg.layers} layer(s)")
    inputs = make_inputs(args, cfg, num_ranks)
    exchange = Exchange(num_ranks, timeout_s=args.timeout_ms / 1000)
    t0 = time.perf_counter()
    results = epx.run_host_ranks(groups, lambda r, g: dict(rank=r, **rank_main(
        r, g, args, cfg, inputs, exchange, devices, use_epx_dp, print)))
    print(f"ranks finished in {time.perf_counter() - t0:.1f} s; checking against the reference on {devices[0]}")
    checks = check(args, cfg, results, torch.device(devices[0]))
    summary = report(args, cfg, results, checks, fallbacks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"results written to {args.json}")
    if args.plot:
        plot(args.plot, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
