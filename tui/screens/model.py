"""Model picker: the catalog with search and what is on disk, free-form specs, load progress."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from rich.text import Text
from textual import events, on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Header, Input, ProgressBar, Static

from tinyvllm_tui.backend import CatalogRow, LoadError, LoadProgress
from tinyvllm_tui.messages import LoadFailed, ModelLoaded

if TYPE_CHECKING:
    from tinyvllm_tui.app import TinyVLLMApp

HELP = (
    "Pick a catalog entry (Enter loads it) or type a catalog name, a hub id, a local directory "
    "or a .gguf file below."
)
# Cells the description column cannot use: its own padding (2) and the table's scrollbar (2).
DESCRIPTION_MARGIN = 4


class CatalogTable(DataTable[object]):
    """The catalog rows. It has the focus at start (arrows pick a row); printable keys and
    pastes are posted as `Typed` for the model field instead of being dropped."""

    class Typed(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def on_key(self, event: events.Key) -> None:
        if event.is_printable and event.character:
            event.stop()
            event.prevent_default()
            self.post_message(self.Typed(event.character))

    def on_paste(self, event: events.Paste) -> None:
        text = " ".join(event.text.split())  # a name is one line
        if text:
            event.stop()
            self.post_message(self.Typed(text))


class ModelScreen(Screen[None]):
    def __init__(self) -> None:
        super().__init__()
        self.load_busy = False
        self._width = 0  # the width the descriptions were cut for

    @property
    def tui(self) -> TinyVLLMApp:
        return cast("TinyVLLMApp", self.app)

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="model-body"):
            yield Static(HELP, id="model-help")
            yield Input(placeholder="Search the catalog", id="search")
            yield CatalogTable(id="catalog", cursor_type="row", zebra_stripes=True)
            yield Static("", id="catalog-empty")
            with Horizontal(id="load-row"):
                # No select-all on focus: keys sent here from the table must add up.
                yield Input(
                    placeholder="catalog name, hub id, directory or .gguf file",
                    id="spec",
                    select_on_focus=False,
                )
                yield Button("Load", id="load", variant="primary")
            yield ProgressBar(id="progress", show_eta=False)
            yield Static("", id="load-status")
            yield Static("", id="load-error")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(ProgressBar).display = False
        self.query_one("#catalog-empty").display = False
        self.refresh_catalog("")
        self.query_one(DataTable).focus()
        if self.tui.initial_model:
            self.query_one("#spec", Input).value = self.tui.initial_model
            self.start_load(self.tui.initial_model)

    # ---- catalog ----------------------------------------------------------------------------
    def refresh_catalog(self, query: str) -> None:
        table = self.query_one(DataTable)
        table.clear(columns=True)
        table.add_columns(*COLUMNS)
        try:
            rows = self.tui.backend.catalog(query)
        except Exception as exc:  # a broken catalog must not keep local paths from loading
            self._error(f"Catalog unavailable: {exc}")
            return
        self._width = self.query_one("#model-body").content_size.width
        for row, cells in zip(rows, table_cells(rows, self._width), strict=True):
            table.add_row(*cells, key=row.name)
        empty = self.query_one("#catalog-empty", Static)
        empty.display = not rows and bool(query.strip())
        if empty.display:
            empty.update(
                f"No catalog model matches {query.strip()!r}: type a hub id, a local directory "
                "or a .gguf file below."
            )

    def on_resize(self) -> None:
        if self.query_one("#model-body").content_size.width != self._width:
            table = self.query_one(DataTable)
            row = table.cursor_row
            self.refresh_catalog(self.query_one("#search", Input).value)
            table.move_cursor(row=row)

    def on_catalog_table_typed(self, message: CatalogTable.Typed) -> None:
        # Typing over the table starts a new name in the model field (Enter then loads what was
        # typed, not the highlighted row); the keys of the same burst that the terminal had
        # already sent to the table follow it there.
        spec = self.query_one("#spec", Input)
        if self.focused is not spec:
            spec.value = ""
            self.set_focus(spec)  # at once, not after the queued keys as focus() would
        spec.insert_text_at_cursor(message.text)

    @on(Input.Changed, "#search")
    def _search(self, event: Input.Changed) -> None:
        self.refresh_catalog(event.value)

    @on(DataTable.RowHighlighted)
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        spec = self.query_one("#spec", Input)
        if self.focused is spec:
            return  # never overwrite what is being typed (a resize rebuilds the table)
        if event.row_key.value is not None and not self.load_busy:
            spec.value = event.row_key.value

    @on(DataTable.RowSelected)
    def _selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value is not None:
            self.start_load(event.row_key.value)

    @on(Input.Submitted, "#spec")
    @on(Button.Pressed, "#load")
    def _load_pressed(self) -> None:
        self.start_load(self.query_one("#spec", Input).value)

    # ---- loading ----------------------------------------------------------------------------
    def start_load(self, spec: str) -> None:
        if self.load_busy:
            self.notify("A model is already loading.", severity="warning")
            return
        self.load_busy = True
        self._error("")
        bar = self.query_one(ProgressBar)
        bar.display = True
        bar.update(total=None, progress=0)
        self._status(f"Resolving {spec.strip() or 'the default model'}…")
        self.query_one("#load", Button).disabled = True
        self._load(spec)

    @work(thread=True, exclusive=True, group="load")
    def _load(self, spec: str) -> None:
        # Resolution, download and engine construction block for seconds to minutes: keep them
        # off the event loop and report back through call_from_thread / post_message.
        def progress(p: LoadProgress) -> None:
            self.app.call_from_thread(self._show_progress, p)

        try:
            loaded = self.tui.backend.load(spec, progress)
        except LoadError as exc:
            self.post_message(LoadFailed(spec, str(exc)))
        except Exception as exc:  # anything else is a bug, but it must still be shown
            self.post_message(LoadFailed(spec, f"{type(exc).__name__}: {exc}"))
        else:
            self.post_message(ModelLoaded(loaded))

    def _show_progress(self, p: LoadProgress) -> None:
        bar = self.query_one(ProgressBar)
        if p.total:
            bar.update(total=p.total, progress=p.done or 0)
        else:
            bar.update(total=None)
        self._status(p.line())

    def _finish_load(self) -> None:
        self.load_busy = False
        self.query_one(ProgressBar).display = False
        self.query_one("#load", Button).disabled = False

    def on_model_loaded(self, message: ModelLoaded) -> None:
        self._finish_load()
        loaded = message.loaded
        self._status(f"Loaded {loaded.name} in {loaded.seconds:.1f} s.")

    def on_load_failed(self, message: LoadFailed) -> None:
        self._finish_load()
        self._status("")
        self._error(message.error)

    def _status(self, text: str) -> None:
        self.query_one("#load-status", Static).update(text)

    def _error(self, text: str) -> None:
        error = self.query_one("#load-error", Static)
        error.update(text)
        error.display = bool(text)


COLUMNS = ("model", "size", "on disk", "description")
# Below this many cells for the descriptions, "on disk" says only ✓ to make room.
MIN_DESCRIPTION = 24


def table_cells(rows: list[CatalogRow], width: int) -> list[tuple[str, str, str, Text]]:
    """The catalog's cells for a table `width` cells wide: descriptions cut with an ellipsis
    to the room left (DataTable would crop them mid-word, or scroll sideways)."""
    room = 0
    for compact in (False, True):
        cells = [_cells(row, compact) for row in rows]
        widths = [max([len(c[i]) for c in cells] + [len(COLUMNS[i])]) + 2 for i in range(3)]
        room = width - sum(widths) - DESCRIPTION_MARGIN
        if room >= MIN_DESCRIPTION:
            break
    room = max(room, len(COLUMNS[-1]))
    return [(*c, _ellipsis(row.description, room)) for row, c in zip(rows, cells, strict=True)]


def _cells(row: CatalogRow, compact: bool) -> tuple[str, str, str]:
    name = f"{row.name} (default)" if row.default else row.name
    if not row.on_disk:
        return name, row.size, "download"
    return name, row.size, "✓" if compact else f"✓ {row.on_disk}"


def _ellipsis(text: str, width: int) -> Text:
    return Text(text if len(text) <= width else text[: width - 1].rstrip() + "…")
