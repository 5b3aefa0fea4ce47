"""Sorting and paging the console's tables from query parameters."""

from __future__ import annotations

from appliance.console.table import sort_and_page

ROWS = [{"name": f"n{i:02}", "size": (i * 7) % 10} for i in range(30)]
KEYS = {"name": lambda r: r["name"], "size": lambda r: r["size"]}


def test_default_sort_and_first_page() -> None:
    table = sort_and_page(ROWS, KEYS, {}, "name", page_size=10)
    assert [r["name"] for r in table.rows] == [f"n{i:02}" for i in range(10)]
    assert (table.page, table.num_pages, table.num_rows) == (1, 3, 30)
    assert table.aria_sort("name") == "ascending" and table.aria_sort("size") == "none"
    assert table.order_for("name") == "desc" and table.order_for("size") == "asc"


def test_sort_by_another_column_descending_and_a_later_page() -> None:
    table = sort_and_page(ROWS, KEYS, {"sort": "size", "order": "desc", "page": "3"}, "name",
                          page_size=10)  # fmt: skip
    assert table.page == 3 and table.descending
    assert [r["size"] for r in table.rows] == sorted((r["size"] for r in ROWS), reverse=True)[20:]


def test_unknown_column_order_or_page_falls_back_to_the_defaults() -> None:
    for params in ({"sort": "secret"}, {"order": "sideways"}, {"page": "-1"}, {"page": "x"}):
        table = sort_and_page(ROWS, KEYS, params, "name", page_size=10)
        assert (table.sort, table.descending, table.page) == ("name", False, 1)
    assert sort_and_page(ROWS, KEYS, {"page": "99"}, "name", page_size=10).page == 3


def test_empty_table_has_one_empty_page() -> None:
    table = sort_and_page([], KEYS, {}, "name")
    assert (table.rows, table.page, table.num_pages) == ([], 1, 1)
