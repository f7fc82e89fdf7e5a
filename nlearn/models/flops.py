"""Training FLOPs of each family's token mixer, as its train step runs it (pure arithmetic over the config);
a family's record names its count (`nlearn.models.Family.flops`), and `nlearn.train.flops` adds the dense
layers for MFU.

Counted: every matmul (2·m·n·k FLOPs) of the mixer at the shapes the training step uses: attention over the
keys each query is actually scored against (the full square of causal attention, the two blocks of
sliding-window attention, a MAC segment's persistent, retrieved and segment keys), and the memory ops in the
chunked forms training runs (whole chunks and mini-batches including their padding and masked halves; the delta
rule's form by backend; the neural memory's dual form for any depth, optimizer and mini-batch, or its per-token
form for mini-batch 1). A mixer's backward counts twice its forward (each matmul's two gradients), except the
block inverse of the delta rule and DGD, whose custom backward is two C×C×C matmuls. Not counted: elementwise
work (norms, activations, gates, softmax, the short convs), except the per-weight optimizer step of the
per-token neural memory.
"""

from __future__ import annotations

from nlearn.layers.core import head_dim
from nlearn.memory.inner_optimizers import get_inner_optimizer
from nlearn.memory.neural_memory import SCAN_GROUP, step_parts

TTT_REMAT_GROUP = 4  # the TTT ops' default `remat_group` (their padding unit is minibatch · group)


