"""Captioning and VQA metrics, computed as the reference evaluation code computes them.

- :func:`bleu` -- BLEU-1..4 (Papineni et al., 2002, "BLEU: a Method for Automatic Evaluation of Machine
  Translation", Sec. 2) as the COCO caption evaluation toolkit scores a corpus (Chen et al., 2015, "Microsoft
  COCO Captions: Data Collection and Evaluation Server", Sec. 3.1): clipped n-gram counts summed over the corpus,
  the brevity penalty against the *closest* reference length of each caption, its 1e-9 / 1e-15 smoothing.
- :func:`cider` -- CIDEr-D (Vedantam et al., 2015, "CIDEr: Consensus-based Image Description Evaluation",
  Sec. 3 and 4.2, the variant the COCO server reports): TF-IDF n-gram vectors (n = 1..4, document frequencies
  over the references of the evaluated set), hypothesis counts clipped by the reference's, a Gaussian length
  penalty (sigma 6), averaged over references and n, times 10.
- :func:`vqa_accuracy` -- VQA v2's accuracy (Goyal et al., 2017, "Making the V in VQA Matter", Sec. 3; Antol et
  al., 2015, "VQA: Visual Question Answering", Sec. 2): ``min(#humans who gave the answer / 3, 1)`` averaged over
  the 10 leave-one-out subsets of 9 human answers, as the official ``vqaEval.py`` computes it: the prediction and
  the human answers are stripped, and normalised (punctuation, number words to digits, articles dropped,
  contractions restored) only when the humans gave more than one distinct answer; ten identical answers are
  matched as given.

Both caption metrics take tokenized text (words joined by spaces). :func:`tokenize_caption` is the COCO
toolkit's tokenization step (``pycocoevalcap``'s ``PTBTokenizer``: Stanford CoreNLP 3.4.1's PTB tokenizer, a Java
program, run with ``-preserveLines -lowerCase``, then its punctuation tokens dropped) in Python: a longest-match
scanner over PTBLexer's token classes (Penn Treebank conventions: hyphenated words, numbers such as 3.5, 1,000
and 5:00, abbreviations such as u.s. and mr. kept whole; clitics split: is n't, dog 's, can not, gon na;
brackets as -lrb- -rrb-, which the toolkit keeps). It reproduces the Java tokenizer on every caption of
``tests/vlm/data/ptb_captions.json``; the scores are then those of ``pycocoevalcap``'s ``Bleu(4)`` and ``Cider``.
One known difference: PTB sometimes splits the period off a single-letter initial, depending on the text
around it ("a." before a capitalised word in "dogs a. A a", "c." in "A B C." as the last caption of a batch, while
"plan b. And" keeps it); here an initial always keeps its period.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence

# ---------------------------------------------------------------- tokenization (COCO's PTB step, in Python)

# the tokens pycocoevalcap's PTBTokenizer removes after tokenizing (its PUNCTUATIONS, verbatim). The bracket
# names are upper-case there while the Java tokenizer runs with -lowerCase, so "-lrb-" and the like survive.
PTB_PUNCTUATION = frozenset(["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-", ".", "?", "!", ",", ":",
                             "-", "--", "...", ";"])

# characters PTBLexer rewrites (CoreNLP 3.4.1 defaults: PTB3 escaping, LaTeX quotes, ptb3Dashes, ptb3Ellipsis,
# currency symbols). Quotes become ` ' `` '' and dashes -- -- all dropped later, so only their role matters here;
# the right single quote is also the apostrophe of "don’t" and "it’s", which PTB writes as "'".
_REWRITE = str.maketrans({
    "\u2019": "'", "\u201b": "'", "\u2018": " ` ", "\u201c": ' " ', "\u201d": ' " ', "\u00ab": ' " ',
    "\u00bb": ' " ', "\u2039": " ` ", "\u203a": " ' ", "\u2013": " -- ", "\u2014": " -- ", "\u2015": " -- ",
    "\u2026": " ... ", "\u20ac": " $ ", "\u00a3": " # ", "\u00a2": " cents ", "\u00bc": " 1/4 ",
    "\u00bd": " 1/2 ", "\u00be": " 3/4 ",
})
# what PTBLexer cannot tokenize and deletes (its default "firstDelete"): characters outside the Basic
# Multilingual Plane (emoji: the lexer sees two UTF-16 surrogates), emoji variation selectors, zero-width joiners
_UNTOKENIZABLE = re.compile("[\U00010000-\U0010ffff\ufe00-\ufe0f\u200b-\u200d]")
# the HTML entities PTBLexer reads as the characters they stand for (caseless; one pass, so "&amp;amp;" leaves
# "&amp;", as the lexer does): "Tom &amp; Jerry" -> tom & jerry, "&lt;b&gt;" -> < b > (never an SGML tag),
# "it&apos;s" -> it 's, "&quot;" a quote (dropped), "&nbsp;" a space, "&mdash;" a dash (dropped)
_ENTITIES = {"&amp;": "&", "&quot;": ' " ', "&apos;": "'", "&lt;": " < ", "&gt;": " > ", "&nbsp;": " ",
             "&mdash;": " -- "}
_ENTITY = re.compile("|".join(_ENTITIES), re.IGNORECASE)

# a letter, as PTBLexer's LETTER, includes the entities of accented vowels (its SPLET): "&eacute;t&eacute;"
_SPLET = r"&[aeiouAEIOU](?:acute|grave|uml);"
_A = rf"(?:[^\W_]|{_SPLET})"  # a letter or digit
_L = rf"(?:[^\W\d_]|{_SPLET})"  # a letter
_END = r"(?![^\W_])"  # not followed by a letter or digit
# abbreviations PTBLexer keeps with their period (its ABMONTH, ABDAYS, ABSTATE, ABCOMP, ABNUM, ABPTIT, ABTITLE
# lists, caseless), those it only knows capitalised (state names that are also words: "Ill." but "ill ."), and
# those it only keeps before a number ("No. 5", "fig. 3", "ca. 1900")
_ABBREV = ("mrs?|ms|drs?|profs?|sens?|reps?|attys?|lt|col|gen|messrs|govs?|adm|rev|maj|sgt|cpl|pvt|capt|ste?|ave|"
           "pres|lieut|hon|brig|co?mdr|pfc|spc|supts?|det|mt|ft|adj|adv|asst|assoc|ens|insp|mlle|mme|msgr|sfc|"
           "jan|feb|mar|apr|jun|jul|aug|sept?|oct|nov|dec|mon|tues?|wed|thu|thurs|fri|"
           "ala|ariz|az|ark|calif|colo|conn|ct|dak|fla|ga|ind|kans?|ky|md|mich|minn|mo|mont|neb|nev|okla|penn|"
           "tenn|va|vt|wisc?|wyo|inc|cos?|corp|pp?t[ye]s?|ltd|plc|rt|bancorp|dept|bhd|assn|univ|intl|sys|"
           r"tel|est|ext|sq|jr|sr|bros|esq|blvd|rd|etc|al|seq|bldg|vs|alex|wm|jos|cie|cf|treas|ph\.d|ed\.d")
_ABBREV_CAPITALISED = "Del|Ill|La|Mass|Miss|Ore|Pa|Tex|Wash"
_ABBREV_BEFORE_NUMBER = "ca|figs?|art|op|pp|nos?"
_BRACKETS = {"(": "-LRB-", ")": "-RRB-", "[": "-LSB-", "]": "-RSB-", "{": "-LCB-", "}": "-RCB-"}


def _rule(pattern: str, emit=None):
    return re.compile(pattern), emit


# PTBLexer's token classes (CoreNLP 3.4.1, PTBLexer.flex), most specific first. As in the JFlex lexer, the
# longest match wins and a tie goes to the earlier rule; ``emit`` turns the matched text into tokens (default:
# the text itself).
_RULES = [
    _rule(r"</?[A-Za-z!?][^>\r\n]*>"),  # SGML/HTML tags stay whole
    _rule(r"&#\d+;"),  # a decimal character reference too: "&#39;"
    _rule(r"https?://[^\s\"<>|()]*[^\s\"<>|.!?(){},-]"),  # URLs, e-mail addresses, @names, #tags stay whole
    _rule(r"(?:www\.)?(?:[^\s\"`'<>|.!?(){},\-_$]+\.)+(?:com|net|org|edu)"
          r"(?:/[^\s\"<>|()]*[^\s\"<>|.!?(){},-])?"),
    _rule(r"[A-Za-z0-9][^\s\"<>|()]*@(?:[^\s\"<>|().]+\.)*[^\s\"<>|().]+"),
    _rule(r"@[A-Za-z_]\w*|#" + _L + _A + "*"),
    _rule(r"[A-Za-z](?:\.[A-Za-z])+\.?"),  # acronyms: u.s. t.v. p.m. e.g. a.k.a.
    _rule(rf"(?i:{_ABBREV}|[a-z])\.|(?:{_ABBREV_CAPITALISED})\."),  # mr. st. etc. and initials: c.
    _rule(rf"(?i:{_ABBREV_BEFORE_NUMBER})\.(?=\s+\d)"),
    # words PTB splits in two: "cannot" -> can not, "gonna" -> gon na, "'tis" -> 't is ...
    _rule(rf"(?i:(can)(not)|(gon|wan)(na)|(got)(ta)|(lem|gim)(me)){_END}", lambda m: [g for g in m.groups() if g]),
    _rule(r"(?i:('t)(is|was))" + _END, lambda m: list(m.groups())),
    # clitics split off their word: is n't, ca n't, dog 's, i 'm, we 're, they 've, it 'll, she 'd
    # (a word before n't must not end in "n": "mann't" stays apart, as PTB's SWORD/SREDAUX)
    _rule(rf"(?i:([a-z]*[a-mo-z])(n't)){_END}", lambda m: list(m.groups())),
    _rule(rf"(?i:({_A}+(?:-{_A}+)*)('(?:s|m|d|re|ve|ll))){_END}", lambda m: list(m.groups())),
    _rule(rf"(?i:n't|'(?:s|m|d|re|ve|ll)){_END}"),
    # apostrophes inside a word PTB keeps: o'clock, c'mon, ma'am, 'n', 'em, 'cause, '90s, y'(all), ol', li'l
    _rule(rf"(?i:'n'|'n{_END})|(?i:'em|'cause|'till?|'\d0s|[a-hj-xz]'{_L}{{2,}}|ol'|li'l|y')"
          rf"|{_L}*[aeiouyAEIOUY]'[aeiouA-Z]{_L}*"),
    _rule(r"[-+]?\d*(?:[.:,]\d+)+|[-+]?\d+"),  # numbers: 3.5 1,000 5:00 .5 -5
    _rule(rf"{_A}+(?:[-/]{_A}+|_{_A}+)*"),  # words, hyphenated words, x/y, 1/2, snake_case
    _rule(rf"{_L}{_A}*(?:[.!?]{_L}{_A}*)+"),  # dog.cat (no space after the period)
    _rule(rf"{_A}[A-Za-z0-9.,]*(?:-[A-Za-z0-9]+)+"),  # 2.5-inch
    _rule(r"[A-Z]+(?:&[A-Z]+)+"),  # AT&T, R&B
    _rule(r"(?i:c\+\+)"),
    _rule(r"[A-Z]*\$"),  # $, US$
    _rule(r"``|''|[\"`']", lambda m: []),  # quotes (PTB's `` '' ` ', all dropped)
    _rule(r"[:;]-?[()]", lambda m: [m.group()[:-1] + _BRACKETS[m.group()[-1]]]),  # emoticons :) ;-(
    _rule(r"[()\[\]{}]", lambda m: [_BRACKETS[m.group()]]),
    _rule(r"\.\.\.+", lambda m: ["..."]),  # ptb3Ellipsis
    _rule(r"[.,;:]"),
    _rule(r"[?!]+"),  # ?! and !!! are tokens
    _rule(r"-+", lambda m: [m.group()] if len(m.group()) > 4 else ["--"]),  # ptb3Dashes: up to 4 hyphens
    _rule(r"_+"),
    _rule(r"\S"),  # any other symbol (& % * + = ° ...) is a token of its own
]


def _ptb_tokens(text: str) -> list[str]:
    """``text`` split into PTB tokens (before lower-casing and punctuation removal)."""
    text = _ENTITY.sub(lambda m: _ENTITIES[m.group().lower()], _UNTOKENIZABLE.sub(" ", text.translate(_REWRITE)))
    tokens: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text[i].isspace():
            i += 1
            continue
        best, emit = None, None
        for pattern, rule_emit in _RULES:
            m = pattern.match(text, i)
            if m is not None and m.end() > i and (best is None or m.end() > best.end()):
                best, emit = m, rule_emit
        tokens.extend(emit(best) if emit is not None else [best.group()])
        i = best.end()
    return tokens


def tokenize_caption(text: str) -> str:
    """``text`` as pycocoevalcap's ``PTBTokenizer`` returns it: Stanford CoreNLP 3.4.1's PTB tokenizer (Penn
    Treebank conventions, ``-preserveLines -lowerCase``), then the tokens of :data:`PTB_PUNCTUATION` dropped;
    words joined by single spaces."""
    return " ".join(w for w in (t.lower() for t in _ptb_tokens(text)) if w not in PTB_PUNCTUATION)


def _ngrams(words: Sequence[str], n: int) -> Counter:
    return Counter(tuple(words[i:i + k]) for k in range(1, n + 1) for i in range(len(words) - k + 1))


def _check(hyps: Mapping, refs: Mapping) -> list:
    if set(hyps) != set(refs):
        raise ValueError("hypotheses and references must have the same keys")
    if not hyps:
        raise ValueError("no captions to score")
    for k, r in refs.items():
        if isinstance(r, str) or not r:
            raise ValueError(f"references of {k!r} must be a non-empty list of captions")
    return list(hyps)


# ---------------------------------------------------------------- BLEU


def bleu(hyps: Mapping[object, str], refs: Mapping[object, Sequence[str]], n: int = 4) -> list[float]:
    """Corpus BLEU-1..``n`` of the tokenized captions ``hyps`` (key -> caption) against ``refs`` (key -> list of
    captions), as the COCO toolkit computes them (``pycocoevalcap.bleu.Bleu(n)``, option 'closest')."""
    keys = _check(hyps, refs)
    small, tiny = 1e-9, 1e-15  # the toolkit's smoothing: a corpus with no match scores ~0, never divides by 0
    guess, correct = [0] * n, [0] * n
    testlen = reflen = 0
    for key in keys:
        words = hyps[key].split()
        counts = _ngrams(words, n)
        maxref: dict[tuple, int] = {}
        lens = []
        for r in refs[key]:
            rw = r.split()
            lens.append(len(rw))
            for g, c in _ngrams(rw, n).items():
                maxref[g] = max(maxref.get(g, 0), c)
        testlen += len(words)
        reflen += min((abs(ln - len(words)), ln) for ln in lens)[1]  # closest; a tie takes the shorter
        for g, c in counts.items():
            correct[len(g) - 1] += min(maxref.get(g, 0), c)
        for k in range(n):
            guess[k] += max(0, len(words) - k)
    scores, prod = [], 1.0
    for k in range(n):
        prod *= (correct[k] + tiny) / (guess[k] + small)
        scores.append(prod ** (1.0 / (k + 1)))
    ratio = (testlen + tiny) / (reflen + small)
    if ratio < 1:
        scores = [s * math.exp(1 - 1 / ratio) for s in scores]
    return scores


# ---------------------------------------------------------------- CIDEr-D


def cider(hyps: Mapping[object, str], refs: Mapping[object, Sequence[str]], n: int = 4,
          sigma: float = 6.0) -> tuple[float, list[float]]:
    """CIDEr-D of the tokenized captions ``hyps`` against ``refs``: (corpus mean, per-key scores in ``hyps``'
    order), as ``pycocoevalcap.cider.Cider`` computes them (document frequencies over this set's references)."""
    keys = _check(hyps, refs)
    ref_counts = [[_ngrams(r.split(), n) for r in refs[k]] for k in keys]
    df: Counter = Counter()
    for rc in ref_counts:
        df.update({g for c in rc for g in c})
    log_n = math.log(float(len(keys)))

    def vec(counts: Counter):
        v: list[dict] = [{} for _ in range(n)]
        norm = [0.0] * n
        length = 0
        for g, tf in counts.items():
            k = len(g) - 1
            v[k][g] = w = tf * (log_n - math.log(max(1.0, df[g])))
            norm[k] += w * w
            if k == 1:  # the toolkit's length: the number of bigrams (only differences of it are used)
                length += tf
        return v, [math.sqrt(x) for x in norm], length

    scores = []
    for key, rc in zip(keys, ref_counts, strict=True):
        vh, nh, lh = vec(_ngrams(hyps[key].split(), n))
        total = [0.0] * n
        for c in rc:
            vr, nr, lr = vec(c)
            penalty = math.exp(-((lh - lr) ** 2) / (2 * sigma ** 2))
            for k in range(n):
                val = sum(min(w, vr[k].get(g, 0.0)) * vr[k].get(g, 0.0) for g, w in vh[k].items())
                if nh[k] != 0 and nr[k] != 0:
                    val /= nh[k] * nr[k]
                total[k] += val * penalty
        scores.append(sum(total) / n / len(rc) * 10.0)
    return sum(scores) / len(scores), scores


def caption_scores(hyps: Mapping[object, str], refs: Mapping[object, Sequence[str]]) -> dict[str, float]:
    """BLEU-1..4 and CIDEr-D of raw captions (both tokenized by :func:`tokenize_caption` first)."""
    h = {k: tokenize_caption(v) for k, v in hyps.items()}
    r = {k: [tokenize_caption(x) for x in v] for k, v in refs.items()}
    b = bleu(h, r)
    return {**{f"bleu{i + 1}": b[i] for i in range(4)}, "cider": cider(h, r)[0]}


# ---------------------------------------------------------------- VQA accuracy

# the official VQA evaluation script's normalisation tables (vqaEval.py)
CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd",
    "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm", "Ive": "I've",
    "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll", "let's": "let's",
    "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've", "mightn'tve": "mightn't've",
    "mightve": "might've", "mustnt": "mustn't", "mustve": "must've", "neednt": "needn't", "notve": "not've",
    "oclock": "o'clock", "oughtnt": "oughtn't", "ow's'at": "'ow's'at", "'ows'at": "'ow's'at",
    "'ow'sat": "'ow's'at", "shant": "shan't", "shed've": "she'd've", "she'dve": "she'd've", "she's": "she's",
    "shouldve": "should've", "shouldnt": "shouldn't", "shouldnt've": "shouldn't've",
    "shouldn'tve": "shouldn't've", "somebody'd": "somebodyd", "somebodyd've": "somebody'd've",
    "somebody'dve": "somebody'd've", "somebodyll": "somebody'll", "somebodys": "somebody's",
    "someoned": "someone'd", "someoned've": "someone'd've", "someone'dve": "someone'd've",
    "someonell": "someone'll", "someones": "someone's", "somethingd": "something'd",
    "somethingd've": "something'd've", "something'dve": "something'd've", "somethingll": "something'll",
    "thats": "that's", "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've",
    "therere": "there're", "theres": "there's", "theyd": "they'd", "theyd've": "they'd've",
    "they'dve": "they'd've", "theyll": "they'll", "theyre": "they're", "theyve": "they've", "twas": "'twas",
    "wasnt": "wasn't", "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't",
    "whatll": "what'll", "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's",
    "whered": "where'd", "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've",
    "who'dve": "who'd've", "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll",
    "whyre": "why're", "whys": "why's", "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't",
    "wouldnt've": "wouldn't've", "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll",
    "y'allll": "y'all'll", "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've",
    "youd": "you'd", "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're",
    "youve": "you've",
}
NUMBER_WORDS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
                "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
