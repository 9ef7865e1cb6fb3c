"""What a training run prints, on rank 0 only: per epoch a rich progress bar on a terminal, or plain progress
lines at a steady interval in a log or a pipe; and one line per epoch (:func:`say`)."""

from __future__ import annotations

import time

from vitlab._console import clock, console, progress_interval, say


class Progress:
    """Progress within an epoch (step, loss, images/s, ETA): a live bar on a terminal; elsewhere (a log file, a
    pipe, a cluster job) a plain line on the run's first step and then every
    :func:`~vitlab._console.progress_interval` seconds (across epochs, so short epochs do not double the log),
    so a long epoch is not minutes of silence. Silent when disabled (quiet mode, other ranks). As a context
    manager, leaving it stops a live bar (an epoch that raised leaves no bar, nor a hidden cursor, behind)."""

    def __init__(self, enabled: bool):
        self.live = enabled and console.is_terminal
        self.plain = enabled and not console.is_terminal
        self.interval = progress_interval() if self.plain else 0.0
        self.last_line: float | None = None  # when the last plain line was printed
        self.bar = None

    def start(self, epoch: int, epochs: int, total: int) -> None:
        self.epoch, self.epochs, self.total = epoch, epochs, total
        self.done, self.t0 = 0, time.perf_counter()
        if not self.live:
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
        """One optimiser step done, at ``loss`` and ``img_s`` images/s so far in the epoch."""
        self.done += 1
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=f"loss {loss:.4f}  {img_s:,.0f} img/s")
        if not self.plain:
            return
        now = time.perf_counter()
        if self.last_line is not None and now - self.last_line < self.interval:
            return
        self.last_line = now
        eta = (self.total - self.done) * (now - self.t0) / self.done
        say(f"epoch {self.epoch}/{self.epochs}  step {self.done}/{self.total}  loss {loss:.4f}  "
            f"{img_s:,.0f} img/s  ETA {clock(eta)}")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["Progress", "say"]
