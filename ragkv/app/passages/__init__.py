"""Passages inside any prompt: found by content (`finder`), looked up in the chunk store
(`PromptPassages.plan`), fused (`prepare`) and the new ones stored (`commit`)."""

from ragkv.app.passages.finder import Span, SpanConfig, SpanFinder
from ragkv.app.passages.keys import FoundSpans, SpanKeys
from ragkv.app.passages.passages import FusedPassages, PromptPassages
from ragkv.app.passages.plan import PassagePlan, Placed

__all__ = [
    "FoundSpans",
    "FusedPassages",
    "PassagePlan",
    "Placed",
    "PromptPassages",
    "Span",
    "SpanConfig",
    "SpanFinder",
    "SpanKeys",
]
