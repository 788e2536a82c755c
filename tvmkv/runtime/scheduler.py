"""A step scheduler over :class:`tvmkv.PagedAttentionKVCache`: waiting / running / swapped queues.

Plain Python bookkeeping (token counts; token ids only for the prefix cache; no tensors), in the
manner of vLLM's scheduler with chunked prefill. Each :meth:`Scheduler.schedule` plans one forward;
the caller runs it and reports back::

    sched = Scheduler(cache, preemption="swap")
    for req in requests:
        sched.add_request(req.seq_id, len(req.prompt))
    while sched.has_unfinished():
        plan = sched.schedule()                      # may swap / remove / add sequences in the cache
        cache.begin_forward(plan.seq_ids, plan.lengths)
        logits = model(tokens of each part)          # part: tokens[start : start + num_tokens]
        cache.end_forward()
        ...sample a token for every part with part.samples...
        sched.step_done(plan, finished=[ids that are done])

Policy of one step (token budget ``token_budget``, at most ``max_batch_size`` sequences):

1. **running**, oldest first: every decode (one pending token), then the next prefill chunk of
   sequences still prefilling (chunked to the remaining budget). When the free pages do not cover a
   sequence's need, the *newest* running sequences not yet planned are preempted until they do (a
   prefill chunk that still does not fit is shortened; a sequence that is itself the newest left is
   preempted). This happens before the cache could raise ``OutOfPagesError``.
2. **swapped**, oldest first (FIFO resumption), only in a step without preemption: swapped back in
   while their pages plus their next tokens fit; the first that does not fit stops the queue.
3. **waiting**, oldest first, only when nothing is swapped out and nothing was preempted: admitted
   while the pages of its whole known length fit (so an admitted prompt rarely has to be preempted by
   its own later chunks), prefilled in chunks.

Preemption modes: ``"swap"`` moves the victims' K/V to host memory (one batched ``swap_out`` per
step) and back later (one batched ``swap_in``); ``"recompute"`` removes them from the cache and queues
them as waiting requests whose prompt is everything they had (prompt + generated tokens), recomputed
by a chunked prefill. Either way they resume in arrival (FIFO) order, before newer requests.

Prefix cache (``prefix_cache=RadixPrefixCache(cache)``; only for requests given with their token
ids, ``add_request(..., tokens=...)``, whose sampled tokens ``step_done(..., sampled=...)`` reports):

- admission starts the sequence with ``add_sequence_with_prefix``, so only the tokens the tree does
  not hold are prefilled (its first part starts at the reused length); a recompute-preempted
  sequence is re-admitted the same way and reuses what is still cached of its own pages;
- the tree gets every full page of a running sequence after each step (``insert``: other requests
  reuse a prompt while it is still running; no copy-on-write, its partial last page stays private)
  and all of a sequence's pages when it finishes or is recompute-preempted (insert, then remove; a
  preempted one only when its pages stay evictable then: each of its pages is the tree's or its
  alone, which a fork's shared with a running parent are not; planning counts them available);
- a partially matched page pins its page as the copy's source until the first forward: an admission
  that would not fit with it reuses the matched full pages alone;
- page accounting counts the tree's evictable pages as available (the cache evicts them before it
  would raise ``OutOfPagesError``), taking into account the pages that planned admissions will share
  (``num_evictable_pages(without=..., pinned=...)``).

Sequences with sliding windows are not supported (page needs are computed from token counts).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

import numpy as np

from ..errors import OutOfPagesError
from .radix import token_ids_tuple
from .sequences import as_int, check_id

WAITING, RUNNING, SWAPPED = "waiting", "running", "swapped"
PREEMPTION_MODES = ("swap", "recompute")


@dataclass
class SeqState:
    """The scheduler's view of one sequence."""

    seq_id: int
    arrival: int  # FIFO rank: smaller is older
    num_tokens: int  # tokens known: prompt + generated
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: str = WAITING
    num_preemptions: int = 0
    tokens: list | None = None  # the token ids (len num_tokens), when the caller gave them
    num_cached: int = 0  # tokens the prefix cache was last given by insert (full pages)
    num_dropped: int = 0  # tokens dropped by its last recompute preemption, not yet computed again

    @property
    def pending(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return self.num_tokens - self.num_computed


@dataclass(frozen=True)
class Part:
    """One sequence's share of a forward: tokens ``[start, start + num_tokens)`` of it.

    ``samples`` is True when the part ends at the last known token, so its last row of logits gives
    the sequence's next token; otherwise the part is an inner prefill chunk.
    """

    seq_id: int
    start: int
    num_tokens: int
    samples: bool


@dataclass
class StepPlan:
    """What :meth:`Scheduler.schedule` decided for one forward (already applied to the cache).

    ``done`` is set by :meth:`Scheduler.step_done`: a plan is completed once.
    """

    parts: list = field(default_factory=list)
    preempted: list = field(default_factory=list)  # (seq_id, "swap" | "recompute")
    swapped_in: list = field(default_factory=list)  # seq ids
    admitted: list = field(default_factory=list)  # seq ids added to the cache this step
    done: bool = False

    @property
    def seq_ids(self) -> list:
        return [p.seq_id for p in self.parts]

    @property
    def lengths(self) -> list:
        return [p.num_tokens for p in self.parts]

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.parts)

    def events(self) -> list:
        """Readable lines: preemptions and swap-ins."""
        out = [f"preempt {sid} ({mode})" for sid, mode in self.preempted]
        out += [f"swap in {sid}" for sid in self.swapped_in]
        return out


