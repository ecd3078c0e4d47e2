// Quantiles page: the estimated CDF with its interval band and the chosen quantiles with their
// CDF intervals (uPlot, vendored). Data come from the JSON block #cdf-data rendered by the server.
(function () {
  "use strict";
  var BLUE = "#1f77b4", RED = "#d62728";
  function fmt(v, k) { return v == null ? "—" : v.toFixed(k == null ? 4 : k); }
  function rd(v) { return v == null ? "—" : String(Math.round(v * 1e6) / 1e6); }
  function init() {
    document.querySelectorAll(".swatch[data-color]").forEach(function (el) {
      el.style.background = el.getAttribute("data-color");
    });
    var host = document.getElementById("cdf-chart");
    var src = document.getElementById("cdf-data");
    if (!host || !src || typeof uPlot === "undefined") return;
    var d = JSON.parse(src.textContent);
    var pct = Math.round(d.confidence * 1000) / 10 + "%";
    var qs = d.quantiles || [];
    var data = [d.x, d.cdf, d.lo, d.hi];
    var series = [
      { label: "reading below" },
      { label: "CDF", stroke: BLUE, width: 2, points: { show: d.x.length <= 80, size: 4, fill: BLUE } },
      { label: "lo (" + pct + ")", stroke: "rgba(31,119,180,0.45)", width: 1, dash: [4, 3], points: { show: false } },
      { label: "hi (" + pct + ")", stroke: "rgba(31,119,180,0.45)", width: 1, dash: [4, 3], points: { show: false } }
    ];
    var readout = document.getElementById("readout");
    function showCursor(u) {
      if (!readout) return;
      var i = u.cursor.idx;
      if (i == null) { readout.textContent = "hover the chart for values"; return; }
      readout.textContent = "F(< " + rd(d.x[i]) + ") = " + fmt(d.cdf[i]) + "  [" + fmt(d.lo[i]) + ", " +
        fmt(d.hi[i]) + "] @" + pct;
    }
    var drawn = 0;
    var opts = {
      width: Math.max(260, host.clientWidth || 900),
      height: 380,
      series: series,
      bands: [{ series: [3, 2], fill: "rgba(31,119,180,0.18)" }],
      scales: { x: { time: false }, y: { range: [0, 1] } },
      legend: { show: false },
      axes: [{ label: "reading", size: 50 }, { label: "fraction of events below (" + pct + " band)", size: 70 }],
      hooks: {
        setCursor: [showCursor],
        draw: [function (u) {
          // the chosen quantiles: a dashed guide at y = q, a marker at the estimate, a whisker over its interval
          var ctx = u.ctx;
          ctx.save();
          qs.forEach(function (q) {
            var x = u.valToPos(q.x, "x", true);
            if (x < u.bbox.left - 1 || x > u.bbox.left + u.bbox.width + 1) return;
            var yq = u.valToPos(q.q, "y", true), y = u.valToPos(q.cdf, "y", true);
            var ylo = u.valToPos(q.lo, "y", true), yhi = u.valToPos(q.hi, "y", true);
            ctx.strokeStyle = "rgba(214,39,40,0.5)";
            ctx.lineWidth = 1;
            ctx.setLineDash([5, 4]);
            ctx.beginPath();
            ctx.moveTo(u.bbox.left, yq);
            ctx.lineTo(x, yq);
            ctx.lineTo(x, u.bbox.top + u.bbox.height);
            ctx.stroke();
            ctx.setLineDash([]);
            ctx.strokeStyle = RED;
            ctx.lineWidth = 2.5;
            ctx.beginPath();
            ctx.moveTo(x, ylo); ctx.lineTo(x, yhi);
            ctx.moveTo(x - 6, ylo); ctx.lineTo(x + 6, ylo);
            ctx.moveTo(x - 6, yhi); ctx.lineTo(x + 6, yhi);
            ctx.stroke();
            ctx.fillStyle = RED;
            ctx.beginPath();
            ctx.arc(x, y, 5, 0, 2 * Math.PI);
            ctx.fill();
            // the CDF rises to the right: the label goes up and to the left of its marker, on white
            var txt = q.label + " " + q.reading;
            ctx.font = "bold 13px system-ui, sans-serif";
            var w = ctx.measureText(txt).width;
            var tx = Math.max(u.bbox.left + 2, x - 12 - w), ty = Math.max(u.bbox.top + 16, y - 12);
            ctx.fillStyle = "rgba(255,255,255,0.85)";
            ctx.fillRect(tx - 3, ty - 13, w + 6, 17);
            ctx.fillStyle = RED;
            ctx.fillText(txt, tx, ty);
          });
          ctx.restore();
          drawn += 1;
          host.setAttribute("data-drawn", String(drawn));
          host.setAttribute("data-points", String(d.x.length));
          host.setAttribute("data-quantiles", String(qs.length));
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
