"""The library API: `LLM(path).generate(prompts, SamplingParams(...))` and `LLM.stream`.

Both run on the serving engine, driven by an `EngineLoop` thread, so a script, the CLI and the
gRPC server share one code path.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import queue
import sys
import threading
from functools import partial
from pathlib import Path
from typing import Iterator, Sequence as Seq

import jax
import jax.numpy as jnp

from .detokenize import whole_text
from .engine import Engine, RequestOutput, TokenLogprob, min_token_bucket
from .engine_loop import EngineLoop
from .replicas import engine_for_mesh
from .sampling import MAX_LOGPROBS
from .settings import default_num_pages, engine_sizes  # noqa: F401  (default_num_pages: re-export)
from .settings import default_pace
from .structured import MAX_LOGIT_BIAS, StructuredOutput


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0, top_p 1, min_p 0 and penalties of
    1 (repetition) or 0 (presence, frequency) are off. A seed (taken modulo 2**32) makes the
    output reproducible whatever else runs in the same batch; max_tokens None runs to the
    context limit. logprobs n returns the sampled token's and the n best tokens' logprobs.
    logit_bias {token id: bias in [-100, 100]} is added to those logits before sampling;
    structured_output constrains the output to a JSON schema, regex, choice or grammar."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: int | None = None
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop, self.stop_token_ids = list(self.stop or []), list(self.stop_token_ids or [])
        rules = [
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, ">= 0"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an int >= 0 (0 = off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", 0 < self.repetition_penalty < math.inf, "> 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("seed", self.seed is None or _is_int(self.seed), "None or an int"),
            ("max_tokens", self.max_tokens is None or (_is_int(self.max_tokens)
                                                       and self.max_tokens >= 1), "None or >= 1"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             "token ids >= 0"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs)
                                                   and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"None or in [0, {MAX_LOGPROBS}]"),
            ("logit_bias", self.logit_bias is None or (
                isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS
                and all(_is_int(t) and t >= 0 and -100 <= b <= 100
                        for t, b in self.logit_bias.items())),
             f"None or at most {MAX_LOGIT_BIAS} {{token id: bias in [-100, 100]}}"),
            ("structured_output", self.structured_output is None
             or isinstance(self.structured_output, StructuredOutput), "None or a StructuredOutput"),
        ]
        for field, ok, rule in rules:
            if not ok:
                raise ValueError(f"SamplingParams.{field} must be {rule}, got {getattr(self, field)!r}")

    def reported_stop(self, stop_reason):
        """What ended a request as vLLM reports it: one of `stop` or `stop_token_ids`, else None
        (end of sequence, length, abort). The engine's `stop_reason` also names an EOS token."""
        hit = isinstance(stop_reason, str) or stop_reason in self.stop_token_ids
        return stop_reason if hit else None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None
    spec_proposed: int = 0  # speculative tokens proposed for this request
    spec_accepted: int = 0  # ... and accepted
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


def default_model_folder() -> Path:
    try:
        from ..model import default_model_path
    except ImportError:
        raise RuntimeError("no embedded default model in this build; pass a checkpoint folder "
                           "as LLM(path)") from None
    return Path(default_model_path())


