// Weir admin UI: one ES module, no build step. Every number comes from the admin API (mounted for
// signed-in browsers at /admin/session/api/v1), so the UI and the API can never disagree.
import uPlot from "./vendor/uPlot.esm.js";

const API = "/admin/session/api/v1";
const main = document.getElementById("main");
// What a price row prices: token classes, and `web_search` (Anthropic's, billed per search).
const TOKEN_CLASSES = ["input", "cached_input", "cache_write_5m", "cache_write_1h", "output", "web_search"];
// The classes billed per request, by what one request is: the API takes and shows their price per
// 1,000 (`usd_per_1k_requests`, as vendors quote it), the others' per 1M tokens.
const PER_REQUEST = { web_search: "searches" };
// A price row as it reads: "$2.50 / 1M tokens", "$10.00 / 1k searches" (every decimal the API holds).
const priceFmt = (p) => p.usd_per_1k_requests != null
  ? `${usdFmt(p.usd_per_1k_requests, 9)} / 1k ${PER_REQUEST[p.token_class] || "requests"}`
  : `${usdFmt(p.usd_per_1m_tokens, 6)} / 1M tokens`;
const COLORS = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#dc2626", "#0891b2"];
let csrf = null;
// Each render of a page (route()) takes the next number, and only the latest may write the page: a
// render still waiting on the API when another began (signing in, then following a link at once; a
// link followed while a page loads) would otherwise replace the newer page, and a form the admin had
// begun to fill, when its answers arrive. The sign-in form takes a number too.
let generation = 0;

// --- small helpers ------------------------------------------------------------------------------

// Builds DOM nodes; text always goes through textContent, never HTML, so data cannot inject markup.
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

class ApiError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super(e.message || `request failed with HTTP ${status}`);
    this.status = status;
    this.param = e.param;
    this.code = e.code;
  }
}

// `body` is sent as JSON; `bytes` (an ArrayBuffer, e.g. an uploaded file) is sent as it is.
async function api(path, { method = "GET", body, bytes, ifMatch } = {}) {
  const headers = { accept: "application/json" };
  if (ifMatch) headers["if-match"] = `"${ifMatch}"`;
  if (bytes !== undefined) headers["content-type"] = "application/octet-stream";
  else if (body !== undefined) headers["content-type"] = "application/json";
  if (method !== "GET" && csrf) headers["x-weir-csrf"] = csrf;
  const res = await fetch(path.startsWith("/") ? path : `${API}/${path}`, {
    method, headers, body: bytes !== undefined ? bytes : body === undefined ? undefined : JSON.stringify(body),
    credentials: "same-origin",
  });
  if (res.status === 204) return null;
  const data = await res.json().catch(() => null);
  if (res.status === 401 && data?.error?.code === "invalid_session" && csrf) {
    showSignIn("Your session expired. Sign in again.");
    throw new ApiError(res.status, data);
  }
  if (!res.ok) throw new ApiError(res.status, data);
  return data;
}

const usdFmt = (v, digits = 4) => {
  if (v === null || v === undefined || v === "") return "—";
  const n = Number(v);
  return "$" + n.toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: n !== 0 && Math.abs(n) < 1 ? digits + 2 : digits });
};
// An exact decimal from the API (the ledger's costs) as money, every digit kept and none rounded
// away: "0.14" -> "$0.14", "1234.5" -> "$1,234.50", "0.00000075" -> "$0.00000075", "0" -> "$0.00".
// Raw, "0", "0.035" and "1234.5" stood in one column without a unit, each with its own decimals.
const exactUsd = (v) => {
  if (v === null || v === undefined || v === "") return "—";
  const m = /^(-?)(\d+)(?:\.(\d+))?$/.exec(String(v));
  if (!m) return String(v); // not a plain decimal: shown as the API wrote it rather than misread
  return `${m[1]}$${m[2].replace(/\B(?=(\d{3})+(?!\d))/g, ",")}.${(m[3] || "").padEnd(2, "0")}`;
};
const intFmt = (v) => (v === null || v === undefined ? "—" : Number(v).toLocaleString("en-US"));
const pctFmt = (v) => (v === null || v === undefined ? "—" : (Number(v) * 100).toFixed(1) + "%");
const isoDay = (d) => d.toISOString().slice(0, 10);
const today = () => new Date(new Date().toISOString().slice(0, 10) + "T00:00:00Z");
const addDays = (d, n) => new Date(d.getTime() + n * 86400000);
const monthStart = () => { const t = today(); return new Date(Date.UTC(t.getUTCFullYear(), t.getUTCMonth(), 1)); };

// Every day from `start` (a Date) up to `end` (exclusive), with the report's row for it or `{day}` alone,
// so a chart spans the whole range instead of only the days that had traffic.
function fillDays(rows, start, end) {
  const byDay = Object.fromEntries(rows.map((r) => [r.day, r]));
  const out = [];
  for (let d = start; d < end; d = addDays(d, 1)) out.push(byDay[isoDay(d)] || { day: isoDay(d) });
  return out;
}

function notice(text, kind = "error") {
  return h("p", { class: `notice ${kind}`, role: kind === "error" ? "alert" : "status" }, text);
}

function empty(text) {
  return h("div", { class: "empty" }, text);
}

function field(label, input, hint) {
  const id = input.id || `f-${Math.random().toString(36).slice(2, 9)}`;
  input.id = id;
  const hintEl = hint ? h("small", { id: `${id}-hint`, class: "hint" }, hint) : null;
  if (hintEl) input.setAttribute("aria-describedby", hintEl.id);
  return h("div", { class: "field" }, h("label", { for: id }, label), input, hintEl);
}

// Shows an API error beside the form; a field named in `param` is marked and focused.
function formError(form, err) {
  form.querySelectorAll("[aria-invalid]").forEach((el) => el.removeAttribute("aria-invalid"));
  const box = form.querySelector(".form-error");
  box.textContent = err.message;
  box.hidden = false;
  if (err.param) {
    const input = form.querySelector(`[name="${CSS.escape(err.param)}"]`);
    if (input) { input.setAttribute("aria-invalid", "true"); input.focus(); }
  }
}

function formBox(...children) {
  return [h("p", { class: "form-error notice error", role: "alert", hidden: true }), ...children];
}

// `detail(row)`, when given, adds a full-width row under each row (e.g. a request's attempts);
// `rowClass(row)` marks a row (e.g. a stored route this replica leaves out).
function table(columns, rows, { caption, foot, detail, rowClass } = {}) {
  const thead = h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col", class: c.num ? "num" : null }, c.label))));
  const tbody = h("tbody", {}, rows.map((r) => [
    h("tr", { class: [detail ? "has-detail" : null, rowClass ? rowClass(r) : null].filter(Boolean).join(" ") || null },
      columns.map((c) => h("td", { class: c.num ? "num" : null }, c.render ? c.render(r) : r[c.key]))),
    detail ? h("tr", { class: "detail" }, h("td", { colspan: columns.length }, detail(r))) : null,
  ]));
  const tfoot = foot ? h("tfoot", {}, h("tr", {}, columns.map((c) => h("td", { class: c.num ? "num" : null }, c.render ? c.render(foot) : foot[c.key])))) : null;
  return h("div", { class: "table-wrap" }, h("table", {}, caption ? h("caption", {}, caption) : null, thead, tbody, tfoot));
}

// A chart's time-axis steps, in seconds: whole days, then uPlot's month and year steps (30 and 365 days).
const DAY_STEPS = [1, 2, 3, 7, 14, 30, 60, 90, 180, 365, 730, 1825].map((n) => n * 86400);

// A uPlot chart over days. `stacked` draws each series on top of the previous ones.
function chart(title, days, series, { stacked = false, fmt = (v) => v, range } = {}) {
  const box = h("figure", { class: "chart" }, h("figcaption", {}, title));
  if (!days.length) { box.append(empty("No data in this range yet.")); return box; }
  const xs = days.map((d) => Date.parse(d + "T00:00:00Z") / 1000);
  let ys = series.map((s) => s.values.map((v) => (v === null || v === undefined ? null : Number(v))));
  const raw = ys;
  if (stacked) ys = ys.map((_, i) => xs.map((_, j) => ys.slice(0, i + 1).reduce((a, s) => a + (s[j] || 0), 0)));
  // Draw the tallest stack first so each lower band paints over it.
  const order = stacked ? [...series.keys()].reverse() : [...series.keys()];
  const opts = {
    width: 600, height: 220,
    // Each point is a whole UTC day: ticks fall on UTC midnights and step by whole days (uPlot's own
    // steps, for a few days across, were 6 or 12 hours: "12am, 6am, 12pm" on a chart of days).
    tzDate: (ts) => uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"),
    scales: { x: { time: true }, y: range ? { range } : { range: (u, lo, hi) => [Math.min(0, lo), hi > 0 ? hi * 1.1 : 1] } },
    axes: [{ incrs: DAY_STEPS }, { values: (u, vals) => vals.map((v) => fmt(v)), size: 96 }],
    series: [{ value: "{YYYY}-{MM}-{DD}" }, ...order.map((i) => ({
      label: series[i].label,
      stroke: COLORS[i % COLORS.length],
      fill: stacked ? COLORS[i % COLORS.length] + "99" : undefined,
      width: 2,
      points: { show: xs.length < 40 },
      value: (u, v, si, idx) => (idx === null ? "—" : fmt(raw[i][idx])),
    }))],
  };
  const plot = new uPlot(opts, [xs, ...order.map((i) => ys[i])], box);
  box.plot = plot;  // its axes' ticks, which the canvas alone does not show tests or the console
  const fit = () => plot.setSize({ width: Math.max(260, box.clientWidth - 16), height: 220 });
  requestAnimationFrame(fit);
  new ResizeObserver(fit).observe(box);
  return box;
}

// `exact`: the API's value behind a rounded display, in the tooltip and data-value.
function stat(label, value, sub, exact) {
  return h("div", { class: "stat" }, h("div", { class: "stat-label" }, label),
    h("div", { class: "stat-value", title: exact, "data-value": exact }, value), sub ? h("div", { class: "stat-sub" }, sub) : null);
}

async function copyButton(text) {
  const b = h("button", { type: "button" }, "Copy");
  b.addEventListener("click", async () => {
    try { await navigator.clipboard.writeText(text); b.textContent = "Copied"; }
    catch { b.textContent = "Select the key and copy it by hand"; }
  });
  return b;
}

