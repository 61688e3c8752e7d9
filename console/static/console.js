// oncemill console: the select-all checkbox of the dead letters' and the
// parked messages' lists, and the count of selected rows. Everything works
// without it.
(function () {
  "use strict";
  var all = document.getElementById("select-all");
  var count = document.getElementById("selected-count");
  function boxes() {
    return document.querySelectorAll('input[type=checkbox][name=id][form$="-select-form"]');
  }
  function update() {
    var n = 0, list = boxes();
    for (var i = 0; i < list.length; i++) {
      if (list[i].checked) n++;
    }
    if (count) {
      count.textContent = String(n);
      count.className = n ? "badge processing" : "badge zero";
    }
    if (all) {
      all.checked = list.length > 0 && n === list.length;
      all.indeterminate = n > 0 && n < list.length;
    }
  }
  if (all) {
    all.addEventListener("change", function () {
      var list = boxes();
      for (var i = 0; i < list.length; i++) list[i].checked = all.checked;
      update();
    });
  }
  document.addEventListener("change", function (e) {
    if (e.target && e.target.name === "id") update();
  });
  update();
})();
