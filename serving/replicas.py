"""Data parallelism for serving: one front door over several engines, one per data slice of the
mesh. Each replica is a whole `Engine` (its own scheduler, KV page pool and compiled steps) on a
(1, tensor, expert) slice; nothing is shared between them at run time, so replicas never wait
on each other's collectives. The front door only picks a replica for each new request and
merges their outputs; it has the same surface as `Engine`, so `EngineLoop` and `LLM` drive
either.

A request goes where its prompt's prefix is: to the replica whose prefix cache holds the longest
run of its full pages, or, when none holds any, to the replica its first page hashes to, so that
requests sharing a prefix that arrive together meet on one replica and all but the first hit the
cache. Affinity yields to balance: a replica already carrying `affinity_slack` more sequences
than the least loaded one, or without room for the prompt, is passed over for the one with the
most free KV pages after what its queue will claim (ties: the shorter queue, then the lower
index); prompts shorter than a page go there too. A request stays where it lands until it
finishes (its pages live there); nothing migrates.
"""

from __future__ import annotations

import hashlib
from array import array

from ..model.fuse import fuse_params
from .engine import Engine
from .scheduler import RequestError


class Replicas:
    def __init__(self, config, params, tokenizer=None, *, mesh, **engine_kwargs):
        """`mesh` has the ("data", "tensor", "expert") axes; data=n gives n replicas. `params`
        may be host arrays, on one device, or already laid out over `mesh` (then each replica
        takes its slice's buffers without a copy)."""
        from ..sharding import data_slices, to_slice
        self.config, self.tokenizer, self.mesh = config, tokenizer, mesh
        self.replicas: list[Engine] = []
        on_mesh = _on_mesh(params, mesh)
        for sub in data_slices(mesh):
            local = to_slice(params, sub) if on_mesh else params
            self.replicas.append(Engine(config, local, tokenizer, mesh=sub, **engine_kwargs))
        first = self.replicas[0]
        self.max_model_len, self.eos = first.max_model_len, first.eos
        self.kv_cache_dtype = first.kv_cache_dtype
        self.owner: dict[str, Engine] = {}  # request id -> the replica serving it

    # -- the Engine surface -------------------------------------------------------------------
    def check_request(self, prompt_ids, sampling_params):
        self.replicas[0].check_request(prompt_ids, sampling_params)

    def add_request(self, request_id: str, prompt_ids: list[int], sampling_params,
                    quiet: bool = False):
        if request_id in self.owner:
            raise RequestError(f"request id {request_id!r} is already in use")
        engine = self.pick(prompt_ids)
        engine.add_request(request_id, prompt_ids, sampling_params, quiet=quiet)
        self.owner[request_id] = engine

    def abort(self, request_id: str):
        engine = self.owner.pop(request_id, None)
        if engine is not None:
            engine.abort(request_id)

    def step(self):
        """Step every replica that has work. Each dispatches its next step before it waits for
        its previous one, so the replicas' devices run side by side."""
        outputs = []
        for engine in self.replicas:
            if engine.has_unfinished():
                outputs += engine.step()
        for out in outputs:
            if out.finished:
                self.owner.pop(out.request_id, None)
        return outputs

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.replicas)

    def warmup(self, workers: int | None = None):
        for engine in self.replicas:
            engine.warmup(workers)
        return self

    def stats(self) -> dict:
        """Sums of the replicas' counters (means for per-step times), and each one's under
        `replicas`."""
        each = [e.stats() for e in self.replicas]
        total = {}
        for key, value in each[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values = [s[key] for s in each]
                total[key] = sum(values) / len(values) if key.endswith("_per_step") else sum(values)
        return {**total, "replicas": each}

    @property
    def compilations(self) -> int:
        return sum(e.compilations for e in self.replicas)

    # -- routing ------------------------------------------------------------------------------
    affinity_slack = 4  # sequences a prefix's home may carry beyond the least loaded replica

    def pick(self, prompt_ids=()) -> Engine:
        """The replica for a new request: its prefix's home unless that one is overloaded or
        full, else the one with the most room."""
        return self.replicas[pick_replica(prompt_ids, [_load(e) for e in self.replicas],
                                          [e.pages for e in self.replicas], self.affinity_slack)]


def _load(engine) -> tuple[int, int]:
    """(free KV pages once its queue is admitted, sequences running or waiting)."""
    pages, waiting = engine.pages.stats(), engine.scheduler.waiting
    queued = sum(engine.pages.pages_for(len(s.prompt_ids)) for s in waiting)
    return (pages["pages_free"] + pages["pages_cached"] - queued,
            len(engine.scheduler.running) + len(waiting))


def pick_replica(prompt_ids, loads, pools, slack: int) -> int:
    """Index of the replica for a prompt, from each replica's (free pages, sequences) and its
    KV page pool."""
    best = min(range(len(loads)), key=lambda i: (-loads[i][0], loads[i][1], i))
    page = pools[0].page_size
    if len(prompt_ids) < page:
        return best
    hits = [pool.cached_prefix_tokens(prompt_ids[:-1]) for pool in pools]
    if max(hits):
        home = hits.index(max(hits))
    else:  # nobody has it yet: where its first page hashes, so its siblings meet there
        digest = hashlib.blake2b(array("i", prompt_ids[:page]).tobytes(), digest_size=8).digest()
        home = int.from_bytes(digest, "little") % len(loads)
    need = pools[home].pages_for(len(prompt_ids)) - hits[home] // page
    if loads[home][1] <= loads[best][1] + slack and loads[home][0] >= need:
        return home
    return best


def _on_mesh(params, mesh) -> bool:
    import jax
    leaf = jax.tree.leaves(params)[0]
    return getattr(getattr(leaf, "sharding", None), "mesh", None) == mesh


def engine_for_mesh(config, params, tokenizer=None, *, mesh=None, **engine_kwargs):
    """An `Engine`, or `Replicas` when the mesh has a data axis over 1. On one device the
    q/k/v and gate/up weights are fused in place first (`model/fuse.py`): one product each."""
    if mesh is not None and mesh.shape["data"] > 1:
        return Replicas(config, params, tokenizer, mesh=mesh, **engine_kwargs)
    if mesh is None:
        params = fuse_params(params)
    return Engine(config, params, tokenizer, mesh=mesh, **engine_kwargs)
