"""The prompts real RAG apps send, as they send them: each shape renders retrieved passages
and a question into chat messages with the app's default template and document formatting
(the source each follows is named in its `source`). The shapes bench and the real-client
tests use them, so a change to the span finder is judged on what apps paste, not on a
format the finder was written for.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Passage:
    """One retrieved passage as an app holds it."""

    text: str
    title: str
    id: int


@dataclass(frozen=True)
class PromptShape:
    name: str
    source: str
    """Where the template and the document formatting come from."""
    render: Callable[[Sequence[Passage], str], Messages]

    def messages(self, passages: Sequence[Passage], question: str) -> Messages:
        if not passages:
            raise ValueError(f"shape {self.name!r} needs at least one passage")
        return self.render(passages, question)


# LangChain's create_stuff_documents_chain: documents formatted "{page_content}" and joined
# by DEFAULT_DOCUMENT_SEPARATOR ("\n\n"), the context in a system message.
_STUFF_SYSTEM = "Answer the user's question using only the context below.\n\n{context}"


def _blank_lines(passages: Sequence[Passage], question: str) -> Messages:
    context = "\n\n".join(p.text for p in passages)
    return [{"role": "system", "content": _STUFF_SYSTEM.format(context=context)}, {"role": "user", "content": question}]


# Open WebUI's DEFAULT_RAG_TEMPLATE (backend/open_webui/config.py), sources formatted by its
# middleware as `<source id="i" name="...">content</source>\n` with no blank line between
# them, the filled template put before the user's message (add_or_update_user_message,
# append=False: template, "\n", message).
_OPEN_WEBUI_TEMPLATE = """### Task:
Respond to the user query using the provided context, incorporating inline citations in the format [id] **only when the <source> tag includes an explicit id attribute** (e.g., <source id="1">).

### Guidelines:
- If you don't know the answer, clearly state that.
- If uncertain, ask the user for clarification.
- Respond in the same language as the user's query.
- If the context is unreadable or of poor quality, inform the user and provide the best possible answer.
- If the answer isn't present in the context but you possess the knowledge, explain this to the user and provide the answer using your own understanding.
- **Only include inline citations using [id] (e.g., [1], [2]) when the <source> tag includes an id attribute.**
- Do not cite if the <source> tag does not contain an id attribute.
- Do not use XML tags in your response.
- Ensure citations are concise and directly related to the information provided.

### Example of Citation:
If the user asks about a specific topic and the information is found in a source with a provided id attribute, the response should include the citation like in the following example:
* "According to the study, the proposed method increases efficiency by 20% [1]."

### Output:
Provide a clear and direct response to the user's query, including inline citations in the format [id] only when the <source> tag with id attribute is present in the context.

