// tidelog console: small progressive enhancements; every page works without script.
// Filters a table's rows as you type, for tables with data-filter="<input id>".
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll("table[data-filter]").forEach(function (table) {
    var input = document.getElementById(table.getAttribute("data-filter"));
    if (!input) return;
    input.addEventListener("input", function () {
      var needle = input.value.trim().toLowerCase();
      table.querySelectorAll("tbody tr").forEach(function (row) {
        var name = (row.getAttribute("data-name") || "").toLowerCase();
        row.hidden = needle !== "" && name.indexOf(needle) < 0;
      });
    });
  });
});
