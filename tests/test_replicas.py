"""Routing new requests over data-parallel replicas: a shared prefix stays on one replica (the
one caching it, or where its first page hashes), and balance wins over affinity when the home
replica is overloaded or full."""

import random

from pallasite.serving.kv_pages import KVPages
from pallasite.serving.replicas import pick_replica

PAGE = 4


def pools(n=2, pages=64):
    return [KVPages(pages, PAGE) for _ in range(n)]


def cache_prompt(pool, tokens, name="s"):
    pool.grow(name, len(tokens))
    pool.cache_full_pages(name, tokens)
    pool.free(name)


def test_siblings_of_a_new_prefix_meet_on_one_replica():
    rng = random.Random(0)
    ps = pools(4)
    loads = [(64, 0)] * 4
    for _ in range(20):
        prefix = [rng.randrange(1000) for _ in range(3 * PAGE)]
        homes = {pick_replica(prefix + [rng.randrange(1000) for _ in range(5)], loads, ps, 4)
                 for _ in range(6)}
        assert len(homes) == 1
    # Distinct prefixes spread: 40 random prompts over 4 replicas leave none empty.
    spread = {pick_replica([rng.randrange(1000) for _ in range(8)], loads, ps, 4)
              for _ in range(40)}
    assert spread == {0, 1, 2, 3}


def test_the_replica_caching_the_prefix_wins():
    ps = pools(3)
    prompt = list(range(100, 100 + 4 * PAGE))
    cache_prompt(ps[2], prompt)
    loads = [(64, 0), (64, 0), (60, 2)]  # replica 2 is not the emptiest
    assert pick_replica(prompt + [7, 8], loads, ps, slack=4) == 2
    assert ps[2].cached_prefix_tokens(prompt + [7, 8]) == 4 * PAGE
    assert ps[0].cached_prefix_tokens(prompt) == 0


def test_balance_beats_affinity_when_the_home_is_overloaded_or_full():
    ps = pools(2)
    prompt = list(range(3 * PAGE))
    cache_prompt(ps[1], prompt)
    assert pick_replica(prompt, [(64, 0), (64, 4)], ps, slack=4) == 1  # within the slack
    assert pick_replica(prompt, [(64, 0), (64, 5)], ps, slack=4) == 0  # overloaded
    assert pick_replica(prompt + [1] * 40, [(64, 0), (2, 0)], ps, slack=4) == 0  # no room


def test_short_prompts_go_to_the_most_room():
    ps = pools(3)
    assert pick_replica([1, 2], [(10, 0), (30, 5), (30, 1)], ps, slack=4) == 2
