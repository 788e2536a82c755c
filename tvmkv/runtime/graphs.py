"""CUDA graphs of a forward's attention calls, replayed across steps whose page tables change.

A decode step of an L-layer model launches a kernel (or two or three, where the library lacks the
one-launch decode) per layer through Python; captured once into a CUDA graph, the whole step replays
with one launch. What a replay may and may not change
is docs/cuda_graphs.md's subject; in short, every kernel of a forward reads its page tables, positions
and slots from the index arrays ``begin_forward`` uploads, so a graph captured in one forward is
correct in any later forward whose :meth:`~tvmkv.PagedAttentionKVCache.graph_key` is equal (same
kernels and launch parameters, index arrays in the same device memory), whatever its sequences.

:class:`StepGraphs` keeps one torch ``CUDAGraph`` per key::

    graphs = StepGraphs(cache, step)   # step(): the model's calls on its static tensors
    cache.begin_forward(seq_ids, [1] * len(seq_ids))
    graphs()                           # replay, or run eagerly once and capture for next time
    cache.end_forward()

torch only (the cache itself is not): ``step`` is captured with ``tvm_ffi.use_torch_stream``, so the
cache's TVM kernels launch on the capturing stream.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class StepGraphs:
    """One CUDA graph per :meth:`~tvmkv.PagedAttentionKVCache.graph_key` of ``step``'s forward.

    Parameters
    ----------
    cache : PagedAttentionKVCache
        A cuda cache; every call to the instance happens between its ``begin_forward`` and
        ``end_forward``.
    step : callable
        ``step()`` makes the forward's calls (``attention_with_fused_qkv`` per layer, and any torch work
        around them) on tensors whose addresses do not change between calls (qkv, outputs: the
        "static" tensors of torch's CUDA-graph rules), 64-byte aligned as torch allocates them, with the
        same ``sm_scale`` each time. Tensors the step itself allocates live in the graphs' shared pool:
        do not keep them past the step (another graph's replay may reuse their memory).
    max_graphs : int
        Graphs kept (least recently used dropped first).
    pool : optional
        The memory pool to capture into (``torch.cuda.graph_pool_handle()``), shared by all graphs
        by default.
    """

    def __init__(self, cache, step: Callable[[], Any], *, max_graphs: int = 32, pool=None):
        import torch

        if getattr(cache, "device", None) is None or cache.device.dlpack_device_type() != 2:
            raise ValueError(f"StepGraphs needs a cuda cache, got one on {getattr(cache, 'device', None)}")
        if not callable(step):
            raise TypeError(f"step must be callable (the forward's calls), got {type(step).__name__}")
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs={max_graphs!r} must be an int >= 1")
        self.cache, self.step, self.max_graphs = cache, step, max_graphs
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self._graphs: OrderedDict = OrderedDict()
        self.captures = 0  # graphs captured so far (a capture also runs the step eagerly once)
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def __call__(self) -> None:
        """Run ``step`` for the open forward: replay the graph of its key, or run ``step`` eagerly (the
        forward's results) and capture it for later forwards of that key. Raises ForwardStateError
        outside a forward, and ValueError (before capturing) for a step whose calls read device memory
        that a replay would not refresh (see ``PagedAttentionKVCache.graph_key``)."""
        cache = self.cache
        key = cache.graph_key()
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            graph, layers = entry
            graph.replay()
            cache.mark_attended(layers)  # the replay appended these layers' K/V, as the step's calls would
            self.replays += 1
            return
        self.step()  # this forward's results; also loads every kernel module before capture
        cache.graph_key()  # ValueError where a call of the step used memory outside the key (named there)
        self._graphs[key] = (self._capture(), cache.attended_layers())
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)

    def _capture(self):
        """``step`` recorded (not run) into a new graph. Running it again on the same forward would
        write the same K/V into the same slots and the same outputs: recording is enough."""
        import torch
        import tvm_ffi

        graph = torch.cuda.CUDAGraph()
        with tvm_ffi.use_torch_stream(torch.cuda.graph(graph, pool=self.pool)):
            self.step()
        return graph

    def clear(self) -> None:
        """Drop every graph (e.g. after changing the static tensors ``step`` uses)."""
        self._graphs.clear()