// A key just issued, shown only once: outside `main`, so no render can take it away before the admin
// copied it. The tenant's page rendered again after the issue could be superseded by a newer render
// (the admin following a link meanwhile), which left no place for the key: it was never shown, and
// had to be revoked and issued again. It stays until its Done button or the sign-in form (signed out,
// or the session expired) clears it.
const newKey = document.getElementById("new-key");

async function showNewKey(tenant, key) {
  newKey.replaceChildren(
    h("p", {}, h("strong", {}, `Copy the new key of ${tenant.name}${key.name ? ` (${key.name})` : ""} now: it is shown only once.`)),
    h("code", { class: "secret", id: "new-key-value" }, key.key), " ", await copyButton(key.key), " ",
    h("button", { type: "button", onclick: clearNewKey }, "Done"));
  newKey.hidden = false;
}

function clearNewKey() {
  newKey.replaceChildren();
  newKey.hidden = true;
}

// Opens `hash`, or renders it again when it is the page shown: a form submitted unchanged (Show report
// or Filter pressed again to see the traffic since) set the same hash, which fires no hashchange, and
// the button did nothing.
function go(hash) {
  const before = location.hash;
  location.hash = hash;
  if (location.hash === before) route();
}

function page(title, ...content) {
  main.replaceChildren(h("h1", {}, title), ...content.filter((c) => c !== null && c !== undefined && c !== false));
  document.title = `${title} · Weir admin`;
  main.focus();
}

// --- sign-in ------------------------------------------------------------------------------------

function showSignIn(message) {
  generation++; // a page still loading must not replace the sign-in form
  clearNewKey(); // a secret: not left over the sign-in form for whoever comes next (signed out or expired)
  document.querySelector("header.top").hidden = true;
  csrf = null;
  const err = h("p", { class: "notice error", role: "alert", hidden: !message }, message || "");
  const user = h("input", { name: "username", autocomplete: "username", required: true });
  const pass = h("input", { name: "password", type: "password", autocomplete: "current-password", required: true });
  const token = h("input", { name: "token", type: "password", autocomplete: "off" });
  const submit = async (ev, body) => {
    ev.preventDefault();
    err.hidden = true;
    try {
      const res = await api("/admin/session", { method: "POST", body });
      csrf = res.csrf;
      enterApp(res.user);
    } catch (e) { err.textContent = e.message; err.hidden = false; }
  };
  main.replaceChildren(h("section", { class: "signin" },
    h("h1", {}, "Sign in to Weir"),
    err,
    h("form", { onsubmit: (ev) => submit(ev, { username: user.value, password: pass.value }), "aria-label": "Sign in with an account" },
      field("User name", user), field("Password", pass),
      h("button", { type: "submit" }, "Sign in")),
    h("p", { class: "or" }, "or"),
    h("form", { onsubmit: (ev) => submit(ev, { token: token.value }), "aria-label": "Sign in with the admin token" },
      field("Admin token", token, "WEIR_ADMIN_TOKEN, or the token the gateway printed at its first start."),
      h("button", { type: "submit" }, "Sign in with token")),
    h("p", { class: "muted" }, "Accounts: weir admin create-user NAME. Five wrong tries lock sign-in for 15 minutes."),
  ));
  document.title = "Sign in · Weir admin";
  user.focus();
}

function enterApp(user) {
  document.querySelector("header.top").hidden = false;
  document.getElementById("who").textContent = user;
  if (!location.hash || location.hash === "#/") location.hash = "#/overview";
  else route();
}

document.getElementById("sign-out").addEventListener("click", async () => {
  // Refused or unanswered, the session is still open on the server and its cookie still here:
  // "Signed out." would leave it to the next person at this browser, who reloads and is signed in.
  try { await api("/admin/session", { method: "DELETE" }); } catch (e) {
    if (e.status === 401) return; // already over: api() showed the sign-in form
    main.prepend(notice(`Not signed out: ${e.message}. Your session is still open; try again.`));
    return;
  }
  showSignIn("Signed out.");
});

// --- overview -----------------------------------------------------------------------------------

async function overview(params, query, show) {
  const start = addDays(today(), -29), end = addDays(today(), 1);
  const [days, month, routing] = await Promise.all([
    api(`reports/usage?group_by=day&start=${isoDay(start)}&end=${isoDay(end)}`),
    api(`reports/usage?group_by=tenant&start=${isoDay(monthStart())}&end=${isoDay(end)}`),
    api(`reports/routing-savings?start=${isoDay(start)}&end=${isoDay(end)}`),
  ]);
  const savedDays = fillDays(routing.data, start, end);
  const rows = fillDays(days.rows, start, end), t = month.totals, d = days.totals;
  const todayRow = rows.find((r) => r.day === isoDay(today())) || { cost_usd: "0", requests: 0 };
  const x = rows.map((r) => r.day);
  const col = (k, zero = 0) => rows.map((r) => r[k] ?? zero);
  // Cancelled attempts (499: hedges that lost, clients that left) are neither errors nor answers.
  const errRate = (r) => {
    const settled = r.attempts - (r.cancelled || 0);
    return settled ? r.errors / settled : null;
  };
  show("Overview",
    d.requests ? null : notice("No traffic yet. Create a tenant and a key under Tenants & keys, then send a request with it.", "info"),
    h("div", { class: "stats" },
      stat("Requests (30 days)", intFmt(d.requests), `${intFmt(t.requests)} this month`),
      // Exact, as Finance and the API say them: rounded, this month's spend read $0.018001 here and
      // $0.01800075 on Finance for the same range.
      stat("Spend today", exactUsd(todayRow.cost_usd), null, todayRow.cost_usd),
      stat("Spend this month", exactUsd(t.cost_usd), null, t.cost_usd),
      stat("Tokens this month", intFmt(t.total_tokens), `in ${intFmt(t.input_tokens)} · cached ${intFmt(t.cached_input_tokens)} · cache write ${intFmt(t.cache_write_tokens)} · out ${intFmt(t.output_tokens)}`),
      stat("Cache hit ratio", pctFmt(t.cache_hit_ratio), `saved ${exactUsd(t.cache_savings_usd)} this month`),
      stat("Error rate (30 days)", pctFmt(errRate(d))),
      stat("Routing savings (30 days)", exactUsd(routing.totals.saved_usd), `vs ${exactUsd(routing.totals.strongest_cost_usd)} on each route's priciest candidate`, routing.totals.saved_usd),
    ),
    h("div", { class: "charts" },
      chart("Requests per day", x, [{ label: "requests", values: col("requests") }], { fmt: intFmt }),
      chart("Spend per day (USD)", x, [{ label: "spend", values: col("cost_usd") }], { fmt: usdFmt }),
      chart("Tokens per day by class", x, [
        { label: "input", values: col("input_tokens") },
        { label: "cached input", values: col("cached_input_tokens") },
        { label: "cache write", values: col("cache_write_tokens") },
        { label: "output", values: col("output_tokens") },
      ], { stacked: true, fmt: intFmt }),
      chart("Cache hit ratio and error rate", x, [
        { label: "cache hit ratio", values: col("cache_hit_ratio", null) },
        { label: "error rate", values: rows.map(errRate) },
      ], { fmt: pctFmt, range: [0, 1] }),
      chart("Cache savings per day (USD)", x, [{ label: "saved", values: col("cache_savings_usd") }], { fmt: usdFmt }),
      chart("Routing: spend vs all-strongest per day (USD)", x, [
        { label: "spent", values: savedDays.map((r) => r.cost_usd ?? 0) },
        { label: "on the strongest", values: savedDays.map((r) => r.strongest_cost_usd ?? 0) },
      ], { fmt: usdFmt }),
    ),
  );
}

// --- routes -------------------------------------------------------------------------------------

const POLICIES = ["fixed", "weighted", "cheapest", "lowest_latency", "difficulty", "prefix_affinity"];
// Fields the structured form edits; everything else of a route is kept in the advanced JSON box.
const FORM_FIELDS = ["id", "name", "position", "policy", "candidates", "fallbacks", "threshold", "strong_share", "head", "ttft_timeout", "updated_at"];

// A candidate's settings besides its model and weight, with the schema's defaults (routing/routes.py
// Candidate): the ones that differ are written on its line as key=value, so an edit keeps them.
const CANDIDATE_DEFAULTS = { context_window: null, max_output_tokens: null, tools: true, vision: true, cache_hit_rate: 0, max_in_flight: null, max_waiting: null };
function candidateLine(c) {
  const parts = [c.model];
  if (c.weight !== undefined && c.weight !== 1) parts.push(String(c.weight));
  for (const [k, v] of Object.entries(c)) {
    if (k === "model" || k === "weight" || (k in CANDIDATE_DEFAULTS && v === CANDIDATE_DEFAULTS[k])) continue;
    parts.push(`${k}=${JSON.stringify(v)}`);
  }
  return parts.join(" ");
}

// "gpt-4o-mini 3 context_window=128000 vision=false" -> a candidate, or null when the line is malformed.
function parseCandidate(line) {
  const [model, ...rest] = line.split(/\s+/);
  const c = { model };
  for (const [i, part] of rest.entries()) {
    const eq = part.indexOf("=");
    if (eq > 0) {
      const v = part.slice(eq + 1);
      try { c[part.slice(0, eq)] = JSON.parse(v); } catch { c[part.slice(0, eq)] = v; }
    } else if (i === 0 && Number(part) > 0) c.weight = Number(part);
    else return null;
  }
  return c;
}

// The output limits a route's lines inherit, as "gpt-4o max_output_tokens 16384 (model)": for each
// candidate without its own max_output_tokens, and each fallback (which has none), its model's
// `models[].max_output_tokens` from the config (`limits`: GET routes' model_max_output_tokens).
function inheritedLimits(candidates, fallbacks, limits) {
  const names = [...candidates.filter((c) => c && c.max_output_tokens == null).map((c) => c.model), ...fallbacks];
  return [...new Set(names)].filter((m) => Object.hasOwn(limits, m))
    .map((m) => `${m} max_output_tokens ${limits[m]} (model)`).join(", ");
}

