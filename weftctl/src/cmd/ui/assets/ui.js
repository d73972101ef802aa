// weftctl ui: keeps the page live. The server sends the live part as HTML
// (rendered and escaped there) whenever it changes; this swaps it in and
// keeps what the reader had open and focused. Without this script the
// page reloads itself every 2 s instead.
"use strict";
(() => {
  const live = document.getElementById("live");
  const clock = document.getElementById("clock");
  let lastTick = Date.now();

  // A link to a peering (#peering-X) opens its details.
  function openFromHash() {
    const id = decodeURIComponent(location.hash.slice(1));
    const el = id && document.getElementById(id);
    if (el && el.tagName === "DETAILS") {
      el.open = true;
    }
  }

  function swap(html) {
    const open = Array.from(live.querySelectorAll("details[open]"), (d) => d.id).filter(Boolean);
    const focused = document.activeElement && live.contains(document.activeElement) ? document.activeElement.id : "";
    live.innerHTML = html;
    for (const id of open) {
      const d = document.getElementById(id);
      if (d) d.open = true;
    }
    if (focused) {
      const f = document.getElementById(focused);
      if (f) f.focus({ preventScroll: true });
    }
  }

  const events = new EventSource("/live");
  events.addEventListener("update", (e) => swap(e.data));
  events.addEventListener("tick", (e) => {
    lastTick = Date.now();
    clock.textContent = e.data;
    clock.dataset.state = e.data.startsWith("updated") ? "live" : "stale";
  });
  // No word from weftctl ui for 5 s: say so (EventSource reconnects by itself).
  setInterval(() => {
    if (Date.now() - lastTick > 5000 && clock.dataset.state !== "stale") {
      clock.dataset.state = "stale";
      clock.textContent = "weftctl ui does not answer: is it still running? " + clock.textContent;
    }
  }, 1000);
  window.addEventListener("hashchange", openFromHash);
  openFromHash();
})();
