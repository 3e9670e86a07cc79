"""The draft shipped beside the embedded default model: it loads by name, proposes tokens the
target accepts, and never changes a greedy answer."""

from pallasite import LLM
from pallasite.serving.llm import SamplingParams

# No warm-up: only the programs these greedy steps use compile (the warm-up builds every
# sampler too), and nothing here is about what compiles when.
SIZES = dict(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, token_buckets=[2, 64],
             warmup=False)
PROMPTS = ["The for statement", "A dictionary maps"]


def test_default_draft_keeps_greedy_answers_and_is_accepted():
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with LLM(**SIZES) as plain:
        want = [o.token_ids for o in plain.generate(PROMPTS, sp)]
    spec = {"method": "draft_model", "model": "default-draft", "num_speculative_tokens": 4}
    with LLM(speculative_config=spec, **SIZES) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, sp)]
        stats = llm.engine.stats()
    assert got == want
    assert stats["spec_accepted_tokens"] > 0
    assert stats["spec_mean_accepted"] > 1.0
