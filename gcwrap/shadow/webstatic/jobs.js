// The jobs page: the list from /api/jobs, fetched again every second, and
// the refused connections from /api/refusals.
"use strict";

const REFRESH_MS = 1000;
const DEFAULT_SORT = ["first_seen", -1]; // newest first
const tbody = document.querySelector("#jobs tbody");
const filterBox = document.getElementById("filter");
const stateBox = document.getElementById("state");
const sortBox = document.getElementById("sort");
let jobs = [];
let refusals = [];
let [sortKey, sortDir] = DEFAULT_SORT; // sortDir: 1 ascending, -1 descending
let lastOk = 0;

const params = new URLSearchParams(location.search);
filterBox.value = params.get("q") || "";
stateBox.value = params.get("state") || "";
if (params.get("sort")) { sortKey = params.get("sort"); sortDir = params.get("dir") === "desc" ? -1 : 1; }

function sortValue(job, key) {
  switch (key) {
    case "state": return jobStatus(job).rank;
    case "streams": return job.streams.length;
    case "duration": return job.duration_s ?? 0;
    case "rate": return job.state === "finished" ? -1 : (job.rate || 0);
    case "idle": return job.idle_s === null ? Infinity : job.idle_s;
    case "exit": return job.state !== "finished" ? -Infinity : job.exit_signal ? 1000 + job.exit_signal : (job.exit_code ?? 999);
    default: return job[key] ?? "";
  }
}

function matches(job, text, state) {
  if (state && jobStatus(job).key !== state) return false;
  if (!text) return true;
  const hay = [job.job_id, job.host, job.user, job.state, job.reason, job.why, ...(job.command || []),
    ...job.streams.map((s) => s.name), ...(job.files || []).map((f) => f.name)].join("\n").toLowerCase();
  return text.toLowerCase().split(/\s+/).every((word) => hay.includes(word));
}

function streamsCell(job) {
  const box = el("div", { class: "streamlist" });
  for (const s of job.streams) {
    box.append(
      el("span", { class: "kind", text: s.kind }),
      el("span", { class: "name mono", title: s.name, text: s.name }),
      el("span", { class: "num", text: fmtBytes(s.bytes) }),
      el("span", { class: "num muted", text: job.state === "finished" ? "" : fmtRate(s.rate) }),
    );
  }
  for (const f of job.files || []) {
    box.append(
      el("span", { class: "kind", text: "file" }),
      el("span", { class: "name mono", title: f.name, text: f.name }),
      el("span", { class: "num", text: fmtBytes(f.bytes) }),
      el("span", { class: "num muted", text: `v${f.version}` }),
    );
  }
  if (!job.streams.length && !(job.files || []).length) box.append(el("span", { class: "muted", text: "none" }));
  return box;
}

// A cell; `label` names it where rows stack (narrow windows), as the column's heading does elsewhere.
function cell(label, attrs, ...children) {
  return el("td", { ...attrs, "data-label": label }, ...children);
}

function row(job) {
  const st = jobStatus(job);
  const link = el("a", { href: job.page, class: "mono", text: job.job_id });
  const refused = cell("Refused / failed", { class: "num refused" });
  if (job.failed_attempts) refused.append(el("span", { class: "warn", text: String(job.failed_attempts) }));
  if (job.reason) refused.append(el("div", { class: "reason", title: job.reason, text: job.reason }));
  if (!refused.childNodes.length) {
    refused.classList.add("nothing");
    refused.append(el("span", { class: "muted", text: "–" }));
  }
  const state = el("td", { class: "state" }, pill(job));
  if (job.why) state.append(el("div", { class: `why-line ${whyClass(job.why)}`, title: job.why, text: job.why }));
  const who = cell("Host, user", { class: "who" }, el("span", { class: "mono", text: job.host || "–" }));
  if (job.user) who.append(el("div", { class: "muted", text: job.user }));
  return el("tr", { class: `row-${st.key}`, "data-job": job.job_id, "data-state": st.key },
    el("td", { class: "job" }, link),
    state,
    cell("Started", { class: "started", title: fmtTime(job.first_seen), text: fmtWhen(job.first_seen) }),
    cell("Duration", { class: "num duration", text: fmtDuration(job.duration_s) }),
    who,
    cell("Streams", { class: "streams-cell" }, streamsCell(job)),
    cell("Bytes", { class: "num", text: fmtBytes(job.bytes) }),
    cell("Rate", { class: "num", text: job.state === "finished" ? "" : fmtRate(job.rate) }),
    cell("Last byte", { class: "num", text: fmtAge(job.idle_s) }),
    cell("Exit", { class: `num exit ${st.key === "failed" ? "bad" : ""}`, text: exitText(job) }),
    refused,
  );
}

