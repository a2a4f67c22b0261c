// Elements built from data: every text goes in as textContent, never as HTML.

export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "text") node.textContent = value;
    else if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function $(id) {
  return document.getElementById(id);
}

export function showStatus(message, isError = false) {
  const status = $("status");
  status.textContent = message;
  status.classList.toggle("error", isError);
}

// Ask a question in a modal dialog: resolves with the chosen button's value (null on Escape).
export function choose(text, buttons) {
  const dialog = $("ask-dialog");
  $("ask-dialog-text").textContent = text;
  const row = $("ask-dialog-buttons");
  row.replaceChildren();
  return new Promise((resolve) => {
    const done = (value) => {
      dialog.removeEventListener("close", onClose);
      dialog.close();
      resolve(value);
    };
    const onClose = () => done(null);
    dialog.addEventListener("close", onClose);
    for (const [label, value] of buttons) row.append(el("button", { type: "button", text: label, onclick: () => done(value) }));
    dialog.showModal();
  });
}

export function pages(first, last) {
  if (first === null || first === undefined) return "";
  return last && last !== first ? `pages ${first}–${last}` : `page ${first}`;
}
