"""What a training run prints: a rich progress bar per epoch and one line per epoch, on rank 0 only."""

from __future__ import annotations

from vitlab._console import console


class Progress:
    """A progress bar per epoch (ETA, loss, images/s); silent when disabled (quiet mode, other ranks, no tty)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and console.is_terminal
        self.bar = None

    def start(self, epoch: int, epochs: int, total: int) -> None:
        if not self.enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        self.bar = Bar(TextColumn(f"epoch {epoch}/{epochs}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                       TextColumn("{task.fields[info]}"), console=console, transient=True)
        self.bar.start()
        self.task = self.bar.add_task("train", total=total, info="")

    def update(self, loss: float, img_s: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=f"loss {loss:.4f}  {img_s:,.0f} img/s")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def say(msg: str) -> None:
    """One line to the console, flushed so a log file gets each epoch as it happens."""
    console.print(msg, highlight=False, markup=False)
    console.file.flush()
