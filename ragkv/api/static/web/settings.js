// Settings kept in this browser (localStorage); the API key never goes into a URL.

const KEY = "ragkv.settings";
const DEFAULTS = { apiKey: "", retrieval: "", topK: 5, filter: "", strategy: "", maxTokens: 128 };

export function settings() {
  try {
    return { ...DEFAULTS, ...JSON.parse(localStorage.getItem(KEY) || "{}") };
  } catch (_) {
    return { ...DEFAULTS };
  }
}

export function saveSettings(values) {
  localStorage.setItem(KEY, JSON.stringify({ ...settings(), ...values }));
}

// The retrieval options of a request (the chat `rag` object, /v1/query's fields).
export function retrievalOptions(strategy) {
  const current = settings();
  const options = { top_k: Number(current.topK) || 5 };
  if (current.retrieval) options.retrieval = current.retrieval;
  if (current.filter.trim()) options.filter = JSON.parse(current.filter);
  const chosen = strategy || current.strategy;
  if (chosen) options.strategy = chosen;
  return options;
}

// A name for the key's own storage (conversations): another key, another list.
export function keyScope() {
  let hash = 0x811c9dc5;
  for (const char of settings().apiKey) {
    hash ^= char.codePointAt(0);
    hash = Math.imul(hash, 0x01000193) >>> 0;
  }
  return hash.toString(16);
}
