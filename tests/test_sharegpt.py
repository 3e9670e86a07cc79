"""The ShareGPT sampler on a small synthetic file: deterministic, its filters, a file cut short,
and clear messages for missing files; the committed lengths files obey the same filters."""

import json

import pytest

from benchmarks import sharegpt


def conversation(prompt_words: int, reply_words: int, turns: int = 2) -> dict:
    said = [" ".join(["w"] * prompt_words), " ".join(["r"] * reply_words)]
    return {"id": "x", "conversations": [{"from": "human" if i % 2 == 0 else "gpt",
                                          "value": said[i % 2]} for i in range(turns)]}


def words(texts):
    return [len(t.split()) for t in texts]


def records():
    good = [conversation(4 + i, 4 + 2 * i) for i in range(40)]
    bad = [conversation(10, 10, turns=1),  # one turn
           conversation(3, 50), conversation(50, 3),  # too short
           conversation(1025, 10), conversation(1000, 1049)]  # too long
    return good + bad


def test_sampling_is_deterministic_and_seeded():
    first = sharegpt.sample(records(), 30, words)
    assert first == sharegpt.sample(records(), 30, words)
    assert first != sharegpt.sample(records(), 30, words, seed=1)
    assert sorted(first) != first  # shuffled, not in file order


def test_filters_drop_short_long_and_single_turn_pairs():
    pairs = sharegpt.sample(records(), 40, words)
    assert sorted(pairs) == sorted((4 + i, 4 + 2 * i) for i in range(40))
    with pytest.raises(ValueError, match="only 40 conversations pass"):
        sharegpt.sample(records(), 41, words)


def test_a_file_cut_short_keeps_its_complete_records(tmp_path):
    text = json.dumps([conversation(5, 6), conversation(7, 8), conversation(9, 10)])
    path = tmp_path / "cut.json"
    path.write_text(text[:-40])
    got = sharegpt.read_conversations(path)
    assert [len(r["conversations"][0]["value"].split()) for r in got] == [5, 7]


def test_missing_files_say_how_to_make_them(tmp_path):
    with pytest.raises(sharegpt.MissingData, match=r"--write 1000"):
        sharegpt.load_lengths(1000, tmp_path / "nothing.json")
    with pytest.raises(sharegpt.MissingData, match="no ShareGPT file"):
        sharegpt.read_conversations(tmp_path / "nothing.json")


@pytest.mark.parametrize("n", [1000, 2000])
def test_committed_lengths_follow_the_filters(n):
    pairs = sharegpt.load_lengths(n)
    assert len(pairs) == n
    assert all(p >= 4 and o >= 4 and p <= 1024 and p + o <= 2048 for p, o in pairs)
    assert 150 < sum(p for p, _ in pairs) / n < 300 and 150 < sum(o for _, o in pairs) / n < 250
    assert pairs[:1000] == sharegpt.load_lengths(1000)  # one shuffled order, taken further
