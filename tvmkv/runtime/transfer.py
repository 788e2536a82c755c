"""Moving a sequence between caches: tvmkv's counterpart of TVM's disaggregation calls.

TVM's ``kv_cache_disagg_prepare_recv`` / ``kv_cache_disagg_mark_send`` move KV between prefill and
decode engines through NVSHMEM. tvmkv does the same between two :class:`~tvmkv.PagedAttentionKVCache`
objects of one process (on the same device, another device, or the CPU), in three steps::

    recv = transfer.prepare_receive(receiver, seq_id, length)   # reserve pages on the receiver
    transfer.send_sequence(sender, sender_seq_id, recv)          # copy every layer's pages
    recv.commit()                                                # seq_id is now a sequence of receiver

- :func:`prepare_receive` reserves ``ceil(length / P)`` pages at once (OutOfPagesError when they are
  not free; nothing is reserved then). The reservation is a pending import of
  :mod:`tvmkv.runtime.checkpoint`: until ``commit`` the id is not a sequence of the receiver
  (``begin_forward`` on it raises KeyError), ``check_integrity`` counts the reserved pages.
- :func:`send_sequence` copies whole pages, one TVM copy per run of consecutive page ids on both
  sides (device to device, or through the host between the CPU and a GPU). The sender's sequence is
  only read.
- ``recv.commit()`` hands the pages to the sequence; ``recv.abort()``, leaving a ``with recv:`` block
  without committing, dropping the last reference to ``recv``, or ``receiver.clear()`` frees them.

The caches must agree on everything the stored K/V depends on (layers, heads, head_dim, dtype,
page_size, RoPE mode / scale / theta): ValueError naming the field and both values otherwise.
Sequences with uncommitted token-tree nodes or a sliding window are refused (as for checkpoints).
With fp8 pages (the same ``kv_dtype`` on both) whose scales differ, the received codes are re-encoded
to the receiver's scales (``requantize_pages``: one more rounding; values beyond the receiver's range
saturate); equal scales move the codes unchanged. :func:`move_sequence` into a cache holding no token
first gives it the sender's scales (``set_kv_scales``; a calibration of the receiver ends).
"""

from __future__ import annotations

from .checkpoint import ImportReservations, check_new_id, copy_pages, plain_sequence
from .kv_scales import adoptable
from .sequences import as_int, check_id

__all__ = ["Receive", "check_compatible", "move_sequence", "prepare_receive", "send_sequence"]

