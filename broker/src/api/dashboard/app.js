// The Proteus dashboard: three views over the broker's /v1 API, polled while on screen.
//   #/           jobs: state, progress, spend against budget and the two counterfactuals
//   #/jobs/ID    one job: its chart, cost by market and tier, events, instances, cancel
//   #/markets    markets and their price history over a chosen window
// Requests carry the session cookie (HttpOnly, so this script never sees it); changes also
// send the session's CSRF token from the page's <meta>. Data is put into the page as text
// nodes only, never as HTML.
"use strict";

const CSRF = document.querySelector('meta[name="csrf-token"]').content;
const CSRF_HEADER = document.querySelector('meta[name="csrf-header"]').content;
const JOB_POLL_MS = 2000;
const DETAIL_POLL_MS = 5000;
const CHART_POLL_MS = 10000;
const EVENTS_PAGE = 1000;

// --- small helpers ----------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function usd(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return Math.abs(v) >= 100 ? "$" + v.toFixed(2) : "$" + v.toFixed(4);
}
function pct(v) { return (v * 100).toFixed(1) + "%"; }
function when(t) { return t ? t.replace("T", " ").replace("Z", "") : "–"; }
// "42 s", "7 min 05 s", "3 h 07 min", "2 d 04 h", as the CLI writes durations.
function duration(secs) {
  if (secs === null || secs === undefined) return "–";
  const s = Math.max(0, Math.round(secs));
  const two = (n) => String(n).padStart(2, "0");
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + two(s % 60) + " s";
  if (s < 86400) return Math.floor(s / 3600) + " h " + two(Math.floor(s % 3600 / 60)) + " min";
  return Math.floor(s / 86400) + " d " + two(Math.floor(s % 86400 / 3600)) + " h";
}
// Which clock a job's times are on (the simulated cloud's market time is not the wall's).
function clockText(j) {
  return j.clock === "simulated" ? "simulated market time" : "wall time, UTC";
}

class ApiError extends Error {}

async function api(path, options) {
  const opts = Object.assign({ credentials: "same-origin" }, options || {});
  opts.headers = Object.assign({ Accept: "application/json" }, opts.headers || {});
  const r = await fetch(path, opts);
  if (r.status === 401) {
    // The session ended (expired, signed out elsewhere, broker restarted): sign in again.
    location.assign("/");
    throw new ApiError("signed out");
  }
  const body = await r.json().catch(() => null);
  if (!r.ok) throw new ApiError((body && body.message) || r.status + " " + r.statusText);
  return body;
}

function change(path, method) {
  return api(path, { method, headers: { [CSRF_HEADER]: CSRF } });
}

function setStatus(text, bad) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.classList.toggle("bad", !!bad);
}

// Runs `fn` now and every `ms` until the view changes; errors show in the status line.
let generation = 0;
function every(ms, fn) {
  const mine = generation;
  const run = async () => {
    if (mine !== generation) return;
    try {
      await fn();
      setStatus("updated " + new Date().toLocaleTimeString());
    } catch (e) {
      if (!(e instanceof ApiError && e.message === "signed out")) setStatus(e.message, true);
    }
    if (mine === generation) setTimeout(run, ms);
  };
  run();
}

// Swaps an <img> to a fresh copy of its chart once the new one has loaded (no flicker).
function refreshImage(img, url) {
  const next = new Image();
  next.onload = () => {
    img.src = next.src;
    img.dataset.loaded = "1";
  };
  next.src = url + (url.includes("?") ? "&" : "?") + "t=" + Date.now();
}

// A table in a box that scrolls sideways, so a wide table never widens a narrow page.
function table(id, headers, rows) {
  return h("div", { class: "scroll" }, h("table", { id, class: "grid" },
    h("thead", {}, h("tr", {}, headers.map((c) => h("th", {}, c)))),
    h("tbody", {}, rows)));
}

// Why the spend shown may differ from the final cost: the part a provider interruption would
// make free while spot instances run; "(final)" once the job is over and nothing runs.
function spendNote(j) {
  const running = j.instances.some((i) => !i.ended);
  if (!isLive(j.state) && !running) return " (final)";
  if (j.spend_provisional_usd > 0) {
    return " — " + usd(j.spend_provisional_usd) + " of it is provisional: free if the provider " +
      "interrupts the spot instances now running, so the final cost can be lower";
  }
  return "";
}

// " (+3 leaving)" when warned instances still run until they leave; "" otherwise.
function leavingText(j) {
  const n = Object.values(j.leaving_by_tier || {}).reduce((a, b) => a + b, 0);
  return n > 0 ? " (+" + n + " leaving)" : "";
}

