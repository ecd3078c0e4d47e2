// Item page: draw each line's estimate with its interval band (uPlot, vendored).
// Data come from the JSON block #series-data rendered by the server; nothing is fetched.
(function () {
  "use strict";
  function alpha(hex, a) {
    var n = parseInt(hex.slice(1), 16);
    return "rgba(" + ((n >> 16) & 255) + "," + ((n >> 8) & 255) + "," + (n & 255) + "," + a + ")";
  }
  function fmt(v) {
    if (v == null) return "—";
    return Number.isInteger(v) ? String(v) : v.toFixed(1);
  }
  function pad(n) { return (n < 10 ? "0" : "") + n; }
  function utc(ts, withDate) {
    var t = new Date(ts * 1e3);
    var hm = pad(t.getUTCHours()) + ":" + pad(t.getUTCMinutes());
    return withDate ? t.getUTCFullYear() + "-" + pad(t.getUTCMonth() + 1) + "-" + pad(t.getUTCDate()) + " " + hm : hm;
  }
  function init() {
    document.querySelectorAll(".swatch[data-color]").forEach(function (el) {
      el.style.background = el.getAttribute("data-color");
    });
    var host = document.getElementById("chart");
    var src = document.getElementById("series-data");
    if (!host || !src || typeof uPlot === "undefined") return;
    var d = JSON.parse(src.textContent);
    var pct = Math.round(d.confidence * 1000) / 10 + "%";
    var data = [d.x];
    var series = [{ label: "bucket (UTC)" }];
    var bands = [];
    d.lines.forEach(function (ln) {
      var base = data.length;
      data.push(ln.est, ln.lo, ln.hi, ln.zero);
      series.push(
        { label: ln.label, stroke: ln.color, width: 2, points: { show: true, size: 6, fill: ln.color },
          value: function (u, v) { return fmt(v); } },
        { label: ln.label + " lo (" + pct + ")", stroke: alpha(ln.color, 0.45), width: 1, dash: [4, 3],
          points: { show: false }, value: function (u, v) { return fmt(v); } },
        { label: ln.label + " hi (" + pct + ")", stroke: alpha(ln.color, 0.45), width: 1, dash: [4, 3],
          points: { show: false }, value: function (u, v) { return fmt(v); } },
        { label: ln.label + ": interval includes 0", stroke: ln.color, width: 0, paths: function () { return null; },
          points: { show: true, size: 11, width: 2, fill: "#ffffff", stroke: ln.color },
          value: function (u, v) { return v == null ? "" : "yes"; } }
      );
      bands.push({ series: [base + 2, base + 1], fill: alpha(ln.color, 0.18) });
    });
    var readout = document.getElementById("readout");
    function showCursor(u) {
      if (!readout) return;
      var i = u.cursor.idx;
      if (i == null) { readout.textContent = "hover the chart for values"; return; }
      // x is the bucket start (as in the table below the chart); the bucket is [x, x + step)
      var parts = [utc(d.x[i], true) + " – " + utc(d.x[i] + d.step, false) + " UTC"];
      d.lines.forEach(function (ln) {
        var e = ln.est[i];
        parts.push(ln.label + ": " + (e == null ? "no release" :
          fmt(e) + " [" + fmt(ln.lo[i]) + ", " + fmt(ln.hi[i]) + "] @" + pct +
          (ln.zero[i] != null ? " (includes 0)" : "")));
      });
      if (d.partial && d.partial[i]) parts.push("some devices have no release in this bucket");
      readout.textContent = parts.join("   ·   ");
    }
    var drawn = 0;
    var opts = {
      width: Math.max(260, host.clientWidth || 900),
      height: 380,
      series: series,
      bands: bands,
      tzDate: function (ts) { return uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"); },
      scales: { x: { time: true } },
      legend: { show: false },
      axes: [{ values: function (u, splits) {
        var span = splits.length > 1 ? splits[splits.length - 1] - splits[0] : 0;
        return splits.map(function (ts, k) {
          var t = new Date(ts * 1e3);
          var day = t.getUTCFullYear() + "-" + pad(t.getUTCMonth() + 1) + "-" + pad(t.getUTCDate());
          var first = k === 0 || span >= 86400 || (t.getUTCHours() === 0 && t.getUTCMinutes() === 0);
          return first ? utc(ts, false) + "\n" + day : utc(ts, false);
        });
      }, size: 52 }, { label: "estimated count (" + pct + " interval band)", size: 70 }],
      hooks: {
        drawClear: [function (u) {
          // shade buckets that lack releases of some devices (a dip there is missing data)
          var ctx = u.ctx;
          ctx.save();
          ctx.fillStyle = "rgba(255, 193, 7, 0.16)";
          (d.partial || []).forEach(function (p, i) {
            if (!p) return;
            var x0 = u.valToPos(d.x[i], "x", true), x1 = u.valToPos(d.x[i] + d.step, "x", true);
            x0 = Math.max(x0, u.bbox.left);
            x1 = Math.min(x1, u.bbox.left + u.bbox.width);
            if (x1 > x0) ctx.fillRect(x0, u.bbox.top, x1 - x0, u.bbox.height);
          });
          ctx.restore();
        }],
        setCursor: [showCursor],
        draw: [function () {
          drawn += 1;
          host.setAttribute("data-drawn", String(drawn));
          host.setAttribute("data-bands", String(bands.length));
          host.setAttribute("data-points", String(d.x.length));
          host.setAttribute("data-partial", String((d.partial || []).filter(Boolean).length));
        }]
      }
    };
    var plot = new uPlot(opts, data, host);
    window.addEventListener("resize", function () {
      plot.setSize({ width: Math.max(260, host.clientWidth || 900), height: 380 });
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
