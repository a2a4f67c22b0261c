// The API as the page calls it: the bearer key from the settings, errors in words.

import { settings } from "./settings.js";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function headers(extra = {}) {
  const key = settings().apiKey;
  return key ? { Authorization: `Bearer ${key}`, ...extra } : extra;
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON: keep the status line */ }
  if (response.status === 401) message = `The server refused the API key: ${message}`;
  return new ApiError(response.status, message);
}

export async function api(method, path, body) {
  const init = { method, headers: headers() };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (!response.ok) throw await errorOf(response);
  return response.status === 204 ? null : response.json();
}

// A multipart upload with upload progress (fetch reports none): resolves with [status, body].
export function upload(method, path, form, onProgress) {
  return new Promise((resolve, reject) => {
    const request = new XMLHttpRequest();
    request.open(method, path);
    for (const [name, value] of Object.entries(headers())) request.setRequestHeader(name, value);
    request.upload.addEventListener("progress", (event) => {
      if (event.lengthComputable) onProgress(event.loaded / event.total);
    });
    request.addEventListener("load", () => {
      let body = null;
      try { body = JSON.parse(request.responseText); } catch (_) { /* keep null */ }
      if (request.status >= 400) {
        let message = (body && body.error && body.error.message) || `${request.status} ${request.statusText}`;
        if (request.status === 401) message = `The server refused the API key: ${message}`;
        reject(new ApiError(request.status, message));
      } else {
        resolve([request.status, body]);
      }
    });
    request.addEventListener("error", () => reject(new ApiError(0, "the server could not be reached")));
    request.send(form);
  });
}

// POST a JSON body and read server-sent events: onEvent(object) for each data line but [DONE].
export async function stream(path, body, onEvent) {
  const response = await fetch(path, {
    method: "POST",
    headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
    body: JSON.stringify(body),
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const event = JSON.parse(data);
        if (event.error) throw new ApiError(event.error.code, event.error.message);
        onEvent(event);
      }
    }
  }
}