function stateBadge(state, id) {
  return h("span", { class: "state state-" + state, id }, state);
}

function bar(fraction, over) {
  const f = Math.max(0, Math.min(1, fraction || 0));
  return h("span", { class: "bar" + (over ? " over" : "") },
    h("span", { class: "fill", style: null, "data-w": f }));
}
// Inline styles are barred by the page's CSP; widths go through the CSSOM instead.
function sizeBars(root) {
  for (const el of root.querySelectorAll(".fill[data-w]")) {
    el.style.width = (Number(el.dataset.w) * 100).toFixed(1) + "%";
  }
}

function counterfactual(cost, policy) {
  if (!cost) return "…";
  const c = (cost.counterfactuals || []).find((x) => x.policy === policy);
  if (!c || c.cost_usd === null || c.cost_usd === undefined) return "–";
  const s = cost.savings ? cost.savings[policy] : undefined;
  const rel = s === undefined ? "" : s >= 0 ? " (" + pct(s) + " cheaper)" : " (" + pct(-s) + " dearer)";
  return usd(c.cost_usd) + rel;
}

function isLive(state) { return state === "pending" || state === "running"; }

// --- jobs ---------------------------------------------------------------------------------

function jobsView(view) {
  const summary = h("p", { class: "summary", id: "jobs-summary" }, "…");
  const holder = h("div", {});
  view.replaceChildren(h("h2", {}, "Jobs"), summary, holder);
  const costs = new Map(); // id -> {cost, at, state}

  every(JOB_POLL_MS, async () => {
    const jobs = await api("/v1/jobs");
    jobs.sort((a, b) => b.id - a.id);
    // Costs run the counterfactual simulations: refreshed every 10 s for live jobs, once
    // for finished ones.
    await Promise.all(jobs.map(async (j) => {
      const c = costs.get(j.id);
      const stale = !c || c.state !== j.state || (isLive(j.state) && Date.now() - c.at > 10000);
      if (stale) {
        try {
          costs.set(j.id, { cost: await api("/v1/jobs/" + j.id + "/cost"), at: Date.now(), state: j.state });
        } catch (e) { /* shown as "…" until the next round */ }
      }
    }));
    const running = jobs.filter((j) => j.state === "running").length;
    const spent = jobs.reduce((s, j) => s + j.spend_usd, 0);
    const onDemand = jobs.reduce((s, j) => {
      const c = costs.get(j.id);
      const cf = c && (c.cost.counterfactuals || []).find((x) => x.policy === "on-demand");
      return s + ((cf && cf.cost_usd) || 0);
    }, 0);
    summary.textContent = jobs.length + " jobs, " + running + " running · spent " + usd(spent) +
      " · the same work on-demand: " + usd(onDemand);
    const rows = jobs.map((j) => {
      const c = costs.get(j.id);
      const budget = j.budget_usd ? " / " + usd(j.budget_usd) : "";
      const metric = j.metric ? j.metric.kind + " " + Number(j.metric.value).toFixed(4) : "–";
      const eta = j.work && j.work.eta;
      return h("tr", { "data-job-id": j.id, "data-state": j.state, class: "job-row" },
        h("td", {}, h("a", { href: "#/jobs/" + j.id, class: "job-link" }, "#" + j.id + " " + j.name)),
        h("td", {}, stateBadge(j.state)),
        h("td", { "data-col": "policy" }, j.policy),
        h("td", { "data-col": "submitted", title: clockText(j) }, when(j.created)),
        h("td", { class: "num", "data-col": "duration" }, duration(j.duration_s)),
        h("td", { "data-col": "eta", title: clockText(j) }, isLive(j.state) ? when(eta) : "–"),
        h("td", { class: "num" }, bar(j.progress), " ", pct(j.progress)),
        h("td", { class: "num" }, usd(j.spend_usd) + budget,
          j.budget_usd ? bar(j.spend_usd / j.budget_usd, j.spend_usd > j.budget_usd) : null),
        h("td", { class: "num" }, counterfactual(c && c.cost, "on-demand")),
        h("td", { class: "num" }, counterfactual(c && c.cost, "standard-bidding")),
        h("td", { class: "num instances" }, (j.instances_by_tier.reliable || 0) + " / " + (j.instances_by_tier.transient || 0) + leavingText(j)),
        h("td", { class: "num" }, j.evictions),
        h("td", {}, metric));
    });
    holder.replaceChildren(jobs.length === 0
      ? h("p", { class: "muted", id: "no-jobs" }, "No jobs yet. Submit one with `proteus submit job.toml`.")
      : table("jobs-table", ["job", "state", "policy", "submitted", "duration", "ETA", "progress", "spend / budget", "vs on-demand",
        "vs standard bidding", "reliable / transient", "evictions", "metric"], rows));
    sizeBars(holder);
  });
}

