"""`Sampler`: one base model and a stack of LoRA adapters, generating for many rows at once with a KV cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from trace_jax import lora as lora_lib
from trace_jax.models import decoder
from trace_jax.models.config import ModelConfig
from trace_jax.sampling.fused import FusedSession
from trace_jax.sampling.kernels import Programs
from trace_jax.sampling.session import Completion, Session, per_row
from trace_jax.sampling.shapes import ShapePolicy, bucket_size, prefix_capacity, shared_prefix_length
from trace_jax.sharding import ShardingPlan

ADAPTIVE, FUSED = "adaptive", "fused"
POLICIES = (ADAPTIVE, FUSED)


def default_policy() -> str:
    """The session policy for the default backend: fused on accelerators, adaptive on the CPU."""
    return ADAPTIVE if jax.default_backend() == "cpu" else FUSED


class Sampler:
    """Generates for many rows at once from one base model and a stack of LoRA adapters.

    `generate` returns the completions and a `KVCache` holding every row's tokens so
    far; pass it back with `rows=` to append a next turn to those rows and go on.
    A fresh batch whose prompts share at least `min_shared_prefix` leading tokens
    prefills that prefix once per adapter into a prefix slot of the cache that the rows
    continue from (None: never); `add_prefix` and `start_row` do the same for rows
    started one by one (under the fused policy, a started row copies such a prefix from a row that holds it).
    Other prompt tokens are prefilled in calls of at most `prefill_chunk` tokens per row: little padding, and
    few compiled widths.

    `policy` picks how sessions run (None: by backend): "adaptive" (`Session`: row-wise prefills, shared prefixes,
    shapes fitted to each call; what a CPU runs fastest) or "fused" (`FusedSession`: fed tokens folded into
    decode steps of `decode_chunk` steps a call, a fixed set of programs compiled at a session's start; what an
    accelerator runs fastest). `tokenize` lets a fused session detect stop strings on the device.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        *,
        adapters: lora_lib.Adapters | None = None,
        plan: ShardingPlan | None = None,
        max_context: int | None = None,
        decode_chunk: int = 32,
        min_cache: int = 128,
        detokenize: Callable[[list[int]], str] | None = None,
        min_shared_prefix: int | None = 64,
        prefill_chunk: int = 128,
        policy: str | None = None,
        feed_chunks: int = 4,
        tokenize: Callable[[str], list[int]] | None = None,
    ):
        if prefill_chunk != bucket_size(prefill_chunk, 16):
            raise ValueError(f"prefill_chunk {prefill_chunk} must be a bucket size (16, 24, 32, 48, 64, 96, 128, ...)")
        self.policy = policy or default_policy()
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES} or None (by backend), not {policy!r}")
        self.feed_chunks = feed_chunks
        self.tokenize = tokenize
        self._warm: set[tuple] = set()  # (rows, stop ids) of the fused sessions whose programs are compiled
        self.cfg = cfg
        self.prefill_chunk = prefill_chunk
        self.plan = plan
        self.max_context = max_context or cfg.max_position_embeddings
        self.decode_chunk = decode_chunk
        self.min_cache = min_cache
        self.detokenize = detokenize
        self.min_shared_prefix = min_shared_prefix if self.policy == ADAPTIVE else None
        # fused: a started row copies the head of a conversation another row holds when they share this many tokens
        self.min_copied_prefix = min_shared_prefix if self.policy == FUSED else None
        self.shapes = ShapePolicy(plan.batch_multiple if plan else 1, min_cache, self.max_context)
        self.params = plan.shard_params(params) if plan else params
        self.adapters = None if adapters is None else (plan.shard_params(adapters) if plan else adapters)
        self.programs = Programs.compile(
            cfg,
            plan.constrain if plan else decoder.no_constraint,
            decode_chunk,
            prefill_chunk,
            self.max_context,
            self.shapes.batch_multiple,
        )

    @property
    def fixed_shapes(self) -> bool:
        """Whether sessions run programs compiled for their rows ahead of time (the fused policy): callers then keep
        one session size rather than fitting rows to the work."""
        return self.policy == FUSED

    def set_adapters(self, adapters: lora_lib.Adapters | None) -> None:
        """Swaps in new adapter weights (same shapes: no recompilation)."""
        self.adapters = None if adapters is None else (self.plan.shard_params(adapters) if self.plan else adapters)

    def put(self, x, name: str):
        """`x` as a device array, placed on the mesh as the activation `name` where the sampler is sharded. A host
        value goes by `jax.device_put`, which copies it; `jnp.asarray` would compile a program for each new shape."""
        if not isinstance(x, jax.Array):
            x = np.asarray(x)
        return jax.device_put(x, self.plan.activation_sharding(name, x.shape) if self.plan else None)

    def new_cache(self, batch: int, capacity: int | None = None) -> decoder.KVCache:
        """An empty cache for `batch` rows (rounded up to a bucket)."""
        capacity = min(capacity or self.min_cache, self.max_context)
        cache = decoder.init_cache(self.cfg, self.shapes.batch_size(batch), capacity, self.params["embed"].dtype)
        return self._place(cache)

    def _place(self, cache: decoder.KVCache) -> decoder.KVCache:
        layers = lambda arrays, name: tuple(self.put(a, name) for a in arrays)
        return decoder.KVCache(
            layers(cache.k, "cache"),
            layers(cache.v, "cache"),
            self.put(cache.lengths, "batch"),
            layers(cache.prefix_k, "prefix_cache"),
            layers(cache.prefix_v, "prefix_cache"),
            self.put(cache.prefix_slot, "batch"),
            self.put(cache.prefix_len, "batch"),
        )

    def resize(self, cache: decoder.KVCache, capacity: int) -> decoder.KVCache:
        """`cache` with `capacity` positions in each row's own buffer (padded, or cut: rows must fit)."""
        k, v = self.programs.resize(cache.k, cache.v, capacity=capacity)
        return self._place(cache.replace(k=k, v=v))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        key: jax.Array,
        max_new_tokens=256,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        adapter_idx=lora_lib.NO_ADAPTER,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        cache: decoder.KVCache | None = None,
        rows: Sequence[int] | None = None,
        stream=None,
    ) -> tuple[list[Completion], decoder.KVCache]:
        """Appends prompts[i] to row rows[i] (a fresh cache and rows 0..n-1 by default) and samples.

        Sampling arguments are scalars or one value per prompt. Every prompt must be
        non-empty: a continuing row appends at least the next turn's tokens. `stream`: each
        prompt's random stream (default its row; see `Session.feed`).
        """
        n = len(prompts)
        if cache is None:
            cache, prompts = self._fresh_cache(
                prompts, per_row(adapter_idx, n, np.int32), per_row(max_new_tokens, n, np.int32)
            )
        rows = list(range(n)) if rows is None else [int(r) for r in rows]
        session = self._session_class()(self, cache, stop_token_ids=stop_token_ids, stop_strings=stop_strings)
        session.feed(
            rows,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            adapter_idx=adapter_idx,
            stream=stream,
        )
        done: dict[int, Completion] = {}
        while len(done) < n:
            done.update(session.step(key))
        return [done[r] for r in rows], session.cache

    def session(self, batch: int, **stops) -> Session:
        """A session of the sampler's policy over a fresh cache of `batch` rows (see `Session`; `stops`:
        stop_token_ids, stop_strings); a fused one has every program it can run compiled."""
        session = self._session_class()(self, self.new_cache(batch), **stops)
        warm = (session.cache.batch, frozenset(stops.get("stop_token_ids", ())))
        if self.policy == FUSED and warm not in self._warm:
            session.warm_up()
            self._warm.add(warm)
        return session

    def _session_class(self) -> type[Session]:
        return FusedSession if self.policy == FUSED else Session

    def add_prefix(
        self, cache: decoder.KVCache, prefix: Sequence[int], adapter_idx: int
    ) -> tuple[decoder.KVCache, int]:
        """`cache` with `prefix` prefilled with adapter `adapter_idx` in a new prefix slot, and the slot."""
        slot = cache.num_slots
        return self._add_slots(cache, prefix, np.array([adapter_idx])), slot

    def start_row(self, cache: decoder.KVCache, row: int, slot: int = 0, length: int = 0) -> decoder.KVCache:
        """`cache` with `row` emptied to start a new sequence: after the first `length` positions of
        prefix slot `slot` (as if those tokens had been prefilled in it), or from scratch (length 0)."""
        return cache.replace(
            lengths=cache.lengths.at[row].set(0),
            prefix_slot=cache.prefix_slot.at[row].set(slot),
            prefix_len=cache.prefix_len.at[row].set(length),
        )

    def _fresh_cache(
        self, prompts: Sequence[Sequence[int]], adapter_idx: np.ndarray, max_new: np.ndarray
    ) -> tuple[decoder.KVCache, Sequence[Sequence[int]]]:
        """A cache for a fresh batch and what of each prompt is left to prefill: rows continuing
        the shared prefix (prefilled once per adapter, in prefix slots) when it is long enough,
        else empty rows."""
        lengths = [len(p) for p in prompts]
        shared = shared_prefix_length(prompts, self.min_shared_prefix)
        if not shared or max(lengths) >= self.max_context:  # a row that cannot fit must stay empty
            return self.new_cache(len(prompts)), prompts
        capacity = self.shapes.capacity(int(np.max(np.add(lengths, max_new))) - shared)
        groups, group_of_row = np.unique(adapter_idx, return_inverse=True)
        cache = self._add_slots(self.new_cache(len(prompts), capacity), prompts[0][:shared], groups)
        slot = np.zeros((cache.batch,), np.int32)
        slot[: len(prompts)] = group_of_row.reshape(-1)
        length = np.zeros((cache.batch,), np.int32)
        length[: len(prompts)] = shared
        cache = cache.replace(prefix_slot=self.put(slot, "batch"), prefix_len=self.put(length, "batch"))
        return cache, [p[shared:] for p in prompts]

    def _add_slots(self, cache: decoder.KVCache, prefix: Sequence[int], groups: np.ndarray) -> decoder.KVCache:
        """`cache` with one new prefix slot per adapter of `groups`, each holding `prefix` prefilled with it."""
        width = min(prefix_capacity(len(prefix)), self.max_context)
        prefilled = self.new_cache(len(groups), width)
        tokens = np.zeros((prefilled.batch, width), np.int32)
        tokens[: len(groups), : len(prefix)] = prefix
        num_new = np.zeros((prefilled.batch,), np.int32)
        num_new[: len(groups)] = len(prefix)
        group_adapter = np.full((prefilled.batch,), lora_lib.NO_ADAPTER, np.int32)
        group_adapter[: len(groups)] = groups
        _, prefilled = self.programs.prefill(
            self.params,
            self.adapters,
            prefilled,
            self.put(tokens, "batch"),
            self.put(num_new, "batch"),
            self.put(group_adapter, "batch"),
        )
        rows = lambda arrays: tuple(a[: len(groups)] for a in arrays)  # the mesh may have padded the batch
        return self._place(decoder.add_prefix_slots(cache, prefilled.replace(k=rows(prefilled.k), v=rows(prefilled.v))))

    def find_stop_string(self, ids: list[int], stop_strings: Sequence[str]) -> tuple[int, int] | None:
        """(tokens to keep, text length before the stop string) for the earliest stop string, if any."""
        text = self.detokenize(ids)
        hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
        if not hits:
            return None
        start = min(hits)
        end = min(start + len(s) for s in stop_strings if text.find(s) == start)
        keep = next(k for k in range(1, len(ids) + 1) if len(self.detokenize(ids[:k])) >= end)
        return keep, start
