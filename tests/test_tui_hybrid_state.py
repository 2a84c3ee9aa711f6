"""The TUI shows hybrid models' recurrent state: snapshot blocks in the block map, state slots
and hits in the stats panel."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from dataclasses import replace

from tinyvllm.stats import BlockInfo
from tinyvllm_tui.scripted import frozen_stats
from tinyvllm_tui.widgets.block_map import snapshot_cells
from tinyvllm_tui.widgets.stats_panel import fmt_prefix


def test_snapshot_cells_follow_the_folding() -> None:
    blocks = [BlockInfo(i, "cached", 0, ()) for i in range(6)]
    blocks[4] = BlockInfo(4, "cached", 0, (), state_snapshot=True)
    assert snapshot_cells(blocks, 1) == [False] * 4 + [True, False]
    assert snapshot_cells(blocks, 4) == [False, True]
    assert snapshot_cells([], 3) == []


def test_stats_panel_shows_state_slots_only_for_hybrids() -> None:
    stats = frozen_stats()
    assert "state" not in fmt_prefix(stats)
    hybrid = replace(
        stats, state_running_slots=8, state_running_slots_used=3, state_snapshot_slots=16,
        state_snapshots_cached=5, state_hits=12,
    )  # fmt: skip
    assert fmt_prefix(hybrid).endswith("state slots 3/8 · snapshots 5/16 · state hits 12")
