// Chat: streamed answers with numbered citations and their cost, follow-ups in the same
// conversation (its server session), the list of conversations, and a side-by-side
// comparison with the full prefill.

import { api, ApiError, stream } from "./api.js";
import { $, el, pages, showStatus } from "./dom.js";
import { keyScope, retrievalOptions, settings } from "./settings.js";

const MODEL = "ragkv"; // the alias every ragkv server accepts for its model

let conversations = [];
let current = null;

function storageKey() {
  return `ragkv.conversations.${keyScope()}`;
}

function load() {
  try {
    conversations = JSON.parse(localStorage.getItem(storageKey()) || "[]");
  } catch (_) {
    conversations = [];
  }
  current = conversations[0] || null;
}

function save() {
  localStorage.setItem(storageKey(), JSON.stringify(conversations.slice(0, 50)));
}

function seconds(value) {
  return value === undefined || value === null ? "–" : `${value.toFixed(3)} s`;
}

function openPassage(citation) {
  $("passage-title").textContent = citation.name;
  const where = [`chunk ${citation.chunk_index}`, pages(citation.page, citation.page_end), `score ${citation.score}`];
  $("passage-where").textContent = where.filter(Boolean).join(" · ");
  $("passage-text").textContent = citation.text;
  $("passage").showModal();
}

function citationList(citations) {
  if (!citations || !citations.length) return el("p", { class: "hint", text: "No sources retrieved." });
  return el(
    "ol",
    { class: "citations", "aria-label": "Sources" },
    ...citations.map((citation, index) => {
      const where = pages(citation.page, citation.page_end);
      return el(
        "li",
        {},
        el("button", {
          type: "button",
          class: "citation",
          text: `[${index + 1}] ${citation.name}${where ? `, ${where}` : ""}`,
          onclick: () => openPassage(citation),
        }),
      );
    }),
  );
}

function costLine(cost) {
  if (!cost) return null;
  const parts = [
    `time to first token ${seconds(cost.ttft)}`,
    `${cost.cached} tokens read from the store, ${cost.computed} computed`,
    `strategy ${cost.strategy}`,
  ];
  if (cost.context) parts.push(`${cost.context} of them from the conversation`);
  return el("p", { class: "cost", text: parts.join(" · ") });
}

function answerBlock(turn) {
  const text = el("div", { class: "answer-text", text: turn.answer || "" });
  const block = el("li", { class: "assistant" }, text);
  if (turn.error) block.append(el("p", { class: "error", role: "alert", text: turn.error }));
  if (turn.citations) block.append(citationList(turn.citations));
  const cost = costLine(turn.cost);
  if (cost) block.append(cost);
  return { block, text };
}

function compareBlock(turn) {
  const side = (run) =>
    el(
      "div",
      { class: "side" },
      el("h3", { text: run.strategy }),
      el("div", { class: "answer-text", text: run.answer }),
      el(
        "p",
        { class: "cost", text: `time to first token ${seconds(run.ttft)} · total ${seconds(run.total)} · ${run.cached} read, ${run.computed} computed` },
      ),
    );
  if (!turn.full && !turn.error) {
    return el("li", { class: "assistant", "aria-busy": "true", text: "Answering twice: the configured strategy, then the full prefill…" });
  }
  const block = el("li", { class: "assistant compare" });
  if (turn.error) block.append(el("p", { class: "error", role: "alert", text: turn.error }));
  else block.append(el("div", { class: "sides" }, side(turn.fused), side(turn.full)), citationList(turn.citations));
  return block;
}

function render() {
  const list = $("conversation-list");
  list.replaceChildren(
    ...conversations.map((conversation) =>
      el(
        "li",
        {},
        el("button", {
          type: "button",
          text: conversation.title,
          "aria-current": conversation === current ? "true" : false,
          onclick: () => {
            current = conversation;
            render();
          },
        }),
      ),
    ),
  );
  const messages = $("messages");
  messages.replaceChildren();
  for (const turn of current ? current.turns : []) {
    messages.append(el("li", { class: "user", text: turn.question }));
    messages.append(turn.kind === "compare" ? compareBlock(turn) : answerBlock(turn).block);
  }
}

