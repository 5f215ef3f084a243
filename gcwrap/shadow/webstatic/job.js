// A job's page: its record, its "why" and timeline, and each output stream
// live, from one server-sent event stream (/api/jobs/JOB/events).
"use strict";

const CONTEXT = 20; // lines shown above a linked line that the page has to fetch
const jobId = decodeURIComponent(location.pathname.split("/")[2] || "");
const api = "/api/jobs/" + encodeURIComponent(jobId);
const panes = new Map(); // stream kind -> Pane (lines.js)
const followBox = document.getElementById("follow");
const pauseButton = document.getElementById("pause");
const live = document.getElementById("live");
const finder = new Finder(panes, document.getElementById("find"), document.getElementById("found"), jumpTo);
let source = null;
let paused = false;
let ended = false;
let instance = null;
let target = parseLineHash(location.hash); // the line the address links to, until it is shown

document.getElementById("jobid").textContent = jobId;
document.title = `${jobId} · gcshadow`;

function pane(stream) {
  let p = panes.get(stream.kind);
  if (p) return p;
  const pre = el("pre", { class: "out", "data-stream": stream.kind, tabindex: "0" });
  const note = el("div", { class: "note", hidden: true });
  const bytes = el("span", { class: "num muted bytes" });
  const head = el("header", {},
    el("h2", { text: stream.kind }),
    el("span", { class: "name mono", title: stream.name, text: stream.name }),
    bytes,
    el("span", { class: "spacer" }),
    el("a", { class: "download", href: stream.download, download: "", text: "Download whole file" }),
  );
  const section = el("section", { class: "stream", "data-stream": stream.kind }, head, note, pre);
  document.getElementById("streams").append(section);
  p = new Pane(stream.kind, pre, note, grew);
  p.bytes = bytes;
  pre.addEventListener("scroll", () => {
    const atEnd = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 24;
    if (!atEnd && followBox.checked && !pre.dataset.autoscroll) followBox.checked = false;
    delete pre.dataset.autoscroll;
  });
  panes.set(stream.kind, p);
  return p;
}

function grew(p, lines) {
  finder.check(p, lines);
  if (target && target.kind === p.kind) showTarget();
  if (followBox.checked) scrollEnd(p.pre);
}

function scrollEnd(pre) {
  pre.dataset.autoscroll = "1";
  pre.scrollTop = pre.scrollHeight;
}

// Bring a line into view: its pane scrolled to it, and the page to its pane.
function jumpTo(line) {
  followBox.checked = false;
  const pre = line.closest("pre");
  pre.dataset.autoscroll = "1";
  pre.scrollTop = line.offsetTop - pre.clientHeight / 3;
  const box = pre.getBoundingClientRect();
  if (box.top < 0 || box.bottom > window.innerHeight) pre.closest("section").scrollIntoView({ block: "start" });
}

function showTarget() {
  const line = document.getElementById(lineId(target.kind, target.n));
  if (!line) return;
  for (const old of document.querySelectorAll(".line.target")) old.classList.remove("target");
  line.classList.add("target");
  jumpTo(line);
  target = null;
}

window.addEventListener("hashchange", () => {
  const wanted = parseLineHash(location.hash);
  if (!wanted) return;
  const p = panes.get(wanted.kind);
  const first = p && p.pre.querySelector(".line[id]");
  const firstN = first ? Number(first.querySelector(".ln").dataset.n) : null;
  target = wanted;
  if (firstN !== null && wanted.n < firstN) location.reload(); // before what the page holds: open there
  else showTarget(); // shown now, or when it comes
});

function fact(dl, label, value, cls, wide) {
  dl.append(el("div", { class: wide ? "fact wide" : "fact" }, el("dt", { text: label }), el("dd", { class: cls || "", text: value })));
}

function showJob(j) {
  document.getElementById("pill").replaceChildren(pill(j));
  const why = document.getElementById("why");
  why.textContent = j.why || "";
  why.className = `why ${whyClass(j.why)}`;
  why.hidden = !j.why;
  const dl = document.getElementById("facts");
  dl.replaceChildren();
  fact(dl, "Host", j.host || "–", "mono");
  fact(dl, "User", j.user || "–");
  fact(dl, "Started", fmtTime(j.first_seen));
  if (j.state === "finished") fact(dl, "Ended", fmtTime(j.ended));
  else if (j.state === "disconnected") fact(dl, "Disconnected", fmtTime(j.last_seen));
  fact(dl, "Duration", fmtDuration(j.duration_s), "num");
  fact(dl, "Bytes", fmtBytes(j.bytes), "num");
  fact(dl, j.state === "finished" ? "Average rate" : "Rate", fmtRate(j.state === "finished" ? j.avg_rate : j.rate), "num");
  fact(dl, "Last byte", j.idle_s === null ? "–" : j.idle_s < 1 ? "just now" : `${fmtAge(j.idle_s)} ago`, "num");
  fact(dl, "Refused / failed attempts", String(j.failed_attempts), j.failed_attempts ? "num warn" : "num");
  if (j.stdin) fact(dl, "Stdin", j.stdin, "mono");
  fact(dl, "Command", (j.command || []).join(" ") || "–", "mono", true);
  showFiles(j.files || []);
  for (const s of j.streams) {
    const p = pane(s);
    p.bytes.textContent = fmtBytes(s.bytes) + (j.state === "finished" ? "" : ` · ${fmtRate(s.rate)}`);
  }
  const endedBox = document.getElementById("ended");
  if (j.state === "finished") {
    const st = jobStatus(j);
    endedBox.hidden = false;
    endedBox.className = `ended ${st.key}`;
    document.getElementById("exit").textContent = `Ended with ${j.exit}`;
    document.getElementById("reason").textContent = j.reason || "";
    const items = Object.entries(j.summary || {}).map(([k, v]) =>
      el("div", { class: "fact" }, el("dt", { text: summaryLabel(k) }), el("dd", { text: summaryValue(k, v) })));
    document.getElementById("summary").replaceChildren(...items);
  }
}