ARTICLES = frozenset(["a", "an", "the"])
VQA_PUNCT = [";", r"/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?",
             "!"]
# kept verbatim, quirks included: "(?!<=\d)" is a look-ahead, so the pattern removes every '.' not followed by a
# digit; the official call passes re.UNICODE (32) as sub's count, so at most 32 are removed
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
_COMMA_STRIP = re.compile(r"(\d)(\,)(\d)")


def _punctuation(text: str) -> str:
    out = text
    for p in VQA_PUNCT:
        if (p + " " in text or " " + p in text) or _COMMA_STRIP.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return _PERIOD_STRIP.sub("", out, count=32)


def _digits_articles(text: str) -> str:
    words = [NUMBER_WORDS.get(w, w) for w in text.lower().split()]
    words = [w for w in words if w not in ARTICLES]
    return " ".join(CONTRACTIONS.get(w, w) for w in words)


def _strip(answer: str) -> str:
    return answer.replace("\n", " ").replace("\t", " ").strip()


def normalize_answer(answer: str) -> str:
    """An answer as the official VQA script normalises it when the human answers differ (processPunctuation,
    then processDigitArticle): newlines and tabs to spaces, stripped, lower-cased, punctuation removed or spaced,
    number words as digits, articles dropped, contractions restored."""
    return _digits_articles(_punctuation(_strip(answer).lower()))


