// The Overview's live charts: polls the series endpoint once per sampling interval (only the
// points the page lacks), draws each chart as SVG lines over the last hour, and puts the
// server's texts in place: the charts' summaries (their text alternatives), the current values,
// the GPUs' readings. It formats no value itself. Without script the page keeps the texts as
// of loading it; in a hidden tab it stops polling.
"use strict";
(() => {
  const SVG = "http://www.w3.org/2000/svg";
  const WIDTH = 400, HEIGHT = 150, LEFT = 40, RIGHT = 6, TOP = 8, BOTTOM = 18;
  const PLOT_W = WIDTH - LEFT - RIGHT, PLOT_H = HEIGHT - TOP - BOTTOM;
  const container = document.querySelector("[data-series-url]");
  if (container === null) {
    return;
  }
  const url = container.dataset.seriesUrl;
  const status = document.querySelector("[data-charts-status]");
  let series = null; // one array per field, oldest point first
  let seriesId = null; // the server's series: another after a restart
  let lastSeq = -1;
  let intervalS = 5;
  let windowS = 3600;
  let timer = null;
  let polling = false;
  container.classList.add("live");

  async function poll() {
    timer = null;
    polling = true;
    try {
      const query = seriesId === null ? "" : `?series=${seriesId}&after=${lastSeq}`;
      const response = await fetch(url + query, {
        credentials: "same-origin", cache: "no-store", headers: {Accept: "application/json"},
      });
      if (!response.ok) {
        const why = response.status === 401 ? "the session ended; sign in again" : `HTTP ${response.status}`;
        status.textContent = `The charts stopped updating: ${why}.`;
        return; // no retry: reloading the page is the way on
      }
      update(await response.json());
      status.textContent = `Live: one point every ${intervalS} s, last at ${new Date().toLocaleTimeString()}. ` +
        "Latency percentiles are estimated from the metrics' histogram buckets.";
    } catch (error) {
      status.textContent = `The charts are not updating (${error.message}); retrying.`;
    } finally {
      polling = false;
    }
    schedule();
  }

  function schedule() {
    if (!document.hidden && timer === null && !polling) {
      timer = setTimeout(poll, intervalS * 1000);
    }
  }

  document.addEventListener("visibilitychange", () => {
    if (document.hidden) {
      clearTimeout(timer);
      timer = null;
    } else if (timer === null && !polling) {
      poll();
    }
  });

  function update(body) {
    intervalS = body.interval_s;
    windowS = body.window_s;
    if (body.reset || series === null) {
      series = body.series;
    } else {
      for (const [name, values] of Object.entries(body.series)) {
        series[name].push(...values);
      }
    }
    seriesId = body.series_id;
    lastSeq = body.last_seq;
    const times = series.time;
    const oldest = times.length ? times[times.length - 1] - windowS : 0;
    const drop = times.findIndex((t) => t > oldest);
    if (drop > 0) {
      for (const values of Object.values(series)) {
        values.splice(0, drop);
      }
    }
    for (const figure of container.querySelectorAll("figure[data-chart]")) {
      draw(figure);
    }
    putTexts(body);
  }

  function putTexts(body) {
    for (const [key, text] of Object.entries(body.summaries)) {
      const element = document.querySelector(`[data-summary="${key}"]`);
      if (element !== null) {
        element.textContent = text;
      }
    }
    for (const element of document.querySelectorAll("[data-current]")) {
      const text = body.current[element.dataset.current];
      if (text !== undefined) {
        element.textContent = text;
      }
    }
    const meter = document.querySelector("meter[data-meter]");
    if (meter !== null && body.kv_cache_usage !== null) {
      meter.value = body.kv_cache_usage;
    }
    for (const gpu of body.gpus) {
      for (const field of ["utilization", "memory", "temperature", "cc_mode"]) {
        const cell = document.querySelector(`[data-gpu="${gpu.index}"][data-field="${field}"]`);
        if (cell !== null) {
          cell.textContent = gpu[field];
        }
      }
    }
    const note = document.querySelector("[data-gpu-note]");
    if (note !== null && body.gpu_note !== null) {
      note.textContent = body.gpu_note;
    }
  }

  // Each line of a chart: its values scaled for display, null where there is none.
  function linesOf(figure) {
    const scale = Number(figure.dataset.scale);
    const scaled = (v) => (v === null || v === undefined ? null : v * scale);
    const fields = figure.dataset.fields.split(" ");
    if (!figure.hasAttribute("data-per-gpu")) {
      return fields.map((field) => series[field].map(scaled));
    }
    const column = series[fields[0]];
    const numGpus = Math.max(0, ...column.map((values) => values.length));
    return Array.from({length: numGpus}, (_, gpu) => column.map((values) => scaled(values[gpu])));
  }

  function draw(figure) {
    const svg = figure.querySelector("svg");
    const lines = linesOf(figure);
    const times = series.time;
    const end = times.length ? times[times.length - 1] : Date.now() / 1000;
    const highest = Math.max(0, ...lines.flat().filter((v) => v !== null));
    const top = figure.dataset.top ? Number(figure.dataset.top) : niceCeiling(highest);
    const x = (t) => LEFT + ((t - (end - windowS)) / windowS) * PLOT_W;
    const y = (v) => TOP + PLOT_H - (Math.min(v, top) / top) * PLOT_H;
    const parts = [];
    for (const fraction of [0, 0.5, 1]) {
      const at = TOP + PLOT_H - fraction * PLOT_H;
      parts.push(element("line", {class: "grid", x1: LEFT, x2: WIDTH - RIGHT, y1: at, y2: at}));
      parts.push(element("text", {class: "axis", x: LEFT - 4, y: at + 3, "text-anchor": "end"},
        shortNumber(top * fraction)));
    }
    for (const [label, t, anchor] of [["−60 min", end - windowS, "start"], ["−30 min", end - windowS / 2, "middle"], ["now", end, "end"]]) {
      parts.push(element("text", {class: "axis", x: x(t), y: HEIGHT - 4, "text-anchor": anchor}, label));
    }
    lines.forEach((values, index) => {
      let d = "";
      let drawing = false;
      values.forEach((value, i) => {
        if (value === null) {
          drawing = false;
          return;
        }
        const point = `${x(times[i]).toFixed(1)} ${y(value).toFixed(1)}`;
        // A point alone (after a gap) shows as a dot: a line of almost no length, round caps.
        d += drawing ? ` L${point}` : ` M${point} l0.01 0`;
        drawing = true;
      });
      parts.push(element("path", {class: `series line-${index % 8}`, d: d.trim() || "M0 0"}));
    });
    svg.replaceChildren(...parts);
    svg.dataset.seq = String(lastSeq);
  }

  function element(name, attributes, text) {
    const node = document.createElementNS(SVG, name);
    for (const [key, value] of Object.entries(attributes)) {
      node.setAttribute(key, String(value));
    }
    if (text !== undefined) {
      node.textContent = text;
    }
    return node;
  }

  // The smallest of 1, 2, 5 × a power of ten at or above `value` (1 at least).
  function niceCeiling(value) {
    if (!(value > 0)) {
      return 1;
    }
    const power = 10 ** Math.floor(Math.log10(value));
    return [1, 2, 5, 10].map((step) => step * power).find((step) => step >= value);
  }

  function shortNumber(value) {
    if (value >= 1e6) {
      return `${+(value / 1e6).toPrecision(3)}M`;
    }
    if (value >= 1e4) {
      return `${+(value / 1e3).toPrecision(3)}k`;
    }
    return String(+value.toPrecision(3));
  }

  poll();
})();
