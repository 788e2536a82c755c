"""An independent NumPy model of a KV cache: per-sequence token lists, no pages, fp64 attention.

Used as the oracle of replays and cache tests. It shares no code with the runtime or the kernels:
it keeps each sequence's kept tokens as plain arrays and recomputes attention from scratch.
Semantics follow docs/layout.md (sliding window + sink, token trees, RoPE modes, base-2 LSE).
"""

from __future__ import annotations

import numpy as np


def rope_np(x: np.ndarray, pos: np.ndarray, scale: float, theta: float) -> np.ndarray:
    """Rotate-half RoPE of ``x [..., n, H, D]`` at positions ``pos [n]`` (fp64)."""
    D = x.shape[-1]
    half = D // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2 / D)
    ang = np.asarray(pos, np.float64)[:, None] * scale * inv[None, :]  # [n, D/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x = np.asarray(x, np.float64)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class _Seq:
    """One sequence. Positions follow TVM's rule: a kept token's position is its index among the kept
    tokens (after a window drops tokens, the later ones move down). ``index`` / ``appended`` count in
    append order instead (no renumbering), as page accounting needs."""

    def __init__(self, L, H, D):
        self.k = np.zeros((L, 0, H, D))  # kept committed tokens, as stored
        self.v = np.zeros((L, 0, H, D))
        self.pos = np.zeros(0, np.int64)  # position of each kept token (0, 1, 2, ... after a slide)
        self.index = np.zeros(0, np.int64)  # append index of each kept token
        self.length = 0  # committed tokens held
        self.appended = 0  # committed tokens appended and not popped (dropped ones included)
        self.slid = False  # a window has dropped tokens
        self.window = 0
        self.sink = 0
        self.fork_prefix = 0  # whole pages shared with a fork (parent or child): sinks of a window (TVM)
        self.asked_sink = 0  # the sink enable_window asked for
        # uncommitted tree nodes
        self.tk = np.zeros((L, 0, H, D))
        self.tv = np.zeros((L, 0, H, D))
        self.tparent: list = []
        self.tdepth: list = []

    def copy(self):
        other = _Seq.__new__(_Seq)
        other.__dict__ = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in self.__dict__.items()}
        return other


