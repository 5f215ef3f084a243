// A job's page: its record, and each output stream live, from one
// server-sent event stream (/api/jobs/JOB/events).
"use strict";

const MAX_CHARS = 2000000; // text kept per stream; older text leaves the page (the download has it all)
const jobId = decodeURIComponent(location.pathname.split("/")[2] || "");
const api = "/api/jobs/" + encodeURIComponent(jobId);
const panes = new Map(); // stream kind -> {pre, bytes, note, offset, chars}
const followBox = document.getElementById("follow");
const pauseButton = document.getElementById("pause");
const live = document.getElementById("live");
let source = null;
let paused = false;
let ended = false;
let instance = null;
let job = null;

document.getElementById("jobid").textContent = jobId;
document.title = `${jobId} · gcshadow`;

function pane(stream) {
  let p = panes.get(stream.kind);
  if (p) return p;
  const pre = el("pre", { class: "out", "data-stream": stream.kind, tabindex: "0" });
  const note = el("div", { class: "note", hidden: true });
  const bytes = el("span", { class: "num muted" });
  const head = el("header", {},
    el("h2", { text: stream.kind }),
    el("span", { class: "name mono", title: stream.name, text: stream.name }),
    bytes,
    el("span", { class: "spacer" }),
    el("a", { class: "download", href: stream.download, download: "", text: "Download whole file" }),
  );
  const section = el("section", { class: "stream", "data-stream": stream.kind }, head, note, pre);
  document.getElementById("streams").append(section);
  p = { pre, note, bytes, offset: 0, chars: 0 };
  pre.addEventListener("scroll", () => {
    const atEnd = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 24;
    if (!atEnd && followBox.checked && !pre.dataset.autoscroll) followBox.checked = false;
    delete pre.dataset.autoscroll;
  });
  panes.set(stream.kind, p);
  return p;
}

// Terminal colour codes and stray control characters would show as garbage.
function clean(text) {
  return text.replace(/\x1b\[[0-9;?]*[ -\/]*[@-~]/g, "").replace(/[\x00-\x08\x0b-\x1f\x7f]/g, "");
}

function append(p, text) {
  p.pre.append(document.createTextNode(clean(text)));
  p.chars += text.length;
  if (p.chars > MAX_CHARS) {
    const keep = p.pre.textContent.slice(-Math.floor(MAX_CHARS * 0.8));
    p.pre.textContent = keep.slice(keep.indexOf("\n") + 1);
    p.chars = p.pre.textContent.length;
    p.note.textContent = "Earlier output left this page to keep it fast; the download has everything.";
    p.note.hidden = false;
  }
  if (followBox.checked) scrollEnd(p.pre);
}

function scrollEnd(pre) {
  pre.dataset.autoscroll = "1";
  pre.scrollTop = pre.scrollHeight;
}

function fact(dl, label, value, cls, wide) {
  dl.append(el("div", { class: wide ? "fact wide" : "fact" }, el("dt", { text: label }), el("dd", { class: cls || "", text: value })));
}

function showJob(j) {
  job = j;
  document.getElementById("pill").replaceChildren(pill(j));
  const dl = document.getElementById("facts");
  dl.replaceChildren();
  fact(dl, "Host", j.host || "–", "mono");
  fact(dl, "User", j.user || "–");
  fact(dl, "Started", fmtTime(j.first_seen));
  if (j.state === "finished") fact(dl, "Ended", fmtTime(j.ended));
  else if (j.state === "disconnected") fact(dl, "Disconnected", fmtTime(j.last_seen));
  fact(dl, "Bytes", fmtBytes(j.bytes), "num");
  fact(dl, j.state === "finished" ? "Average rate" : "Rate", fmtRate(j.state === "finished" ? j.avg_rate : j.rate), "num");
  fact(dl, "Last byte", j.idle_s === null ? "–" : j.idle_s < 1 ? "just now" : `${fmtAge(j.idle_s)} ago`, "num");
  fact(dl, "Refused / failed attempts", String(j.failed_attempts), j.failed_attempts ? "num warn" : "num");
  if (j.stdin) fact(dl, "Stdin", j.stdin, "mono");
  fact(dl, "Command", (j.command || []).join(" ") || "–", "mono", true);
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

const LABELS = {
  wall_s: "wall time", throughput_mb_s: "throughput", connected_s: "connected", disconnected_s: "disconnected",
  paused_s: "job paused", connections: "connections", reconnects: "reconnects",
  failed_attempts: "failed connection attempts", zero_copy_pct: "sent without copying",
};

function summaryLabel(key) {
  if (LABELS[key]) return LABELS[key];
  if (key.endsWith("_bytes")) return `${key.slice(0, -6)} bytes`;
  return key.replace(/_/g, " ");
}

function summaryValue(key, value) {
  const n = Number(value);
  if (Number.isNaN(n)) return String(value);
  if (key.endsWith("_bytes")) return fmtBytes(n);
  if (key === "throughput_mb_s") return `${n.toFixed(n < 1 ? 3 : 1)} MB/s`;
  if (key.endsWith("_s")) return `${n.toFixed(1)} s`;
  if (key.endsWith("_pct")) return `${n.toFixed(0)} %`;
  return String(n);
}

function url() {
  const q = new URLSearchParams();
  if (instance !== null) {
    for (const [kind, p] of panes) q.set(kind, String(p.offset));
    q.set("instance", instance);
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
  source.addEventListener("data", (e) => {
    const d = JSON.parse(e.data);
    const p = panes.get(d.stream);
    if (!p) return;
    append(p, d.text);
    p.offset = d.end;
  });
  source.addEventListener("skip", (e) => {
    const d = JSON.parse(e.data);
    const p = panes.get(d.stream);
    if (!p) return;
    const what = d.from === 0 ? `The first ${fmtBytes(d.to)} are not shown` : `${fmtBytes(d.to - d.from)} skipped to keep up`;
    p.note.textContent = `${what}; the download has everything.`;
    p.note.hidden = false;
    if (d.from > 0) append(p, `\n[… ${fmtBytes(d.to - d.from)} skipped …]\n`);
    p.offset = d.to;
  });
  source.addEventListener("reset", (e) => {
    const d = JSON.parse(e.data);
    for (const [kind, p] of panes) {
      if (d.stream && d.stream !== kind) continue;
      p.pre.textContent = "";
      p.chars = 0;
      p.offset = 0;
      p.note.textContent = "A new attempt of the job started this output afresh.";
      p.note.hidden = false;
    }
  });
  source.addEventListener("refused", (e) => {
    const d = JSON.parse(e.data);
    const p = panes.get(d.stream);
    if (!p) return;
    p.note.textContent = d.reason;
    p.note.className = "note bad";
    p.note.hidden = false;
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

async function start() {
  const res = await fetch(api, { cache: "no-store", credentials: "same-origin" });
  if (res.status === 401) { location.href = `/login?next=${encodeURIComponent(location.pathname)}`; return; }
  if (!res.ok) { showBanner(`No job ${jobId} at this shadow.`); live.textContent = ""; return; }
  const j = await res.json();
  showJob(j);
  connect();
}
start();
