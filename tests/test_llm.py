"""The library API on a tiny checkpoint folder (transformers weights + a trained BPE tokenizer):
generate, stream, concurrent callers, and SamplingParams validation."""

import threading

import jax
import numpy as np
import pytest
import torch
import transformers

import tok_fixtures
from pallasite.model import forward_logits
from pallasite.serving.llm import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llm")
    tok = tok_fixtures.byte_level(400)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=tok.token_to_id("<|eos|>"), bos_token_id=tok.token_to_id("<|bos|>")))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    tok_fixtures.save(tok, folder)
    llm = LLM(folder, max_model_len=128, num_pages=64, page_size=8, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=[8, 32], page_buckets=[16])
    yield llm
    llm.close()


def greedy(llm, ids, n):
    """Reference: greedy over the full-sequence forward, padded to one shape (causal: the padding
    after the last token changes nothing before it)."""
    e = llm.engine
    if not hasattr(llm, "_ref"):
        llm._ref = jax.jit(lambda p, x: forward_logits(p, e.config, x))
    ids = list(ids)
    for _ in range(n):
        padded = np.zeros((1, 128), np.int32)
        padded[0, :len(ids)] = ids
        ids.append(int(np.argmax(llm._ref(e.params, padded)[0, len(ids) - 1])))
    return ids[-n:]


def test_generate_texts_and_token_ids(llm):
    texts = ["The quick brown fox", "def add(a, b):", "héllo"]
    outs = llm.generate(texts, SamplingParams(max_tokens=8, **GREEDY))
    assert len(outs) == 3
    for text, out in zip(texts, outs):
        ids = llm.tokenizer.encode(text)
        assert out.token_ids == greedy(llm, ids, 8)
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert (out.finish_reason, out.prompt_tokens, out.completion_tokens) == ("length", len(ids), 8)
    # Token id prompts, one SamplingParams each; a single prompt still gives a list.
    ids = [llm.tokenizer.encode(t) for t in texts[:2]]
    outs = llm.generate(ids, [SamplingParams(max_tokens=n, **GREEDY) for n in (3, 5)])
    assert [len(o.token_ids) for o in outs] == [3, 5]
    assert outs[1].token_ids == greedy(llm, ids[1], 5)
    one = llm.generate(texts[0], SamplingParams(max_tokens=2, **GREEDY))
    assert len(one) == 1 and one[0].token_ids == greedy(llm, llm.tokenizer.encode(texts[0]), 2)


def test_a_completion_names_the_stop_that_ended_it(llm):
    free = llm.generate("The quick", SamplingParams(max_tokens=12, **GREEDY))[0]
    stop, token = free.text[3:6], free.token_ids[2]
    by_text, by_token = llm.generate(["The quick"] * 2, [
        SamplingParams(max_tokens=12, stop=[stop], **GREEDY),
        SamplingParams(max_tokens=12, stop_token_ids=[token], **GREEDY)])
    assert (by_text.finish_reason, by_text.stop_reason) == ("stop", stop)
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", token)
    assert (free.finish_reason, free.stop_reason) == ("length", None)


def test_stream_yields_the_same_text_as_generate(llm):
    sp = SamplingParams(max_tokens=12, **GREEDY)
    whole = llm.generate("Lists, tuples", sp)[0]
    deltas = list(llm.stream("Lists, tuples", sp))
    assert "".join(d.text_delta for d in deltas) == whole.text
    assert [t for d in deltas for t in d.new_token_ids] == whole.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert not any(d.finished for d in deltas[:-1])


def test_closing_a_stream_aborts_it(llm):
    stream = llm.stream("Python is", SamplingParams(max_tokens=100, **GREEDY))
    next(stream)
    stream.close()
    # The abort reaches the engine thread; afterwards the pool holds no page for it.
    llm.generate("Python is", SamplingParams(max_tokens=2, **GREEDY))
    assert llm.engine.stats()["pages_used"] == 0


def test_concurrent_callers(llm):
    results, texts = {}, ["The lazy dog", "built in", "you work quickly"]

    def call(i):
        results[i] = llm.generate(texts[i], SamplingParams(max_tokens=6, **GREEDY))[0].token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, text in enumerate(texts):
        assert results[i] == greedy(llm, llm.tokenizer.encode(text), 6)


def test_a_paced_batch_completes_each_prompt_in_order(llm):
    """LLM() paces offline batches on a GPU: longest outputs admitted first, the steps' tokens
    spread over the longest request's steps. The answers come back in the caller's order."""
    texts, lengths = ["The lazy dog", "built in", "you work quickly", "a"], [3, 9, 5, 7]
    llm.engine.scheduler.pace = 8
    try:
        got = llm.generate(texts, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths])
    finally:
        llm.engine.scheduler.pace = None
    for text, n, c in zip(texts, lengths, got):
        assert c.token_ids == greedy(llm, llm.tokenizer.encode(text), n)


def test_reset_prefix_cache_makes_the_next_prompt_compute_whole(llm):
    ids = list(range(40, 80))  # five full pages of 8
    sp = SamplingParams(max_tokens=3, **GREEDY)
    first = llm.generate([ids], sp)[0]
    again = llm.generate([ids], sp)[0]
    assert again.cached_tokens == 32 and again.token_ids == first.token_ids
    before = llm.engine.stats()["pages_cached"]
    assert before > 0 and llm.reset_prefix_cache()
    stats = llm.engine.stats()
    assert stats["pages_cached"] == 0 and stats["pages_free"] == stats["pages_total"]
    fresh = llm.generate([ids], sp)[0]
    assert fresh.cached_tokens == 0 and fresh.token_ids == first.token_ids
    llm.engine.pages.check()
    stream = llm.stream(ids, SamplingParams(max_tokens=50, **GREEDY))
    next(stream)  # a request is running: nothing is reset
    assert not llm.reset_prefix_cache()
    stream.close()


def test_seeded_generate_is_reproducible(llm):
    sp = SamplingParams(temperature=1.0, top_k=40, seed=5, max_tokens=10, ignore_eos=True)
    a = llm.generate(["The quick", "Python"], sp)
    b = llm.generate(["Python", "The quick"], sp)
    assert a[0].token_ids == b[1].token_ids and a[1].token_ids == b[0].token_ids


def test_errors_name_the_limit(llm):
    with pytest.raises(ValueError, match="max_model_len is 128"):
        llm.generate([list(range(3, 200))], SamplingParams())


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 2.0),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("seed", 1.5), ("max_tokens", 0), ("stop", [""]), ("stop_token_ids", [-1]),
    ("logprobs", 21)])
def test_sampling_params_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**{field: value})


def test_sampling_params_defaults():
    sp = SamplingParams(stop="###")
    assert sp.stop == ["###"] and sp.temperature == 1.0 and sp.max_tokens == 16