<context>
{{CONTEXT}}
</context>
"""  # noqa: E501 (the template verbatim)


def _open_webui(passages: Sequence[Passage], question: str) -> Messages:
    sources = "".join(f'<source id="{p.id}" name="{p.title}">{p.text}</source>\n' for p in passages)
    template = _OPEN_WEBUI_TEMPLATE.replace("{{CONTEXT}}", sources)
    return [{"role": "user", "content": f"{template}\n{question}"}]


# AnythingLLM's saneDefaultSystemPrompt and its providers' #appendContext:
# "\nContext:\n" + "[CONTEXT i]:\n{text}\n[END CONTEXT i]\n\n" per source, i from 0.
_ANYTHINGLLM_SYSTEM = (
    "Given the following conversation, relevant context, and a follow up question, reply with "
    "an answer to the current question the user is asking. Return only your response to the "
    "question given the above information following the users instructions as needed."
)


def _anythingllm(passages: Sequence[Passage], question: str) -> Messages:
    context = "".join(f"[CONTEXT {i}]:\n{p.text}\n[END CONTEXT {i}]\n\n" for i, p in enumerate(passages))
    return [
        {"role": "system", "content": f"{_ANYTHINGLLM_SYSTEM}\nContext:\n{context}"},
        {"role": "user", "content": question},
    ]


# LangChain hub rlm/rag-prompt (one human message, the question before the context), the
# documents joined by "\n\n" as its tutorial's format_docs does.
_HUB_TEMPLATE = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question. If you don't know the answer, just say that you don't know. "
    "Use three sentences maximum and keep the answer concise.\n"
    "Question: {question} \nContext: {context} \nAnswer:"
)


def _langchain_hub(passages: Sequence[Passage], question: str) -> Messages:
    context = "\n\n".join(p.text for p in passages)
    return [{"role": "user", "content": _HUB_TEMPLATE.format(question=question, context=context)}]


# LlamaIndex's CHAT_TEXT_QA_PROMPT (llama_index/core/prompts/chat_prompts.py); each node as
# get_content(MetadataMode.LLM) renders it: "{key}: {value}" metadata lines, a blank line,
# the text. SimpleDirectoryReader leaves only file_path in the LLM's metadata (file_name,
# file_type, sizes and dates are in excluded_llm_metadata_keys); nodes joined by "\n\n".
_LLAMAINDEX_SYSTEM = (
    "You are an expert Q&A system that is trusted around the world.\n"
    "Always answer the query using the provided context information, and not prior knowledge.\n"
    "Some rules to follow:\n"
    "1. Never directly reference the given context in your answer.\n"
    "2. Avoid statements like 'Based on the context, ...' or 'The context information ...' "
    "or anything along those lines."
)
_LLAMAINDEX_USER = (
    "Context information is below.\n---------------------\n{context_str}\n---------------------\n"
    "Given the context information and not prior knowledge, answer the query.\n"
    "Query: {query_str}\nAnswer: "
)


def _llamaindex(passages: Sequence[Passage], question: str) -> Messages:
    nodes = "\n\n".join(f"file_path: /data/{_file_name(p.title)}.txt\n\n{p.text}" for p in passages)
    return [
        {"role": "system", "content": _LLAMAINDEX_SYSTEM},
        {"role": "user", "content": _LLAMAINDEX_USER.format(context_str=nodes, query_str=question)},
    ]


def _file_name(title: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in title)[:40] or "doc"


# No app's: one JSON record per line, half before the question and half after it, so no
# blank line, tag or header marks a passage and the question sits among them.
def _json_lines(passages: Sequence[Passage], question: str) -> Messages:
    records = [json.dumps({"id": p.id, "title": p.title, "text": p.text}, ensure_ascii=False) for p in passages]
    half = len(records) // 2
    body = "\n".join(records[:half]) + f"\nQ: {question}\n" + "\n".join(records[half:])
    return [{"role": "user", "content": f"{body}\nAnswer Q from the records above."}]


SHAPES: dict[str, PromptShape] = {
    shape.name: shape
    for shape in (
        PromptShape(
            "blank_lines", "LangChain create_stuff_documents_chain, documents joined by blank lines", _blank_lines
        ),
        PromptShape("open_webui", "Open WebUI DEFAULT_RAG_TEMPLATE with <source> tags", _open_webui),
        PromptShape("anythingllm", "AnythingLLM [CONTEXT i] tags in the system prompt", _anythingllm),
        PromptShape("langchain_hub", "LangChain hub rlm/rag-prompt, question before context", _langchain_hub),
        PromptShape("llamaindex", "LlamaIndex CHAT_TEXT_QA_PROMPT, file_path metadata per node", _llamaindex),
        PromptShape("json_lines", "no app: JSON records, the question among them", _json_lines),
    )
}


def split_documents(texts: Sequence[str], chunk_size: int, chunk_overlap: int) -> list[str]:
    """Documents cut as a LangChain app cuts them: RecursiveCharacterTextSplitter."""
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    splitter = RecursiveCharacterTextSplitter(chunk_size=chunk_size, chunk_overlap=chunk_overlap)
    return [chunk for text in texts for chunk in splitter.split_text(text)]
