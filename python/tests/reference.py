"""Independent numpy references of epx's dispatch/combine contracts (include/epx/buffer.h), for the tests.

Experts are split evenly over ranks; a token goes to rank d if one of its top-k experts lives there.
"""

import numpy as np

try:
    import ml_dtypes

    BF16 = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover
    BF16 = None


def destinations(idx, num_experts, num_ranks):
    """bool [T, R]: token t goes to rank d."""
    local = num_experts // num_ranks
    out = np.zeros((idx.shape[0], num_ranks), bool)
    for d in range(num_ranks):
        out[:, d] = ((idx >= 0) & (idx // local == d)).any(axis=1)
    return out


def normal_dispatch(inputs, rank, num_experts, num_ranks):
    """Rows rank `rank` receives: (x rows, src_idx, local topk ids, weights), by source rank then token."""
    local = num_experts // num_ranks
    rows, src, tidx, tw = [], [], [], []
    for xs, ids, ws in inputs:
        for t in range(xs.shape[0]):
            mine = (ids[t] >= 0) & (ids[t] // local == rank)
            if not mine.any():
                continue
            rows.append(xs[t])
            src.append(t)
            tidx.append(np.where(mine, ids[t] - rank * local, -1))
            tw.append(np.where(mine, ws[t], 0).astype(np.float32))
    return rows, src, tidx, tw


def normal_combine(x_f32, dest, factor=1.0):
    """Identity experts that scale by `factor`: each token comes back once per rank it went to."""
    return x_f32 * factor * dest.sum(1, keepdims=True)


def low_latency_rows(inputs, rank, num_experts, num_ranks):
    """Per local expert: [(source rank, token)] in packed order (source rank, token, k)."""
    local = num_experts // num_ranks
    out = []
    for e in range(local):
        ge = rank * local + e
        out.append([(s, t) for s, (_, ids, _) in enumerate(inputs) for t in range(ids.shape[0])
                    for k in range(ids.shape[1]) if ids[t, k] == ge])
    return out


def low_latency_combine(x_f32, idx, weights):
    """Identity experts: out[t] = sum over valid k of w[t, k] * x[t]."""
    return x_f32 * np.where(idx >= 0, weights, 0).sum(1, keepdims=True)