function counts() {
  const by = { streaming: 0, quiet: 0, disconnected: 0, failed: 0, done: 0 };
  for (const job of jobs) by[jobStatus(job).key]++;
  const nav = document.getElementById("counts");
  nav.replaceChildren();
  const chip = (key, label, n) => {
    const b = el("button", { type: "button", class: `chip ${key}${stateBox.value === key ? " on" : ""}`, "data-state": key },
      el("span", { class: "n", text: String(n) }), ` ${label}`);
    b.addEventListener("click", () => { stateBox.value = stateBox.value === key ? "" : key; render(); });
    return b;
  };
  nav.append(chip("", "jobs", jobs.length));
  for (const key of Object.keys(by)) nav.append(chip(key, key, by[key]));
  if (refusals.length) {
    nav.append(el("a", { class: "chip refused", href: "#refusals" },
      el("span", { class: "n", text: String(refusals.length) }), " refused connections"));
  }
}

function render() {
  const text = filterBox.value.trim();
  const state = stateBox.value;
  const shown = jobs.filter((j) => matches(j, text, state));
  shown.sort((a, b) => {
    const x = sortValue(a, sortKey), y = sortValue(b, sortKey);
    const c = typeof x === "string" || typeof y === "string" ? String(x).localeCompare(String(y), undefined, { numeric: true }) : x - y;
    return c * sortDir || String(a.job_id).localeCompare(String(b.job_id), undefined, { numeric: true });
  });
  tbody.replaceChildren(...shown.map(row));
  for (const th of document.querySelectorAll("#jobs th")) {
    th.setAttribute("aria-sort", th.dataset.key === sortKey ? (sortDir > 0 ? "ascending" : "descending") : "none");
  }
  const chosen = `${sortKey} ${sortDir > 0 ? "asc" : "desc"}`;
  if (![...sortBox.options].some((o) => o.value === chosen)) sortBox.append(el("option", { value: chosen, text: `${sortKey} (${sortDir > 0 ? "ascending" : "descending"})` }));
  sortBox.value = chosen;
  counts();
  renderRefusals();
  const empty = document.getElementById("empty");
  empty.hidden = shown.length > 0;
  empty.textContent = jobs.length ? "No job matches the filter." : "This shadow knows no jobs yet.";
  const q = new URLSearchParams();
  if (text) q.set("q", text);
  if (state) q.set("state", state);
  if (sortKey !== DEFAULT_SORT[0] || sortDir !== DEFAULT_SORT[1]) { q.set("sort", sortKey); q.set("dir", sortDir > 0 ? "asc" : "desc"); }
  history.replaceState(null, "", (q.toString() ? `?${q}` : location.pathname) + location.hash);
}

function renderRefusals() {
  const section = document.getElementById("refusals");
  section.hidden = refusals.length === 0;
  document.getElementById("refusals-count").textContent = `(${refusals.length})`;
  const known = new Map(jobs.map((j) => [j.job_id, j.page]));
  document.getElementById("refusals-body").replaceChildren(...refusals.map((r) => {
    const job = r.job_id ? (known.has(r.job_id) ? el("a", { href: known.get(r.job_id), class: "mono", text: r.job_id })
      : el("span", { class: "mono", text: r.job_id })) : el("span", { class: "muted", text: "–" });
    return el("tr", { "data-refused": r.job_id || "" },
      cell("Time", { class: "started", title: fmtTime(r.time), text: fmtWhen(r.time) }),
      cell("Peer", { class: "mono peer", text: r.peer || "–" }),
      cell("Identity", { text: r.identity || "–" }),
      cell("Job", {}, job),
      cell("Why", { class: "why-cell" }, el("span", { class: "code", text: r.code || "" }), " ", r.message || ""),
    );
  }));
}

async function getJson(url) {
  const res = await fetch(url, { cache: "no-store", credentials: "same-origin" });
  if (res.status === 401) { location.href = "/login?next=/"; throw new Error("not logged in"); }
  if (!res.ok) throw new Error(`the server answered ${res.status}`);
  return res.json();
}

async function refresh() {
  try {
    const [data, refused] = await Promise.all([getJson("/api/jobs"), getJson("/api/refusals")]);
    jobs = data.jobs;
    refusals = refused.refusals || [];
    document.getElementById("root").textContent = data.root;
    document.getElementById("root").title = data.root;
    showBanner(data.error);
    lastOk = Date.now();
    render();
  } catch (e) {
    showBanner(`Cannot reach gcshadow web (${e.message}); retrying.`);
  }
  const age = lastOk ? Math.round((Date.now() - lastOk) / 1000) : null;
  document.getElementById("updated").textContent = age === null ? "" : age < 2 ? "live" : `updated ${age} s ago`;
  setTimeout(refresh, REFRESH_MS);
}

for (const th of document.querySelectorAll("#jobs th")) {
  th.tabIndex = 0;
  const sortBy = () => {
    if (sortKey === th.dataset.key) sortDir = -sortDir;
    else { sortKey = th.dataset.key; sortDir = th.classList.contains("num") || sortKey === "first_seen" ? -1 : 1; }
    render();
  };
  th.addEventListener("click", sortBy);
  th.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); sortBy(); } });
}
sortBox.addEventListener("change", () => {
  const [key, dir] = sortBox.value.split(" ");
  sortKey = key;
  sortDir = dir === "desc" ? -1 : 1;
  render();
});
filterBox.addEventListener("input", render);
stateBox.addEventListener("change", render);
refresh();
