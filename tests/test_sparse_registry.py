"""Selectors chosen by spec strings from the one registry; every option is the selector's own."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import ClassVar

import pytest

from ragkv.app.query import check_sparse
from ragkv.app.rag import QueryConfig
from ragkv.bench.sparse_bench import selector_config
from ragkv.cli.config_args import add_config_options, config_from_args
from ragkv.cli.main import build_parser
from ragkv.engine.spec_string import spec_of
from ragkv.sparse import SELECTORS, Selector, SparseConfig, selector_names
from ragkv.sparse.a2ats import A2ATSOptions
from ragkv.sparse.pqcache import PQCacheOptions
from ragkv.sparse.wiring import sparse_chunk_codes


def test_registry_lists_each_selector_once():
    assert selector_names() == ("dense", "oracle", "a2ats", "pqcache", "lrqk")
    for name, options in SELECTORS.items():
        assert options.name == name and dataclasses.is_dataclass(options)
        assert spec_of(options()) == name  # defaults print as the bare name


def test_each_options_class_names_the_selector_that_runs_it():
    """`attach` is written once: it builds the class that declared `options=` these options."""
    runners = [options.selector for options in SELECTORS.values()]
    assert all(issubclass(runner, Selector) for runner in runners) and len(set(runners)) == len(runners)


def test_spec_sets_the_selectors_own_options():
    config = SparseConfig(selector="pqcache:bits=8,subspaces=4,seed=3", budget=0.1)
    assert config.options == PQCacheOptions(subspaces=4, bits=8, seed=3)
    assert config.name == "pqcache"
    assert SparseConfig(selector="a2ats:mean_key=false").options == A2ATSOptions(mean_key=False)
    assert SparseConfig(selector=spec_of(config.options)).options == config.options


@pytest.mark.parametrize(
    "spec,message",
    [
        ("nope", "unknown sparse selector 'nope'"),
        ("a2ats:rank=3", "has no option 'rank'"),
        ("lrqk:rank=0", "rank must be >= 1"),
        ("pqcache:bits=16", "bits must be in"),
        ("a2ats:mean_key=maybe", "mean_key must be true or false"),
        ("oracle:x", "is not key=value"),
    ],
)
def test_bad_specs_are_refused_with_their_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        SparseConfig(selector=spec)


def test_snapkv_settings_are_validated_by_snapkv():
    assert SparseConfig(snapkv_capacity=100, snapkv_kernel=5).eviction.kernel == 5
    with pytest.raises(ValueError, match="odd kernel"):
        SparseConfig(snapkv_capacity=100, snapkv_kernel=4)
    with pytest.raises(ValueError, match="give snapkv_capacity"):
        SparseConfig(snapkv_kernel=5)


def test_cli_flags_fill_the_config():
    args = build_parser().parse_args(
        ["ask", "q?", "--sparse-selector", "lrqk:rank=8", "--sparse-budget", "0.1", "--sparse-snapkv-capacity", "512"]
    )
    config = config_from_args(SparseConfig, args, prefix="sparse_")
    assert (config.name, config.options.rank, config.budget, config.eviction.capacity) == ("lrqk", 8, 0.1, 512)


def test_options_are_not_flags_of_their_own():
    import argparse

    parser = argparse.ArgumentParser()
    add_config_options(parser, SparseConfig, prefix="sparse_")
    flags = {action.dest for action in parser._actions}
    assert "sparse_selector" in flags and "sparse_options" not in flags and "sparse_eviction" not in flags


def test_bench_variants_mix_selector_and_shared_options():
    config = selector_config("a2ats:head_aggregation=logits,mean_key=false", 0.06)
    assert config.head_aggregation == "logits" and config.options == A2ATSOptions(mean_key=False)
    assert config.selector == "a2ats:mean_key=false"


@dataclasses.dataclass(frozen=True)
class TwinOptions(A2ATSOptions):
    """A selector no module names: it needs the codebook because its options say so."""

    name: ClassVar[str] = "twin"


def test_the_codebook_is_asked_for_by_the_selectors_hook_not_its_name():
    assert {name for name, options in SELECTORS.items() if options.needs_codebook} == {"a2ats"}
    engine = SimpleNamespace()  # never read: the selector's hook decides before any model work
    assert sparse_chunk_codes(engine, None, SparseConfig(selector="pqcache"), [], None) is None
    twin = SparseConfig()
    object.__setattr__(twin, "options", TwinOptions())
    with pytest.raises(ValueError, match="the twin selector needs an A2ATS codebook"):
        sparse_chunk_codes(engine, None, twin, [], None)
    with pytest.raises(ValueError, match="the twin selector needs an A2ATS codebook") as refused:
        check_sparse(None, QueryConfig(sparse=twin))
    assert refused.value.reason == "no_codebook"
    check_sparse(None, QueryConfig(sparse=SparseConfig(selector="lrqk")))
