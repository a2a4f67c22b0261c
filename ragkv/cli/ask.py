"""`ragkv ask QUESTION`: retrieve, fuse the stored chunk KV with the question, answer."""

from __future__ import annotations

import argparse
import json

from ragkv.cli.command import Command
from ragkv.cli.config_args import add_config_options, config_from_args
from ragkv.cli.options import add_engine_options, add_store_options, add_verbose_option, client_config


def configure(parser: argparse.ArgumentParser) -> None:
    from ragkv.engine.generation import GenerationConfig
    from ragkv.engine.sampling import SamplingConfig
    from ragkv.fusion import FusionConfig
    from ragkv.ingest.index.hybrid import DEFAULT_RETRIEVAL, RETRIEVAL_MODES
    from ragkv.sparse import SparseConfig

    parser.add_argument("question")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON, with the API's field names")
    add_verbose_option(parser)
    retrieval = parser.add_argument_group("retrieval")
    retrieval.add_argument("--top-k", type=int, default=5, help="chunks retrieved (default: 5)")
    retrieval.add_argument(
        "--doc", action="append", default=None, help="restrict retrieval to this document id (repeatable)"
    )
    retrieval.add_argument(
        "--retrieval",
        choices=RETRIEVAL_MODES,
        default=DEFAULT_RETRIEVAL,
        help="dense (embeddings), bm25 (words) or hybrid (both, fused by reciprocal rank) "
        f"(default: {DEFAULT_RETRIEVAL})",
    )
    retrieval.add_argument(
        "--filter",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="retrieve only from documents whose metadata KEY equals VALUE (repeatable: every key "
        "must hold; a key given twice matches either value)",
    )
    add_config_options(parser.add_argument_group("fusion"), FusionConfig)
    generation = parser.add_argument_group("generation")
    add_config_options(generation, GenerationConfig, skip=("stop",))
    add_config_options(generation, SamplingConfig)
    generation.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    add_config_options(parser.add_argument_group("sparse decode"), SparseConfig, prefix="sparse_")
    add_engine_options(parser)
    add_store_options(parser)


def run(args: argparse.Namespace) -> int:
    from ragkv.app.rag import QueryConfig
    from ragkv.app.server.local import LocalClient
    from ragkv.engine.generation import GenerationConfig
    from ragkv.engine.sampling import SamplingConfig
    from ragkv.fusion import FusionConfig
    from ragkv.ingest.index.filters import MetadataFilter
    from ragkv.sparse import SparseConfig

    # A bad filter is an InputError (exit 2 with its message) before the model loads.
    metadata_filter = MetadataFilter.from_pairs(args.filter) if args.filter else None
    generation = config_from_args(
        GenerationConfig, args, sampling=config_from_args(SamplingConfig, args), stop=tuple(args.stop or ())
    )
    query = QueryConfig(
        top_k=args.top_k,
        doc_ids=tuple(args.doc) if args.doc else None,
        fusion=config_from_args(FusionConfig, args),
        generation=generation,
        sparse=config_from_args(SparseConfig, args, prefix="sparse_") if args.sparse_selector else None,
        retrieval=args.retrieval,
        filter=metadata_filter,
    )
    with LocalClient(client_config(args), read_only=True) as client:
        answer = client.query(args.question, args.tenant, query)
    if args.json:
        from ragkv.api.query.serving import answer_fields

        print(json.dumps(answer_fields(answer), indent=2))
        return 0
    print(answer.text)
    print()
    for number, citation in enumerate(answer.citations, start=1):
        snippet = " ".join(citation.text.split())[:100]
        pages = ""
        if citation.page is not None:
            last = citation.page_end or citation.page
            pages = f", page {citation.page}" if last == citation.page else f", pages {citation.page}-{last}"
        print(
            f"[{number}] {citation.name} chunk {citation.chunk_index}{pages} (score {citation.score:.3f}): {snippet}..."
        )
    t = answer.timings
    print(
        f"\nstrategy {answer.strategy}: TTFT {t['ttft']:.2f} s "
        f"(retrieve {t['retrieve']:.2f} s, load {t['load']:.2f} s, "
        f"fuse {t['fuse']:.2f} s), decode {t['decode']:.2f} s; {answer.usage.cached_tokens} of "
        f"{answer.usage.prompt_tokens} prompt tokens cached, {answer.usage.recomputed_tokens} recomputed"
    )
    return 0


COMMAND = Command("ask", "answer a question from the ingested documents", configure, run)