// The form field an API error's `param` belongs to: "retry.jitter" and "when.tenants" are in the
// advanced JSON box (`extra`, the fields it held), "candidates[1].weight" is the candidates box.
// Anything else (route_id of a route deleted meanwhile, updated_at) is about the form as a whole.
function routeParam(form, param, extra) {
  if (!param || param === "updated_at" || param === "id") return null;
  const top = param.split(/[.[]/)[0];
  if (form.querySelector(`[name="${CSS.escape(top)}"]`)) return top;
  return Object.hasOwn(extra, top) ? "advanced" : null;
}

// The head <select>'s options: "shipped", the stored heads, and the route's own head where it is no
// longer stored (kept selectable, so saving says so).
function headOptions(heads, selected) {
  const names = selected && !heads.includes(selected) ? [...heads, selected] : heads;
  return [h("option", { value: "" }, "shipped (default)"),
    names.map((n) => h("option", { value: n, selected: n === selected }, heads.includes(n) ? n : `${n} (not stored)`))];
}

function routeSummary(r) {
  const when = r.when ? Object.entries(r.when).filter(([, v]) => v !== null).map(([k, v]) => `${k}=${Array.isArray(v) ? v.join("|") : typeof v === "object" ? JSON.stringify(v) : v}`).join(", ") : "";
  return when || "always";
}

// `heads`: the stored difficulty heads' names, or null when the gateway has no difficulty-heads API
// (then a route's `head`, if any, stays in the advanced JSON box). `onGone(message)`: the edited
// route was deleted meanwhile (a 404). `limits`: the models' max_output_tokens (inheritedLimits).
function routeForm(existing, onSaved, heads = null, onGone = null, limits = {}) {
  const r = existing || { policy: "fixed", candidates: [], fallbacks: [] };
  const name = h("input", { name: "name", required: true, value: r.name || "", autocomplete: "off" });
  const policy = h("select", { name: "policy" }, POLICIES.map((p) => h("option", { value: p, selected: p === r.policy }, p)));
  const cands = h("textarea", { name: "candidates", rows: 3, required: true },
    (r.candidates || []).map(candidateLine).join("\n"));
  const fallbacks = h("input", { name: "fallbacks", value: (r.fallbacks || []).join(", "), autocomplete: "off" });
  const threshold = h("input", { name: "threshold", inputmode: "decimal", value: r.threshold ?? "" , placeholder: "0.5" });
  const share = h("input", { name: "strong_share", inputmode: "decimal", value: r.strong_share ?? "", placeholder: "not set" });
  const ttft = h("input", { name: "ttft_timeout", inputmode: "decimal", value: r.ttft_timeout ?? "", placeholder: "none" });
  // An edit leaves an empty position out of the PUT, which keeps the stored one.
  const position = h("input", { name: "position", inputmode: "numeric", value: r.position ?? "", placeholder: existing ? "unchanged" : "after the others", autocomplete: "off" });
  const head = heads ? h("select", { name: "head" }, headOptions(heads, r.head)) : null;
  const formFields = heads ? FORM_FIELDS : FORM_FIELDS.filter((k) => k !== "head");
  const rest = Object.fromEntries(Object.entries(r).filter(([k]) => !formFields.includes(k)));
  const advanced = h("textarea", { name: "advanced", rows: 6, class: "code" }, Object.keys(rest).length ? JSON.stringify(rest, null, 2) : "{}");
  // What applies where a line sets no max_output_tokens, kept up to date as the lines are typed.
  const inherited = h("small", { class: "hint", "aria-live": "polite" });
  const showInherited = () => {
    const text = inheritedLimits(cands.value.split("\n").map((l) => l.trim()).filter(Boolean).map(parseCandidate),
      fallbacks.value.split(",").map((x) => x.trim()).filter(Boolean), limits);
    inherited.textContent = text ? `Inherited: ${text}.` : "";
  };
  showInherited();
  cands.addEventListener("input", showInherited);
  fallbacks.addEventListener("input", showInherited);
  const candsField = field("Candidates", cands, "One model per line, optionally followed by a weight and settings: gpt-4o-mini 3 context_window=128000 max_output_tokens=16384 vision=false");
  candsField.append(inherited);
  const form = h("form", { class: "inline-form", "aria-label": existing ? `Edit route ${r.name}` : "Create a route" }, ...formBox(
    field("Public model name", name, "What clients send as model; several routes may share it (the first whose conditions match wins)."),
    field("Policy", policy, "fixed: first candidate; weighted: by weight; difficulty: candidates are weak, strong."),
    candsField,
    field("Fallbacks", fallbacks, "Comma-separated models tried in order after every candidate failed."),
    field("Difficulty threshold", threshold, "difficulty: strong model when p_strong is above this (0-1)."),
    field("Target strong share", share, "difficulty: send this share of traffic to the strong model instead (0-1)."),
    head ? field("Difficulty head", head, "difficulty only: score prompts with a head trained on your own outcomes (Difficulty heads below) instead of the shipped one.") : null,
    field("First-token timeout (s)", ttft, "Streams fail over when no token arrived by then."),
    field("Position (#)", position, "Routes sharing a model name are tried lowest # first; the first whose conditions match wins."),
    field("Advanced (JSON)", advanced, "Other route fields: when (conditions), retry, hedge, breaker, failover_on, resume… See docs/routing-policies.md."),
    h("button", { type: "submit" }, existing ? "Save route" : "Create route")));
  const submit = form.querySelector("button[type=submit]");
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    if (submit.disabled) return; // a create carries no If-Match: a second submit would store it twice
    let extra;
    try { extra = JSON.parse(advanced.value || "{}"); } catch (e) {
      formError(form, { message: `Advanced (JSON) is not valid JSON: ${e.message}`, param: "advanced" }); return;
    }
    // Spread into the route, a list or string would add fields named "0", "1"... and null or a
    // number would silently drop every advanced setting.
    if (extra === null || typeof extra !== "object" || Array.isArray(extra)) {
      formError(form, { message: 'Advanced (JSON) must be a JSON object of route fields, e.g. {"retry": {"attempts": 3}}; write {} for none.', param: "advanced" }); return;
    }
    const candidates = [];
    for (const line of cands.value.split("\n").map((l) => l.trim()).filter(Boolean)) {
      const c = parseCandidate(line);
      if (!c) {
        formError(form, { message: `Candidate line "${line}": write a model name, then optionally a positive weight and settings as key=value.`, param: "candidates" }); return;
      }
      candidates.push(c);
    }
    const num = (el) => (el.value.trim() === "" ? undefined : Number(el.value));
    const body = { ...extra, name: name.value.trim(), policy: policy.value, candidates,
      fallbacks: fallbacks.value.split(",").map((x) => x.trim()).filter(Boolean) };
    for (const [k, el] of [["threshold", threshold], ["strong_share", share], ["ttft_timeout", ttft], ["position", position]]) {
      const v = num(el);
      // Infinity (or 1e999) is no setting: JSON would send it as null, dropping the field.
      if (v !== undefined && (!Number.isFinite(v) || (k === "position" && !Number.isInteger(v)))) {
        formError(form, { message: `${k} must be a ${k === "position" ? "whole " : ""}number.`, param: k }); return;
      }
      if (v !== undefined) body[k] = v;
    }
    if (head) { if (head.value) body.head = head.value; else delete body.head; }
    submit.disabled = true;
    try {
      // If-Match: refused (412) when another admin changed the route since this form was filled.
      await api(existing ? `routes/${existing.id}` : "routes", { method: existing ? "PUT" : "POST", body, ifMatch: existing?.updated_at });
      onSaved();
    } catch (e) {
      if (existing && e.status === 404 && onGone) { await onGone(e.message); return; }
      formError(form, { message: e.message, param: routeParam(form, e.param, extra) });
    }
    finally { submit.disabled = false; }
  });
  return form;
}

// The preview's Metadata field: a JSON object of strings, as a client sends `metadata` ({"tier":
// "gold", "tags": "batch,eu"}), or one key=value per line. { meta } or { error } (the form's message).
function parseMetadata(text) {
  const json = text.trim();
  if (json.startsWith("{")) {
    let meta;
    try { meta = JSON.parse(json); } catch (e) { return { error: `Metadata: not a JSON object (${e.message}).` }; }
    const bad = Object.entries(meta).find(([, v]) => typeof v !== "string");
    if (bad) return { error: `Metadata "${bad[0]}": write its value as a string, as requests carry it ("tags": "batch,eu").` };
    return { meta };
  }
  const meta = {};
  for (const line of text.split("\n").map((l) => l.trim()).filter(Boolean)) {
    const eq = line.indexOf("=");
    if (eq <= 0) return { error: `Metadata line "${line}": write key=value, or a JSON object.` };
    meta[line.slice(0, eq).trim()] = line.slice(eq + 1).trim();
  }
  return { meta };
}

function previewForm(list) {
  const model = h("input", { name: "model", required: true, value: list[0]?.name || "", autocomplete: "off" });
  const prompt = h("textarea", { name: "prompt", rows: 3, required: true }, "");
  const tenant = h("input", { name: "tenant", autocomplete: "off", placeholder: "any" });
  const keyId = h("input", { name: "key_id", autocomplete: "off", placeholder: "any" });
  const metadata = h("textarea", { name: "metadata", rows: 2, placeholder: "none" }, "");
  const tools = h("input", { name: "tools", type: "checkbox" });
  const images = h("input", { name: "images", type: "checkbox" });
  const out = h("div", { "aria-live": "polite", id: "preview-result" });
  const form = h("form", { class: "inline-form", "aria-label": "Preview a prompt" }, ...formBox(
    field("Model name", model, "What the client sends as model."), field("Tenant name", tenant, "For routes with tenant conditions."),
    field("Key id", keyId, "For routes with key conditions; plans with the models that key may use."),
    field("Metadata", metadata, "The request's metadata, one key=value per line (tags=batch,eu) or a JSON object ({\"tags\": \"batch,eu\"}), for routes with metadata or tag conditions."),
    h("label", { class: "check" }, tools, " request offers tools"),
    h("label", { class: "check" }, images, " request has images"),
    field("Sample prompt", prompt, "The last user message; difficulty and prefix policies look at it."),
    h("button", { type: "submit" }, "Preview")), out);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    form.querySelector(".form-error").hidden = true;
    const { meta, error } = parseMetadata(metadata.value);
    if (error) { formError(form, { message: error, param: "metadata" }); return; }
    try {
      const p = await api("routes/preview", { method: "POST", body: { model: model.value.trim(), prompt: prompt.value, tenant: tenant.value.trim() || null,
        key_id: keyId.value.trim() || null, metadata: meta, tools: tools.checked, images: images.checked } });
      out.replaceChildren(
        h("p", {}, p.routed ? `Route ${p.model} (policy ${p.policy}) matches.` : `No route matches: the request goes to the model named ${p.model}, tried once.`,
          p.note ? ` ${p.note}.` : ""),
        h("ol", { class: "plan" }, p.choices.map((c, i) => h("li", {}, h("strong", {}, c.model), ` on ${c.backend} (${c.upstream_model})`,
          i === 0 ? " — tried first" : "", c.reason ? `; reason: ${c.reason}` : "", c.score !== null ? `; score ${Number(c.score).toPrecision(4)}` : ""))),
        h("p", { class: "muted" }, "x-weir-route: ", h("code", {}, p.header)));
    } catch (e) { formError(form, e); }
  });
  return form;
}