function start(question) {
  if (!current) {
    current = { id: crypto.getRandomValues(new Uint32Array(2)).join("-"), title: question.slice(0, 60), sessionId: null, turns: [] };
    conversations.unshift(current);
  }
  return current;
}

async function chatTurn(conversation, turn, onToken) {
  const history = [];
  for (const earlier of conversation.turns) {
    if (earlier.kind === "compare" || earlier === turn || earlier.error) continue;
    history.push({ role: "user", content: earlier.question }, { role: "assistant", content: earlier.answer });
  }
  const body = (sessionId) => ({
    model: MODEL,
    // With a session the server holds the earlier turns: only the new message is sent.
    messages: sessionId ? [{ role: "user", content: turn.question }] : [...history, { role: "user", content: turn.question }],
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Number(settings().maxTokens) || 128,
    rag: retrievalOptions(),
    ...(sessionId ? { session_id: sessionId } : {}),
  });
  const onEvent = (event) => {
    if (event.session_id) conversation.sessionId = event.session_id;
    const choice = event.choices && event.choices[0];
    if (choice && choice.delta && choice.delta.content) onToken(choice.delta.content);
    if (event.rag) {
      turn.citations = event.rag.citations;
      turn.cost = { ...(turn.cost || {}), ttft: event.rag.timings.ttft, strategy: event.rag.strategy, context: event.rag.context_tokens };
    }
    if (event.usage) turn.cost = { ...(turn.cost || {}), cached: event.usage.cached_tokens, computed: event.usage.computed_tokens };
  };
  try {
    await stream("/v1/chat/completions", body(conversation.sessionId), onEvent);
  } catch (error) {
    if (!(error instanceof ApiError && error.status === 404 && conversation.sessionId && !turn.answer)) throw error;
    conversation.sessionId = null; // the session expired: send the whole conversation again
    await stream("/v1/chat/completions", body(null), onEvent);
  }
}

async function ask(question) {
  const conversation = start(question);
  const turn = { question, answer: "" };
  conversation.turns.push(turn);
  render();
  const { text } = answerBlock(turn);
  const blocks = $("messages").children;
  const block = blocks[blocks.length - 1];
  block.replaceChildren(text);
  block.setAttribute("aria-busy", "true");
  try {
    await chatTurn(conversation, turn, (token) => {
      turn.answer += token;
      text.textContent = turn.answer;
    });
  } catch (error) {
    turn.error = error.message;
  }
  save();
  render();
}

async function compare(question) {
  const conversation = start(question);
  const turn = { kind: "compare", question };
  conversation.turns.push(turn);
  render();
  const run = async (strategy) => {
    const body = { question, max_tokens: Number(settings().maxTokens) || 128, ...retrievalOptions(strategy) };
    const answer = await api("POST", "/v1/query", body);
    turn.citations = answer.citations;
    return {
      strategy: answer.strategy,
      answer: answer.answer,
      ttft: answer.timings.ttft,
      total: answer.timings.total,
      cached: answer.usage.cached_tokens,
      computed: answer.usage.computed_tokens,
    };
  };
  try {
    turn.fused = await run(null);
    turn.full = await run("full");
  } catch (error) {
    turn.error = error.message;
  }
  save();
  render();
}

export function reloadConversations() {
  load();
  render();
}

export function setUpChat() {
  load();
  render();
  const form = $("ask-form");
  const question = $("question");
  const busy = (on) => {
    $("ask").disabled = on;
    $("compare").disabled = on;
  };
  const submit = async (action) => {
    const text = question.value.trim();
    if (!text) return;
    question.value = "";
    busy(true);
    try {
      await action(text);
    } catch (error) {
      showStatus(error.message, true);
    } finally {
      busy(false);
      question.focus();
    }
  };
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    submit(ask);
  });
  question.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
  $("compare").addEventListener("click", () => submit(compare));
  $("new-conversation").addEventListener("click", () => {
    current = null;
    render();
    question.focus();
  });
  $("passage-close").addEventListener("click", () => $("passage").close());
}