def vqa_score(prediction: str, answers: Sequence[str], always_normalize: bool = False) -> float:
    """VQA accuracy of one answer against the human ``answers`` (10 in VQA v2): for each answer left out, the
    share ``min(#matches among the other answers / 3, 1)``, averaged over the leave-one-out subsets.

    As the official ``vqaEval.py`` (Antol et al., 2015; Goyal et al., 2017): newlines and tabs become spaces and
    both sides are stripped; the prediction and the answers are normalised (:func:`normalize_answer`) only when
    the humans gave more than one distinct answer. When all answers are the same string, the prediction must
    equal it as given ("Two" scores 0 against ten "2"). ``always_normalize=True`` normalises both sides in every
    case (for answers not written in the answer vocabulary's form, such as one free-form answer repeated)."""
    if not answers:
        raise ValueError("a question needs at least one reference answer")
    pred = _strip(prediction)
    gts = [_strip(a) for a in answers]
    if always_normalize or len(set(gts)) > 1:
        pred = normalize_answer(pred)
        gts = [normalize_answer(g) for g in gts]
    accs = [min(1.0, sum(g == pred for j, g in enumerate(gts) if j != i) / 3.0) for i in range(len(gts))]
    return sum(accs) / len(accs)


def vqa_accuracy(predictions: Iterable[str], answers: Iterable[Sequence[str]],
                 kinds: Iterable[str] | None = None, always_normalize: bool = False) -> dict[str, float]:
    """VQA accuracy in percent (:func:`vqa_score` per question): ``overall`` and, with ``kinds`` (one per question:
    count, presence, ...), one entry per kind (``acc_<kind>``)."""
    scores = [vqa_score(p, a, always_normalize) for p, a in zip(predictions, answers, strict=True)]
    if not scores:
        raise ValueError("no questions to score")
    out = {"overall": 100.0 * sum(scores) / len(scores)}
    if kinds is not None:
        by: dict[str, list[float]] = defaultdict(list)
        for k, s in zip(kinds, scores, strict=True):
            by[k].append(s)
        out.update({f"acc_{k}": 100.0 * sum(v) / len(v) for k, v in sorted(by.items())})
    return out
