// Tables built from <template>s: one template per table (its <thead>), one per row. Sortable tables
// have <button data-sort="key"> in their headers; clicking sorts by that key, again reverses.

import { el, fromTemplate } from "./dom.js";

/** A table from `templateId`, with an empty-state row helper and sorting by `keys` (key -> value of a row). */
export class DataTable {
  constructor(templateId, { keys = {}, sort = null, descending = false, onSort = null } = {}) {
    this.table = fromTemplate(templateId);
    this.body = this.table.querySelector("tbody");
    this.columns = this.table.querySelectorAll("thead th").length;
    this.keys = keys;
    this.sortKey = sort;
    this.descending = descending;
    this.onSort = onSort;
    this.rows = null;
    for (const button of this.table.querySelectorAll("thead button[data-sort]")) {
      button.addEventListener("click", () => {
        const key = button.dataset.sort;
        this.descending = this.sortKey === key ? !this.descending : button.dataset.first === "desc";
        this.sortKey = key;
        if (this.onSort) this.onSort();
        if (this.rows) this.render(this.rows, this.renderRow, this.emptyText);
      });
    }
  }

  /** Rows through `renderRow(row) -> <tr>`, sorted; `emptyText` when there are none (null rows: loading). */
  render(rows, renderRow, emptyText) {
    this.rows = rows;
    this.renderRow = renderRow;
    this.emptyText = emptyText;
    this.markSorted();
    if (!rows || !rows.length) {
      const text = rows ? emptyText : "Loading…";
      this.body.replaceChildren(el("tr", { class: "empty-row" }, el("td", { colspan: this.columns, text })));
      return;
    }
    this.body.replaceChildren(...this.sorted(rows).map(renderRow));
  }

  sorted(rows) {
    const key = this.keys[this.sortKey];
    if (!key) return rows;
    const sign = this.descending ? -1 : 1;
    return [...rows].sort((a, b) => {
      const x = key(a);
      const y = key(b);
      if (x == null && y == null) return 0;
      if (x == null) return 1;
      if (y == null) return -1;
      if (typeof x === "string" || typeof y === "string") return sign * String(x).localeCompare(String(y));
      return sign * (x - y);
    });
  }

  markSorted() {
    for (const th of this.table.querySelectorAll("thead th")) {
      const button = th.querySelector("button[data-sort]");
      if (!button) continue;
      const active = button.dataset.sort === this.sortKey;
      if (active) th.setAttribute("aria-sort", this.descending ? "descending" : "ascending");
      else th.removeAttribute("aria-sort");
    }
  }
}
