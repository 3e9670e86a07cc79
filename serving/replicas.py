"""Data parallelism for serving: one front door over several engines, one per data slice of the
mesh. Each replica is a whole `Engine` (its own scheduler, KV page pool and compiled steps) on a
(1, tensor, expert) slice; nothing is shared between them at run time, so replicas never wait
on each other's collectives. The front door only picks a replica for each new request and
merges their outputs; it has the same surface as `Engine`, so `EngineLoop` and `LLM` drive
either.

A request goes to the replica with the most free KV pages after what its queue will claim, ties
broken by the shorter queue, then the lower index. It stays there until it finishes (its pages
live there); nothing migrates.
"""

from __future__ import annotations

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

    def add_request(self, request_id: str, prompt_ids: list[int], sampling_params):
        if request_id in self.owner:
            raise RequestError(f"request id {request_id!r} is already in use")
        engine = self.pick()
        engine.add_request(request_id, prompt_ids, sampling_params)
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

    # -- balancing ----------------------------------------------------------------------------
    def pick(self) -> Engine:
        """The replica with the most free pages once its queue is admitted, then the shortest
        queue."""
        def room(i_engine):
            i, engine = i_engine
            pages, sched = engine.pages.stats(), engine.scheduler.waiting
            queued = sum(engine.pages.pages_for(len(s.prompt_ids)) for s in sched)
            free = pages["pages_free"] + pages["pages_cached"] - queued
            return (-free, len(engine.scheduler.running) + len(sched), i)
        return min(enumerate(self.replicas), key=room)[1]


def _on_mesh(params, mesh) -> bool:
    import jax
    leaf = jax.tree.leaves(params)[0]
    return getattr(getattr(leaf, "sharding", None), "mesh", None) == mesh


def engine_for_mesh(config, params, tokenizer=None, *, mesh=None, **engine_kwargs):
    """An `Engine`, or `Replicas` when the mesh has a data axis over 1."""
    if mesh is not None and mesh.shape["data"] > 1:
        return Replicas(config, params, tokenizer, mesh=mesh, **engine_kwargs)
    return Engine(config, params, tokenizer, mesh=mesh, **engine_kwargs)