const aucFmt = (v) => Number(v).toFixed(3);
const timeFmt = (iso) => iso.slice(0, 19).replace("T", " ");

// What this replica serves for a stored head (routes/status `difficulty_heads`): name@digest12 once
// loaded, else why not; heads no route names are not loaded at all.
function headServed(d, status) {
  if (!status) return "—";
  const served = (status.difficulty_heads || {})[d.name];
  if (served === undefined) return "not used by a route";
  if (!served.includes("@")) return h("span", { class: served === "loading" ? null : "bad" }, served);
  const current = served.endsWith(`@${d.digest.slice(0, 12)}`);
  return h("span", { class: "ok" }, served, current ? "" : " (the version before; the new one is loading)");
}

// The stored difficulty heads: list, delete, upload a bundle (what `weir router heads export` writes).
// `reload` renders this section again (with the route form's head list), leaving the rest as it is.
function headsSection(heads, status, reload) {
  const message = h("div", { id: "heads-message", "aria-live": "polite" });
  const remove = (d) => h("button", { type: "button", class: "danger", "aria-label": `Delete difficulty head ${d.name}`,
    onclick: async () => {
      if (!confirm(`Delete difficulty head ${d.name}? It cannot be undone; export it first to keep it.`)) return;
      message.replaceChildren();
      try { await api(`difficulty-heads/${encodeURIComponent(d.name)}`, { method: "DELETE" }); } catch (e) {
        message.replaceChildren(notice(e.message)); return;
      }
      reload();
    } }, "Delete");
  const name = h("input", { name: "name", required: true, autocomplete: "off" });
  const file = h("input", { name: "file", type: "file", required: true, accept: ".safetensors,application/octet-stream" });
  file.addEventListener("change", () => {
    const base = file.files[0]?.name.replace(/\.safetensors$/, "");
    if (!name.value && base && /^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$/.test(base)) name.value = base;
  });
  const form = h("form", { class: "inline-form", "aria-label": "Upload a difficulty head" }, ...formBox(
    field("Head name", name, "Letters, digits, '.', '_' or '-'; a route names it. Uploading under a stored name replaces that head."),
    field("Head file", file, "A bundle (.safetensors): what weir router heads export writes, or GET difficulty-heads/NAME/bundle."),
    h("button", { type: "submit" }, "Upload head")));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    form.querySelector(".form-error").hidden = true;
    const n = name.value.trim(), f = file.files[0];
    if (!f) { formError(form, { message: "Choose a head file.", param: "file" }); return; }
    const replacing = heads.some((d) => d.name === n);
    if (replacing && !confirm(`Replace difficulty head ${n}? Routes naming it switch to the new one on every replica once it has loaded.`)) return;
    let saved;
    try {
      saved = await api(`difficulty-heads/${encodeURIComponent(n)}`, { method: "PUT", bytes: await f.arrayBuffer() });
    } catch (e) {
      formError(form, { message: e.message, param: e.param === "body" ? "file" : e.param }); return;
    }
    await reload();
    document.getElementById("heads-message")?.replaceChildren(
      notice(`${replacing ? "Replaced" : "Stored"} difficulty head ${saved.name} (${saved.digest.slice(0, 12)}).`, "success"));
  });
  const holdout = (d) => {
    // Rows that know both outcomes say what a difficulty route should send strong: show those first.
    const results = d.holdout?.results ?? [];
    const res = results.find((r) => r.outcome === "needs the strong model") ?? results[0];
    if (!res) return "—";
    const baseline = d.holdout.baseline ?? "the shipped head";
    const against = baseline.startsWith("the shipped") ? "shipped" : "in use";
    const routed = res.routed
      ? `; on the ${res.routed[0]} routed with a stored score: ${aucFmt(res.routed[2])} this head, ${aucFmt(res.routed[1])} as routed`
      : "";
    return h("span", { title: `${res.outcome}: ${res.positives} positive, ${res.negatives} negative held-out rows, against ${baseline}; difference ${aucFmt(res.difference[0])} to ${aucFmt(res.difference[1])} (95%)${routed}` },
      `this head ${aucFmt(res.trained)} vs ${against} ${aucFmt(res.baseline)}`);
  };
  return h("section", { class: "panel", id: "heads" },
    h("h2", {}, "Difficulty heads"),
    h("p", { class: "muted" }, "Heads trained on your own outcomes (weir router train); a difficulty route names one in Difficulty head. Every replica loads it within seconds."),
    message,
    heads.length ? table([
      { label: "Name", key: "name" },
      { label: "Digest", render: (d) => h("code", {}, d.digest.slice(0, 12)) },
      { label: "Embedder", key: "embedder" },
      { label: "Rows", num: true, render: (d) => intFmt(d.rows) },
      { label: "Source", render: (d) => d.source ?? "—" },
      { label: "Held-out AUC", render: holdout },
      { label: "Blend", key: "blend_inputs" },
      { label: "Updated (UTC)", render: (d) => timeFmt(d.updated_at) },
      { label: "Served here", render: (d) => headServed(d, status) },
      { label: "", render: remove },
    ], heads, { caption: "Held-out AUC: how a head fitted without a held-out share ranked it against the shipped head, or with --install against the head its route served (weir router train --holdout); hover for the interval and how the rows ranked as routed. Blend: what the head's blend weighs; components+length where training found the prompt's length ranked its rows better." })
      : empty("No difficulty heads stored: difficulty routes use the shipped head. Upload one below."),
    h("h3", {}, "Upload a head"), form);
}

// What this replica observed of its routes (routes/status): the prefix-cache hit rate each
// prefix_affinity route achieves, and the per-model speed and cache share the policies read.
function routedStatus(status) {
  if (!status) return [];
  const sent = status.prefix_affinity_hit_rate || {};
  const cache = status.prefix_affinity_cache || {};
  const affinity = [...new Set([...Object.keys(sent), ...Object.keys(cache)])].sort();
  const models = Object.entries(status.models || {}).sort(([a], [b]) => a.localeCompare(b));
  const seconds = (v) => (v === null || v === undefined ? "—" : `${(Number(v) * 1000).toFixed(0)} ms`);
  return [
    h("h2", {}, "Prefix affinity"),
    affinity.length ? table([
      { label: "Route", render: (n) => n },
      { label: "Sent to the preferred replica", num: true, render: (n) => pctFmt(sent[n]) },
      { label: "Prompt tokens", num: true, render: (n) => intFmt(cache[n]?.prompt_tokens) },
      { label: "Read from the replicas' caches", num: true, render: (n) => intFmt(cache[n]?.cached_tokens) },
      { label: "Cache hit rate", num: true, render: (n) => pctFmt(cache[n]?.hit_rate) },
    ], affinity, { caption: "Since this replica started. Cache hit rate: the prompt tokens the replicas report they read from their prefix caches; what the policy achieves (sent to the preferred replica only says the policy was followed)." })
      : empty("No prefix_affinity route has had traffic on this replica yet."),
    h("h2", {}, "Models as routed"),
    models.length ? table([
      { label: "Backend / model", render: ([k]) => k },
      { label: "Requests", num: true, render: ([, m]) => intFmt(m.samples) },
      { label: "TTFT (mean)", num: true, render: ([, m]) => seconds(m.ttft_s) },
      { label: "TTFT (p95)", num: true, render: ([, m]) => seconds(m.p95_ttft_s) },
      { label: "Tokens/s", num: true, render: ([, m]) => (m.tokens_per_s == null ? "—" : Number(m.tokens_per_s).toFixed(1)) },
      { label: "Prompt cache share", num: true, render: ([, m]) => pctFmt(m.cache_hit_rate) },
    ], models, { caption: "Moving averages of successful requests on this replica: what lowest_latency and cheapest read." })
      : empty("No model has answered a request on this replica yet."),
  ];
}

// Stored routes the replica that answered does not serve, and why it refused the table as a whole
// (the list's `left_out` and `routes_rejected`): above everything else, for the admin who must fix them.
function notInForce(data) {
  const leftOut = data.left_out || [];
  const rejected = data.routes_rejected;
  if (!leftOut.length && !rejected) return null;
  const count = leftOut.length === 1 ? "1 stored route is" : `${leftOut.length} stored routes are`;
  return h("div", { class: "notice warning", role: "alert", id: "routes-not-in-force" },
    rejected ? h("p", {}, h("strong", {}, "This replica refused the routes table: "),
      `it keeps serving the routes it loaded before, and applies no edit until the table loads. Why: ${rejected}`) : null,
    leftOut.length ? [
      h("p", {}, h("strong", {}, `${count} left out by this replica`),
        " (its config lacks a model the route names, or another version wrote it). Edit each to fix it, or delete it:"),
      h("ul", {}, leftOut.map((r) => h("li", {}, h("a", { href: `#/routes/${r.id}` }, `${r.name} #${r.id}`), ": ", r.error))),
    ] : null);
}