// --- one job ------------------------------------------------------------------------------

function eventClass(kind) {
  if (/evict/.test(kind)) return "ev-eviction";
  if (/warn|interrupt|rebalance/.test(kind)) return "ev-warning";
  if (/hand|takeover|promot|backup/.test(kind)) return "ev-handover";
  if (/restart|recover|lost|fail|leak/.test(kind)) return "ev-restart";
  return "";
}

function jobView(view, id) {
  const title = h("h2", { id: "job-title" }, "Job " + id);
  const actions = h("div", { class: "actions" });
  const facts = h("dl", { class: "facts", id: "job-facts" });
  const chartUrl = "/v1/jobs/" + id + "/chart";
  const chart = h("img", { id: "job-chart", class: "chart", alt: "spot prices, bids and instances per tier of job " + id });
  const costBox = h("div", { id: "job-cost" });
  const eventsBox = h("div", { id: "job-events" });
  // The event log's filter: every kind seen so far; the choice survives the polls.
  const eventFilter = h("select", { id: "event-filter", "aria-label": "show events of kind" },
    h("option", { value: "" }, "all events"));
  let eventClock = "time";
  const instancesBox = h("div", { id: "job-instances" });
  view.replaceChildren(
    h("p", {}, h("a", { href: "#/" }, "← all jobs")),
    h("div", { class: "job-head" }, title, actions),
    facts,
    h("section", {}, h("h3", {}, "Timeline"),
      h("p", { class: "muted" }, "Spot price of each market the job used, its bids there, on-demand prices, and instances per tier. ",
        h("a", { href: chartUrl + "?format=png", id: "chart-png" }, "PNG")),
      chart),
    h("section", {}, h("h3", {}, "Cost"), costBox),
    h("section", {}, h("div", { class: "section-head" }, h("h3", {}, "Events"),
      h("label", { class: "muted" }, "show ", eventFilter)), eventsBox),
    h("section", {}, h("h3", {}, "Instances"), instancesBox));

  let armed = null;
  const cancelButton = h("button", { id: "cancel", class: "danger", type: "button" }, "Cancel job");
  const cancelMessage = h("span", { id: "cancel-message", class: "muted" });
  cancelButton.addEventListener("click", async () => {
    // Two clicks: the first arms the button for five seconds.
    if (!armed) {
      cancelButton.textContent = "Click again to cancel";
      cancelButton.classList.add("armed");
      armed = setTimeout(() => {
        armed = null;
        cancelButton.textContent = "Cancel job";
        cancelButton.classList.remove("armed");
      }, 5000);
      return;
    }
    clearTimeout(armed);
    armed = null;
    cancelButton.disabled = true;
    cancelButton.textContent = "Cancelling…";
    try {
      const job = await change("/v1/jobs/" + id + "/cancel", "POST");
      cancelMessage.textContent = "job " + job.id + " is " + job.state;
      showJob(job);
    } catch (e) {
      cancelMessage.textContent = "could not cancel: " + e.message;
      cancelButton.disabled = false;
      cancelButton.textContent = "Cancel job";
    }
  });

  let live = true;
  function showJob(j) {
    live = isLive(j.state);
    eventClock = j.clock === "simulated" ? "market time" : "time (UTC)";
    title.replaceChildren("Job " + j.id + " · " + j.name + " ", stateBadge(j.state, "job-state"));
    actions.replaceChildren(live ? cancelButton : null, cancelMessage);
    const metric = j.metric ? j.metric.kind + " " + Number(j.metric.value).toFixed(4) : "–";
    const rows = [
      ["policy", j.policy + " (" + j.billing + ")"],
      ["progress", pct(j.progress)],
      [live ? "spend" : "cost", usd(j.spend_usd) + (j.budget_usd ? " of " + usd(j.budget_usd) + " budget" : "") + spendNote(j)],
      ["instances", (j.instances_by_tier.reliable || 0) + " reliable (on-demand), " + (j.instances_by_tier.transient || 0) + " transient (spot)" + leavingText(j)],
      ["evictions", j.evictions],
      ["stage", j.stage || "–"],
      ["sync", j.sync],
      ["metric", metric],
      ["submitted", when(j.created)],
      ["started", when(j.started)],
      ["finished", when(j.finished)],
      ["duration", duration(j.duration_s)],
      ["ETA", when(j.work && j.work.eta)],
      ["clock", clockText(j)],
      ["state", j.state + (j.state_reason ? " (" + j.state_reason + ")" : "")],
    ];
    if (j.deadline) {
      const w = j.work || {};
      const slack = typeof w.deadline_slack_hours === "number"
        ? ", " + w.deadline_slack_hours.toFixed(1) + " h of slack at full speed" : "";
      const risk = w.deadline_at_risk === true ? " — at risk (the ETA is later)"
        : w.deadline_at_risk === false ? " — on track" : "";
      rows.push(["deadline", when(j.deadline) + slack + risk]);
    }
    if (j.held) rows.push(["held", j.held]);
    facts.replaceChildren(...rows.flatMap(([k, v]) => [h("dt", {}, k), h("dd", { "data-fact": k === "cost" ? "spend" : k }, v)]));
    instancesBox.replaceChildren(j.instances.length === 0 ? h("p", { class: "muted" }, "none yet") :
      table("instances-table", ["instance", "market", "tier", "bid", "state", "launched", "ended", "reason"],
        j.instances.map((i) => h("tr", {},
          h("td", {}, i.id), h("td", {}, i.market), h("td", {}, i.tier),
          h("td", { class: "num" }, i.bid_usd === null ? "–" : usd(i.bid_usd)),
          h("td", {}, i.state), h("td", {}, when(i.launched)), h("td", {}, when(i.ended)),
          h("td", {}, i.end_reason || "")))));
  }

  every(JOB_POLL_MS, async () => showJob(await api("/v1/jobs/" + id)));
  // Events come a page at a time (oldest first): each poll asks only for those after the
  // newest one already shown, following full pages (a few at most per poll).
  const events = [];
  const newEvents = async () => {
    for (let pages = 0; pages < 5; pages++) {
      const after = events.length ? events[events.length - 1].id : 0;
      const page = await api("/v1/jobs/" + id + "/events?after=" + after + "&limit=" + EVENTS_PAGE);
      events.push(...page);
      if (page.length < EVENTS_PAGE) break;
    }
    return events;
  };
  every(DETAIL_POLL_MS, async () => {
    const [cost] = await Promise.all([api("/v1/jobs/" + id + "/cost"), newEvents()]);
    costBox.replaceChildren(
      h("p", { id: "cost-total" }, (live ? "Cost so far " : "Final cost ") + usd(cost.total_usd) + " (" + cost.billing + "), reliable (on-demand) " +
        usd(cost.by_tier.reliable || 0) + ", transient (spot) " + usd(cost.by_tier.transient || 0) +
        "; work received " + cost.work_units.toFixed(2) + " units."),
      cost.work_note ? h("p", { class: "muted" }, cost.work_note) : null,
      table("counterfactuals-table", ["the same work under", "cost", "runtime h", "evictions", "this job saved"],
        cost.counterfactuals.map((c) => h("tr", {},
          h("td", {}, c.policy), h("td", { class: "num" }, usd(c.cost_usd)),
          h("td", { class: "num" }, c.runtime_hours === null ? "–" : c.runtime_hours.toFixed(2)),
          h("td", { class: "num" }, c.evictions === null ? "–" : c.evictions),
          h("td", { class: "num" }, cost.savings[c.policy] === undefined ? (c.note || "–") : pct(cost.savings[c.policy]))))),
      h("h4", {}, "Ledger by market and tier"),
      cost.by_market.length === 0 ? h("p", { class: "muted" }, "nothing billed yet") :
        table("ledger-table", ["market", "tier", "instances", "instance-hours", "cost"],
          cost.by_market.map((m) => h("tr", {},
            h("td", {}, m.market), h("td", {}, m.tier), h("td", { class: "num" }, m.instances),
            h("td", { class: "num" }, m.instance_hours.toFixed(2)), h("td", { class: "num" }, usd(m.usd))))));
    const kinds = [...new Set(events.map((e) => e.kind))].sort();
    const listed = [...eventFilter.options].map((o) => o.value).filter((v) => v);
    if (kinds.join() !== listed.join()) {
      const chosen = eventFilter.value;
      eventFilter.replaceChildren(h("option", { value: "" }, "all events"),
        ...kinds.map((k) => h("option", { value: k }, k)));
      eventFilter.value = chosen;
    }
    showEvents();
  });
  function showEvents() {
    const kind = eventFilter.value;
    const newest = events.filter((e) => !kind || e.kind === kind).reverse();
    eventsBox.replaceChildren(newest.length === 0 ? h("p", { class: "muted" }, events.length ? "no " + kind + " events" : "none yet") :
      table("events-table", [eventClock, "event", "instance", "detail"],
        newest.map((e) => h("tr", { class: eventClass(e.kind), "data-kind": e.kind },
          h("td", {}, when(e.time)), h("td", {}, e.kind), h("td", {}, e.instance_id || ""),
          h("td", {}, e.detail)))));
  }
  eventFilter.addEventListener("change", showEvents);
  // The chart is redrawn while the job runs; once over, it is drawn once more and kept.
  let drawnFinal = false;
  every(CHART_POLL_MS, async () => {
    if (!live && drawnFinal) return;
    drawnFinal = !live;
    refreshImage(chart, chartUrl);
  });
}

