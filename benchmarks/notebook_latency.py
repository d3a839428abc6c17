"""How long a researcher waits for the first point of a live plot, and what each plot update costs the page.

    .venv/bin/python benchmarks/notebook_latency.py [--trials 3] [--think 0,10] [--seconds 20] [--json OUT]

In a real JupyterLab in Debian's Chromium (the browser tests' harness: tests/browser/jupyterlab.py), against a
real control plane started here (a temporary home; warmed with one lease first, so that the base model is loaded
as on a lab that has been up a while), each trial opens a notebook in a fresh browser context (a fresh page:
plotly's widget module loads again) and a fresh OpenRL kernel, waits `think` seconds after the kernel is idle
(0: Run at once, as Run All does; 10: a user reading the first cell), then presses Shift+Enter on

    [0] %openrl lease bench-N --rank 2
    [1] plot = run.plot(["reward", "loss"], hz=5); display(plot)
        for step in range(...): run.log(step, ...); time.sleep(0.2)      # a 5 Hz loop, `seconds` long

(Shift+Enter twice: cell 1 queued behind cell 0). Measured in the page (performance.now()):
* first point: from the first Shift+Enter to the first frame in which the rendered plot holds a point
  (plotly's `gd.data[0].x` non-empty and its trace drawn): what the researcher sees;
* main-thread time per update: Chromium's own count of main-thread task time (CDP Performance.getMetrics
  `TaskDuration`) over a window of the running loop, minus the same page's idle rate over an equal window after
  the loop, divided by the plot updates plotly drew in that window (`plotly_restyle` events on the graph div);
  `_raw`: without subtracting the idle rate (an upper bound: everything the page did in the window).
Kernel-side, cell 0 prints how long `%openrl lease` took.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.browser.jupyterlab import LabUnderTest, NotebookPage, launch_chromium  # noqa: E402
from tests.browser.plot_helpers import write_notebook  # noqa: E402

LEASE = """import time as _t
_t0 = _t.perf_counter()
%openrl lease bench-{i} --rank 2
print(f"LEASE_S {{_t.perf_counter() - _t0:.3f}}")"""

LOOP = """import math, time
from IPython.display import display
plot = run.plot(["reward", "loss"], hz=5)
display(plot)
for step in range({steps}):
    run.log(step, reward=1 - math.exp(-step / 30), loss=math.exp(-step / 40))
    time.sleep(0.2)"""

# Installed before the first Shift+Enter: a frame loop that notes when the plot first holds a drawn point, and a
# counter of the updates plotly draws.
WATCH = """() => {
  window.__bench = {first: null, updates: 0, hooked: false};
  const tick = () => {
    const gd = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .js-plotly-plot');
    if (gd && !window.__bench.hooked && gd.on) {
      gd.on('plotly_restyle', () => { window.__bench.updates += 1; });
      window.__bench.hooked = true;
    }
    if (gd && window.__bench.first === null && gd.data && gd.data.length && gd.data[0].x && gd.data[0].x.length
        && gd.querySelector('.scatterlayer .trace')) {
      window.__bench.first = performance.now();
    }
    if (window.__bench.first === null || !window.__bench.hooked) requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
  return performance.now();
}"""


def _task_s(cdp) -> float:
    return next(m["value"] for m in cdp.send("Performance.getMetrics")["metrics"] if m["name"] == "TaskDuration")


def trial(chromium, lab: LabUnderTest, i: int, think: float, seconds: float) -> dict:
    steps = int(seconds * 5) + 25
    path = f"bench-{i}.ipynb"
    write_notebook(lab.root / path, [LEASE.format(i=i), LOOP.format(steps=steps), f"%openrl release bench-{i}"])
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    try:
        page = context.new_page()
        page.set_default_timeout(180_000)
        nbp = NotebookPage(page, lab, path + "?reset").open()
        time.sleep(think)
        t0 = page.evaluate(WATCH)
        nbp.run_cell(0)
        page.keyboard.press("Shift+Enter")  # cell 1, queued behind the lease
        page.wait_for_function("() => window.__bench.first !== null && window.__bench.hooked", timeout=180_000)
        first_s = (page.evaluate("() => window.__bench.first") - t0) / 1000
        lease_s = float(nbp.output_text(0).split("LEASE_S")[1].split()[0])

        cdp = context.new_cdp_session(page)
        cdp.send("Performance.enable")
        time.sleep(2)  # past the first updates (layout, first trace draws)
        window = max(4.0, seconds - 8)
        u0, c0, w0 = page.evaluate("() => window.__bench.updates"), _task_s(cdp), time.monotonic()
        time.sleep(window)
        u1, c1, w1 = page.evaluate("() => window.__bench.updates"), _task_s(cdp), time.monotonic()
        nbp.wait_for_cell(1, timeout=180_000)
        time.sleep(2)
        c2, w2 = _task_s(cdp), time.monotonic()
        time.sleep(window)
        c3, w3 = _task_s(cdp), time.monotonic()
        idle_rate = (c3 - c2) / (w3 - w2)
        updates = u1 - u0
        busy = (c1 - c0) - idle_rate * (w1 - w0)
        nbp.run_cell(2)
        nbp.wait_for_cell(2)
        return {
            "trial": i,
            "think_s": think,
            "first_point_s": round(first_s, 3),
            "lease_s": lease_s,
            "updates": updates,
            "update_hz": round(updates / (w1 - w0), 2),
            "main_thread_ms_per_update": round(1000 * busy / max(updates, 1), 2),
            "main_thread_ms_per_update_raw": round(1000 * (c1 - c0) / max(updates, 1), 2),
            "main_thread_ms_per_s_idle": round(1000 * idle_rate, 2),
        }
    finally:
        context.close()
        for k in lab.api("GET", "api/kernels").json():
            lab.api("DELETE", f"api/kernels/{k['id']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=3, help="trials per think time")
    ap.add_argument("--think", default="0,10", help="seconds between the kernel's first idle and Run (comma list)")
    ap.add_argument("--seconds", type=float, default=20, help="length of the 5 Hz loop")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    from openrl_lab.lab import Lab
    from openrl_lab.server import LabServer

    rows = []
    with tempfile.TemporaryDirectory(prefix="openrl-notebook-latency-") as tmp_name:
        tmp = Path(tmp_name)
        with LabServer(tmp / "home") as server:
            warm = Lab.connect(server.base_url, api_key=server.api_key)
            warm.lease("warm-up", rank=2)
            warm.release("warm-up")
            warm.close()
            with LabUnderTest(tmp / "jupyterlab", server.home) as lab, sync_playwright() as p:
                chromium = launch_chromium(p)
                i = 0
                for think in [float(x) for x in args.think.split(",")]:
                    for _ in range(args.trials):
                        row = trial(chromium, lab, i, think, args.seconds)
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                        i += 1
                chromium.close()
    for think in sorted({r["think_s"] for r in rows}):
        rs = [r for r in rows if r["think_s"] == think]
        print(
            f"think {think:g} s: first point median {statistics.median(r['first_point_s'] for r in rs):.2f} s "
            f"(min {min(r['first_point_s'] for r in rs):.2f}, max {max(r['first_point_s'] for r in rs):.2f}); "
            f"%openrl lease median {statistics.median(r['lease_s'] for r in rs):.2f} s; main thread per update "
            f"median {statistics.median(r['main_thread_ms_per_update'] for r in rs):.2f} ms at "
            f"{statistics.median(r['update_hz'] for r in rs):.1f} updates/s"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
