"""The terminal view of a run: one line per published round, as it is published."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from islands.core.config import RunConfig
from islands.storage.manifest import Manifest


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def loss_text(loss: float | None) -> str:
    """A held-out loss as shown; None for a round not evaluated (yet, or at all: eval_every)."""
    return "—" if loss is None else f"{loss:.4f}"


class ProgressView:
    def __init__(self, run: str, console: Console | None = None):
        self.run = run
        self.console = console or Console(highlight=False, soft_wrap=True)

    def header(self, newest: Manifest, config: RunConfig) -> None:
        slow = ", ".join(f"{r}×{f:g}" for r, f in config.speed.items()) or "none"
        if config.min_step_s:
            slow += "; steps of at least " + ", ".join(f"{r} {s:.3g} s" for r, s in config.min_step_s.items())
        self.console.print(
            f"[bold]{self.run}[/]: {config.num_learners} learners in {', '.join(config.regions)} "
            f"(slowed: {slow}); H={config.inner_steps}, Q_min={config.quorum.min_quorum}, "
            f"{config.end_rule()}; round {newest.round} eval loss {loss_text(newest.eval_loss)}"
        )
        self.console.print(
            f"[dim]{'round':>5}  {'closed by':<12} {'wait s':>6}  {'eval loss':>9}  {'in':>8}  contributors (learner@staleness)[/]"
        )

    def round(self, s: dict) -> None:
        line = (
            f"{s['round']:>5}  {s['closed_by']:<12} {s['waited_s']:>6.1f}  {loss_text(s['eval_loss']):>9}  "
            f"{mb(s['bytes_in']):>8}  {s['learners']}"
        )
        if s["excluded"]:
            line += f"  [yellow]excluded: {len(s['excluded'])}[/]"
        self.console.print(line)

    def note(self, line: str) -> None:
        """An event between the round lines: a learner died, was relaunched or given up."""
        self.console.print(f"[yellow]{self.run}: {escape(line)}[/]")

    def footer(self, summary: dict) -> None:
        c = self.console
        if summary.get("failed"):
            c.print(f"[bold red]failed[/]: {escape(summary['failed'])}")
        c.print(
            f"[bold green]done[/]: {summary['rounds_published']} rounds in {summary['wall_s']:.0f} s; eval loss "
            f"{loss_text(summary['eval_loss_round0'])} (round 0) → {loss_text(summary['eval_loss_final'])}"
        )
        c.print(f"checkpoints: {summary['checkpoints']}")
        for region, b in summary["bytes"].items():
            c.print(f"  {region:<14} wrote {mb(b['written']):>9}  read {mb(b['read']):>9}")