# --kv-cache-dtype: "auto" stores K/V in the weights' dtype; "fp8" (alias "fp8_e4m3") in
# float8_e4m3fn with float32 per-KV-head scales (docs/kernels_notes.md).
KV_CACHE_DTYPES = {"auto": None, "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn}


def kv_cache_dtype_of(name: str):
    """The KV pages' dtype for a `kv_cache_dtype` option (None: the weights'), or a ValueError
    naming the valid choices."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not one of "
                         f"{', '.join(repr(k) for k in KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] and jnp.dtype(KV_CACHE_DTYPES[name])


def gather(results: list[Completion], ids, params, tokenizer, all_done):
    """`LLM.generate`'s callback `on_output(i, out)`, called on the engine's thread for each
    output of request i (its first and last only, unless it asks for logprobs or stop
    strings): its tokens, text and logprobs into results[i], the counts as it ends, and
    `all_done()` once every request has."""
    left, lock = [len(ids)], threading.Lock()

    def on_output(i, out: RequestOutput):
        r = results[i]
        r.token_ids += out.new_token_ids
        if out.text_delta is not None:  # text the engine made (stop strings)
            r.text += out.text_delta
        if out.logprobs is not None:
            r.logprobs = (r.logprobs or []) + out.logprobs
        if not out.finished:
            return
        # the counts as it ends (an output carries them all so far)
        r.finish_reason, r.cached_tokens = out.finish_reason, out.cached_tokens
        r.completion_tokens = out.completion_tokens
        r.spec_proposed, r.spec_accepted = out.spec_proposed, out.spec_accepted
        sp = params[i] or SamplingParams()
        r.stop_reason = sp.reported_stop(out.stop_reason)
        if tokenizer is not None and not sp.stop:
            r.text = whole_text(tokenizer, ids[i], r.token_ids, out.stop_reason)
        with lock:
            left[0] -= 1
            if left[0] == 0:
                all_done()
    return on_output


class LLM:
    """A model, its tokenizer and a serving engine. `path` is a Hugging Face checkpoint folder or
    a Hub name, `org/name[@revision]` (None: the embedded default model). `quantization="fp8"`
    stores every linear weight in float8_e4m3fn with float32 per-output-channel scales,
    "w4a16" / "w8a16" in INT4 (group 128) / INT8 (per channel), quantized as it loads; an
    AWQ, GPTQ or compressed-tensors INT4/INT8 checkpoint loads as stored. Sizes left as None
    are picked for the device (`settings.engine_sizes`): small on CPU, throughput-sized on a
    GPU. `pace` (tokens; "auto": `settings.default_pace`, on a GPU for bf16 and FP8 weights)
    paces a batch as scheduler.py says: longest outputs first, each step's tokens spread over
    the steps the longest request needs; None serves first come first served. Pacing takes
    each request's max_tokens as its length: where outputs end far sooner (max_tokens None and
    an early EOS), it makes smaller steps than it should.

    `speculative_config` turns on speculative decoding, in vLLM's shape: {"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} or
    {"method": "draft_model", "model": DRAFT_PATH, "num_speculative_tokens": 4}
    ("default-draft": the default model's own draft)."""

    def __init__(self, path=None, *, dtype=None, max_model_len: int | None = None,
                 num_pages: int | None = None, page_size: int = 16,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 mesh=None, seed: int = 0, quantization: str | None = None,
                 kv_cache_dtype: str = "auto", **engine_kwargs):
        from ..model import load_hf, quant
        from ..model.hub import resolve
        quant.check_quantization(quantization)
        kv_cache_dtype_of(kv_cache_dtype)  # refuse a bad value before loading anything
        path = resolve(path) if path is not None else default_model_folder()
        if dtype is None:
            dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
        config, params = load_hf(path, dtype=dtype, quantization=quantization,
                                 **self._placement(path, mesh, dtype, quantization))
        tokenizer = None
        if (path / "tokenizer.json").exists():
            from ..model.tokenizer import Tokenizer
            tokenizer = Tokenizer.from_pretrained(path)
        else:
            print(f"pallasite: no tokenizer.json in {path}; prompts must be token ids",
                  file=sys.stderr)
        self._start(config, params, tokenizer, max_model_len=max_model_len, num_pages=num_pages,
                    page_size=page_size, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, mesh=mesh, seed=seed,
                    kv_cache_dtype=kv_cache_dtype, **engine_kwargs)

    @staticmethod
    def _placement(path, mesh, dtype, quantization=None) -> dict:
        """On a mesh, check the plan (and that its weights fit where the device reports its
        memory) before reading anything, then load each tensor straight onto its shards: no
        device ever holds the whole model."""
        if mesh is None:
            return {}
        from ..model import load_config
        from ..sharding import check_fits, param_shardings, plan_of, validate_plan
        config = load_config(path)
        plan = plan_of(mesh)
        validate_plan(config, plan)
        limit = (mesh.devices.flat[0].memory_stats() or {}).get("bytes_limit")
        if limit:
            check_fits(config, plan, limit, dtype, quantization=quantization)
        return dict(config=config, shardings=param_shardings(config, mesh))

    @classmethod
    def from_params(cls, config, params, tokenizer=None, **kwargs) -> "LLM":
        """An LLM over weights already in memory (tests, benchmarks, freshly trained models).
        `quantization="fp8"` quantizes their linear weights first."""
        from ..model import quant_int
        params = quant_int.quantize_params(params, kwargs.pop("quantization", None))
        llm = cls.__new__(cls)
        kwargs.setdefault("page_size", 16)
        llm._start(config, params, tokenizer, **kwargs)
        return llm

    def _start(self, config, params, tokenizer, *, max_model_len=None, num_pages=None,
               page_size=16, max_num_seqs=None, max_num_batched_tokens=None,
               token_buckets=None, warmup=True, kv_cache_dtype="auto", pace="auto",
               **engine_kwargs):
        self.config, self.tokenizer = config, tokenizer
        max_model_len = max_model_len or min(config.max_position_embeddings, 8192)
        kv_dtype = kv_cache_dtype_of(kv_cache_dtype) or jax.tree.leaves(params)[0].dtype
        sizes = engine_sizes(config, kv_dtype, max_model_len=max_model_len, page_size=page_size,
                             num_pages=num_pages, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             token_buckets=token_buckets, first_bucket=min_token_bucket(params))
        num_pages = sizes.pop("num_pages")
        engine_kwargs.update({k: v for k, v in sizes.items() if v is not None})
        engine_kwargs["pace"] = default_pace(params) if pace == "auto" else pace
        max_model_len = min(max_model_len, num_pages * page_size)
        # A mesh with data > 1 gets one engine per data slice behind one front door.
        self.engine = engine_for_mesh(config, params, tokenizer, num_pages=num_pages,
                                      page_size=page_size, max_model_len=max_model_len,
                                      kv_cache_dtype=kv_dtype, **engine_kwargs)
        if warmup:
            self.engine.warmup()
        self.loop = self._loop = EngineLoop(self.engine)  # `_loop`: an older name, kept for now
        self._ids = itertools.count()

    # -- prompts ------------------------------------------------------------------------------
    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token id lists")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _prompts(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # one text, or one prompt of token ids
        return [self._token_ids(p) for p in prompts]

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompts, sampling: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Complete every prompt (a text, a list of texts, or token id lists), concurrently.
        Returns one Completion per prompt, in order."""
        ids = self._prompts(prompts)
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(ids)
        if len(params) != len(ids):
            raise ValueError(f"{len(params)} SamplingParams for {len(ids)} prompts")
        results, done = [Completion("", [], None, len(p), 0, 0) for p in ids], threading.Event()
        on_output = gather(results, ids, params, self.tokenizer, done.set)
        names = []
        try:
            for i, (p, sp) in enumerate(zip(ids, params)):
                names.append(f"generate-{next(self._ids)}")
                self.loop.submit(names[-1], p, sp or SamplingParams(), partial(on_output, i),
                                 stream=False, quiet=True)
            if not ids:
                return []
            done.wait()
        except BaseException:
            for name in names:
                self.loop.abort(name)
            raise
        if self.loop.error is not None:
            raise RuntimeError("the engine failed") from self.loop.error
        return results

    def stream(self, prompt, sampling: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's outputs as they come: `.text_delta`, `.new_token_ids`, and on the
        last one `.finished` and `.finish_reason`. Closing the iterator early aborts it."""
        outputs: queue.Queue[RequestOutput] = queue.Queue()
        name = f"stream-{next(self._ids)}"
        self.loop.submit(name, self._token_ids(prompt), sampling or SamplingParams(), outputs.put)
        finished = False
        try:
            while not finished:
                out = outputs.get()
                finished = out.finished
                yield out
            if self.loop.error is not None:
                raise RuntimeError("the engine failed") from self.loop.error
        finally:
            if not finished:
                self.loop.abort(name)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (as vLLM's `LLM.reset_prefix_cache`): later prompts
        are computed whole. Returns False, changing nothing, while requests are running."""
        return self.loop.reset_prefix_cache()

    def close(self):
        self.loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