@dataclass
class SchedulerStats:
    steps: int = 0
    preempted_swap: int = 0
    preempted_recompute: int = 0
    swapped_in: int = 0
    recomputed_tokens: int = 0  # tokens computed again after a recompute preemption
    reused_tokens: int = 0  # tokens admissions took from the prefix cache instead of prefilling
    forks_recomputed: int = 0  # forks that found no free page and were queued for recomputation


class Scheduler:
    """Plans forwards over ``cache`` with waiting / running / swapped queues (policy: module docstring).

    Parameters
    ----------
    cache : tvmkv.PagedAttentionKVCache
        Queried for free pages and page needs; ``swap_out`` / ``swap_in`` in swap mode.
    token_budget : int, optional
        Most new tokens of one forward (default and maximum: the cache's ``prefill_chunk_size``).
    max_batch_size : int, optional
        Most sequences of one forward (default and maximum: the cache's ``max_batch_size``).
    preemption : str
        "swap" or "recompute".
    watermark_pages : int
        Free pages an admission leaves untouched (headroom for running sequences to grow), while some
        sequence runs: with nothing running, a request is admitted if its pages fit.
    ops : object, optional
        Where ``add_sequence`` / ``remove_sequence`` / ``fork_sequence`` go (default ``cache``), e.g.
        an adapter that calls them through TVM's ``vm.builtin.kv_state_*`` functions.
    prefix_cache : tvmkv.RadixPrefixCache, optional
        A prefix cache over ``cache``: requests with token ids are admitted through it (reusing cached
        prefixes) and inserted into it (module docstring). Admission calls its
        ``add_sequence_with_prefix`` (not ``ops.add_sequence``); removals still go through ``ops``.
    """

    def __init__(
        self,
        cache,
        *,
        token_budget=None,
        max_batch_size=None,
        preemption="swap",
        watermark_pages=0,
        ops=None,
        prefix_cache=None,
    ):
        cfg = cache.config
        chunk, batch, total = cfg.prefill_chunk_size, cfg.max_batch_size, cfg.total_pages
        if token_budget is not None:
            why = f"new tokens of one forward: at most the cache's prefill_chunk_size={chunk}, or None for that"
            token_budget = _int_in(token_budget, "token_budget", 1, chunk, meaning=why)
        if max_batch_size is not None:
            why = f"sequences of one forward: at most the cache's max_batch_size={batch}, or None for that"
            max_batch_size = _int_in(max_batch_size, "max_batch_size", 1, batch, meaning=why)
        why = f"free pages admissions leave untouched: fewer than the cache's {total} pages, or nothing is admitted"
        watermark_pages = _int_in(watermark_pages, "watermark_pages", 0, total - 1, meaning=why)
        if not isinstance(preemption, str) or preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption={preemption!r} is not one of {PREEMPTION_MODES}")
        if prefix_cache is not None and prefix_cache.cache is not cache:
            raise ValueError("prefix_cache is over another cache; pass RadixPrefixCache(cache) of this cache")
        self.cache = cache
        self.ops = cache if ops is None else ops
        self.token_budget: int = cfg.prefill_chunk_size if token_budget is None else token_budget
        self.max_batch_size: int = cfg.max_batch_size if max_batch_size is None else max_batch_size
        self.preemption = preemption
        self.watermark_pages = watermark_pages
        self.prefix_cache = prefix_cache
        self.page_size = cfg.page_size
        self.total_pages = cfg.total_pages
        self.stats = SchedulerStats()
        self.seqs: dict = {}  # seq_id -> SeqState (unfinished sequences)
        self.queues: dict = {WAITING: [], RUNNING: [], SWAPPED: []}  # each sorted by arrival
        self._arrivals = itertools.count()
        self._open: StepPlan | None = None  # the last plan schedule() returned, until step_done
        self._open_states: dict[int, SeqState] = {}  # its parts' states (a finished id may come back as new)

    # ------------------------------------------------------------------ requests
    def add_request(self, seq_id, num_prompt_tokens=None, *, tokens=None) -> None:
        """Queue a new sequence of ``num_prompt_tokens`` (> 0) tokens as waiting (the newest).

        Parameters
        ----------
        seq_id : int
            Not used by another request of this scheduler nor by a sequence in the cache (on the
            device or swapped out).
        num_prompt_tokens : int, optional
            The prompt's length (default ``len(tokens)``); its pages must fit in the cache.
        tokens : sequence of int, optional
            The prompt's token ids. With a prefix cache, a request given with them reuses cached
            prefixes and is inserted into the tree; ``step_done`` then needs its sampled tokens.

        Raises TypeError, KeyError (an id in use) or ValueError before queueing anything, so that
        :meth:`schedule` can admit it.
        """
        seq_id = self._new_id(seq_id, "seq_id")
        if tokens is not None:
            tokens = list(token_ids_tuple(tokens, "tokens"))
            if num_prompt_tokens is None:
                num_prompt_tokens = len(tokens)
        if num_prompt_tokens is None:
            raise TypeError(f"add_request of sequence {seq_id} needs num_prompt_tokens or tokens")
        num_prompt_tokens = as_int(num_prompt_tokens, "num_prompt_tokens")
        if tokens is not None and num_prompt_tokens != len(tokens):
            raise ValueError(
                f"num_prompt_tokens={num_prompt_tokens} of sequence {seq_id} != len(tokens)={len(tokens)}; "
                "pass one of them"
            )
        if num_prompt_tokens <= 0:
            raise ValueError(f"num_prompt_tokens={num_prompt_tokens} of sequence {seq_id} must be positive")
        pages = -(-num_prompt_tokens // self.page_size)
        if pages > self.total_pages:
            raise ValueError(
                f"num_prompt_tokens={num_prompt_tokens} of sequence {seq_id} needs {pages} pages, more than the "
                f"cache's {self.total_pages}; shorten the prompt or build the cache with more pages"
            )
        self._enqueue(SeqState(seq_id, next(self._arrivals), num_prompt_tokens, tokens=tokens), WAITING)

    def fork(self, parent_seq_id, child_seq_id, *, tokens=None) -> bool:
        """A child with the parent's tokens so far, the last one replaced by the caller (parallel
        sampling): it shares the parent's computed pages when the parent is on the device and a page is
        free for the copy of a partial last page; otherwise it is queued as waiting and recomputed.
        ``tokens`` (optional): the child's token ids (as many as the parent's). Returns whether it
        shares the parent's pages."""
        parent = self._known(parent_seq_id, "parent_seq_id")
        child_seq_id = self._new_id(child_seq_id, "child_seq_id")
        if tokens is not None:
            tokens = list(token_ids_tuple(tokens, "tokens"))
            if len(tokens) != parent.num_tokens:
                raise ValueError(
                    f"tokens of child {child_seq_id} has {len(tokens)} ids; its parent {parent_seq_id} has "
                    f"{parent.num_tokens} tokens (pass the parent's with the last one replaced)"
                )
        child = SeqState(child_seq_id, next(self._arrivals), parent.num_tokens, tokens=tokens)
        copy = 1 if parent.num_computed % self.page_size else 0  # a partial last page is copied
        if parent.status == RUNNING and copy <= self._free_pages():
            try:
                self.ops.fork_sequence(parent_seq_id, child_seq_id, parent.num_computed)
            except OutOfPagesError:
                self.stats.forks_recomputed += 1
            else:
                child.num_computed = parent.num_computed
                self._enqueue(child, RUNNING)
                return True
        self._enqueue(child, WAITING)
        return False

    def finish(self, seq_id) -> None:
        """Drop ``seq_id`` from the scheduler and the cache (wherever it is). With a prefix cache, a
        sequence on the device with token ids is inserted into it first (its pages stay cached).

        A sequence of the plan not yet reported may finish (a cancelled request): :meth:`step_done`
        then skips its part. Raises KeyError (not a request of this scheduler) and, for a sequence the
        cache holds, ForwardStateError while a forward is open, before changing anything."""
        st = self._known(seq_id, "seq_id")
        seq_id = st.seq_id
        if st.status != WAITING or st.num_computed:  # the cache holds it: the cache calls first
            self.cache.require_no_forward("Scheduler.finish")
            if st.status == RUNNING and self.prefix_cache is not None and st.tokens is not None:
                self.prefix_cache.insert(seq_id, st.tokens[: st.num_computed])
            self.ops.remove_sequence(seq_id)
        del self.seqs[seq_id]
        self.queues[st.status].remove(st)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def queue_ids(self, status: str) -> list:
        """Ids in the ``"waiting"``, ``"running"`` or ``"swapped"`` queue, oldest first."""
        return [st.seq_id for st in self.queues[status]]

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepPlan:
        """Plan the next forward and apply its preemptions, swap-ins and admissions to the cache.

        Raises before changing anything: ForwardStateError (a forward is open), KeyError (a waiting
        request's id was taken in the cache, or reserved by an import, since ``add_request``),
        ValueError (the forward of the plan not yet reported to :meth:`step_done` ran), RuntimeError
        when nothing can run (a sequence that needs more pages than the cache has). The plan it
        returns supersedes a plan not yet reported whose forward did not run.
        """
        P, cache, prefix = self.page_size, self.cache, self.prefix_cache
        cache.require_no_forward("Scheduler.schedule")
        self._check_unreported()
        in_cache = set(cache.sequence_ids()).union(cache.swapped_sequence_ids())
        claimed = set(cache.reserved_sequence_ids())
        for st in self.queues[WAITING]:
            if st.seq_id in in_cache:
                raise KeyError(
                    f"request {st.seq_id} is waiting, but a sequence {st.seq_id} was added to the cache outside this "
                    f"scheduler; remove that sequence from the cache or finish({st.seq_id}) the request"
                )
            if st.seq_id in claimed:
                raise KeyError(
                    f"request {st.seq_id} is waiting, but an import into the cache reserved id {st.seq_id} since; "
                    f"abort that import or finish({st.seq_id}) the request"
                )
        budget, slots = self.token_budget, self.max_batch_size
        base_free = cache.num_available_pages()
        chosen = {}  # seq_id -> (SeqState, num_tokens)
        victims: list = []
        used = 0  # pages the chosen parts take
        pinned: list = []  # tree pages that planned admissions will share (prefix cache)

        def available(pins=()) -> int:
            """Free pages, plus those the victims release and the tree could evict, minus ``used``."""
            leaving = [v.seq_id for v in victims]
            released = cache.num_pages_released_by(leaving) if leaving else 0
            evictable = 0 if prefix is None else prefix.num_evictable_pages(without=leaving, pinned=pinned + list(pins))
            return base_free + released + evictable - used

        # ---- 1. running: decodes, then prefill chunks; preempt the newest when pages run out
        running = self.queues[RUNNING]
        for decode in (True, False):
            for st in running:
                if st.seq_id in chosen or st in victims or (st.pending == 1) != decode:
                    continue
                n = min(st.pending, budget)
                if n <= 0 or not slots:
                    continue
                need = cache.num_pages_needed(st.seq_id, n)
                while need > available():
                    newest = next(r for r in reversed(running) if r.seq_id not in chosen and r not in victims)
                    if newest is st:
                        break
                    victims.append(newest)
                if need > available() and not decode:  # shorten the chunk to the pages there are
                    short = self._tokens_fitting(st, n, available())
                    n, need = (short, cache.num_pages_needed(st.seq_id, short)) if short else (n, need)
                if need > available():
                    if -(-(st.num_computed + n) // P) > self.total_pages:
                        raise RuntimeError(
                            f"sequence {st.seq_id} needs {-(-(st.num_computed + n) // P)} pages, more than the "
                            f"cache's {self.total_pages}; build the cache with more pages"
                        )
                    victims.append(st)
                    continue
                chosen[st.seq_id] = (st, n)
                used += need
                budget -= n
                slots -= 1
        # ---- 2. swapped, FIFO, only without preemption in this step
        swap_in = []
        if not victims:
            for st in self.queues[SWAPPED]:
                n = min(st.pending, budget)
                if n <= 0 or not slots:
                    break
                need = cache.num_pages_needed(st.seq_id, n)  # its pages back + room for n tokens
                if need > available():
                    break
                swap_in.append(st)
                chosen[st.seq_id] = (st, n)
                used += need
                budget -= n
                slots -= 1
        # ---- 3. waiting, FIFO, only with nothing swapped out and nothing preempted
        admit = {}  # seq_id -> (SeqState, tokens reused from the prefix cache)
        if not victims and len(swap_in) == len(self.queues[SWAPPED]):
            reserved = 0  # pages admitted prompts will need beyond their first chunk
            for st in self.queues[WAITING]:
                # headroom for running sequences to grow: none is needed while nothing runs (a
                # request longer than the cache less the watermark would otherwise wait forever)
                wm = self.watermark_pages if chosen or self.queues[RUNNING] else 0
                if not slots or budget <= 0:
                    break
                total = -(-st.num_tokens // P)
                if total > self.total_pages:
                    raise RuntimeError(
                        f"sequence {st.seq_id} needs {total} pages, more than the cache's {self.total_pages}; "
                        "build the cache with more pages"
                    )
                limit = None  # max_reuse of its admission
                reused, pages = prefix.prefix_pages(st.tokens) if self._uses_prefix(st) else (0, [])
                # shared full pages are not allocated; a partially matched page is copied on write, and
                # held (not evictable) as the copy's source until then
                whole = total - reused // P
                if reused % P and whole + wm > available(pages) - reserved:
                    # without the partial page (its copy's source would take the page the prompt needs;
                    # nothing runs to evict it later): the full pages alone
                    limit = reused // P * P
                    reused, pages = prefix.prefix_pages(st.tokens, max_reuse=limit)
                    whole = total - reused // P
                if whole + wm > available(pages) - reserved:
                    break
                n = min(st.pending - reused, budget)  # (>= 1: a prompt's last token is never reused)
                need = -(-(reused + n) // P) - reused // P
                admit[st.seq_id] = (st, reused, limit)
                pinned += pages
                chosen[st.seq_id] = (st, n)
                used += need
                reserved += whole - need
                budget -= n
                slots -= 1
        if not chosen and victims and prefix is None and not self._retry_runs(victims, available()):
            raise self._nothing_to_run()  # before the preemptions: planning again could run nothing either
        plan = self._apply(chosen, victims, swap_in, admit)
        if not plan.parts and plan.preempted:
            # only preemptions (the newest running sequence preempted itself): plan again with what
            # they released. With a prefix cache, tree pages the victims pinned are evictable now
            again = self.schedule()
            again.preempted[:0] = plan.preempted
            return again
        if not plan.parts:
            raise self._nothing_to_run()
        self.stats.steps += 1
        self._open = plan
        self._open_states = {p.seq_id: self.seqs[p.seq_id] for p in plan.parts}
        return plan

    def step_done(self, plan: StepPlan, finished=(), *, sampled=None) -> None:
        """Record that ``plan``'s forward ran: its tokens are in the cache, every part with
        ``samples`` appended one sampled token, and the sequences in ``finished`` are done (removed).

        ``sampled`` : dict seq_id -> token id, the token sampled for each part with ``samples`` of a
        sequence with token ids (required for those; ignored for the others). With a prefix cache,
        the full pages of the forward's sequences are then inserted into it.

        The parts of sequences finished since :meth:`schedule` (:meth:`finish`) are skipped.

        Raises before changing anything: ValueError for a plan already completed or superseded by a
        later :meth:`schedule`, KeyError / TypeError / ValueError for ``finished`` (ids this scheduler
        knows, each once) and ``sampled``, ForwardStateError while a forward is open (call
        ``end_forward`` first).
        """
        if plan is not self._open:
            if getattr(plan, "done", False):
                raise ValueError("this plan was already completed by step_done (a plan can be completed once)")
            raise ValueError(
                "this plan is not the one the last schedule() returned; report each plan once, before the next "
                "schedule()"
            )
        states = self._open_states
        parts = [p for p in plan.parts if self.seqs.get(p.seq_id) is states[p.seq_id]]  # not finished since
        finished = [self._known(sid, "finished[i]").seq_id for sid in finished]
        if len(set(finished)) != len(finished):
            raise ValueError(f"finished={finished} names a sequence twice; pass each once")
        sampled = {} if sampled is None else sampled
        if not isinstance(sampled, dict):
            raise TypeError(f"sampled must be a dict seq_id -> token id, not {type(sampled).__name__}")
        need = [p.seq_id for p in parts if p.samples and self.seqs[p.seq_id].tokens is not None]
        missing = [sid for sid in need if sid not in sampled]
        if missing:
            raise ValueError(
                f"sequences {missing} have token ids and sampled a token: pass sampled={{seq_id: token}} for them"
            )
        new = {sid: _token(sampled[sid], sid) for sid in need}  # validated before anything changes
        self.cache.require_no_forward("Scheduler.step_done")  # (the forward ran: it has ended)
        plan.done, self._open, self._open_states = True, None, {}
        for part in parts:
            st = self.seqs[part.seq_id]
            st.num_computed += part.num_tokens
            if part.samples:
                st.num_tokens += 1
                if st.tokens is not None:
                    st.tokens.append(new[part.seq_id])
            aligned = st.num_computed // self.page_size * self.page_size
            if self._uses_prefix(st) and aligned > st.num_cached:
                prefix = st.tokens[:aligned]
                # not below pages of another sequence's (they would stay pinned while this one runs);
                # it is inserted when it finishes
                if self.prefix_cache.holds_cached_prefix(st.seq_id, prefix):
                    self.prefix_cache.insert(st.seq_id, prefix)
                st.num_cached = aligned
        for sid in finished:
            self.finish(sid)

    # ------------------------------------------------------------------ internals
    def _new_id(self, seq_id, name: str) -> int:
        """``seq_id`` as an int (the cache's id rule) that no request and no sequence in the cache uses."""
        seq_id = check_id(seq_id, name)
        if seq_id in self.seqs:
            raise KeyError(f"{name} {seq_id} is already scheduled ({self.seqs[seq_id].status}); pick another id")
        if seq_id in self.cache.sequence_ids() or seq_id in self.cache.swapped_sequence_ids():
            raise KeyError(
                f"{name} {seq_id} is used by a sequence in the cache that this scheduler does not manage; pick "
                "another id or remove that sequence first"
            )
        if seq_id in self.cache.reserved_sequence_ids():
            raise KeyError(
                f"{name} {seq_id} is reserved by an import into the cache that is in progress; pick another id, or "
                "finish (or abort) that import and remove the sequence first"
            )
        return seq_id

    def _check_unreported(self) -> None:
        """ValueError when the forward of the plan not yet reported to :meth:`step_done` ran: one of its
        sequences holds more tokens than the scheduler counts as computed, and planning again would
        append them a second time."""
        for part in self._open.parts if self._open is not None else ():
            st = self._open_states[part.seq_id]
            if self.seqs.get(part.seq_id) is st and st.status == RUNNING:
                held = self.cache.sequence_length(part.seq_id)
                if held != st.num_computed:
                    raise ValueError(
                        f"sequence {part.seq_id} holds {held} tokens but {st.num_computed} were computed when the "
                        "last plan was made: its forward ran; report it with step_done(plan, ...) before schedule()"
                    )

    def _known(self, seq_id, name: str) -> SeqState:
        """The state of ``seq_id``, a request of this scheduler (KeyError names it otherwise)."""
        st = self.seqs.get(check_id(seq_id, name))
        if st is None:
            raise KeyError(f"{name} {seq_id} is not a request of this scheduler (finished, or never added)")
        return st

    def _tokens_fitting(self, st: SeqState, limit: int, pages: int) -> int:
        """Most tokens (<= ``limit``) ``st`` can append using at most ``pages`` free pages (0 if none,
        e.g. when its shared last page would need a copy)."""
        if pages <= 0:
            return 0
        room = -st.num_computed % self.page_size + pages * self.page_size
        n = min(limit, room)
        return n if n and self.cache.num_pages_needed(st.seq_id, n) <= pages else 0

    def _uses_prefix(self, st: SeqState) -> bool:
        return self.prefix_cache is not None and st.tokens is not None

    def _leaves_evictable(self, st: SeqState) -> bool:
        """Whether the pages of running ``st``, inserted into the prefix cache and then removed from the
        cache, stay evictable, as planning counted them released: every page of it that is not one of
        the tree's (those its tokens match) is its alone. A page it shares otherwise (a fork's with its
        running parent) would pin the new tree node, whose pages could then be neither freed nor
        evicted."""
        assert st.tokens is not None and self.prefix_cache is not None  # (_uses_prefix)
        tokens = st.tokens[: st.num_computed]
        tree = set(self.prefix_cache.prefix_pages(tokens, max_reuse=len(tokens))[1])
        own = [p for p in self.cache.sequence_pages(st.seq_id) if p not in tree]
        return self.cache.num_pages_released_by([st.seq_id]) == len(own)

    def _free_pages(self) -> int:
        """Pages a forward can get now: free ones and those the prefix cache could evict."""
        evictable = self.prefix_cache.num_evictable_pages() if self.prefix_cache is not None else 0
        return self.cache.num_available_pages() + evictable

    def _nothing_to_run(self) -> RuntimeError:
        return RuntimeError(
            "nothing can be scheduled: "
            f"{len(self.queues[WAITING])} waiting, {len(self.queues[RUNNING])} running, "
            f"{len(self.queues[SWAPPED])} swapped, {self._free_pages()} pages free or evictable of "
            f"{self.total_pages}; pages may be held by sequences this scheduler does not manage"
        )

    def _retry_runs(self, victims: list, free_after: int) -> bool:
        """Whether a step that would only preempt ``victims`` lets the planning that follows it run
        something, with ``free_after`` pages free once they left (no prefix cache: the count is exact).
        That planning takes the sequence first in line or nothing: in swap mode the oldest swapped one
        (the victims join that queue), in recompute mode the oldest waiting one (they rejoin it from
        scratch)."""
        P, cache = self.page_size, self.cache
        if self.preemption == "swap":
            first = min([*self.queues[SWAPPED], *victims], key=_arrival)
            n = min(first.pending, self.token_budget)
            if first in victims:  # swap_in brings back all of its tokens' pages, then room for n
                return -(-(cache.sequence_length(first.seq_id) + n) // P) <= free_after
            return cache.num_pages_needed(first.seq_id, n) <= free_after
        first = min([*self.queues[WAITING], *victims], key=_arrival)
        wm = self.watermark_pages if len(victims) < len(self.queues[RUNNING]) else 0  # (none while nothing runs)
        return -(-first.num_tokens // P) + wm <= free_after

    def _apply(self, chosen, victims, swap_in, admit) -> StepPlan:
        plan = StepPlan()
        if victims:
            if self.preemption == "swap":
                self.cache.swap_out([v.seq_id for v in victims])
            for v in victims:
                self.queues[RUNNING].remove(v)
                v.num_preemptions += 1
                if self.preemption == "swap":
                    self._enqueue(v, SWAPPED)
                    self.stats.preempted_swap += 1
                else:
                    if self._uses_prefix(v) and self._leaves_evictable(v):  # re-admission may reuse them
                        self.prefix_cache.insert(v.seq_id, v.tokens[: v.num_computed])
                    self.ops.remove_sequence(v.seq_id)
                    v.num_dropped, v.num_computed, v.num_cached = v.num_computed, 0, 0
                    self._enqueue(v, WAITING)
                    self.stats.preempted_recompute += 1
                plan.preempted.append((v.seq_id, self.preemption))
        # admissions before swap-ins: the pages they share from the prefix cache are then held, so
        # the evictions of swap_in (and of begin_forward) cannot take them. The cache calls come first;
        # should one fail, the admitted sequences leave the cache again and the queues stay as they were
        # (admissions and swap-ins happen only in a step without preemption)
        reused_by: dict = {}
        try:
            for st, reused, limit in admit.values():
                if self._uses_prefix(st):
                    got = self.prefix_cache.add_sequence_with_prefix(st.seq_id, st.tokens, max_reuse=limit)
                    reused_by[st.seq_id] = got
                    assert got == reused, "the tree changed between planning and admission"
                else:
                    self.ops.add_sequence(st.seq_id)
                    reused_by[st.seq_id] = 0
            if swap_in:
                self.cache.swap_in([st.seq_id for st in swap_in])
        except BaseException:
            for sid in reversed(list(reused_by)):
                self.ops.remove_sequence(sid)
            raise
        for st, _, _ in admit.values():
            if self._uses_prefix(st):
                st.num_computed = st.num_cached = reused_by[st.seq_id]
                self.stats.reused_tokens += st.num_computed
            self.stats.recomputed_tokens += max(0, st.num_dropped - st.num_computed)
            st.num_dropped = 0
            self.queues[WAITING].remove(st)
            self._enqueue(st, RUNNING)
            plan.admitted.append(st.seq_id)
        if swap_in:
            for st in swap_in:
                self.queues[SWAPPED].remove(st)
                self._enqueue(st, RUNNING)
                plan.swapped_in.append(st.seq_id)
            self.stats.swapped_in += len(swap_in)
        for st, n in chosen.values():
            plan.parts.append(Part(st.seq_id, st.num_computed, n, st.num_computed + n == st.num_tokens))
        return plan

    def _enqueue(self, st: SeqState, status: str) -> None:
        st.status = status
        self.seqs[st.seq_id] = st
        queue = self.queues[status]
        queue.insert(bisect.bisect(queue, st.arrival, key=_arrival), st)


def _arrival(st: SeqState) -> int:
    return st.arrival


def _int_in(value, name: str, lo: int, hi: int, *, meaning: str) -> int:
    """``value`` as a Python int in ``[lo, hi]``; the TypeError / ValueError names it, the range and
    what it means."""
    try:
        value = as_int(value, name)
    except TypeError:
        raise TypeError(f"{name}={value!r} must be an int in [{lo}, {hi}] ({meaning})") from None
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} must be in [{lo}, {hi}] ({meaning})")
    return value


def _token(value, seq_id) -> int:
    """A sampled token id as a Python int (TypeError names the sequence)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"sampled token of sequence {seq_id} is {value!r}; pass an int token id")
    return int(value)
