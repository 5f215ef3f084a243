// An output stream shown as numbered lines, and the search through them.
//
// Each line is <span class="line" id="L120"><a class="ln" href="#L120" data-n="120"></a>text\n</span>
// (stderr's ids are "stderr-L120"): the number is drawn from data-n by the
// stylesheet, so it is neither copied with the text nor part of innerText.
// The server says which line each event's text starts on (null when it
// could not count them cheaply: then lines are shown without numbers).
"use strict";

const MAX_CHARS = 2000000; // text kept per stream; older text leaves the page (the download has it all)
const MAX_MARKS = 2000; // matches painted inside lines at most (every matching line is marked anyway)

function lineId(kind, n) {
  return kind === "stdout" ? `L${n}` : `${kind}-L${n}`;
}

// "#L120" (stdout) or "#stderr-L120": {kind, n}, or null.
function parseLineHash(hash) {
  const m = /^#(?:(stdout|stderr)-)?L(\d+)$/.exec(hash || "");
  return m ? { kind: m[1] || "stdout", n: Number(m[2]) } : null;
}

// Terminal colour codes and stray control characters would show as garbage.
function clean(text) {
  return text.replace(/\x1b\[[0-9;?]*[ -\/]*[@-~]/g, "").replace(/[\x00-\x08\x0b-\x1f\x7f]/g, "");
}

class Pane {
  constructor(kind, pre, note, onLines) {
    this.kind = kind;
    this.pre = pre;
    this.note = note;
    this.onLines = onLines; // called with the lines made or grown by each append
    this.offset = 0; // the next byte
    this.chars = 0;
    this.open = null; // the last line, while its newline has not come
    this.line = null; // the number of the line the next text goes on
  }

  clear(message) {
    this.pre.textContent = "";
    this.chars = 0;
    this.offset = 0;
    this.open = null;
    this.line = 1;
    if (message) this.say(message);
  }

  say(message, cls) {
    this.note.textContent = message;
    this.note.className = cls ? `note ${cls}` : "note";
    this.note.hidden = false;
  }

  newLine(frag) {
    const span = el("span", { class: "line" });
    if (this.line !== null) {
      const id = lineId(this.kind, this.line);
      span.id = id;
      span.append(el("a", { class: "ln", href: `#${id}`, "data-n": String(this.line), tabindex: "-1", "aria-hidden": "true" }));
    }
    span.append(document.createTextNode(""));
    frag.append(span);
    return span;
  }

  // Text that starts on line `line` (a number, or null when unknown).
  append(text, line) {
    if (typeof line === "number" && !this.open) this.line = line;
    const frag = document.createDocumentFragment();
    const touched = [];
    const parts = clean(text).split("\n");
    parts.forEach((piece, i) => {
      if (i > 0) { // a newline ends the open line (an empty one if none is open)
        if (!this.open) this.open = this.newLine(frag);
        this.open.lastChild.appendData("\n");
        if (touched[touched.length - 1] !== this.open) touched.push(this.open);
        this.open = null;
        if (this.line !== null) this.line += 1;
      }
      if (piece) {
        if (!this.open) this.open = this.newLine(frag);
        this.open.lastChild.appendData(piece);
        if (touched[touched.length - 1] !== this.open) touched.push(this.open);
      }
    });
    this.pre.append(frag);
    this.chars += text.length;
    if (this.chars > MAX_CHARS) this.trim();
    this.onLines(this, touched);
  }

  // A gap in what is shown (bytes skipped to keep up), then lines from number `line`.
  gap(words, line) {
    if (this.open) { this.open.lastChild.appendData("\n"); this.open = null; }
    this.pre.append(el("span", { class: "gap", text: `${words}\n` }));
    this.line = typeof line === "number" ? line : null;
  }

  trim() {
    const keep = Math.floor(MAX_CHARS * 0.8);
    while (this.chars > keep && this.pre.firstChild && this.pre.firstChild !== this.open) {
      this.chars -= this.pre.firstChild.textContent.length;
      this.pre.firstChild.remove();
    }
    this.say("Earlier output left this page to keep it fast; the download has everything.");
  }

  lines() {
    return this.pre.querySelectorAll(".line"); // a static list: a live one would be walked again after each class change
  }
}

// Find in the output: every matching line marked, the matches inside them
// painted where the browser can (CSS Custom Highlight API), Enter for the next.
class Finder {
  constructor(panes, box, count, onJump) {
    this.panes = panes; // Map kind -> Pane, in the order shown
    this.box = box;
    this.count = count;
    this.onJump = onJump;
    this.query = "";
    this.current = null;
    this.paint = typeof CSS !== "undefined" && CSS.highlights ? new Highlight() : null;
    if (this.paint) CSS.highlights.set("find", this.paint);
  }

  matches(line) {
    return this.query !== "" && line.textContent.toLowerCase().includes(this.query);
  }

  run() {
    this.query = this.box.value.toLowerCase();
    if (this.paint) this.paint.clear();
    for (const line of document.querySelectorAll(".line.hit")) line.classList.remove("hit");
    for (const pane of this.panes.values()) this.check(pane, pane.lines());
    if (this.current && !this.current.classList.contains("hit")) this.current = null;
    this.show();
  }

  // Lines made or grown since: marked if they match now.
  check(pane, lines) {
    if (!this.query) return;
    for (const line of lines) {
      const hit = this.matches(line);
      line.classList.toggle("hit", hit);
      if (hit && this.paint && this.paint.size < MAX_MARKS) this.mark(line);
    }
    if (lines.length) this.show();
  }

  mark(line) {
    const node = line.lastChild;
    const text = node.data.toLowerCase();
    for (let at = text.indexOf(this.query); at >= 0 && this.paint.size < MAX_MARKS; at = text.indexOf(this.query, at + this.query.length)) {
      if (at + this.query.length > node.length) break; // lower case of another length: the line is marked anyway
      const range = new Range();
      range.setStart(node, at);
      range.setEnd(node, at + this.query.length);
      this.paint.add(range);
    }
  }

  hits() {
    const out = [];
    for (const pane of this.panes.values()) out.push(...pane.pre.querySelectorAll(".line.hit"));
    return out;
  }

  show() {
    const hits = this.query ? this.hits() : [];
    const at = this.current ? hits.indexOf(this.current) : -1;
    this.count.textContent = !this.query ? "" : hits.length === 0 ? "no match"
      : `${at >= 0 ? `${at + 1} of ` : ""}${hits.length} line${hits.length === 1 ? "" : "s"}`;
    this.box.classList.toggle("nomatch", !!this.query && hits.length === 0);
  }

  step(by) {
    const hits = this.hits();
    if (!hits.length) return;
    const at = this.current ? hits.indexOf(this.current) : -1;
    const next = hits[(at + by + hits.length) % hits.length] || hits[0];
    if (this.current) this.current.classList.remove("current");
    this.current = next;
    next.classList.add("current");
    this.onJump(next);
    this.show();
  }
}
