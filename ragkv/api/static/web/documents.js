// Documents: upload (drag and drop or the file picker) with progress, the list, delete,
// metadata editing, and a re-upload of a known name that asks to replace.

import { api, upload } from "./api.js";
import { $, choose, el, showStatus } from "./dom.js";

let known = [];

export async function refreshDocuments() {
  const body = await api("GET", "/v1/documents");
  known = body.data;
  const rows = known
    .slice()
    .sort((a, b) => b.created - a.created)
    .map((doc) =>
      el(
        "tr",
        { "data-id": doc.id },
        el("th", { scope: "row", class: "name", text: doc.name, title: doc.id }),
        el("td", { class: "num", text: doc.pages ?? "–" }),
        el("td", { class: "num", text: doc.tokens }),
        el("td", { class: "num", text: doc.chunks }),
        el("td", { class: "meta" }, el("code", { text: Object.keys(doc.metadata).length ? JSON.stringify(doc.metadata) : "" })),
        el("td", { text: new Date(doc.created * 1000).toLocaleString() }),
        el(
          "td",
          { class: "actions" },
          el("button", { type: "button", text: "Metadata", "aria-label": `Edit the metadata of ${doc.name}`, onclick: () => editMetadata(doc) }),
          el("button", { type: "button", class: "danger", text: "Delete", "aria-label": `Delete ${doc.name}`, onclick: () => remove(doc) }),
        ),
      ),
    );
  $("doc-table").tBodies[0].replaceChildren(...rows);
  $("doc-empty").hidden = rows.length > 0;
}

async function remove(doc) {
  const answer = await choose(`Delete “${doc.name}”? Its text leaves retrieval now.`, [["Delete", "delete"], ["Cancel", null]]);
  if (answer !== "delete") return;
  try {
    await api("DELETE", `/v1/documents/${encodeURIComponent(doc.id)}`);
    showStatus(`Deleted ${doc.name}.`);
  } catch (error) {
    showStatus(error.message, true);
  }
  await refreshDocuments().catch((error) => showStatus(error.message, true));
}

// Follow an ingestion to its end: a 201/200 body, or a 202 job polled until it finishes.
async function settle(status, body, row) {
  if (status !== 202) return body;
  for (;;) {
    const job = await api("GET", body.status_url);
    if (job.status === "succeeded") return job.result;
    if (job.status === "failed" || job.status === "cancelled") {
      throw new Error(job.error ? job.error.message : `the ingestion ${job.status}`);
    }
    const fraction = job.progress.fraction;
    row.progress.value = 0.2 + 0.8 * (fraction ?? 0);
    row.state.textContent = fraction === null ? `ingesting (${job.status})` : `ingesting ${Math.round(fraction * 100)}%`;
    await new Promise((resolve) => setTimeout(resolve, 400));
  }
}

function uploadRow(name) {
  const progress = el("progress", { max: 1, value: 0, "aria-label": `Progress of ${name}` });
  const state = el("span", { class: "state", text: "waiting" });
  const item = el("li", {}, el("span", { class: "name", text: name }), progress, state);
  $("uploads").prepend(item);
  return { item, progress, state };
}

function finish(row, text, isError) {
  row.state.textContent = text;
  row.item.classList.add(isError ? "failed" : "done");
  if (isError) row.state.setAttribute("role", "alert");
  row.progress.value = isError ? 0 : 1;
}

async function uploadFile(file) {
  let replace = false;
  if (known.some((doc) => doc.name === file.name)) {
    const answer = await choose(`A document named “${file.name}” exists. Replace it with this file?`, [
      ["Replace", "replace"],
      ["Keep both", "both"],
      ["Cancel", null],
    ]);
    if (answer === null) return;
    replace = answer === "replace";
  }
  const row = uploadRow(file.name);
  const form = new FormData();
  form.append("file", file, file.name);
  form.append("background", "true");
  if (replace) form.append("replace", "true");
  try {
    const [status, body] = await upload("POST", "/v1/documents", form, (sent) => {
      row.progress.value = 0.2 * sent;
      row.state.textContent = `uploading ${Math.round(sent * 100)}%`;
    });
    const result = await settle(status, body, row);
    const verb = result.ingest.replaced ? "replaced" : "ingested";
    finish(row, `${verb}: ${result.document.chunks} chunks, ${result.document.tokens} tokens`, false);
  } catch (error) {
    finish(row, `refused: ${error.message}`, true);
  }
  await refreshDocuments().catch((error) => showStatus(error.message, true));
}

async function uploadAll(files) {
  for (const file of files) await uploadFile(file); // one at a time: the model thread ingests one anyway
}

let editing = null;

function editMetadata(doc) {
  editing = doc;
  $("metadata-title").textContent = `Metadata of ${doc.name}`;
  $("metadata-text").value = JSON.stringify(doc.metadata, null, 2);
  $("metadata-error").textContent = "";
  $("metadata-dialog").showModal();
}

async function saveMetadata() {
  const doc = editing;
  let metadata;
  try {
    metadata = JSON.parse($("metadata-text").value || "{}");
    if (typeof metadata !== "object" || metadata === null || Array.isArray(metadata)) throw new Error("not an object");
  } catch (error) {
    $("metadata-error").textContent = `The metadata must be a JSON object (${error.message}).`;
    return;
  }
  $("metadata-dialog").close();
  const row = uploadRow(`${doc.name} (metadata)`);
  try {
    // A new version with the same text: its chunks keep their KV, a PDF its pages.
    const detail = await api("GET", `/v1/documents/${encodeURIComponent(doc.id)}?include_text=true`);
    const response = await api("PUT", `/v1/documents/${encodeURIComponent(doc.id)}`, {
      text: detail.text,
      name: doc.name,
      metadata,
      background: true,
    });
    await settle(202, response, row);
    finish(row, "metadata saved", false);
  } catch (error) {
    finish(row, `refused: ${error.message}`, true);
  }
  await refreshDocuments().catch((error) => showStatus(error.message, true));
}

export function setUpDocuments() {
  const drop = $("drop");
  for (const name of ["dragenter", "dragover"]) {
    drop.addEventListener(name, (event) => {
      event.preventDefault();
      drop.classList.add("over");
    });
  }
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    uploadAll([...event.dataTransfer.files]);
  });
  $("file-input").addEventListener("change", (event) => {
    const files = [...event.target.files];
    event.target.value = "";
    uploadAll(files);
  });
  $("metadata-save").addEventListener("click", saveMetadata);
  $("metadata-cancel").addEventListener("click", () => $("metadata-dialog").close());
}