async function routes(params, query, show) {
  let data;
  try { data = await api("routes"); } catch (e) {
    if (e.status === 404) {
      show("Routes", empty("This gateway has no routes API: routes come from the routes: section of the config file (docs/routing.md)."));
      return;
    }
    throw e;
  }
  const [status, audit, heads] = await Promise.all([
    api("routes/status").catch(() => null), api("audit?entity=route&limit=50"),
    // null: a gateway without difficulty heads (older than them).
    api("difficulty-heads").then((d) => d.data, (e) => { if (e.status === 404) return null; throw e; }),
  ]);
  const headNames = heads ? heads.map((d) => d.name) : null;
  const list = data.data || [];
  const leftOut = new Map((data.left_out || []).map((r) => [r.id, r]));
  const limits = data.model_max_output_tokens || {}; // absent from a gateway older than it
  const editing = params[0] ? list.find((r) => String(r.id) === params[0]) : null;
  // pushState, not location.hash: a hashchange would render the page a second time, after this one.
  const reload = async () => { if (location.hash !== "#/routes") history.pushState(null, "", "#/routes"); return route(); };
  // Only the heads section and the route form's head list: an open route form keeps what was typed.
  const reloadHeads = async () => {
    let fresh, now;
    try { [fresh, now] = await Promise.all([api("difficulty-heads"), api("routes/status").catch(() => null)]); } catch (e) {
      document.getElementById("heads-message")?.replaceChildren(notice(e.message)); return;
    }
    document.getElementById("heads")?.replaceWith(headsSection(fresh.data, now, reloadHeads));
    const select = main.querySelector('select[name="head"]');
    select?.replaceChildren(...headOptions(fresh.data.map((d) => d.name), select.value).flat());
  };
  // A route another admin deleted meanwhile: the list again, without it, and the API's word above it.
  const gone = async (message) => {
    if (await reload()) document.getElementById("routes-message")?.replaceChildren(notice(message));
  };
  const remove = (r) => h("button", { type: "button", class: "danger", "aria-label": `Delete route ${r.name} #${r.id}`,
    onclick: async () => {
      if (!confirm(`Delete route ${r.name} (#${r.id})? Requests for ${r.name} then use the next matching route or the model of that name.`)) return;
      try { await api(`routes/${r.id}`, { method: "DELETE", ifMatch: r.updated_at }); } catch (e) {
        if (e.status === 404) { await gone(e.message); return; }
        document.getElementById("routes-message")?.replaceChildren(notice(e.message)); return;
      }
      reload();
    } }, "Delete");
  const breakers = status ? Object.entries(status.breakers || {}) : [];
  // Routes' own breakers for their ttft_timeout on models other routes wait longer for: [route, backend/model, state].
  const latency = status ? Object.entries(status.latency_breakers || {}).sort(([a], [b]) => a.localeCompare(b))
    .flatMap(([r, keys]) => Object.entries(keys).sort(([a], [b]) => a.localeCompare(b)).map(([k, v]) => [r, k, v])) : [];
  const stateCell = (v) => h("span", { class: v === "closed" ? "ok" : "bad" }, v);
  const shown = show("Routes",
    notInForce(data),
    h("div", { id: "routes-message", "aria-live": "polite" }),
    list.length ? table([
      { label: "#", num: true, key: "position" },
      { label: "Model name", render: (r) => (leftOut.has(r.id) ? [r.name, " ", h("span", { class: "tag warning", title: leftOut.get(r.id).error }, "left out")] : r.name) },
      { label: "Policy", render: (r) => (r.head ? `${r.policy} (head ${r.head})` : r.policy) },
      { label: "Candidates", render: (r) => r.candidates.map((c) => (r.policy === "weighted" ? `${c.model} ×${c.weight ?? 1}` : c.model)).join(", ") },
      { label: "Fallbacks", render: (r) => (r.fallbacks || []).join(", ") || "—" },
      { label: "When", render: routeSummary },
      { label: "", render: (r) => h("span", { class: "actions" }, h("a", { href: `#/routes/${r.id}`, "aria-label": `Edit route ${r.name} #${r.id}` }, "Edit"), " ", remove(r)) },
    ], list, { caption: `Routes (version ${data.version ?? "—"}); routes sharing a model name are tried in # order, the first whose conditions match wins. Changes apply on every replica within seconds.`,
      rowClass: (r) => (leftOut.has(r.id) ? "left-out" : null) })
      : empty("No routes yet: every request goes to the model it names. Create a route below (the config file's routes: are copied here at first start)."),
    editing ? h("section", { class: "panel", id: "edit" }, h("h2", { tabindex: -1 }, `Edit route ${editing.name} (#${editing.id})`),
      leftOut.has(editing.id) ? notice(`This replica leaves this route out: ${leftOut.get(editing.id).error}`, "warning") : null,
      routeForm(editing, reload, headNames, gone, limits))
      : h("section", { class: "panel" }, h("h2", {}, "New route"), routeForm(null, reload, headNames, null, limits)),
    h("h2", {}, "Preview"), previewForm(list),
    heads ? headsSection(heads, status, reloadHeads) : null,
    h("h2", {}, "Circuit breakers"),
    breakers.length ? table([{ label: "Backend / model", render: ([k]) => k }, { label: "State", render: ([, v]) => stateCell(v) }], breakers)
      : empty("No breaker has seen traffic yet."),
    latency.length ? table([{ label: "Route", render: ([r]) => r }, { label: "Backend / model", render: ([, k]) => k }, { label: "Latency breaker", render: ([, , v]) => stateCell(v) }], latency,
      { caption: "Routes' own latency breakers on this replica: a route's ttft_timeouts on a model that other routes wait longer for. Open, that route's streams skip the model (tried=model:slow); other routes keep it." })
      : null,
    ...routedStatus(status),
    h("p", { class: "muted" }, "Every response carries x-weir-route, and the Requests page shows each attempt."),
    h("h2", {}, "History"),
    audit.data.length ? table([
      { label: "When (UTC)", render: (a) => a.ts.slice(0, 19).replace("T", " ") },
      { label: "Who", key: "actor" }, { label: "Change", key: "action" },
      { label: "Route", render: (a) => `${(a.after || a.before || {}).name || ""} #${a.entity_id}` },
      { label: "Policy / candidates", render: (a) => { const x = a.after || a.before || {}; return `${x.policy || ""}: ${(x.candidates || []).map((c) => c.model).join(", ")}`; } },
    ], audit.data) : empty("No route changes yet."),
  );
  // Focus, not only scroll: a keyboard user who opened the form tabs on into it, not through the table.
  if (shown && editing) { document.getElementById("edit").scrollIntoView(); document.querySelector("#edit h2").focus(); }
}

// --- tenants and keys ---------------------------------------------------------------------------

// Rate limits may be 0 (refuse every request), as the API takes for tenants and keys: with min 1 the
// browser refused to submit a form holding a 0 the API had stored, so such a tenant could not be saved.
const limitInputs = () => ({
  budget: h("input", { name: "budget_usd_monthly", inputmode: "decimal", placeholder: "no budget" }),
  rpm: h("input", { name: "rpm", type: "number", min: 0, placeholder: "no limit" }),
  tpm: h("input", { name: "tpm", type: "number", min: 0, placeholder: "no limit" }),
});
const limitsBody = (i) => ({
  budget_usd_monthly: i.budget.value.trim() || null,
  rpm: i.rpm.value ? Number(i.rpm.value) : null,
  tpm: i.tpm.value ? Number(i.tpm.value) : null,
});

async function tenants(params, query, show) {
  const end = addDays(today(), 1);
  const [list, spend] = await Promise.all([
    api("tenants"),
    api(`reports/usage?group_by=tenant&start=${isoDay(monthStart())}&end=${isoDay(end)}`),
  ]);
  const spent = Object.fromEntries(spend.rows.map((r) => [r.tenant, r.cost_usd]));
  const name = h("input", { name: "name", required: true, autocomplete: "off" });
  const lim = limitInputs();
  const form = h("form", { class: "inline-form", "aria-label": "Create a tenant" }, ...formBox(
    field("Name", name, "Unique, e.g. the team or customer."),
    field("Monthly budget (USD)", lim.budget, "Requests are refused once this month's spend reaches it."),
    field("Requests per minute", lim.rpm), field("Tokens per minute", lim.tpm),
    h("button", { type: "submit" }, "Create tenant")));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    try {
      const t = await api("tenants", { method: "POST", body: { name: name.value.trim(), ...limitsBody(lim) } });
      location.hash = `#/tenants/${t.id}`;
    } catch (e) { formError(form, e); }
  });
  const rows = list.data;
  // Tenants from the config file's tenants: are listed (their requests are in the ledger under their
  // name) but change only in the config: no link to keys, no budget or rate limits kept for them.
  const fromConfig = (t) => t.source === "config";
  // Spend and budget as the API's exact decimals, as Finance shows them ($0.00000075, not $0.000001).
  const budgetCell = (t) => {
    const s = spent[t.id] ?? "0";
    if (!t.budget_usd_monthly) return `${exactUsd(s)} (no budget)`;
    const share = Math.min(1, Number(s) / Number(t.budget_usd_monthly));
    return h("span", { class: "budget" }, h("meter", { min: 0, max: 1, value: share, "aria-label": `${t.name} budget used` }), ` ${exactUsd(s)} of ${exactUsd(t.budget_usd_monthly)}`);
  };
  const tenantCell = (t) => (fromConfig(t)
    ? [t.name, " ", h("span", { class: "tag config", title: `Defined in the config file's tenants: (${intFmt(t.keys)} key${t.keys === 1 ? "" : "s"}); read-only here, change it there.` }, "from config")]
    : h("a", { href: `#/tenants/${t.id}` }, t.name));
  const linked = params[0] ? rows.find((t) => t.id === params[0]) : null;
  const selected = linked && !fromConfig(linked) ? linked : null;
  // A link to a config tenant (its id is its name) said it "no longer exists" while it is listed above.
  const missing = !params[0] || selected ? null : linked
    ? notice(`${linked.name} is defined in the config file's tenants:, which holds its keys and limits: it cannot be edited or deleted here; edit the config to change or remove it.`, "info")
    : notice("That tenant no longer exists.");
  const shown = show("Tenants & keys",
    h("div", { id: "tenants-message", "aria-live": "polite" }),
    rows.length ? table([
      { label: "Tenant", render: tenantCell },
      { label: "Spend this month vs budget", render: budgetCell },
      { label: "RPM", num: true, render: (t) => intFmt(t.rpm) },
      { label: "TPM", num: true, render: (t) => intFmt(t.tpm) },
    ], rows) : empty("No tenants yet. Create one below, then issue it a key."),
    h("h2", {}, "New tenant"), form,
    selected ? tenantSettings(selected) : missing,
    selected ? await tenantKeys(selected) : null,
    selected ? await tenantComparisons(selected) : null,
  );
  if (shown && selected) document.getElementById("tenant").scrollIntoView();
}

// --- a tenant's settings: edit (PATCH) and delete -----------------------------------------------

// The request limits a tenant may set beside its budget and rate limits; empty: the config's default.
const TENANT_COUNTS = [
  ["max_messages", "Max messages per request", "the config's limits"],
  ["max_concurrent_streams", "Max concurrent streams", "the config's limits"],
  ["prompt_retention_days", "Keep stored prompts (days)", "30 days"],
];

