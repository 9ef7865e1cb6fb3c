"""BLEU-4 and CIDEr-D equal pycocoevalcap's scorers on the same tokens; VQA accuracy follows the official rule."""

from __future__ import annotations

import random

import pytest

from vitlab.vlm.metrics import (
    bleu,
    caption_scores,
    cider,
    normalize_answer,
    tokenize_caption,
    vqa_accuracy,
    vqa_score,
)

WORDS = "a the dog cat man woman sits on red blue table grass ball with two plays near runs".split()


def _corpus(seed: int, n_images: int = 12):
    rng = random.Random(seed)

    def sentence():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 11)))

    refs = {i: [sentence() for _ in range(rng.randint(1, 5))] for i in range(n_images)}
    # some hypotheses copy a reference (high scores), some are random (low), one is a single word
    hyps = {i: (rng.choice(refs[i]) if i % 3 == 0 else sentence()) for i in range(n_images)}
    hyps[1] = "dog"
    return hyps, refs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bleu_and_cider_equal_pycocoevalcap(seed):
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    hyps, refs = _corpus(seed)
    want_bleu, _ = Bleu(4).compute_score(refs, {k: [v] for k, v in hyps.items()}, verbose=0)
    assert bleu(hyps, refs) == pytest.approx(want_bleu, rel=1e-12, abs=1e-15)
    want_cider, want_each = Cider().compute_score(refs, {k: [v] for k, v in hyps.items()})
    got, each = cider(hyps, refs)
    assert got == pytest.approx(want_cider, rel=1e-12)
    assert each == pytest.approx(list(want_each), rel=1e-12, abs=1e-12)


def test_perfect_captions_and_no_overlap():
    refs = {0: ["a dog on grass"], 1: ["two cats on a table"]}
    assert bleu({0: "a dog on grass", 1: "two cats on a table"}, refs)[3] == pytest.approx(1.0)
    assert bleu({0: "zebra", 1: "zebra"}, refs)[0] < 1e-6
    assert cider({0: "zebra", 1: "zebra"}, refs)[0] == 0.0


def test_tokenize_caption_like_ptb():
    assert tokenize_caption("A Dog's ball, on the GRASS.") == "a dog 's ball on the grass"
    assert tokenize_caption("It doesn't fit -- really?!") == "it does n't fit really"
    scores = caption_scores({0: "A dog, on grass."}, {0: ["a dog on grass"]})
    assert scores["bleu4"] == pytest.approx(1.0)


def test_caption_metrics_refuse_mismatched_keys():
    with pytest.raises(ValueError, match="same keys"):
        bleu({0: "a"}, {1: ["a"]})
    with pytest.raises(ValueError, match="non-empty list"):
        cider({0: "a"}, {0: "a"})


def test_vqa_normalisation():
    assert normalize_answer("Two") == "2"
    assert normalize_answer("the dog.") == "dog"
    assert normalize_answer("a red, blue ball") == "red blue ball"
    assert normalize_answer("dont know") == "don't know"
    assert normalize_answer("yes!") == "yes"
    assert normalize_answer("3.5") == "3.5"
    assert normalize_answer("1,000") == "1000"


@pytest.mark.parametrize("matches, want", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)])
def test_vqa_score_leave_one_out(matches, want):
    # k humans agree: each of the k subsets without one of them has k-1 matches, the 10-k others have k
    answers = ["two"] * matches + ["blue"] * (10 - matches)
    expected = (matches * min(1, (matches - 1) / 3) + (10 - matches) * min(1, matches / 3)) / 10
    assert vqa_score("2", answers) == pytest.approx(expected)
    assert vqa_score("2", answers) == pytest.approx(want, abs=1e-12)


def test_vqa_accuracy_per_kind():
    out = vqa_accuracy(["yes", "3", "left"], [["yes"] * 10, ["three"] * 10, ["right"] * 10],
                       kinds=["presence", "count", "position"])
    assert out == pytest.approx({"overall": 200 / 3, "acc_count": 100.0, "acc_position": 0.0,
                                 "acc_presence": 100.0})
    with pytest.raises(ValueError):
        vqa_accuracy([], [])
