"""KV-cache block map: one cell per block, or per group of blocks when there are many."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from rich.style import Style
from rich.text import Text
from textual.geometry import Size
from textual.reactive import reactive
from textual.widget import Widget

if TYPE_CHECKING:
    from tinyvllm.stats import BlockInfo

CELL = "■ "  # two columns, so a cell looks square in most terminal fonts
# Hybrid models: a cell holding a block whose prefix has a recurrent-state snapshot.
SNAPSHOT_CELL = "◆ "
FREE = "free"
CACHED = "cached"
# In-use cells take their request's colour; ids beyond the palette reuse colours in order.
REQUEST_COLOURS = (
    "#f4a259",
    "#ff5c8a",
    "#9bc53d",
    "#e55934",
    "#c879ff",
    "#fde74c",
    "#d4a373",
    "#00c49a",
)


def group_cells(blocks: Sequence[BlockInfo], max_cells: int) -> tuple[int, list[str]]:
    """Fold blocks into at most `max_cells` cells: (blocks per cell, key of each cell).

    A cell's key is the request owning most of its in-use blocks, else "cached" if any block
    still holds reusable KV, else "free": in-use wins because it is what the user watches.
    """
    if not blocks:
        return 1, []
    per_cell = max(1, -(-len(blocks) // max(1, max_cells)))
    keys = []
    for start in range(0, len(blocks), per_cell):
        owners: dict[str, int] = {}
        cached = False
        for info in blocks[start : start + per_cell]:
            if info.state == "used":
                # A block shared by several requests (prefix hit) counts for its first owner.
                owner = info.request_ids[0] if info.request_ids else "?"
                owners[owner] = owners.get(owner, 0) + 1
            elif info.state == CACHED:
                cached = True
        if owners:
            keys.append(max(owners, key=owners.__getitem__))
        else:
            keys.append(CACHED if cached else FREE)
    return per_cell, keys


def snapshot_cells(blocks: Sequence[BlockInfo], per_cell: int) -> list[bool]:
    """Per cell (as `group_cells` folds them): whether any of its blocks ends a prefix with a
    cached recurrent-state snapshot (hybrid models)."""
    return [
        any(info.state_snapshot for info in blocks[start : start + per_cell])
        for start in range(0, len(blocks), per_cell)
    ]


class BlockMap(Widget):
    """Grid of KV blocks coloured free / cached / in use (per request), with a legend line."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "blockmap--free",
        "blockmap--cached",
        "blockmap--legend",
    }

    blocks: reactive[tuple[BlockInfo, ...]] = reactive((), layout=True)

    def __init__(self, max_rows: int = 8, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.max_rows = max_rows
        # Colour per request id, stable while the request holds blocks.
        self._colours: dict[str, str] = {}
        self._next_colour = 0

    def _per_row(self, width: int | None = None) -> int:
        return max(1, (width if width is not None else self.size.width) // len(CELL))

    def _layout(self, width: int | None = None) -> tuple[int, list[str]]:
        return group_cells(self.blocks, self._per_row(width) * self.max_rows)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        _, keys = self._layout(width)
        per_row = self._per_row(width)
        legend = 2 if self._layout(width)[0] > 1 else 1
        return max(1, -(-len(keys) // per_row)) + legend

    def colour_of(self, request_id: str) -> str:
        if request_id not in self._colours:
            self._colours[request_id] = REQUEST_COLOURS[self._next_colour % len(REQUEST_COLOURS)]
            self._next_colour += 1
        return self._colours[request_id]

    def render(self) -> Text:
        per_cell, keys = self._layout()
        per_row = self._per_row()
        free = self.get_component_rich_style("blockmap--free")
        cached = self.get_component_rich_style("blockmap--cached")
        legend_style = self.get_component_rich_style("blockmap--legend")
        live = [k for k in dict.fromkeys(keys) if k not in (FREE, CACHED)]
        for gone in set(self._colours) - set(live):
            del self._colours[gone]
        styles = {FREE: free, CACHED: cached}
        styles.update({rid: Style(color=self.colour_of(rid)) for rid in live})
        text = Text(no_wrap=True, overflow="crop")
        if not keys:
            text.append("no engine\n", style=legend_style)
        snapshots = snapshot_cells(self.blocks, per_cell)
        for i, key in enumerate(keys):
            if i and i % per_row == 0:
                text.append("\n")
            text.append(SNAPSHOT_CELL if snapshots[i] else CELL, style=styles[key])
        text.append("\n")
        text.append("■", style=free)
        text.append(" free  ", style=legend_style)
        text.append("■", style=cached)
        text.append(" cached  ", style=legend_style)
        if any(snapshots):
            text.append("◆", style=cached)
            text.append(" state snapshot  ", style=legend_style)
        for rid in live[:3]:
            text.append("■", style=styles[rid])
            text.append(f" {rid[:10]}  ", style=legend_style)
        if per_cell > 1:
            text.append(f"\n1 cell = {per_cell} blocks", style=legend_style)
        return text
