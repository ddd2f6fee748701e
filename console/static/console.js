// Live pages without a build step: an element with data-live is refreshed from that URL (a
// server-rendered HTML fragment) every data-refresh-ms. Open <details> stay open.
(function () {
  "use strict";
  function refresh(region) {
    var open = Array.prototype.map.call(
      region.querySelectorAll("details[open][data-testid]"), function (d) { return d.dataset.testid; });
    fetch(region.dataset.live, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html === null || html === region.dataset.last) { return; }
        region.dataset.last = html;
        region.innerHTML = html;
        open.forEach(function (id) {
          var d = region.querySelector('details[data-testid="' + id + '"]');
          if (d) { d.open = true; }
        });
      })
      .catch(function () { /* the next tick tries again */ });
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-live]").forEach(function (region) {
      var every = parseInt(region.dataset.refreshMs, 10) || 1000;
      setInterval(function () { refresh(region); }, every);
    });
  });
})();
