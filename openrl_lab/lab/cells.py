"""Cell boundaries for a `ResidentState` in an IPython kernel: what `%openrl resident` and `%openrl autophase` install.

A cell whose code names a registered variable is marked as using the state (pre_run_cell -> `begin_cell`,
post_run_cell -> `end_cell`), so a job that starts waiting between phases has the state moved after that cell,
never in its middle. Other cells are not marked: a cell that waits for something else (a thread that itself
waits for the group) must not hold the eviction up. Code that reaches the state only through a function
defined elsewhere is not seen; if it runs while the state is evicted, the module's forward and the optimizer's
step refuse (SwapStateError) rather than compute on placeholders. With autophase on, a marked cell runs as one
phase (entered before the cell, ended after it, also when it raised), so cells need no `%%openrl phase`.
"""

from __future__ import annotations

import ast
import contextlib

from openrl_lab.lab.resident import ResidentState


class _CellFailed(Exception):
    """Carries a cell's error into the phase's release (the cell's traceback was shown by IPython already)."""


class CellHooks:
    def __init__(self, shell, state: ResidentState):
        self.shell = shell
        self.state = state
        self.autophase = False
        self._phase = None  # the phase autophase opened for the running cell
        self._marked = []  # per running cell (cells nest: `%%openrl phase` runs its body as a cell): marked?

    def install(self) -> None:
        self.shell.events.register("pre_run_cell", self.pre_run_cell)
        self.shell.events.register("post_run_cell", self.post_run_cell)

    def uninstall(self) -> None:
        for name, fn in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
            with contextlib.suppress(ValueError):
                self.shell.events.unregister(name, fn)

    def uses_state(self, raw_cell: str) -> bool:
        """Whether the cell's code (magics transformed away) names a registered variable."""
        try:
            tree = ast.parse(self.shell.transform_cell(raw_cell))
        except (SyntaxError, ValueError):
            return False  # IPython will report it; no phase for a cell that cannot run
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        return not names.isdisjoint(self.state.objects)

    def pre_run_cell(self, info) -> None:
        uses = self.uses_state(info.raw_cell or "")
        self._marked.append(uses)
        if uses:
            self.state.begin_cell()
        if self.autophase and uses and self._phase is None and not self.state._in_phase:
            phase = self.state.phase(kind="cell")
            phase.__enter__()  # waits for the group and restores the state before the cell runs
            self._phase = phase

    def post_run_cell(self, result) -> None:
        phase, self._phase = self._phase, None
        try:
            if phase is not None:
                err = result.error_in_exec or result.error_before_exec
                if err is None:
                    phase.__exit__(None, None, None)
                else:
                    e = _CellFailed(f"{type(err).__name__}: {err}")
                    phase.__exit__(_CellFailed, e, None)
        finally:
            if self._marked and self._marked.pop():
                self.state.end_cell()


def run_cell_as_phase(shell, state: ResidentState, cell: str, kind: str = "cell"):
    """`%%openrl phase` on a kernel with registered state: the cell runs as one phase of the state's job. A
    cell that raises ends its phase as failed (its traceback is shown as usual, once)."""
    try:
        with state.phase(kind=kind) as report:
            result = shell.run_cell(cell)
            err = result.error_in_exec or result.error_before_exec
            if err is not None:
                raise _CellFailed(f"{type(err).__name__}: {err}")
    except _CellFailed:
        pass
    return report
