"""A one-row bar chart of a rate over time, with zero at the bottom.

Textual's Sparkline scales between the data's minimum and maximum, so one sample, or samples
that are all equal (an idle engine: all zero), draw as a row of full-height bars. Here the
scale starts at zero, so zero is a flat baseline, and ends at the largest value plus the mean:
a steady rate is a row at half height (not a wall), a burst rises well above its surroundings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

BARS = "▁▂▃▄▅▆▇█"


def cell_values(values: Sequence[float], width: int) -> list[float]:
    """The value each of `width` cells shows, the newest at the right. Fewer values than cells
    are stretched over the row (so the picture does not depend on how many samples there are
    yet); more show the latest `width`. No data reads as zero."""
    shown = list(values[-width:]) if width > 0 else []
    if not shown:
        return [0.0] * max(width, 0)
    return [shown[i * len(shown) // width] for i in range(width)]


def bar_chars(values: Sequence[float], width: int) -> str:
    """`values` (oldest first) as `width` bar characters on a scale from zero; zero (or no
    data) is the lowest bar."""
    cells = cell_values(values, width)
    top = max(cells, default=0.0) + sum(cells) / max(len(cells), 1)
    return "".join(_bar(value, top) for value in cells)


def _bar(value: float, top: float) -> str:
    if value <= 0 or top <= 0:
        return BARS[0]
    level = math.ceil(value / top * len(BARS))
    return BARS[min(max(level, 1), len(BARS)) - 1]


class RateBars(Widget):
    """`data` drawn with `bar_chars`; zero cells in the `rate-bars--zero` style."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"rate-bars--bar", "rate-bars--zero"}
    DEFAULT_CSS = """
    RateBars {
        height: 1;
    }
    """

    data: reactive[list[float]] = reactive(list, always_update=True)

    def render(self) -> Text:
        width = self.content_size.width
        cells = cell_values(self.data, width)
        bar = self.get_component_rich_style("rate-bars--bar")
        zero = self.get_component_rich_style("rate-bars--zero")
        text = Text(no_wrap=True, overflow="crop")
        for value, char in zip(cells, bar_chars(self.data, width), strict=True):
            text.append(char, style=bar if value > 0 else zero)
        return text
