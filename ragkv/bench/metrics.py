"""Answer and distribution metrics shared by the benchmarks."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> list[str]:
    """SQuAD normalisation: lower case, no punctuation, no articles, split on whitespace."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def token_f1(prediction: str, references: list[str]) -> float:
    """Best token-level F1 of `prediction` against any reference."""
    predicted = normalize_answer(prediction)
    best = 0.0
    for reference in references:
        gold = normalize_answer(reference)
        if not predicted and not gold:
            return 1.0
        common = sum((Counter(predicted) & Counter(gold)).values())
        if common:
            precision, recall = common / len(predicted), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best