def _pad(t: int, unit: int) -> int:
    return -(-t // unit) * unit


# --- forward FLOPs of one head over a sequence of t tokens ----------------------------------------


def _attention(queries: int, keys: int, d: int) -> float:
    """Scores and their weighted sum: queries × keys × d, twice."""
    return 4.0 * queries * keys * d


def causal_attention(t: int, d: int, window: int = 0, num_persistent: int = 0) -> float:
    """Full causal attention scores the whole t × t square (plus the persistent keys); a window w
    scores blocks of w queries against their own and the previous block (`layers.attention`)."""
    if not window:
        return _attention(t, num_persistent + t, d)
    w = min(window, t)
    return _attention(_pad(t, w), num_persistent + 2 * w, d)


def linear_attention(t: int, d: int, chunk: int) -> float:
    """Per chunk of C: Q Kᵀ, (·) V, Q S and Kᵀ V."""
    return _pad(t, chunk) * (4.0 * chunk * d + 4.0 * d * d)


def _unit_lower_inverse(c: int) -> tuple[float, float]:
    """(forward, backward) of `delta.unit_lower_inverse` on one C × C block: block doubling on the
    next power of two P, (2/3)·P·(P² − 1); its custom backward, two C×C×C matmuls."""
    p = 1 << max(0, (c - 1).bit_length())
    return 2.0 / 3.0 * p * (p * p - 1), 4.0 * c**3


def delta_rule(t: int, d: int, chunk: int, backend: str) -> float:
    """Training FLOPs (forward + backward) of the chunked (gated) delta rule: per chunk K Kᵀ, Q Kᵀ,
    the WY inverse, U and W (or `T(βV − βK S)`), the state's read and write, `P u`."""
    n = _pad(t, chunk) // chunk
    parallel = backend != "cpu"  # the form `impl="chunked"` takes there (`linear_attention.resolve_chunked`)
    per_chunk = 6.0 * chunk * d * d + (10.0 if parallel else 8.0) * chunk * chunk * d
    inv_fwd, inv_bwd = _unit_lower_inverse(chunk)
    return n * (3.0 * per_chunk + inv_fwd + inv_bwd)


def ttt_linear(t: int, d: int, minibatch: int) -> float:
    """Dual form per mini-batch of b: [K; Q] W, Q Kᵀ, (·) G and Kᵀ G: 6 d² + 4 b d per token."""
    return _pad(t, minibatch * TTT_REMAT_GROUP) * (6.0 * d * d + 4.0 * minibatch * d)


def ttt_mlp(t: int, d: int, f: int, minibatch: int) -> float:
    """Dual form per mini-batch: [K; Q] W1, X2 W2 (keys and reads), G2 W2ᵀ, both weight updates
    (14 d f per token) and the two b × b read matrices with their products (4 b (d + f))."""
    return _pad(t, minibatch * TTT_REMAT_GROUP) * (14.0 * d * f + 4.0 * minibatch * (d + f))


def neural_memory(t: int, d: int, mem) -> float:
    """Training FLOPs of `memory.neural_memory` over t tokens, from the `model.memory` section."""
    opt = get_inner_optimizer(mem.optimizer)
    dims = [d] + [mem.expansion * d] * (mem.depth - 1) + [d]
    layers = list(zip(dims[:-1], dims[1:]))
    use_mu = bool(mem.momentum) and opt.momentum
    b = mem.minibatch
    overlap = "overlap" in step_parts(mem.get("inner_step", "paper"))
    if b == 1:  # per token: keys forward, errors back, rank-1 gradients, the optimizer step, the read
        per_token = 0.0
        for i, (di, do) in enumerate(layers):
            w = di * do
            per_token += 2 * w + (2 * w if i else 0) + w + (5 * w if opt.momentum else 3 * w) + 2 * w
            per_token += 5 * w if opt.precondition else 0
        return 3.0 * t * per_token
    n = -(-t // b)
    if n >= 16 * SCAN_GROUP:  # mini-batches go SCAN_GROUP at a time through the scan
        n = _pad(n, SCAN_GROUP)
    fwd, inverse = 0.0, 0.0
    for i, (di, do) in enumerate(layers):
        mm = 2.0 * b * di * do
        fwd += mm + mm  # keys and queries through W at the mini-batch start
        fwd += mm if i else 0.0  # the error back-propagated through W
        fwd += mm if use_mu else 0.0  # queries through the momentum U
        fwd += 2.0 * b * b * (di + do)  # the dual-form read: (y xᵀ) and its product with δ
        fwd += mm * (2 if opt.momentum else 1)  # the state after the mini-batch
        if opt.precondition:  # DGD: Gram matrix, right-hand side, solve, and its read
            fwd += 2.0 * b * b * (di + 3 * do) + (mm if use_mu else 0.0)
            inverse += sum(_unit_lower_inverse(b))
        elif overlap:  # the "overlap" step's Gram matrix of the inputs (DGD's own serves it)
            fwd += 2.0 * b * b * di
    fwd += 2.0 * b**3 * ((1 if mem.decay else 0) + (2 if opt.momentum else 0))  # gate coefficient matrices
    return n * (3.0 * fwd + inverse)


# --- per family (named by its record, nlearn.models.Family.flops): one layer's mixer over t tokens ---------


def mac(cfg, t: int, backend: str) -> float:
    h, d = cfg.num_heads, head_dim(cfg)
    c, mem = cfg.segment_len, cfg.memory
    tp = _pad(t, c)  # the forward pads to whole segments
    dims = [d] + [mem.expansion * d] * (mem.depth - 1) + [d]
    read = 2.0 * sum(a * b for a, b in zip(dims[:-1], dims[1:]))  # M*(q) per token
    fwd = h * (tp // c * _attention(c, cfg.num_persistent + 2 * c, d) + tp * read)
    fwd += tp * 2 * 2.0 * cfg.d_model * h * d  # keys and values of the retrieved tokens
    return 3.0 * fwd + h * (tp // c) * neural_memory(c, d, mem)


def windowed_titans(cfg, t: int, backend: str) -> float:
    h, d = cfg.num_heads, head_dim(cfg)
    attn = causal_attention(t, d, cfg.window, cfg.num_persistent)
    return h * (3.0 * attn + neural_memory(t, d, cfg.memory))


def self_referential(t: int, d: int, mem) -> float:
    """Training FLOPs of the chunked `memory.self_referential_titans` over t tokens (one head), from
    the `model.memory` section: per memory (k, v, lr, retain, memory, and q when adaptive) its MLP
    forward on x and on v (targets), the error and δ at the chunk start, both outer-product writes and
    the in-chunk DGD solve; the memory's read adds q W_in and the masked decayed attention."""
    hid, c_m, c_o = mem.expansion * d, mem.chunk_memory, mem.chunk_other
    # (output width, chunk) of k, v, lr, retain, memory (and q)
    memories = [(d, c_o), (d, c_o), (1, c_o), (1, c_o), (d, c_m)] + ([(d, c_o)] if mem.adaptive_q else [])
    per_token = 0.0
    for d_out, chunk in memories:
        mlp = 2.0 * d * hid + 2.0 * hid * d_out
        per_token += 2 * mlp + mlp + 2.0 * hid * d_out + 2.0 * d * hid  # x and v forward, e / δ, both writes
        per_token += 2.0 * chunk * (d + hid)  # DGD's Gram matrix and the in-chunk solve
    per_token += 2.0 * d * hid + 2.0 * c_m * (d + hid) + 2.0 * hid * d  # the read of the memory
    return 3.0 * _pad(t, max(c_m, c_o)) * per_token


def hope(cfg, t: int, backend: str) -> float:
    """Hope's mixer: self-referential Titans or causal attention (the CMS levels are dense layers;
    `flops_per_token` doubles everything for the two-pass `cms.update=ntp`)."""
    h, d = cfg.num_heads, head_dim(cfg)
    if cfg.hope.mixer == "attention":
        return h * 3.0 * causal_attention(t, d, cfg.window)
    return h * self_referential(t, d, cfg.memory)


def per_head(fn):
    """A family's count from `fn(cfg, t, d, backend)`, one head's, times the heads."""
    return lambda cfg, t, backend: cfg.num_heads * fn(cfg, t, head_dim(cfg), backend)