// The files the job writes (gcwrap --file): what each NAME holds, its version and state.
function showFiles(files) {
  document.getElementById("files").hidden = !files.length;
  document.getElementById("filerows").replaceChildren(...files.map((f) => {
    const state = f.next ? `${f.state}; version ${f.next.version} arriving (${fmtBytes(f.next.bytes)})` : f.state;
    return el("tr", { "data-file": f.name },
      el("td", { class: "name mono", title: f.sha256 ? `SHA-256 ${f.sha256}` : f.name, text: f.name }),
      el("td", { class: "num", text: fmtBytes(f.bytes) }),
      el("td", { class: "num", text: String(f.version) }),
      el("td", { class: f.state === "committed" ? "" : "muted", text: state }));
  }));
}

const LABELS = {
  wall_s: "wall time", throughput_mb_s: "throughput", connected_s: "connected", disconnected_s: "disconnected",
  stalled_s: "stalled", paused_s: "job paused", connections: "connections", reconnects: "reconnects",
  failed_attempts: "failed connection attempts", zero_copy_pct: "sent without copying",
};

function summaryLabel(key) {
  if (LABELS[key]) return LABELS[key];
  if (key.endsWith("_bytes")) return `${key.slice(0, -6)} bytes`;
  return key.replace(/_/g, " ");
}

function summaryValue(key, value) {
  const n = Number(value);
  if (typeof value === "boolean" || value === null || value === "" || Number.isNaN(n)) return String(value);
  if (key.endsWith("_bytes")) return fmtBytes(n);
  if (key === "throughput_mb_s") return `${n.toFixed(n < 1 ? 3 : 1)} MB/s`;
  if (key === "job_started" || key === "job_ended") return fmtTime(n);
  if (key.endsWith("_s")) return `${n.toFixed(1)} s`;
  if (key.endsWith("_pct")) return `${n.toFixed(0)} %`;
  return String(n);
}

// -- the timeline ------------------------------------------------------------------------

const KINDS = {
  session_opened: "connected", session_ended: "session ended", connection_lost: "connection lost",
  stalled: "stalled", reconnected: "reconnected", paused: "job paused", resumed: "job resumed",
  refused: "refused", compression: "compression", disk: "disk", exit: "exit",
  file_committed: "file committed", file_refused: "file refused",
  file_gone: "file deleted by the job: home keeps what it had",
  file_unreadable: "file gcwrap cannot read: home keeps what it had",
};
const TONE = {
  session_opened: "good", reconnected: "good", resumed: "good", session_ended: "warn", connection_lost: "bad",
  stalled: "warn", paused: "bad", refused: "bad", file_refused: "bad", file_gone: "warn", file_unreadable: "bad",
};

function detailText(key, value) {
  if (typeof value === "boolean") return value ? "yes" : "no";
  if (typeof value === "number" && (key.endsWith("_at") || key === "since")) return fmtWhen(value);
  if (typeof value === "number" && (key.endsWith("_s") || key === "seconds")) return fmtDuration(value);
  return String(value);
}

function eventItem(ev) {
  const details = el("span", { class: "details" });
  for (const [key, value] of Object.entries(ev.details || {})) {
    if (value === null || value === undefined || value === "") continue;
    details.append(el("span", { class: "detail" }, el("span", { class: "muted", text: `${key.replace(/_/g, " ")} ` }), detailText(key, value)));
  }
  const tone = ev.kind === "disk" && ev.details && ev.details.full ? "bad" : ev.kind === "exit"
    ? (ev.details && (ev.details.code || ev.details.signal) ? "bad" : "good") : TONE[ev.kind] || "";
  return el("li", { class: `event${tone ? ` tone-${tone}` : ""}`, "data-kind": ev.kind },
    el("time", { title: fmtTime(ev.time), text: fmtWhen(ev.time) }),
    el("span", { class: `source ${ev.source || ""}`, text: ev.source || "" }),
    el("span", { class: "kind", text: KINDS[ev.kind] || ev.kind.replace(/_/g, " ") }),
    details);
}

