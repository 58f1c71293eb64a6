// The reader's progress through the chapters, kept in the browser's localStorage.
//
// docs/progress.md holds a list inside <div class="mv-progress" data-storage-key="...">, one
// <li data-chapter="NN"> per chapter. This script puts a tick box in front of every item, a
// bar and a count above the list, and saves the ticked chapter ids as a JSON array under the
// storage key. Without JavaScript the page is a plain list of chapters.
//
// Material for MkDocs can swap pages without a full reload (the navigation.instant feature);
// it then announces every new page on its `document$` observable. Subscribing to it covers
// both cases: it also fires once for the first page. Without Material we wait for the DOM.
(function () {
  "use strict";

  var STYLE_ID = "mv-progress-style";
  var CSS = [
    // Material indents lists with `[dir=ltr] .md-typeset ul li`; match its weight to undo it.
    "[dir] .md-typeset .mv-progress ul, [dir] .md-typeset .mv-progress ul li { list-style: none; margin-left: 0; padding-left: 0; }",
    ".mv-progress__item { display: flex; gap: 0.6em; align-items: baseline; cursor: pointer; }",
    ".mv-progress__item input { width: 1.05em; height: 1.05em; accent-color: var(--md-accent-fg-color); cursor: pointer; }",
    ".mv-progress__summary { display: flex; flex-wrap: wrap; gap: 0.5em 1em; align-items: center; margin: 1em 0; }",
    ".mv-progress__bar { flex: 1 1 12em; height: 0.7em; border-radius: 0.35em; overflow: hidden;",
    "  background: var(--md-default-fg-color--lightest); }",
    ".mv-progress__fill { height: 100%; width: 0; background: var(--md-accent-fg-color); transition: width 0.2s; }",
    ".mv-progress__count { font-weight: 700; }",
    ".mv-progress__reset { font: inherit; font-size: 0.8em; padding: 0.1em 0.6em; cursor: pointer;",
    "  color: var(--md-default-fg-color--light); background: none;",
    "  border: 1px solid var(--md-default-fg-color--lighter); border-radius: 0.2em; }",
    ".mv-progress__note { color: var(--md-default-fg-color--light); font-size: 0.8em; width: 100%; }",
  ].join("\n");

  // localStorage can be missing or refuse writes (some private modes, file:// pages, full
  // quota). Then the boxes still tick, but only until the page is left; we say so.
  function loadDone(key) {
    try {
      var parsed = JSON.parse(window.localStorage.getItem(key) || "[]");
      return Array.isArray(parsed) ? parsed.map(String) : [];
    } catch (error) {
      return [];
    }
  }

  function saveDone(key, done) {
    try {
      window.localStorage.setItem(key, JSON.stringify(done));
      return true;
    } catch (error) {
      return false;
    }
  }

  function addStyleOnce() {
    if (document.getElementById(STYLE_ID)) return;
    var style = document.createElement("style");
    style.id = STYLE_ID;
    style.textContent = CSS;
    document.head.appendChild(style);
  }

  function element(tag, className, text) {
    var node = document.createElement(tag);
    if (className) node.className = className;
    if (text) node.textContent = text;
    return node;
  }

  function setUpTracker(container) {
    // With instant navigation the same page can be shown again; build it only once per DOM.
    if (container.dataset.mvReady) return;
    container.dataset.mvReady = "1";

    var key = container.dataset.storageKey || "minivllm.progress";
    var items = Array.prototype.slice.call(container.querySelectorAll("li[data-chapter]"));
    var done = loadDone(key);

    var summary = element("div", "mv-progress__summary");
    var bar = element("div", "mv-progress__bar");
    var fill = element("div", "mv-progress__fill");
    var count = element("span", "mv-progress__count");
    var reset = element("button", "mv-progress__reset", "Clear all ticks");
    var note = element("span", "mv-progress__note");
    bar.setAttribute("role", "progressbar");
    bar.setAttribute("aria-label", "Chapters done");
    bar.setAttribute("aria-valuemin", "0");
    bar.setAttribute("aria-valuemax", String(items.length));
    reset.type = "button";
    bar.appendChild(fill);
    summary.appendChild(bar);
    summary.appendChild(count);
    summary.appendChild(reset);
    summary.appendChild(note);
    container.insertBefore(summary, container.firstChild);

    var boxes = items.map(function (item) {
      var chapter = item.dataset.chapter;
      var box = element("input");
      box.type = "checkbox";
      box.value = chapter;
      box.checked = done.indexOf(chapter) !== -1;
      box.setAttribute("aria-label", "Chapter " + chapter + " done");
      // Wrap the item's content in a <label>, so a click on the chapter's name ticks it too
      // (a click on the link inside still follows the link).
      var label = element("label", "mv-progress__item");
      while (item.firstChild) label.appendChild(item.firstChild);
      label.insertBefore(box, label.firstChild);
      item.appendChild(label);
      return box;
    });

    function update() {
      var ticked = boxes.filter(function (box) { return box.checked; });
      var percent = items.length ? (100 * ticked.length) / items.length : 0;
      fill.style.width = percent + "%";
      bar.setAttribute("aria-valuenow", String(ticked.length));
      count.textContent = ticked.length + " of " + items.length + " chapters done";
      return ticked.map(function (box) { return box.value; });
    }

    function save() {
      var saved = saveDone(key, update());
      note.textContent = saved ? "" : "This browser does not let the page store data: your ticks will be lost when you leave.";
    }

    boxes.forEach(function (box) { box.addEventListener("change", save); });
    reset.addEventListener("click", function () {
      if (!window.confirm("Clear every tick on this page?")) return;
      boxes.forEach(function (box) { box.checked = false; });
      save();
    });
    update();
  }

  function onPage() {
    var trackers = document.querySelectorAll(".mv-progress");
    if (!trackers.length) return;
    addStyleOnce();
    Array.prototype.forEach.call(trackers, setUpTracker);
  }

  if (typeof window.document$ !== "undefined" && typeof window.document$.subscribe === "function") {
    window.document$.subscribe(onPage);
  } else if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", onPage);
  } else {
    onPage();
  }
})();
