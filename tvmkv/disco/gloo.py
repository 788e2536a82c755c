"""A collective backend for Disco workers on the CPU: ``R.ccl.allreduce`` / ``allgather`` over
``torch.distributed``'s gloo (the TVM wheel has no CPU collective backend, and its NCCL one is not
built in: ``docs/layout.md``, "Tensor parallelism").

Disco's worker builtins dispatch a collective to ``runtime.disco.<ccl>.<name>``, ``<ccl>`` being the
backend named when the session's communicator was created in C++. A backend set up from Python (as
here) leaves that name empty, so the functions are registered as ``runtime.disco..allreduce`` and
``runtime.disco..allgather``; compiled Relax modules reach them through the same builtins. The
arrays are shared with torch through DLPack (no copy) and reduced in place.

:func:`init` (``tvmkv.disco.init_gloo`` on every worker at once, from
:meth:`tvmkv.disco.TvmkvSession.init_gloo`) creates the process group; every worker process has
its own (worker 0 is a thread of the controller process, which then holds its group).
"""

from __future__ import annotations

INIT = "tvmkv.disco.init_gloo"
FINALIZE = "tvmkv.disco.finalize_gloo"
# Disco's reduction kinds (runtime.disco.allreduce's Shape([kind])): sum, prod, min, max, avg
_KINDS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")


def init(init_method: str) -> str:
    """Join this worker to the gloo group at ``init_method`` (``tcp://host:port``); "" or the error."""
    try:
        import torch.distributed as dist
        from tvm_ffi import get_global_func

        rank = int(get_global_func("runtime.disco.worker_rank")())
        world = int(get_global_func("runtime.disco.world_size")())
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        return ""
    except Exception as err:  # noqa: BLE001  (a raise would kill the worker)
        return f"{type(err).__name__}: {err}"


def finalize() -> str:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return ""
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"


def _torch(x):
    import torch

    return torch.from_dlpack(x)


def allreduce(send, kind: int, in_group: bool, recv) -> None:
    """``recv = reduce(send over the workers)`` (kind: 0 sum, 1 prod, 2 min, 3 max, 4 avg)."""
    import torch.distributed as dist

    out = _torch(recv)  # in_group: the session has one group (TvmkvSession.init_gloo checks), the world
    out.copy_(_torch(send))
    name = _KINDS[int(kind)]
    if name == "AVG":  # gloo has no AVG: sum, then divide (integers rounded down, as an integer mean)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        if out.is_floating_point():
            out.div_(dist.get_world_size())
        else:
            out.floor_divide_(dist.get_world_size())
    else:
        dist.all_reduce(out, op=getattr(dist.ReduceOp, name))


def allgather(send, in_group: bool, recv) -> None:
    """``recv`` = the workers' ``send`` one after the other along the first axis."""
    import torch.distributed as dist

    out = _torch(recv)
    dist.all_gather(list(out.chunk(dist.get_world_size())), _torch(send).contiguous())


def register() -> None:
    """Register the backend's functions in this process (idempotent)."""
    import tvm_ffi

    for name, func in ((INIT, init), (FINALIZE, finalize)):
        tvm_ffi.register_global_func(name, func, override=True)
    tvm_ffi.register_global_func("runtime.disco..allreduce", allreduce, override=True)
    tvm_ffi.register_global_func("runtime.disco..allgather", allgather, override=True)
