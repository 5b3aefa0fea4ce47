"""Sorting and paging the console's tables, by query parameters (`sort`, `order`, `page`), so
that they work without script and a sorted page can be bookmarked."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

PAGE_SIZE = 25


@dataclass(frozen=True, slots=True)
class TablePage(Generic[T]):
    rows: Sequence[T]
    sort: str
    descending: bool
    page: int
    num_pages: int
    num_rows: int

    def order_for(self, column: str) -> str:
        """The order a click on `column`'s header asks for: the other one if it is sorted by
        it, else ascending."""
        return "asc" if column != self.sort or self.descending else "desc"

    def aria_sort(self, column: str) -> str:
        if column != self.sort:
            return "none"
        return "descending" if self.descending else "ascending"


def sort_and_page(
    rows: Sequence[T],
    keys: Mapping[str, Callable[[T], Any]],
    params: Mapping[str, str],
    default_sort: str,
    *,
    default_descending: bool = False,
    page_size: int = PAGE_SIZE,
) -> TablePage[T]:
    """The page of `rows` that `params` asks for, sorted by one of `keys` (an unknown column
    or page number falls back to the default and the first page)."""
    sort = params.get("sort", default_sort)
    if sort not in keys:
        sort = default_sort
    order = params.get("order")
    descending = default_descending if order not in ("asc", "desc") else order == "desc"
    ordered = sorted(rows, key=keys[sort], reverse=descending)
    num_pages = max(1, -(-len(ordered) // page_size))
    page_text = params.get("page", "1")
    page = int(page_text) if page_text.isdigit() else 1
    page = min(max(page, 1), num_pages)
    start = (page - 1) * page_size
    return TablePage(
        ordered[start : start + page_size], sort, descending, page, num_pages, len(ordered)
    )
