// The page: three tabs (documents, chat, settings); the first load checks the API key.

import { refreshDocuments, setUpDocuments } from "./documents.js";
import { reloadConversations, setUpChat } from "./chat.js";
import { $, showStatus } from "./dom.js";
import { saveSettings, settings } from "./settings.js";

const TABS = ["documents", "chat", "settings"];

function select(name, focus = false) {
  for (const tab of TABS) {
    const button = $(`tab-${tab}`);
    const chosen = tab === name;
    button.setAttribute("aria-selected", String(chosen));
    button.tabIndex = chosen ? 0 : -1;
    $(tab).hidden = !chosen;
    if (chosen && focus) button.focus();
  }
  history.replaceState(null, "", `#${name}`);
}

function setUpTabs() {
  for (const [index, tab] of TABS.entries()) {
    const button = $(`tab-${tab}`);
    button.addEventListener("click", () => select(tab));
    button.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (step) select(TABS[(index + step + TABS.length) % TABS.length], true);
    });
  }
  const wanted = location.hash.slice(1);
  select(TABS.includes(wanted) ? wanted : "documents");
}

function setUpSettings() {
  const current = settings();
  $("api-key").value = current.apiKey;
  $("retrieval").value = current.retrieval;
  $("top-k").value = current.topK;
  $("filter").value = current.filter;
  $("strategy").value = current.strategy;
  $("max-tokens").value = current.maxTokens;
  $("settings-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const filter = $("filter").value.trim();
    if (filter) {
      try {
        const parsed = JSON.parse(filter);
        if (typeof parsed !== "object" || parsed === null || Array.isArray(parsed)) throw new Error("not an object");
      } catch (error) {
        showStatus(`The metadata filter must be a JSON object (${error.message}).`, true);
        return;
      }
    }
    saveSettings({
      apiKey: $("api-key").value.trim(),
      retrieval: $("retrieval").value,
      topK: Number($("top-k").value) || 5,
      filter,
      strategy: $("strategy").value,
      maxTokens: Number($("max-tokens").value) || 128,
    });
    reloadConversations();
    if (await connect()) showStatus("Settings saved.");
  });
}

async function connect() {
  try {
    await refreshDocuments();
    return true;
  } catch (error) {
    $("doc-table").tBodies[0].replaceChildren();
    showStatus(error.status === 401 ? `${error.message}. Set the key under Settings.` : error.message, true);
    return false;
  }
}

setUpTabs();
setUpSettings();
setUpDocuments();
setUpChat();
connect();