// --- markets ------------------------------------------------------------------------------

const WINDOWS = [["6", "6 hours"], ["24", "1 day"], ["168", "1 week"], ["720", "30 days"], ["2160", "90 days"]];

async function marketsView(view) {
  const windowSelect = h("select", { id: "window" },
    WINDOWS.map(([v, label]) => h("option", { value: v, selected: v === "168" }, label)));
  const fromInput = h("input", { type: "date", id: "from" });
  const toInput = h("input", { type: "date", id: "to" });
  const chart = h("img", { id: "market-chart", class: "chart", alt: "spot price history" });
  const message = h("p", { class: "muted", id: "market-message" });
  const listBox = h("div", {});
  view.replaceChildren(
    h("h2", {}, "Markets"),
    h("div", { class: "controls" },
      h("label", {}, "window ", windowSelect),
      h("label", {}, "or from ", fromInput), h("label", {}, " to ", toInput)),
    message, chart, listBox);
  const markets = await api("/v1/markets");
  const selected = new Set(markets.length ? [markets[0].market] : []);
  const draw = () => {
    if (selected.size === 0) {
      message.textContent = "Tick a market to see its price history.";
      chart.removeAttribute("src");
      return;
    }
    const params = new URLSearchParams({ market: [...selected].join(",") });
    if (fromInput.value) {
      params.set("from", fromInput.value);
      if (toInput.value) params.set("to", toInput.value);
    } else {
      params.set("hours", windowSelect.value);
      if (toInput.value) params.set("to", toInput.value);
    }
    message.textContent = "";
    const url = "/v1/markets/chart?" + params;
    // A bad window (e.g. from after to) answers 4xx with a message: show it instead.
    fetch(url, { credentials: "same-origin", method: "GET" }).then(async (r) => {
      if (r.ok) refreshImage(chart, url);
      else message.textContent = ((await r.json().catch(() => null)) || {}).message || r.statusText;
    });
  };
  for (const el of [windowSelect, fromInput, toInput]) el.addEventListener("change", draw);
  listBox.replaceChildren(markets.length === 0 ? h("p", { class: "muted" }, "No prices ingested yet (`proteus prices ingest`).") :
    table("markets-table", ["chart", "market", "type", "spot now", "on-demand", "price changes", "first", "last"],
      markets.map((m) => {
        const box = h("input", { type: "checkbox", checked: selected.has(m.market), "data-market": m.market });
        box.addEventListener("change", () => {
          if (box.checked) {
            if (selected.size >= 8) { box.checked = false; message.textContent = "at most 8 markets at once"; return; }
            selected.add(m.market);
          } else selected.delete(m.market);
          draw();
        });
        return h("tr", {}, h("td", {}, box), h("td", {}, m.market), h("td", {}, m.instance_type),
          h("td", { class: "num" }, m.spot_usd === null ? "–" : usd(m.spot_usd)),
          h("td", { class: "num" }, m.on_demand_usd === null ? "–" : usd(m.on_demand_usd)),
          h("td", { class: "num" }, m.price_changes), h("td", {}, when(m.first)), h("td", {}, when(m.last)));
      })));
  draw();
  setStatus("updated " + new Date().toLocaleTimeString());
}

// --- routing ------------------------------------------------------------------------------

function route() {
  generation += 1;
  const view = document.getElementById("view");
  const hash = location.hash || "#/";
  for (const a of document.querySelectorAll("nav a")) {
    a.classList.toggle("active", hash === a.getAttribute("href") ||
      (a.id === "nav-jobs" && hash.startsWith("#/jobs")));
  }
  const job = hash.match(/^#\/jobs\/(\d+)$/);
  if (job) jobView(view, job[1]);
  else if (hash === "#/markets") marketsView(view).catch((e) => setStatus(e.message, true));
  else jobsView(view);
}

window.addEventListener("hashchange", route);
route();