// An admin-DB tenant's settings, filled from what the API holds; an empty field clears its limit
// (PATCH's null). Config tenants never get here: they have no page (`tenants`), only a note.
function tenantSettings(tenant) {
  const name = h("input", { name: "name", required: true, autocomplete: "off", value: tenant.name });
  const lim = limitInputs();
  lim.budget.value = tenant.budget_usd_monthly ?? "";
  lim.rpm.value = tenant.rpm ?? "";
  lim.tpm.value = tenant.tpm ?? "";
  const counts = TENANT_COUNTS.map(([key, label, unset]) => [key, label,
    h("input", { name: key, type: "number", min: 1, value: tenant[key] ?? "", placeholder: unset })]);
  const store = h("input", { name: "store_prompts", type: "checkbox", checked: tenant.store_prompts });
  const form = h("form", { class: "inline-form", "aria-label": `Edit tenant ${tenant.name}` }, ...formBox(
    field("Name", name),
    field("Monthly budget (USD)", lim.budget, "Empty: no budget."),
    field("Requests per minute", lim.rpm), field("Tokens per minute", lim.tpm),
    counts.map(([, label, input]) => field(label, input)),
    h("label", { class: "check" }, store, " store prompts and answers"),
    h("button", { type: "submit" }, "Save tenant")));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const body = { name: name.value.trim(), ...limitsBody(lim), store_prompts: store.checked };
    for (const [key, , input] of counts) body[key] = input.value ? Number(input.value) : null;
    try { await api(`tenants/${tenant.id}`, { method: "PATCH", body }); } catch (e) { formError(form, e); return; }
    if (await route()) document.getElementById("tenant-message")?.replaceChildren(notice(`Saved ${body.name}.`, "success"));
  });
  return h("section", { id: "tenant", class: "panel" },
    h("h2", {}, `Settings of ${tenant.name}`),
    h("div", { id: "tenant-message", "aria-live": "polite" }),
    form,
    h("p", {}, h("button", { type: "button", class: "danger", onclick: () => deleteTenant(tenant) }, `Delete tenant ${tenant.name}`)));
}

// What DELETE /tenants/{id} does, said before it is done: its keys go with it (refused at once), its
// ledger rows stay (reports list them under its id), the routes naming it drop it (one for it alone
// goes) and its stored prompts go at the next purge.
async function deleteTenant(tenant) {
  const say = (text, kind) => document.getElementById("tenant-message")?.replaceChildren(notice(text, kind));
  let active;
  try {
    active = (await api(`tenants/${tenant.id}/keys`)).data.filter((k) => !k.revoked_at).length;
  } catch (e) { say(`${tenant.name} was not deleted: ${e.message}`); return; }
  const keys = `${active} active key${active === 1 ? "" : "s"}`;
  if (!confirm(`Delete tenant ${tenant.name}? This cannot be undone.\n\n`
    + `Its keys are deleted with it (${keys}): requests with them are refused at once.\n`
    + `Its usage stays in the ledger: Finance and the request log keep its spend, under its id ${tenant.id}.\n`
    + "Routes that name it in when.tenants, or its keys in when.keys, stop naming them; a route for it alone is deleted.\n"
    + "Its stored prompts, if any, are deleted at the next retention run.")) return;
  try { await api(`tenants/${tenant.id}`, { method: "DELETE" }); } catch (e) {
    say(`${tenant.name} was not deleted: ${e.message}`); return;
  }
  // The list without it, at its own address: the tenant's no longer exists.
  history.replaceState(null, "", "#/tenants");
  if (await route()) document.getElementById("tenants-message")?.replaceChildren(notice(`Deleted tenant ${tenant.name} and its keys.`, "success"));
}

// A key's own budget and rate limits, compact ("$5.00/month · 60 rpm"); the tenant's apply as well.
const keyLimits = (k) => [
  k.budget_usd_monthly != null ? `${exactUsd(k.budget_usd_monthly)}/month` : null,
  k.rpm != null ? `${intFmt(k.rpm)} rpm` : null,
  k.tpm != null ? `${intFmt(k.tpm)} tpm` : null,
].filter(Boolean).join(" · ") || "tenant's only";

const minuteFmt = (iso) => iso.slice(0, 16).replace("T", " ");
// A key past its expires_at is refused as a revoked one is: it read "active".
const keyStatus = (k) => {
  if (k.revoked_at) return `revoked ${minuteFmt(k.revoked_at)} UTC`;
  if (k.expires_at && Date.parse(k.expires_at) <= Date.now()) return h("span", { class: "bad" }, `expired ${minuteFmt(k.expires_at)} UTC`);
  return "active";
};

async function tenantKeys(tenant) {
  const keys = (await api(`tenants/${tenant.id}/keys`)).data;
  const kname = h("input", { name: "name", autocomplete: "off" });
  const models = h("input", { name: "models", autocomplete: "off", placeholder: "all models" });
  // Tomorrow at the earliest: a key expiring at 00:00 UTC today or before was issued already expired.
  const expires = h("input", { name: "expires_at", type: "date", min: isoDay(addDays(today(), 1)) });
  const lim = limitInputs();
  const form = h("form", { class: "inline-form", "aria-label": "Issue a key" }, ...formBox(
    field("Key name", kname), field("Models", models, "Comma-separated public model names; empty allows every model."),
    field("Expires", expires, "Optional; the key stops working at 00:00 UTC that day (tomorrow at the earliest)."),
    field("Monthly budget (USD)", lim.budget), field("Requests per minute", lim.rpm), field("Tokens per minute", lim.tpm),
    h("button", { type: "submit" }, "Issue key")));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const body = { name: kname.value.trim() || null, ...limitsBody(lim) };
    const m = models.value.split(",").map((s) => s.trim()).filter(Boolean);
    if (m.length) body.models = m;
    if (expires.value) body.expires_at = `${expires.value}T00:00:00Z`;
    try {
      const k = await api(`tenants/${tenant.id}/keys`, { method: "POST", body });
      await showNewKey(tenant, k); // before the render below, whichever page that render ends on
      // The key list with the new key. A render begun meanwhile (the admin followed a link) takes the
      // page instead, and then keeps the focus too.
      if (await route()) newKey.querySelector("button").focus();
    } catch (e) { formError(form, e); }
  });
  const revoke = (k) => h("button", {
    type: "button", class: "danger", "aria-label": `Revoke key ${k.name || k.prefix}`,
    onclick: async () => {
      if (!confirm(`Revoke key ${k.name || k.prefix}? Requests with it are refused at once.`)) return;
      // A refusal is said above the keys: uncaught, the button did nothing and the key looked revoked
      // to an admin who assumed it was, while it still worked.
      try { await api(`keys/${k.id}`, { method: "DELETE" }); } catch (e) {
        document.getElementById("keys-message")?.replaceChildren(notice(`Key ${k.name || k.prefix} was not revoked: ${e.message}`)); return;
      }
      await route();
    },
  }, "Revoke");
  return h("section", { id: "keys", class: "panel" },
    h("h2", {}, `Keys of ${tenant.name}`),
    h("div", { id: "keys-message", "aria-live": "polite" }),
    keys.length ? table([
      { label: "Name", render: (k) => k.name || "—" },
      { label: "Prefix", render: (k) => h("code", {}, k.prefix) },
      { label: "Models", render: (k) => (k.models ? k.models.join(", ") : "all") },
      { label: "Own limits", render: keyLimits },
      { label: "Expires", render: (k) => (k.expires_at ? k.expires_at.slice(0, 10) : "never") },
      { label: "Status", render: keyStatus },
      { label: "", render: (k) => (k.revoked_at ? "" : revoke(k)) },
    ], keys) : empty("No keys yet. Issue one below; it is shown once, so copy it then."),
    h("h3", {}, "Issue a key"), form);
}

const shareFmt = (v) => `${Math.round(Number(v) * 100)}%`;
// A comparison's score back on the judge's 1..10 scale (routing.compare.scaled); 6 or more is acceptable.
const gradeFmt = (s) => h("span", { class: s >= 0.5 ? "ok" : "bad", title: `score ${Number(s).toFixed(3)}` },
  `${Math.round((Number(s) * 9 + 1) * 10) / 10}/10`);

// A head's AUC on compared traffic, and what its interval says about it against a coin toss.
const rankingCell = (r) => {
  if (r.auc === null) return h("span", { title: "needs requests of both kinds: some that only the strong model answered acceptably, some not" }, "not yet");
  const tone = { "better than chance": "ok", "worse than chance": "bad" }[r.verdict] || null;
  return h("span", { class: tone, title: `95% interval ${aucFmt(r.auc_low)} to ${aucFmt(r.auc_high)}` },
    `${aucFmt(r.auc)} (${r.verdict})`);
};

// What the judge said of both candidates' answers (a difficulty route's `compare`), for one tenant.
async function tenantComparisons(tenant) {
  let data;
  try { data = await api(`tenants/${tenant.id}/comparisons?limit=100`); } catch (e) {
    if (e.status === 404) return null; // a gateway older than comparisons
    return h("section", { id: "comparisons", class: "panel" }, h("h2", {}, `Comparisons of ${tenant.name}`), notice(e.message));
  }
  const pair = (c) => `${c.weak_model} vs ${c.strong_model}`;
  return h("section", { id: "comparisons", class: "panel" },
    h("h2", {}, `Comparisons of ${tenant.name}`),
    data.data.length ? [
      table([
        { label: "Route", key: "route" },
        { label: "Weak vs strong", render: pair },
        { label: "Comparisons", num: true, render: (s) => intFmt(s.comparisons) },
        { label: "Weak acceptable", num: true, render: (s) => shareFmt(s.weak_acceptable) },
        { label: "Strong acceptable", num: true, render: (s) => shareFmt(s.strong_acceptable) },
        { label: "Only strong acceptable", num: true, render: (s) => shareFmt(s.only_strong_acceptable) },
      ], data.summary, { caption: "Acceptable: a judge's grade of 6 or more out of 10. Only strong acceptable is the share a difficulty route should send to the strong model." }),
      (data.ranking || []).length ? table([
        { label: "Route", key: "route" },
        { label: "Head", render: (r) => r.head || "(set in code)" },
        { label: "Comparisons", num: true, render: (r) => intFmt(r.comparisons) },
        { label: "Needed strong", num: true, render: (r) => intFmt(r.needs_strong) },
        { label: "Ranking (AUC)", num: true, render: rankingCell },
      ], data.ranking, { caption: "How well each head's score ranked the compared requests: the chance that one which only the strong model answered acceptably scored above one that did not (0.5 is a coin toss), over the latest 5,000 (hover for the 95% interval); a verdict needs 10 of each kind. A head worse than chance sends the wrong requests strong: train one on these comparisons (weir router train --tenant) or route a fixed share." }) : null,
      table([
        { label: "Request", render: (c) => h("code", {}, c.request_id) },
        { label: "Route", render: (c) => `${c.route} (${pair(c)})` },
        { label: "Served", key: "served" },
        { label: "Weak grade", num: true, render: (c) => gradeFmt(c.weak_score) },
        { label: "Strong grade", num: true, render: (c) => gradeFmt(c.strong_score) },
        { label: "Judge", key: "judge" },
        { label: "When (UTC)", render: (c) => timeFmt(c.created_at) },
      ], data.data, { caption: "The most recent comparisons (up to 100), newest first; grades are the judge's, out of 10." }),
    ] : empty(`No comparisons yet. A difficulty route's compare option has a judge grade both candidates' answers to a share of its requests, only for tenants with store_prompts on (docs/routing.md)${tenant.store_prompts ? "" : "; this tenant's store_prompts is off"}.`));
}