# Configuration fields the stored K/V depends on (capacity, batch and target may differ); the RoPE
# variant ones (partial rotary, llama3 / yarn scaling) rotate K differently under rope_mode "normal".
_FIELDS = (
    *("num_layers", "first_layer", "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "dtype", "kv_dtype"),
    *("rope_mode", "rope_scale", "rope_theta", "rotary_dim", "rope_scaling"),
    *("kv_lora_rank", "qk_rope_head_dim"),  # MLA caches move their latent pages the same way
)


def check_compatible(sender, receiver) -> None:
    """ValueError naming the first field in which the two caches' stored K/V would differ."""
    for name in _FIELDS:
        a, b = getattr(sender.config, name, None), getattr(receiver.config, name, None)  # None: an older config
        if a != b:
            raise ValueError(
                f"cannot move a sequence between these caches: {name} is {a!r} on the sender but {b!r} on the "
                "receiver; both caches must store the same K/V layout"
            )
    a, b = tuple(sender.pages[0].shape[1:]), tuple(receiver.pages[0].shape[1:])
    if a != b:
        raise ValueError(f"cannot move a sequence between pages of shape {a} (sender) and {b} (receiver)")


class Receive:
    """Pages reserved on ``cache`` for ``seq_id`` (``length`` tokens), from :func:`prepare_receive`.

    ``pending`` is True until :meth:`commit` or :meth:`abort` (or ``cache.clear()``). Dropping the object
    while pending aborts; ``with recv: ...`` aborts on leaving unless committed inside.
    """

    __slots__ = ("cache", "seq_id", "length", "sent", "record")

    def __init__(self, cache, seq_id: int, length: int, rec):
        self.cache = cache
        self.seq_id = seq_id
        self.length = length
        self.sent = False  # send_sequence filled the pages
        self.record = rec

    @property
    def num_pages(self) -> int:
        return len(self.record.pages)

    @property
    def pending(self) -> bool:
        res = ImportReservations.of(self.cache, create=False)
        return res is not None and res.pending.get(self.seq_id) is self.record

    def _reservations(self, what: str):
        if not self.pending:
            raise ValueError(
                f"{what}: the receive of sequence {self.seq_id} is no longer pending (committed, aborted, or the "
                "receiver was cleared)"
            )
        return ImportReservations.of(self.cache)

    def commit(self) -> None:
        """Make ``seq_id`` a sequence of the receiver holding the sent K/V (after :func:`send_sequence`)."""
        res = self._reservations("commit")
        if not self.sent:
            raise ValueError(f"nothing was sent into the receive of sequence {self.seq_id}; call send_sequence first")
        res.finish(self.cache, self.record)

    def abort(self) -> None:
        """Free the reserved pages (nothing happens when no longer pending)."""
        res = ImportReservations.of(self.cache, create=False)
        if res is not None:
            res.abort(self.cache, self.record)

    def __enter__(self) -> Receive:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    def __del__(self):
        try:
            self.abort()
        except Exception:  # interpreter shutdown: nothing left to free
            pass

    def __repr__(self) -> str:
        state = "pending" if self.pending else "closed"
        return f"Receive(seq_id={self.seq_id}, length={self.length}, pages={self.num_pages}, {state})"


def prepare_receive(receiver, seq_id, length) -> Receive:
    """Reserve ``ceil(length / page_size)`` pages of ``receiver`` for the new ``seq_id``.

    Raises KeyError (``seq_id`` in use or pending), ValueError (negative length, non-MHA pages),
    OutOfPagesError; nothing is reserved then. It may run while a forward is open on ``receiver`` (the
    reserved pages are none of the forward's; a transfer overlaps a step), ``Receive.commit`` may not.
    """
    seq_id = check_new_id(receiver, seq_id, "prepare_receive")
    length = as_int(length, "length")
    if length < 0:
        raise ValueError(f"length={length} must be >= 0 (the tokens of the sequence to receive)")
    check_compatible(receiver, receiver)  # MHA pages
    rec = ImportReservations.of(receiver).reserve(receiver, seq_id, length, receive=True)
    return Receive(receiver, seq_id, length, rec)


def send_sequence(sender, seq_id, recv: Receive) -> None:
    """Copy every layer of the sender's ``seq_id`` into the pages ``recv`` reserved.

    The sequence must hold exactly ``recv.length`` tokens, without uncommitted token-tree nodes or a
    sliding window; no forward may be open on the sender. Sending again overwrites the pages.
    """
    if not isinstance(recv, Receive):
        raise TypeError(f"recv must be the Receive of prepare_receive, not {type(recv).__name__}")
    seq = plain_sequence(sender, seq_id)
    check_compatible(sender, recv.cache)
    if seq.length != recv.length:
        raise ValueError(
            f"sequence {check_id(seq_id)} holds {seq.length} tokens but the receive of sequence {recv.seq_id} "
            f"reserved {recv.length}; prepare_receive with length={seq.length}"
        )
    sender.require_no_forward("send_sequence")
    if not recv.pending:
        raise ValueError(
            f"the receive of sequence {recv.seq_id} is no longer pending (committed, aborted, or the receiver was "
            "cleared); prepare_receive again"
        )
    rec = recv.record
    # ---- validated
    fp8 = getattr(sender.config, "fp8_pages", False)
    for layer, model_layer in enumerate(sender.config.layer_ids):  # (the same stage on both: check_compatible)
        copy_pages(sender, sender.pages[layer], seq.pages, recv.cache.pages[layer], rec.pages)
        if fp8:  # codes stored under the sender's scales, now under the receiver's
            recv.cache.requantize_pages(model_layer, rec.pages, sender.kv_scales(model_layer))
    rec.imported[:] = [True] * len(rec.imported)
    recv.sent = True


def move_sequence(sender, seq_id, receiver, receiver_seq_id=None, *, remove: bool = False) -> int:
    """Prepare, send and commit in one call: ``seq_id`` of ``sender`` becomes ``receiver_seq_id``
    (default: the same id) of ``receiver``; with ``remove`` the sender's sequence is removed after.

    Returns the receiver's id. On any error the receiver is left as it was. No forward may be open on
    either cache (raised before anything is reserved or copied; the step-by-step calls may reserve and
    copy during a forward, only ``commit`` may not).
    """
    receiver.require_no_forward("move_sequence")  # (what its commit checks)
    seq = plain_sequence(sender, seq_id)
    target = check_id(seq_id) if receiver_seq_id is None else receiver_seq_id
    check_new_id(receiver, target, "move_sequence")
    check_compatible(sender, receiver)
    sender.require_no_forward("send_sequence")  # (what send_sequence checks, before the scales change)
    fits = -(-seq.length // receiver.config.page_size) <= receiver.num_available_pages()
    if getattr(sender.config, "fp8_pages", False) and receiver.holds_no_token() and fits:  # codes move unchanged
        for layer in sender.config.layer_ids:
            receiver.set_kv_scales(layer, *adoptable(sender.kv_scales(layer)))
    recv = prepare_receive(receiver, target, seq.length)
    with recv:
        send_sequence(sender, seq_id, recv)
        recv.commit()
    if remove:
        sender.remove_sequence(seq_id)
    return recv.seq_id
