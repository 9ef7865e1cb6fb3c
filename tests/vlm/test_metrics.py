"""BLEU-4 and CIDEr-D equal pycocoevalcap's scorers on the same tokens; the caption tokenizer equals
pycocoevalcap's PTBTokenizer (Stanford CoreNLP 3.4.1) on a fixture of captions; VQA accuracy follows the official
vqaEval.py (Antol et al., 2015; Goyal et al., 2017)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

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


# captions and what pycocoevalcap's PTBTokenizer (CoreNLP 3.4.1, run in Java) returned for them
PTB_FIXTURE = Path(__file__).parent / "data" / "ptb_captions.json"


def _ptb_pairs() -> list[tuple[str, str]]:
    return [(c, want) for c, want in json.loads(PTB_FIXTURE.read_text(encoding="utf-8"))["pairs"]]


def test_tokenize_caption_equals_ptb_fixture():
    pairs = _ptb_pairs()
    assert len(pairs) > 300
    wrong = [(c, tokenize_caption(c), want) for c, want in pairs if tokenize_caption(c) != want]
    assert wrong == []


@pytest.mark.parametrize("caption, want", [
    ("A man in a t-shirt, a 10-year-old on a skate-board.", "a man in a t-shirt a 10-year-old on a skate-board"),
    ("It costs 3.5 dollars; 1,000 people at 5:00 p.m.", "it costs 3.5 dollars 1,000 people at 5:00 p.m."),
    ("The U.S. flag, a t.v. and Mr. Smith's x/y plot", "the u.s. flag a t.v. and mr. smith 's x/y plot"),
    ('A sign that says "STOP" (in red) [sic]', "a sign that says stop -lrb- in red -rrb- -lsb- sic -rsb-"),
    ("I cannot go, gonna wanna; it isn't 'quoted'", "i can not go gon na wan na it is n't quoted"),
    ("$5 and 50% & more... -- wow!!!", "$ 5 and 50 % & more wow !!!"),
    ("A dog’s “toy” — café 😀 here", "a dog 's toy café here"),
])
def test_tokenize_caption_ptb_conventions(caption, want):
    assert tokenize_caption(caption) == want


def test_caption_scores_equal_pycocoevalcap_on_ptb_fixture():
    """Raw captions through caption_scores == pycocoevalcap's Bleu(4) and Cider on PTBTokenizer's output."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    pairs = _ptb_pairs()
    ptb = dict(pairs)
    caps = [c for c, _ in pairs]
    rng = random.Random(0)
    hyps, refs = {}, {}
    for i in range(60):
        hyps[i] = caps[(7 * i) % len(caps)]
        refs[i] = rng.sample(caps, rng.randint(1, 5))
        if i % 4 == 0:
            refs[i].append(hyps[i])  # some hypotheses match a reference, so the higher n-grams count too
    got = caption_scores(hyps, refs)
    tok_refs = {k: [ptb[c] for c in v] for k, v in refs.items()}
    tok_hyps = {k: [ptb[c]] for k, c in hyps.items()}
    want_bleu, _ = Bleu(4).compute_score(tok_refs, tok_hyps, verbose=0)
    want_cider, _ = Cider().compute_score(tok_refs, tok_hyps)
    assert [got[f"bleu{n}"] for n in range(1, 5)] == pytest.approx(want_bleu, rel=1e-12, abs=1e-15)
    assert got["cider"] == pytest.approx(want_cider, rel=1e-12)
    assert got["bleu1"] > 0.1 and got["cider"] > 0.1  # a corpus with real overlap, not the all-zero case


@pytest.mark.skipif(shutil.which("java") is None, reason="runs Stanford's PTB tokenizer, which needs Java")
def test_tokenize_caption_equals_live_ptb_tokenizer():
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    caps = [c for c, _ in _ptb_pairs()]
    live = PTBTokenizer().tokenize({i: [{"caption": c}] for i, c in enumerate(caps)})
    wrong = [(c, tokenize_caption(c), live[i][0]) for i, c in enumerate(caps) if tokenize_caption(c) != live[i][0]]
    assert wrong == []


def test_tokenize_caption_like_ptb():
    assert tokenize_caption("A Dog's ball, on the GRASS.") == "a dog 's ball on the grass"
    assert tokenize_caption("It doesn't fit -- really?!") == "it does n't fit really ?!"
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
    answers = ["2"] * matches + ["blue"] * (10 - matches)
    expected = (matches * min(1, (matches - 1) / 3) + (10 - matches) * min(1, matches / 3)) / 10
    assert vqa_score("2", answers) == pytest.approx(expected)
    assert vqa_score("2", answers) == pytest.approx(want, abs=1e-12)


def test_vqa_score_identical_answers_compared_as_given():
    # vqaEval.py normalises only when the humans' answers differ; ten identical ones are matched verbatim
    # (after replacing newlines and tabs and stripping)
    assert vqa_score("Two", ["2"] * 10) == 0.0
    assert vqa_score("two", ["2"] * 10) == 0.0
    assert vqa_score("yes!", ["yes"] * 10) == 0.0
    assert vqa_score("the dog", ["dog"] * 10) == 0.0
    assert vqa_score(" 2\n", ["2"] * 10) == 1.0
    assert vqa_score("2", ["2 "] * 9 + ["\t2"]) == 1.0  # identical once stripped: still verbatim, and equal
    assert vqa_score("Dog", ["Dog"] * 10) == 1.0
    assert vqa_score("dog", ["Dog"] * 10) == 0.0
    # normalising both sides in every case (vitlab's earlier rule) is an option
    assert vqa_score("Two", ["2"] * 10, always_normalize=True) == 1.0
    assert vqa_score("the dog", ["dog"] * 10, always_normalize=True) == 1.0


def test_vqa_score_mixed_answers_normalised():
    # distinct answers: both sides normalised, so "Two", "two" and "2" all count as "2"
    answers = ["2"] * 2 + ["two"] + ["Two"] + ["3"] * 6
    assert vqa_score("Two", answers) == pytest.approx(1.0)
    assert vqa_score("2", answers) == pytest.approx(1.0)
    assert vqa_score("three", answers) == pytest.approx(1.0)
    # only two humans said "dog" or "the dog." once normalised: 2 matches -> (2 * 1/3 + 8 * 2/3) / 10
    answers = ["dog", "the dog."] + ["cat"] * 8
    assert vqa_score("A dog", answers) == pytest.approx(0.6)
    assert vqa_score("Dog!", answers) == pytest.approx(0.6)


def test_vqa_accuracy_per_kind():
    out = vqa_accuracy(["yes", "3", "left"], [["yes"] * 10, ["3"] * 10, ["right"] * 10],
                       kinds=["presence", "count", "position"])
    assert out == pytest.approx({"overall": 200 / 3, "acc_count": 100.0, "acc_position": 0.0,
                                 "acc_presence": 100.0})
    # "three" against ten "3": 0 as in vqaEval.py, 1 when always normalising
    assert vqa_accuracy(["three"], [["3"] * 10]) == {"overall": 0.0}
    assert vqa_accuracy(["three"], [["3"] * 10], always_normalize=True) == {"overall": 100.0}
    with pytest.raises(ValueError):
        vqa_accuracy([], [])