// --- backends and models ------------------------------------------------------------------------

async function backends(params, query, show) {
  const days = [...Array(14).keys()].map((i) => addDays(today(), i - 13));
  const [prices, history, uptime, perDay] = await Promise.all([
    api("prices"), api("prices?history=true"),
    api(`reports/uptime?start=${isoDay(days[0])}&end=${isoDay(addDays(today(), 1))}`),
    Promise.all(days.map((d) => api(`reports/uptime?start=${isoDay(d)}&end=${isoDay(addDays(d, 1))}`))),
  ]);
  const names = [...new Set(perDay.flatMap((r) => r.backends.map((b) => b.backend)))];
  const series = names.map((n) => ({
    label: n,
    values: perDay.map((r) => { const b = r.backends.find((x) => x.backend === n); return b ? (b.request_availability ?? b.probe_availability) : null; }),
  }));
  const model = h("input", { name: "model", required: true });
  const backend = h("input", { name: "backend", value: "*" });
  const cls = h("select", { name: "token_class" }, TOKEN_CLASSES.map((c) => h("option", { value: c }, c)));
  // The API's tier names (pricing.TierName), checked here so a typo is said in words, not as a regex.
  const tier = h("input", { name: "service_tier", autocomplete: "off", placeholder: "base price",
    pattern: "[a-z][a-z0-9_\\-]{0,31}", title: "A tier as its vendor names it: lower-case letters, digits, _ or -, such as flex" });
  const usd = h("input", { name: "usd_per_1m_tokens", inputmode: "decimal", required: true });
  const from = h("input", { name: "effective_from", type: "datetime-local" });
  const tokenHint = "As vendors quote it (GPT-4o input: 2.50).";
  const usdField = field("USD per 1M tokens", usd, tokenHint);
  // The price's unit follows the class: a search price is typed as vendors quote it, per 1,000 (10,
  // not 10000), and sent as the field of that unit, whose name an API error then points at.
  const showUnit = () => {
    const unit = PER_REQUEST[cls.value];
    usd.name = unit ? "usd_per_1k_requests" : "usd_per_1m_tokens";
    usdField.querySelector("label").textContent = unit ? `USD per 1,000 ${unit}` : "USD per 1M tokens";
    usdField.querySelector(".hint").textContent = unit ? `As vendors quote it (Anthropic's web search: 10, $10 per 1,000 ${unit}).` : tokenHint;
  };
  cls.addEventListener("change", showUnit);
  showUnit();
  const form = h("form", { class: "inline-form", "aria-label": "Add a price" }, ...formBox(
    field("Model", model, "The upstream model name, as the backend bills it."),
    field("Backend", backend, "* applies to every backend serving the model."),
    field("Token class", cls), usdField,
    field("Service tier", tier, "Empty: the base price. flex, priority...: bills only the attempts served at that tier."),
    field("Effective from (UTC)", from, "Empty: now. Never in the past: history is not re-priced."),
    h("button", { type: "submit" }, "Add price")));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const p = { model: model.value.trim(), backend: backend.value.trim() || "*", token_class: cls.value, [usd.name]: usd.value.trim() };
    if (tier.value.trim()) p.service_tier = tier.value.trim();
    if (from.value) p.effective_from = `${from.value}:00Z`;
    try { await api("prices", { method: "PUT", body: { prices: [p] } }); await route(); } catch (e) {
      formError(form, { ...e, message: e.message, param: e.param ? e.param.replace(/^prices\[\d+\]\./, "") : null });
    }
  });
  const priceCols = [
    { label: "Model", key: "model" }, { label: "Backend", key: "backend" },
    { label: "Token class", key: "token_class" },
    // A tier's price bills only attempts served at that tier: without the column, a flex price read
    // as a second, contradicting base price of the same model.
    { label: "Tier", render: (p) => p.service_tier ?? "base" },
    { label: "Price (USD)", num: true, render: priceFmt },
    { label: "Effective from (UTC)", render: (p) => minuteFmt(p.effective_from) },
  ];
  show("Backends & models",
    h("h2", {}, "Health"),
    uptime.backends.length ? table([
      { label: "Backend", key: "backend" },
      { label: "Probe availability", num: true, render: (b) => pctFmt(b.probe_availability) },
      { label: "Request availability", num: true, render: (b) => pctFmt(b.request_availability) },
      { label: "Attempts", num: true, render: (b) => intFmt(b.attempts) },
    ], uptime.backends, { caption: "Last 14 days" }) : empty("No attempts or health probes recorded in the last 14 days."),
    chart("Uptime per day (successful attempts, else probes)", names.length ? days.map(isoDay) : [], series, { fmt: pctFmt, range: [0, 1] }),
    h("h2", {}, "Prices in effect"),
    prices.data.length ? table(priceCols, prices.data) : empty("No prices yet: add them below or under models[].price in the config. Unpriced models cost $0 in reports."),
    h("h2", {}, "Add a price"), form,
    h("details", {}, h("summary", {}, `Price history (${history.data.length} rows)`), table(priceCols, history.data)),
  );
}

// --- finance ------------------------------------------------------------------------------------

// A report wider than the page (three group-bys at 1280 px) scrolls sideways: style.css keeps its
// first column in view and shades the edge that has more columns beyond it.
const scrolling = (wrap) => { wrap.classList.add("scrolls"); return wrap; };

// A key as the keys list names it ("ci wk-9fs6d1LX", or its prefix alone), its id on hover: the id
// alone is shown nowhere else. A config file's key has only its id.
const keyCell = (r) => (r.key_prefix
  ? h("span", { title: r.key }, r.key_name ? `${r.key_name} ` : "", h("code", {}, r.key_prefix))
  : r.key ?? "");
const GROUP_COLUMNS = {
  tenant: { label: "tenant", render: (r) => r.tenant_name ?? r.tenant ?? "" },
  key: { label: "key", render: keyCell },
};

async function finance(params, query, show) {
  const start = query.get("start") || isoDay(monthStart());
  const end = query.get("end") || isoDay(addDays(today(), 1));
  const groups = (query.get("group_by") || "tenant,model").split(",").filter(Boolean);
  const qs = `start=${encodeURIComponent(start)}&end=${encodeURIComponent(end)}&group_by=${groups.join(",")}`;
  const startIn = h("input", { name: "start", type: "date", value: start, required: true });
  const endIn = h("input", { name: "end", type: "date", value: end, required: true });
  // service_tier: cost by the tier each attempt was served and billed at (flex, priority...); blank
  // where its vendor reported none. The report reads the ledger for it (the rollups keep no tier).
  // route: the public name each request asked for (a route such as `auto`, or a model by its name).
  const boxes = ["tenant", "model", "backend", "day", "key", "service_tier", "route"].map((g) =>
    h("label", { class: "check" }, h("input", { type: "checkbox", name: "group_by", value: g, checked: groups.includes(g) }), ` ${g}`));
  const form = h("form", { class: "inline-form", "aria-label": "Report range" }, ...formBox(
    field("From", startIn), field("To (exclusive)", endIn, "UTC days: the report covers From 00:00 UTC up to, not including, To 00:00 UTC."),
    h("fieldset", {}, h("legend", {}, "Group by"), boxes),
    h("button", { type: "submit" }, "Show report")));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const g = [...form.querySelectorAll("input[name=group_by]:checked")].map((i) => i.value);
    if (!g.length) { formError(form, { message: "Pick at least one thing to group by." }); return; }
    if (endIn.value <= startIn.value) { formError(form, { message: "To must be after From.", param: "end" }); return; }
    go(`#/finance?start=${startIn.value}&end=${endIn.value}&group_by=${g.join(",")}`);
  });
  let report, daily;
  try {
    [report, daily] = await Promise.all([api(`reports/usage?${qs}`), api(`reports/spend-by-class?start=${start}&end=${end}`)]);
  } catch (e) {
    if (e.status !== 400) throw e;
    // A range or grouping the API refuses (a link or bookmark edited by hand: the form checks its
    // own) is said beside the form, which can fix it; "Something went wrong ... Reload the page"
    // reloaded the same refused report.
    if (show("Finance", form)) formError(form, { message: e.message, param: e.param });
    return;
  }
  const spanDays = (Date.parse(end) - Date.parse(start)) / 86400000;
  // A long range is charted as it is: filling years of empty days would not help anyone read it.
  const spendDays = spanDays > 0 && spanDays <= 400 ? fillDays(daily.data, new Date(start + "T00:00:00Z"), new Date(end + "T00:00:00Z")) : daily.data;
  const groupCols = groups.map((g) => GROUP_COLUMNS[g] ?? { label: g, render: (r) => r[g] ?? "" });
  const total = { ...report.totals, tenant_name: "Total", [groups[0]]: "Total" };
  const cols = [...groupCols,
    // Client requests, each once however many attempts it took; attempts count every try (retries,
    // failovers, hedges), each its own ledger row.
    { label: "Requests", num: true, render: (r) => intFmt(r.requests) },
    { label: "Attempts", num: true, render: (r) => intFmt(r.attempts) },
    // Of the attempts: failed, and cancelled (499: hedges that lost, clients that left), which is no error.
    { label: "Errors", num: true, render: (r) => intFmt(r.errors) },
    { label: "Cancelled", num: true, render: (r) => intFmt(r.cancelled) },
    { label: "Input", num: true, render: (r) => intFmt(r.input_tokens) },
    { label: "Cached", num: true, render: (r) => intFmt(r.cached_input_tokens) },
    { label: "Cache write", num: true, render: (r) => intFmt(r.cache_write_tokens) },
    { label: "Output", num: true, render: (r) => intFmt(r.output_tokens) },
    { label: "Web searches", num: true, render: (r) => intFmt(r.web_search_requests || 0) },
    { label: "Cost (USD)", num: true, render: (r) => h("span", { class: "cost", "data-usd": r.cost_usd }, exactUsd(r.cost_usd)) },
    { label: "USD / 1M tokens", num: true, render: (r) => exactUsd(r.cost_per_1m_tokens) },
    { label: "Cache saved", num: true, render: (r) => exactUsd(r.cache_savings_usd) },
  ];
  show("Finance", form,
    h("p", {}, h("a", { class: "button", href: `${API}/reports/usage?${qs}&format=csv`, download: "" }, "Download CSV"),
      " ", h("span", { class: "muted" }, `Source: ${report.source}. Costs are exact decimals from the ledger.`)),
    h("p", { class: "muted" }, "Requests are client requests; attempts are every upstream try (retries, failovers, hedges, and the calls of a comparison, which Weir makes itself), and errors and cancelled are of those. A request is counted once, in the row of its first attempt: a failover's or a retry's other row has only its attempts."),
    report.rows.length ? scrolling(table(cols, report.rows, { foot: total, caption: `Usage ${start} to ${end}` })) : empty("No usage in this range. Widen the dates, or send traffic with a tenant's key."),
    chart("Spend by token class per day (USD)", spendDays.map((r) => r.day),
      TOKEN_CLASSES.map((c) => ({ label: c, values: spendDays.map((r) => (r.cost_usd_by_class || {})[c] || 0) })),
      { stacked: true, fmt: usdFmt }),
  );
}

