"""Model picker: the catalog with search and what is on disk, free-form specs, load progress."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
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


class ModelScreen(Screen[None]):
    def __init__(self) -> None:
        super().__init__()
        self.load_busy = False

    @property
    def tui(self) -> TinyVLLMApp:
        return cast("TinyVLLMApp", self.app)

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="model-body"):
            yield Static(HELP, id="model-help")
            yield Input(placeholder="Search the catalog", id="search")
            yield DataTable(id="catalog", cursor_type="row", zebra_stripes=True)
            with Horizontal(id="load-row"):
                yield Input(placeholder="catalog name, hub id, directory or .gguf file", id="spec")
                yield Button("Load", id="load", variant="primary")
            yield ProgressBar(id="progress", show_eta=False)
            yield Static("", id="load-status")
            yield Static("", id="load-error")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("model", "size", "on disk", "description")
        self.query_one(ProgressBar).display = False
        self.refresh_catalog("")
        table.focus()
        if self.tui.initial_model:
            self.query_one("#spec", Input).value = self.tui.initial_model
            self.start_load(self.tui.initial_model)

    # ---- catalog ----------------------------------------------------------------------------
    def refresh_catalog(self, query: str) -> None:
        table = self.query_one(DataTable)
        table.clear()
        try:
            rows = self.tui.backend.catalog(query)
        except Exception as exc:  # a broken catalog must not keep local paths from loading
            self._error(f"Catalog unavailable: {exc}")
            return
        for row in rows:
            table.add_row(*_cells(row), key=row.name)

    @on(Input.Changed, "#search")
    def _search(self, event: Input.Changed) -> None:
        self.refresh_catalog(event.value)

    @on(DataTable.RowHighlighted)
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.row_key.value is not None and not self.load_busy:
            self.query_one("#spec", Input).value = event.row_key.value

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


def _cells(row: CatalogRow) -> tuple[str, str, str, str]:
    name = f"{row.name} (default)" if row.default else row.name
    return name, row.size, f"✓ {row.on_disk}" if row.on_disk else "download", row.description
