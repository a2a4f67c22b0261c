"""Spec strings ('name:option=value,...') against the dataclasses they build."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ragkv.cli.config_args import field_docs
from ragkv.engine.spec_string import build_from_spec, spec_of, split_spec
from ragkv.fusion import STRATEGIES, STRATEGY_NAMES, FusionConfig, build_strategy


@dataclass
class Widget:
    name = "widget"
    size: int = 3
    scale: float = 1.0
    label: str = "plain"
    enabled: bool = False
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError("size must be >= 0")


REGISTRY = {"widget": Widget}


def test_split_and_build_coerce_each_field_type():
    assert split_spec(" widget : size=4 , label=x ") == ("widget", {"size": "4", "label": "x"})
    built = build_from_spec("widget:size=4,scale=0.5,label=big,enabled=true,limit=none", REGISTRY, "widget kind")
    assert built == Widget(size=4, scale=0.5, label="big", enabled=True, limit=None)
    assert build_from_spec("widget:limit=7", REGISTRY, "widget kind").limit == 7


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gadget", "unknown widget kind 'gadget'; choose one of widget"),
        ("widget:colour=red", "has no option 'colour'"),
        ("widget:size", "is not key=value"),
        ("widget:size=1,size=2", "given twice"),
        ("widget:size=big", "size must be int"),
        ("widget:enabled=maybe", "enabled must be true or false"),
        ("widget:size=-1", "size must be >= 0"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        build_from_spec(spec, REGISTRY, "widget kind")


def test_spec_of_round_trips():
    widget = Widget(size=9, enabled=True)
    assert spec_of(widget) == "widget:size=9,enabled=true"
    assert build_from_spec(spec_of(widget), REGISTRY, "widget kind") == widget
    for name in STRATEGY_NAMES:
        assert spec_of(build_strategy(name)) == name
    tuned = build_strategy("a3:ratio=0.3,exclude_sinks=true")
    assert build_strategy(spec_of(tuned)) == tuned


def test_every_strategy_option_is_documented():
    """Spec options are the strategies' fields; each one says what it does (CLI help, docs)."""
    for name, cls in STRATEGIES.items():
        docs = field_docs(cls)
        missing = [field for field in cls.__dataclass_fields__ if field not in docs]
        assert not missing, f"{name}: undocumented options {missing}"
    assert all(name in field_docs(FusionConfig)["strategy"] for name in STRATEGY_NAMES)