function showTimeline(events) {
  const box = document.getElementById("timeline");
  box.hidden = !events.length;
  document.getElementById("events").replaceChildren(...events.map(eventItem));
  document.getElementById("timeline-count").textContent = `· ${events.length} event${events.length === 1 ? "" : "s"}`;
  const last = events[events.length - 1];
  document.getElementById("timeline-last").textContent = last
    ? `· latest: ${KINDS[last.kind] || last.kind.replace(/_/g, " ")} at ${fmtWhen(last.time)}` : "";
}

// -- the event stream ----------------------------------------------------------------------

function url() {
  const q = new URLSearchParams();
  if (instance !== null) {
    for (const [kind, p] of panes) q.set(kind, String(p.offset));
    q.set("instance", instance);
  } else if (target) {
    q.set(`${target.kind}_line`, String(Math.max(1, target.n - CONTEXT)));
  }
  return `${api}/events${q.toString() ? "?" + q : ""}`;
}

function connect() {
  source = new EventSource(url());
  source.addEventListener("open", () => { live.textContent = "● live"; live.className = "live on"; showBanner(""); });
  source.addEventListener("error", () => {
    if (ended || paused) return;
    live.textContent = "reconnecting…";
    live.className = "live muted";
  });
  source.addEventListener("hello", (e) => {
    document.getElementById("tailsize").textContent = fmtBytes(JSON.parse(e.data).tail);
  });
  source.addEventListener("job", (e) => {
    const j = JSON.parse(e.data);
    instance = j.instance;
    showJob(j);
  });
  source.addEventListener("timeline", (e) => showTimeline(JSON.parse(e.data).events || []));
  source.addEventListener("data", (e) => {
    const d = JSON.parse(e.data);
    const p = panes.get(d.stream);
    if (!p) return;
    p.append(d.text, d.line);
    p.offset = d.end;
  });
  source.addEventListener("skip", (e) => {
    const d = JSON.parse(e.data);
    const p = panes.get(d.stream);
    if (!p) return;
    const what = d.from === 0 ? `The first ${fmtBytes(d.to)}${d.line ? ` (${d.line - 1} lines)` : ""} are not shown`
      : `${fmtBytes(d.to - d.from)} skipped to keep up`;
    p.say(`${what}; the download has everything.`);
    if (d.from > 0) p.gap(`[… ${fmtBytes(d.to - d.from)} skipped …]`, d.line);
    else p.line = typeof d.line === "number" ? d.line : null;
    p.offset = d.to;
  });
  source.addEventListener("reset", (e) => {
    const d = JSON.parse(e.data);
    for (const [kind, p] of panes) {
      if (d.stream && d.stream !== kind) continue;
      p.clear("A new attempt of the job started this output afresh.");
    }
  });
  source.addEventListener("refused", (e) => {
    const d = JSON.parse(e.data);
    const p = panes.get(d.stream);
    if (p) p.say(d.reason, "bad");
  });
  source.addEventListener("gone", () => { finish("This job is no longer in the shadow's state."); });
  source.addEventListener("end", () => { finish(""); });
}

function finish(message) {
  ended = true;
  source.close();
  live.textContent = "complete";
  live.className = "live done";
  pauseButton.disabled = true;
  if (message) showBanner(message);
}

pauseButton.addEventListener("click", () => {
  paused = !paused;
  pauseButton.textContent = paused ? "Resume" : "Pause";
  if (paused) {
    source.close();
    live.textContent = "paused";
    live.className = "live paused";
  } else {
    connect();
  }
});
followBox.addEventListener("change", () => {
  if (followBox.checked) for (const p of panes.values()) scrollEnd(p.pre);
});

const findBox = document.getElementById("find");
const onlyBox = document.getElementById("only");
function filterLines() {
  document.getElementById("streams").classList.toggle("only", onlyBox.checked && findBox.value !== "");
}
findBox.addEventListener("input", () => { finder.run(); filterLines(); });
findBox.addEventListener("keydown", (e) => {
  if (e.key === "Enter") { e.preventDefault(); finder.step(e.shiftKey ? -1 : 1); }
  if (e.key === "Escape") { findBox.value = ""; finder.run(); filterLines(); }
});
document.getElementById("find-next").addEventListener("click", () => finder.step(1));
document.getElementById("find-prev").addEventListener("click", () => finder.step(-1));
onlyBox.addEventListener("change", filterLines);

async function start() {
  const res = await fetch(api, { cache: "no-store", credentials: "same-origin" });
  if (res.status === 401) { location.href = `/login?next=${encodeURIComponent(location.pathname)}`; return; }
  if (!res.ok) { showBanner(`No job ${jobId} at this shadow.`); live.textContent = ""; return; }
  const j = await res.json();
  showJob(j);
  showTimeline(j.events || []);
  if (target) followBox.checked = false;
  connect();
}
start();
