// Shared by the pages of gcshadow web. Everything an agent sent (job ids,
// names, commands, output) reaches the page through textContent only.
"use strict";

const QUIET_S = 60; // a streaming job with no new byte for this long is "quiet"

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  if (i === 0) return `${n} B`;
  const digits = n < 10 ? 2 : n < 100 ? 1 : 0;
  return `${n.toFixed(digits).replace(/\.0+$/, "")} ${units[i]}`;
}

function fmtRate(r) {
  if (r === null || r === undefined) return "–";
  if (r === 0) return "0 B/s";
  return fmtBytes(Math.round(r)) + "/s";
}

function fmtAge(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return "now";
  if (s < 60) return `${Math.floor(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}

const two = (n) => String(n).padStart(2, "0");

function fmtTime(t) {
  if (!t) return "–";
  const d = new Date(t * 1000);
  return `${d.getFullYear()}-${two(d.getMonth() + 1)}-${two(d.getDate())} ${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`;
}

// A time of today as 14:02:03, an older one with its date.
function fmtWhen(t) {
  if (!t) return "–";
  const d = new Date(t * 1000);
  const clock = `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`;
  return d.toDateString() === new Date().toDateString() ? clock : fmtTime(t);
}

function fmtDuration(s) {
  if (s === null || s === undefined) return "–";
  if (s < 10) return `${s.toFixed(1)} s`;
  if (s < 60) return `${Math.floor(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${two(Math.floor(s % 60))} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${two(Math.floor((s % 3600) / 60))} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

// The colour of a job's "why" (one line from the shadow), by its first word.
function whyClass(why) {
  const word = (why || "").split(/[\s:]/)[0];
  return { streaming: "streaming", quiet: "quiet", stalled: "disconnected", disconnected: "disconnected",
    refused: "failed", home: "failed", finished: "done" }[word] || "done";
}

// One word for what a person wants to know first, and the class that colours it.
function jobStatus(job) {
  if (job.state === "finished") {
    if (!job.failed) return { key: "done", text: "done", rank: 4 };
    return { key: "failed", text: "failed", rank: 0 };
  }
  if (job.state === "disconnected") return { key: "disconnected", text: "disconnected", rank: 1 };
  const idle = job.idle_s !== null ? job.idle_s : (job.first_seen ? Date.now() / 1000 - job.first_seen : 0);
  if (idle >= QUIET_S) return { key: "quiet", text: `quiet ${fmtAge(idle)}`, rank: 2 };
  return { key: "streaming", text: "streaming", rank: 3 };
}

function exitText(job) {
  if (job.state !== "finished") return "–";
  if (job.exit_signal) return `signal ${job.exit_signal}`;
  if (job.exit_code === null || job.exit_code === undefined) return "unknown";
  return String(job.exit_code);
}

function pill(job) {
  const st = jobStatus(job);
  return el("span", { class: `pill ${st.key}`, "data-state": st.key, text: st.text });
}

function showBanner(text) {
  const banner = document.getElementById("banner");
  banner.textContent = text || "";
  banner.hidden = !text;
}
