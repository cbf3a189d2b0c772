"""``BadWords``: one sequence's bad words, indexed so that a step costs what could match.

Before, each step compared every word's prefix whole with the output's tail: the most a request
may send (``bad_words`` 256 strings of 256 characters, each spelled two ways: 512 token
sequences of up to ~256 tokens) cost 3.6-5.4 ms per sequence and step, so one request with
``n`` 128 made every step of every request beside it about half a second longer. Now the words
are looked up by the output's last token and their prefixes by the output's tail (one hash
lookup per prefix length), and the answers are the reference's (``banned_tokens``).
"""

from __future__ import annotations

import random
import time

from trillm.sample.bad_words import BadWords, banned_tokens


def test_answers_as_the_reference_on_random_words_and_outputs():
    rng = random.Random(7)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 40])
        words = [
            [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
            for _ in range(rng.randrange(0, 6))
        ]
        matcher = BadWords(words)
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        assert matcher.banned(output) == banned_tokens(words, output), (words, output)


def test_the_reference_cases():
    assert BadWords([[5]]).banned([]) == [5]
    assert BadWords([[1, 2, 3]]).banned([9, 1, 2]) == [3]
    assert BadWords([[1, 2, 3]]).banned([1, 2, 9]) == []
    assert BadWords([[1, 2, 3]]).banned([2]) == []
    assert BadWords([[4, 3], [7]]).banned([4]) == [3, 7]
    assert BadWords([[1, 2, 3], [2, 4], [9], [1, 2, 3]]).banned([1, 2]) == [3, 4, 9, 3]


def test_a_step_costs_what_could_match_not_what_was_sent():
    """The most a request sends, against an output that never matches and one that ends
    with every prefix's last tokens: 1,000 steps of each in well under the 3.6 s (and more)
    that the word-by-word comparison took for them."""
    width = 255
    unmatched = [[i % 1000 + j for j in range(width)] for i in range(512)]
    # Every prefix ends with the repeated token the output is made of; only its first differs.
    repeated = [[1000 + i] + [7] * (i % width) + [i] for i in range(512)]
    cases = [(unmatched, list(range(1000))), (repeated, [7] * 1000)]
    for words, output in cases:
        matcher = BadWords(words)
        assert matcher.banned(output) == banned_tokens(words, output)
        start = time.perf_counter()
        for _ in range(1000):
            matcher.banned(output)
        spent = time.perf_counter() - start
        reference_start = time.perf_counter()
        for _ in range(20):
            banned_tokens(words, output)
        reference = (time.perf_counter() - reference_start) * 50
        assert spent < reference / 2, (spent, reference)
