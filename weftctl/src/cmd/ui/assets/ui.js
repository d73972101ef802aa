// weftctl ui: keeps the page live. The server sends the live part as HTML
// (rendered and escaped there) whenever it changes; this patches the page
// to match it, node by node, so that what did not change stays as it is:
// the reader's focus, selection, scroll and the details they opened.
// Without this script the page reloads itself every 2 s instead.
"use strict";
(() => {
  const live = document.getElementById("live");
  const clock = document.getElementById("clock");
  const staleMs = Number(live.dataset.staleMs) || 5000;
  let lastTick = Date.now();

  // A link to a peering (#peering-X) opens its details.
  function openFromHash() {
    const id = decodeURIComponent(location.hash.slice(1));
    const el = id && document.getElementById(id);
    if (el && el.tagName === "DETAILS") {
      el.open = true;
    }
  }

  // Makes the attributes of element `from` those of `to`; whether a
  // <details> is open is the reader's, not the server's.
  function attributes(from, to) {
    for (const a of Array.from(from.attributes)) {
      if (!to.hasAttribute(a.name) && !(from.tagName === "DETAILS" && a.name === "open")) {
        from.removeAttribute(a.name);
      }
    }
    for (const a of Array.from(to.attributes)) {
      if (from.getAttribute(a.name) !== a.value) {
        from.setAttribute(a.name, a.value);
      }
    }
  }

  // Makes the children of `from` those of `to`, keeping every node that
  // is the same kind (and id) in the same place.
  function children(from, to) {
    const olds = Array.from(from.childNodes);
    const news = Array.from(to.childNodes);
    news.forEach((n, i) => {
      const o = olds[i];
      if (!o) {
        from.appendChild(n.cloneNode(true));
      } else if (o.nodeType !== n.nodeType || o.nodeName !== n.nodeName || (o.nodeType === 1 && o.id !== n.id)) {
        from.replaceChild(n.cloneNode(true), o);
      } else if (o.nodeType === 1) {
        attributes(o, n);
        children(o, n);
      } else if (o.nodeValue !== n.nodeValue) {
        o.nodeValue = n.nodeValue;
      }
    });
    for (const o of olds.slice(news.length)) {
      from.removeChild(o);
    }
  }

  function update(html) {
    const t = document.createElement("template");
    t.innerHTML = html;
    children(live, t.content);
  }

  const events = new EventSource("/live");
  events.addEventListener("update", (e) => update(e.data));
  events.addEventListener("tick", (e) => {
    lastTick = Date.now();
    clock.textContent = e.data;
    clock.dataset.state = e.data.startsWith("updated") ? "live" : "stale";
  });
  // No word from weftctl ui for a while: say so (EventSource reconnects by itself).
  setInterval(() => {
    if (Date.now() - lastTick > staleMs && clock.dataset.state !== "stale") {
      clock.dataset.state = "stale";
      clock.textContent = "weftctl ui does not answer: is it still running? " + clock.textContent;
    }
  }, 1000);
  window.addEventListener("hashchange", openFromHash);
  openFromHash();
})();