class CacheModel:
    """Shadow model of ``PagedAttentionKVCache`` semantics (see module docstring)."""

    def __init__(
        self,
        num_layers,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        *,
        rope_mode="none",
        rope_scale=1.0,
        rope_theta=1e4,
        dtype="float32",
        kv_store=None,
        page_size=1,
    ):
        self.L, self.Hq, self.Hkv, self.D = num_layers, num_qo_heads, num_kv_heads, head_dim
        self.dtype = dtype  # what the cache stores: rotated q/k are rounded to it
        # kv_store(layer, k, v) -> (k, v) as the pages hold them (fp8 pages: quantized and back), or None
        self.kv_store = kv_store
        self.rope_mode, self.scale, self.theta = rope_mode, rope_scale, rope_theta
        self.P = page_size  # the cache's: a fork shares whole pages, which are sinks of a later window (TVM)
        self.seqs: dict = {}
        self.fwd = None

    @classmethod
    def of(cls, cfg, **options) -> CacheModel:
        """The model of a cache built with ``cfg`` (its ``CacheConfig``): shape, RoPE, dtype and page size
        as the cache has them; ``options`` (``kv_store``, ...) as the constructor takes them."""
        kw = dict(
            rope_mode=cfg.rope_mode,
            rope_scale=cfg.rope_scale,
            rope_theta=cfg.rope_theta,
            dtype=cfg.dtype,
            page_size=cfg.page_size,
        )
        return cls(cfg.num_layers, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, **{**kw, **options})

    # sequences -------------------------------------------------------------
    def add(self, sid):
        self.seqs[sid] = _Seq(self.L, self.Hkv, self.D)

    def remove(self, sid):
        del self.seqs[sid]

    def fork(self, parent, child, pos=-1):
        p = self.seqs[parent]
        pos = p.length if pos == -1 else pos
        c = p.copy()
        c.k, c.v, c.pos, c.index = p.k[:, :pos], p.v[:, :pos], p.pos[:pos], p.index[:pos]
        c.length = c.appended = pos
        c.tk, c.tv, c.tparent, c.tdepth = p.tk[:, :0], p.tv[:, :0], [], []
        c.window = c.sink = 0  # a fork starts without a window (TVM's rule)
        c.fork_prefix = pos // self.P * self.P  # the whole pages both now share (TVM: a block never slid)
        p.fork_prefix = max(p.fork_prefix, c.fork_prefix)
        c.slid = False
        self.seqs[child] = c

    def pop(self, sid, n):
        s = self.seqs[sid]
        keep = s.k.shape[1] - n
        s.k, s.v, s.pos, s.index = s.k[:, :keep], s.v[:, :keep], s.pos[:keep], s.index[:keep]
        s.length, s.appended = s.length - n, s.appended - n
        s.fork_prefix = min(s.fork_prefix, s.length // self.P * self.P)  # TVM forks again at the new length

    def enable_window(self, sid, window, sink):
        s = self.seqs[sid]
        # nothing dropped yet: the next end() slides; tokens a fork shares are sinks (TVM's rules)
        s.window, s.asked_sink = window, sink

    def _slide(self, s):
        if s.window and not s.slid:  # the sink as the window first slides: what a fork shares then, at least
            s.sink = min(max(s.asked_sink, min(s.fork_prefix, s.length)), s.window - 1)
        if s.window and s.k.shape[1] > s.window:
            idx = np.r_[0 : s.sink, s.k.shape[1] - (s.window - s.sink) : s.k.shape[1]]
            s.k, s.v, s.index = s.k[:, idx], s.v[:, idx], s.index[idx]
            s.pos = np.arange(len(idx))  # positions index the kept tokens
            s.length = len(idx)
            s.slid = True

    # forward -----------------------------------------------------------------
    def begin(self, seq_ids, lengths, parents=None):
        self.fwd = dict(seq_ids=list(seq_ids), lengths=list(lengths), parents=parents)

    def attention(self, layer, qkv, sm_scale=None, *, new_raw=False):
        """Return (o [n, H_qo, D], lse [n, H_qo]) in fp64 and store this layer's new K/V. With a
        ``kv_store``, the history is read as stored and so are the new tokens, unless ``new_raw``:
        they attend to their own K/V as given (a prefill without history, which reads no page)."""
        Hq, Hkv, D = self.Hq, self.Hkv, self.D
        sm_scale = D**-0.5 if sm_scale is None else sm_scale
        qkv = np.asarray(qkv, np.float64)
        fwd = self.fwd
        out = np.zeros((qkv.shape[0], Hq, D))
        lse = np.full((qkv.shape[0], Hq), -np.inf)
        at = 0
        for b, (sid, n) in enumerate(zip(fwd["seq_ids"], fwd["lengths"])):
            s = self.seqs[sid]
            q, k, v = qkv[at : at + n, :Hq], qkv[at : at + n, Hq : Hq + Hkv], qkv[at : at + n, Hq + Hkv :]
            if fwd["parents"] is None:
                qpos = s.length + np.arange(n)
                kept = s.k.shape[1] - (n if layer > 0 else 0)  # layer 0 stashes the new tokens below
                hist_k, hist_v, hist_pos = s.k[layer, :kept], s.v[layer, :kept], s.pos[:kept]
                visible_new = np.tril(np.ones((n, n), bool))
                new_pos = qpos
                old_tree = 0
            else:
                par = fwd["parents"][b]
                old_tree = len(s.tparent) - n if layer > 0 else len(s.tparent)
                if layer == 0:
                    for p in par:
                        s.tparent.append(p)
                        s.tdepth.append(0 if p < 0 else s.tdepth[p] + 1)
                    old_tree = len(s.tparent) - n
                depth = np.asarray(s.tdepth)
                qpos = s.length + depth[old_tree:]
                # history: committed + earlier uncommitted nodes; visibility by ancestry
                anc = self._ancestors(s.tparent)
                hist_k = np.concatenate([s.k[layer], s.tk[layer][:old_tree]])
                hist_v = np.concatenate([s.v[layer], s.tv[layer][:old_tree]])
                hist_pos = np.concatenate([s.pos, s.length + depth[:old_tree]])
                visible_new = np.array([[anc[old_tree + i][old_tree + j] for j in range(n)] for i in range(n)])
                new_pos = qpos
            stored_k = self._round(rope_np(k, new_pos, self.scale, self.theta)) if self.rope_mode == "normal" else k
            held_k, held_v = (stored_k, v) if self.kv_store is None else self.kv_store(layer, stored_k, v)
            # store this layer's new K/V
            if fwd["parents"] is None:
                self._stash(s, layer, held_k, held_v)
            else:
                self._stash_tree(s, layer, held_k, held_v, old_tree, n)
            new_k, new_v = (stored_k, v) if new_raw else (held_k, held_v)
            qr = q
            if self.rope_mode == "normal":
                qr = self._round(rope_np(q, qpos, self.scale, self.theta))
            elif self.rope_mode == "inline":
                qr = rope_np(q, qpos, self.scale, self.theta)
            all_k = np.concatenate([hist_k, new_k])
            if self.rope_mode == "inline":
                all_k = rope_np(all_k, np.concatenate([hist_pos, new_pos]), self.scale, self.theta)
            all_v = np.concatenate([hist_v, new_v])
            H = hist_k.shape[0]
            for i in range(n):
                if fwd["parents"] is None:
                    vis_hist = np.ones(H, bool)
                else:
                    anc = self._ancestors(s.tparent)
                    vis_hist = np.r_[
                        np.ones(s.k.shape[1], bool), [anc[old_tree + i][j] for j in range(old_tree)]
                    ].astype(bool)
                vis = np.r_[vis_hist, visible_new[i]].astype(bool)
                for h in range(Hq):
                    kv_h = h // (Hq // Hkv)
                    sc = sm_scale * (all_k[vis, kv_h] @ qr[i, h])
                    if sc.size == 0:
                        continue
                    m = sc.max()
                    p = np.exp(sc - m)
                    out[at + i, h] = p @ all_v[vis, kv_h] / p.sum()
                    lse[at + i, h] = (m + np.log(p.sum())) / np.log(2)
            at += n
        return out, lse

    def _round(self, x):
        if self.dtype == "bfloat16":
            import ml_dtypes

            return x.astype(ml_dtypes.bfloat16).astype(np.float64)
        return x.astype(self.dtype).astype(np.float64)

    @staticmethod
    def _ancestors(parents):
        """anc[c][a] is True iff a is an ancestor-or-self of c."""
        n = len(parents)
        anc = np.zeros((n, n), bool)
        for c in range(n):
            a = c
            while a >= 0:
                anc[c, a] = True
                a = parents[a]
        return anc

    def _stash(self, s, layer, k, v):
        n = k.shape[0]
        if layer == 0:
            s.k = np.concatenate([s.k, np.zeros((self.L, n, self.Hkv, self.D))], axis=1)
            s.v = np.concatenate([s.v, np.zeros((self.L, n, self.Hkv, self.D))], axis=1)
            s.pos = np.r_[s.pos, s.length + np.arange(n)]
            s.index = np.r_[s.index, s.appended + np.arange(n)]
        s.k[layer, -n:], s.v[layer, -n:] = k, v

    def _stash_tree(self, s, layer, k, v, old, n):
        if layer == 0:
            s.tk = np.concatenate([s.tk, np.zeros((self.L, n, self.Hkv, self.D))], axis=1)
            s.tv = np.concatenate([s.tv, np.zeros((self.L, n, self.Hkv, self.D))], axis=1)
        s.tk[layer, old : old + n], s.tv[layer, old : old + n] = k, v

    def end(self):
        fwd = self.fwd
        for sid, n in zip(fwd["seq_ids"], fwd["lengths"]):
            s = self.seqs[sid]
            if fwd["parents"] is None:
                s.length += n
                s.appended += n
                self._slide(s)
        self.fwd = None

    def commit(self, seq_ids, leaves):
        for sid, leaf in zip(seq_ids, leaves):
            s = self.seqs[sid]
            path = []
            while leaf >= 0:
                path.append(leaf)
                leaf = s.tparent[leaf]
            path = path[::-1]
            s.k = np.concatenate([s.k, s.tk[:, path]], axis=1)
            s.v = np.concatenate([s.v, s.tv[:, path]], axis=1)
            s.pos = np.r_[s.pos, s.length + np.arange(len(path))]
            s.index = np.r_[s.index, s.appended + np.arange(len(path))]
            s.length += len(path)
            s.appended += len(path)
            s.tk, s.tv, s.tparent, s.tdepth = s.tk[:, :0], s.tv[:, :0], [], []

    # inspection ----------------------------------------------------------------
    def length(self, sid):
        s = self.seqs[sid]
        return s.length + len(s.tparent)

    def kept_kv(self, sid):
        """(positions, K [L, n, H_kv, D], V) of every token the cache must still hold, in order."""
        s = self.seqs[sid]
        pos = np.r_[s.pos, s.length + np.arange(len(s.tparent))]
        return pos, np.concatenate([s.k, s.tk], axis=1), np.concatenate([s.v, s.tv], axis=1)