// --- requests -----------------------------------------------------------------------------------

// The request log reads the newest this many (the API has no further pages): a full page says so.
const LOG_LIMIT = 100;

async function requests(params, query, show) {
  const q = new URLSearchParams();
  for (const k of ["tenant", "model", "status"]) if (query.get(k)) q.set(k, query.get(k));
  q.set("limit", String(LOG_LIMIT));
  const [log, tenantList] = await Promise.all([api(`requests?${q}`), api("tenants")]);
  const tenant = h("select", { name: "tenant" }, h("option", { value: "" }, "all tenants"),
    tenantList.data.map((t) => h("option", { value: t.id, selected: query.get("tenant") === t.id }, t.name)));
  const model = h("input", { name: "model", value: query.get("model") || "", placeholder: "any model or route" });
  const status = h("select", { name: "status" }, [["", "any status"], ["ok", "succeeded"], ["error", "failed"]].map(([v, l]) =>
    h("option", { value: v, selected: (query.get("status") || "") === v }, l)));
  const form = h("form", { class: "inline-form", "aria-label": "Filter requests" }, ...formBox(
    field("Tenant", tenant), field("Model", model), field("Status", status), h("button", { type: "submit" }, "Filter")));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const f = new URLSearchParams();
    if (tenant.value) f.set("tenant", tenant.value);
    if (model.value.trim()) f.set("model", model.value.trim());
    if (status.value) f.set("status", status.value);
    go(`#/requests?${f}`);
  });
  const ok = (a) => a.status >= 200 && a.status < 300;
  // The attempt that answered, as the API picks it: the last that succeeded (a hedge that lost is a
  // later attempt, cancelled).
  const answering = (r) => [...r.attempts].reverse().find(ok) ?? null;
  const attemptsText = (n) => `${n} earlier attempt${n > 1 ? "s" : ""}`;
  // Every token class the attempt's cost is priced from, and whether the gateway estimated them (a cut
  // attempt) rather than its vendor reporting them.
  const tokensText = (a) => {
    const written = (a.cache_write_5m_tokens || 0) + (a.cache_write_1h_tokens || 0);
    const extra = [a.cached_input_tokens ? `cached ${intFmt(a.cached_input_tokens)}` : null,
      written ? `written ${intFmt(written)}` : null,
      a.web_search_requests ? `${intFmt(a.web_search_requests)} web search${a.web_search_requests > 1 ? "es" : ""}` : null].filter(Boolean);
    return `${intFmt(a.input_tokens)}/${intFmt(a.output_tokens)}${extra.length ? ` (${extra.join(", ")})` : ""}${a.estimated ? ", estimated" : ""}`;
  };
  // A call Weir made itself (the API's `purpose`): a difficulty route's comparison asked the other
  // candidate, or its judge graded both answers. An attempt and a cost, but no client's request: the
  // reports' request counts leave it out, so the log says so where it lists it among them.
  const PURPOSES = {
    compare: "Weir's own call: a difficulty route's comparison asked the other candidate the same request",
    judge: "Weir's own call: the judge of a difficulty route's comparison graded both answers",
  };
  const purposeTag = (r) => h("span", { class: "tag own", title: `${PURPOSES[r.purpose] || "Weir's own call"}; its decision says which client request it was for (for=). Billed as an attempt, not counted as a client request.` }, r.purpose);
  const story = (r, won) => {
    if (!won) return `no attempt answered (${r.attempts.length} tried)`;
    const at = `attempt ${won.attempt} on ${won.backend} (${won.model}) answered`;
    if (won === r.attempts[0]) return r.attempts.length > 1 ? `${at}; the later attempts were hedges that lost` : `${at}, its first choice`;
    // An earlier attempt cancelled (499) had not failed: a hedge answered first and it was stopped.
    const earlier = r.attempts.slice(0, r.attempts.indexOf(won));
    const raced = earlier.filter((a) => a.status === 499).length, failed = earlier.length - raced;
    return [failed ? `${at} after ${attemptsText(failed)} failed` : `${at} first, as a hedge`,
      raced ? `${attemptsText(raced)} still under way ${raced > 1 ? "were" : "was"} cancelled` : null].filter(Boolean).join("; ");
  };
  const detail = (r) => { const won = answering(r); return h("details", {}, h("summary", {}, `Why and how: ${r.attempts.length} attempt${r.attempts.length > 1 ? "s" : ""}`),
    h("p", {}, `Route ${r.route}: ${story(r, won)}.`),
    r.routing ? h("p", {}, "Decision: ", h("code", {}, r.routing)) : null,
    table([
      { label: "#", num: true, key: "attempt" }, { label: "Backend", key: "backend" }, { label: "Model", key: "model" },
      { label: "Status", render: (a) => h("span", { class: ok(a) ? "ok" : "bad" }, a.status || "no response", a === won ? " (answered)" : "") },
      { label: "Decision (x-weir-route)", render: (a) => (a.routing ? h("code", {}, a.routing) : "—") },
      { label: "Fallback", render: (a) => (a.fallback ? "yes" : "no") },
      { label: "Latency", num: true, render: (a) => `${intFmt(Math.round(a.latency_ms))} ms` },
      // What a route's ttft_timeout is measured against; streams only.
      { label: "First token", num: true, render: (a) => (a.ttft_ms === null || a.ttft_ms === undefined ? "—" : `${intFmt(Math.round(a.ttft_ms))} ms`) },
      { label: "Tokens in/out", num: true, render: tokensText },
      // The tier its vendor served it at (flex, priority...), whose prices its cost is; "—" where it said none.
      { label: "Tier", render: (a) => a.service_tier || "—" },
      { label: "Cost", num: true, render: (a) => exactUsd(a.cost_usd) },
    ], r.attempts)); };
  show("Requests", form,
    log.data.length ? table([
      { label: "Time (UTC)", render: (r) => r.ts.slice(0, 19).replace("T", " ") },
      { label: "Tenant", render: (r) => r.tenant_name || r.tenant_id || "—" },
      { label: "Route", render: (r) => (r.purpose ? [r.route, " ", purposeTag(r)] : r.route) }, { label: "Model", key: "model" },
      { label: "Status", render: (r) => h("span", { class: r.status >= 200 && r.status < 300 ? "ok" : "bad" }, r.status || "no response") },
      { label: "Cost", num: true, render: (r) => exactUsd(r.cost_usd) },
      { label: "Attempts", num: true, render: (r) => r.attempts.length },
    ], log.data, { detail, caption: log.data.length < LOG_LIMIT ? null
      : `The ${LOG_LIMIT} most recent requests that match, newest first; older ones are not listed: filter by tenant, model or status to reach them, or see Finance for totals.` })
      : empty("No requests match. Clear the filters, or send a request with a tenant's key; the log shows them within seconds."),
  );
}

// --- router -------------------------------------------------------------------------------------

const PAGES = { overview, routes, tenants, backends, finance, requests };

// Renders the page the hash names. True when it was shown, false when a later render (or the sign-in
// form) took its place first.
async function route() {
  if (!csrf) return false;
  const gen = ++generation;
  const show = (title, ...content) => {
    if (gen !== generation) return false;
    page(title, ...content);
    return true;
  };
  const [path, qs] = location.hash.replace(/^#\/?/, "").split("?");
  const [name, ...params] = path.split("/");
  const render = PAGES[name] || overview;
  for (const a of document.querySelectorAll("nav a")) {
    if (a.getAttribute("href") === `#/${name}`) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  try {
    await render(params, new URLSearchParams(qs || ""), show);
  } catch (e) {
    if (e.code === "invalid_session") return false;
    show("Something went wrong", notice(`${e.message} Reload the page to try again.`));
  }
  return gen === generation;
}

window.addEventListener("hashchange", route);

// A form of the page shown that the admin typed into is marked data-typed (a render builds new,
// unmarked ones): what a render of the page would throw away.
main.addEventListener("input", (ev) => ev.target.closest("form")?.setAttribute("data-typed", ""));

// A link to the page already shown changes no hash, so no hashchange renders it: render it here, with
// what the API has now. E.g. a route's Edit link after its save was refused (412) because another
// admin changed it: the form is filled again from the current version. A form typed into is asked
// about first: the same link clicked by habit threw away a route half edited.
main.addEventListener("click", (ev) => {
  const link = ev.target.closest('a[href^="#/"]');
  if (!link || link.getAttribute("href") !== location.hash) return;
  if (ev.button !== 0 || ev.ctrlKey || ev.metaKey || ev.shiftKey || ev.altKey) return; // a new tab or window
  ev.preventDefault();
  if (main.querySelector("form[data-typed]") && !confirm("Discard what you typed and show this page as it is now?")) return;
  route();
});

(async () => {
  try {
    const me = await api("/admin/session");
    csrf = me.csrf;
    enterApp(me.user);
  } catch {
    showSignIn();
  }
})();
