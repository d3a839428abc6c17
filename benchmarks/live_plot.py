"""What a LivePlot costs a training loop: 5 Hz updates of a plot holding 10,000+ points per metric.

    .venv/bin/python benchmarks/live_plot.py [--prefill 10000] [--steps 750] [--work-ms 2] [--hz 5]
        [--max-points 2000] [--max-cpu-share 0.005] [--rounds 16] [--in-process]

The loop runs inside a real ipykernel started with jupyter_client (KernelManager + BlockingKernelClient), so
the plot's comm messages really go out on iopub; a client thread here drains iopub as a frontend's server
would (its CPU use competes for the same two cores, as jupyter_server's would), counting messages and bytes.

One step = `--work-ms` of pure-Python arithmetic (calibrated in the kernel; no numpy/torch) plus computing
three metric values. Without the plot the step stops there; with it the step also calls
`plot.append(step, reward=..., loss=..., kl=...)` on a displayed `LivePlot(hz=5, max_points=2000)` that
already holds `--prefill` steps of history (10,000 steps x 3 metrics, replayed with `extend` before the
timer starts). So every flush during the timed steps does the steady-state work of a long run: copy
10,000+ points per trace, downsample to 2,000, send 3 x 2,000 points. Many short runs in pairs, in ABBA
order (without/with, with/without, ...), so that the machine's background load and any drift hit both alike.
Nothing is timed per step inside the loop: a `time.thread_time()` per step cost the with-plot runs ~10%
by itself on this VM (it is a syscall here), so only whole runs are timed.

Reported, each as a ratio within this one run:
* wall overhead = (t_with - t_without) / t_without, pooled, median and quartiles of pairs: the goal's
  measure (< 1%), at the mercy of whatever else the machine runs;
* kernel CPU overhead = (cpu_with - cpu_without) / cpu_without, the kernel process's CPU time (all its
  threads: loop, flusher, ipykernel's iopub and ZMQ threads);
* accounted cost = (appends, timed alone, x steps + the flusher thread's CPU + the extra CPU of ipykernel's
  Python threads) / the loop thread's CPU without a plot: the direct cost, much less noisy;
* the flusher's flush rate and CPU per flush (`LivePlot.stats`), iopub message and byte rates.
`--in-process` runs the same loop in this process without a kernel (comms go nowhere): for comparison only.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Runs in the kernel (or, with --in-process, here). `OUT` is a file each call writes its result to.
KERNEL_CODE = textwrap.dedent("""
    import gc, json, math, sys, threading, time
    sys.path.insert(0, __ROOT__)
    from openrl_lab.lab.widgets import LivePlot
    try:
        from IPython.display import display
    except ImportError:
        display = lambda obj: None

    def _work(k):
        s = 0
        for i in range(k):
            s += (i * i) % 7
        return s

    def _calibrate(work_ms):
        k = 20000
        times = []
        for _ in range(7):
            t = time.perf_counter(); _work(k); times.append(time.perf_counter() - t)
        per = min(times) / k  # the least disturbed sample: steps stay >= work_ms when the machine calms down
        return max(1, int(work_ms / 1000 / per))

    def _save(out, res):
        with open(out, "w") as f:
            json.dump(res, f)

    def bench_setup(out, work_ms, hz, max_points, max_cpu_share):
        global K, OPTS
        OPTS = dict(hz=hz, max_points=max_points, max_cpu_share=max_cpu_share)
        K = _calibrate(work_ms)
        LivePlot(["x"], autostart=False).close()  # import plotly, build one widget: not part of any run
        _save(out, dict(k=K, python=sys.version.split()[0]))

    def _thread_cpu():
        # CPU seconds of every Python thread in the kernel, at ns resolution (Linux: per-thread CPU clocks).
        out = {}
        for t in threading.enumerate():
            try:
                out[t.ident] = (t.name, time.clock_gettime(time.pthread_getcpuclockid(t.ident)))
            except (OSError, AttributeError, OverflowError):
                pass
        return out

    def _values(step):
        return dict(reward=math.sin(step / 300.0), loss=1.0 / (1.0 + step), kl=0.01 * (step % 97))

    def bench_run(out, steps, with_plot, prefill):
        gc.collect()
        plot = None
        if with_plot:
            plot = LivePlot(["reward", "loss", "kl"], title="bench", **OPTS)
            plot.extend([dict(step=s, **_values(s)) for s in range(prefill)])  # the history so far
            display(plot)
            s0 = plot.stats
        time.sleep(0.5)  # both runs: lets the client finish reading the widget's 5 MB comm_open first
        th0 = _thread_cpu()
        t0, c0 = time.perf_counter(), time.process_time()
        for step in range(prefill, prefill + steps):
            _work(K)
            reward = math.sin(step / 300.0)
            loss = 1.0 / (1.0 + step)
            kl = 0.01 * (step % 97)
            if plot is not None:  # not timed per call: a thread_time() per step here cost the run ~10% itself
                plot.append(step, reward=reward, loss=loss, kl=kl)
        t, cpu = time.perf_counter() - t0, time.process_time() - c0
        th1 = _thread_cpu()
        main, flusher = threading.main_thread().ident, plot._thread.ident if plot is not None else None
        threads = {k: (v[0], th1[k][1] - v[1]) for k, v in th0.items() if k in th1}
        res = dict(with_plot=with_plot, t=t, cpu=cpu, steps=steps, 
                   loop_cpu=threads.get(main, ("", 0.0))[1],
                   other_cpu=sum(c for k, (n, c) in threads.items() if k not in (main, flusher)))
        if plot is not None:
            s1 = plot.stats  # the flushes during the timed loop (not the one at display, nor the one at stop)
            res.update(flushes=s1["flushes"] - s0["flushes"], flush_cpu_s=s1["flush_cpu_s"] - s0["flush_cpu_s"],
                       points_per_trace=len(plot), last_sent=s1["last_sent"], errors=s1["errors"])
            plot.close()
        _save(out, res)

    def bench_append(out, n):
        plot = LivePlot(["reward", "loss", "kl"], autostart=False)
        t = time.perf_counter()
        for i in range(n):
            plot.append(i, reward=0.5, loss=0.25, kl=0.125)
        _save(out, dict(append_us=(time.perf_counter() - t) / n * 1e6))
        plot.close()
""")


class KernelRunner:
    """A real ipykernel; iopub drained by a thread that counts messages and bytes (as a frontend would)."""

    def __init__(self):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(ROOT), env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.counts = {"msgs": 0, "comm_msgs": 0, "comm_bytes": 0, "open_bytes": 0}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._drain = threading.Thread(target=self._drain_iopub, daemon=True)
        self._drain.start()

    def _drain_iopub(self):
        while not self._stop.is_set():
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                continue
            kind = msg["header"]["msg_type"]
            size = sum(len(b) for b in msg.get("buffers") or ())
            if kind == "comm_msg":  # small JSON next to the binary buffers
                size += len(json.dumps(msg["content"], default=str))
            elif kind == "comm_open":  # plotly.js source: measured by its length, not re-encoded
                size += sum(len(v) for v in msg["content"]["data"]["state"].values() if isinstance(v, str))
            with self.lock:
                self.counts["msgs"] += 1
                if kind == "comm_msg":
                    self.counts["comm_msgs"] += 1
                    self.counts["comm_bytes"] += size
                elif kind == "comm_open":  # a FigureWidget's opening carries plotly.js itself (~5 MB)
                    self.counts["open_bytes"] += size
            if kind == "stream" and msg["content"]["name"] == "stderr":
                sys.stderr.write(msg["content"]["text"])

    def snapshot(self) -> dict:
        with self.lock:
            return dict(self.counts)

    def call(self, code: str, timeout: float = 600) -> None:
        # Not execute_interactive: it reads iopub itself, and only the drain thread may touch that socket.
        msg_id = self.kc.execute(code)
        while True:
            reply = self.kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"kernel error: {reply['content'].get('ename')}: {reply['content'].get('evalue')}")
        time.sleep(0.3)  # let the drain thread count this call's last messages before the next snapshot

    def close(self):
        self._stop.set()
        self._drain.join(timeout=2)
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


class InProcessRunner:
    def __init__(self):
        self.ns: dict = {}
        self.counts = {"msgs": 0, "comm_msgs": 0, "comm_bytes": 0, "open_bytes": 0}

    def snapshot(self) -> dict:
        return dict(self.counts)

    def call(self, code: str, timeout: float = 600) -> None:
        exec(code, self.ns)

    def close(self):
        pass


def _q(xs: list[float], k: int) -> float:
    return statistics.quantiles(xs, n=4)[k - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=10_000, help="steps of history in the plot before timing")
    ap.add_argument("--steps", type=int, default=750, help="timed steps per run")
    ap.add_argument("--work-ms", type=float, default=2.0, help="pure-Python work per step")
    ap.add_argument("--hz", type=float, default=5.0)
    ap.add_argument("--max-points", type=int, default=2000, help="LivePlot(max_points=...): points sent per trace")
    ap.add_argument("--max-cpu-share", type=float, default=0.005,
                    help="LivePlot(max_cpu_share=...): 1.0 turns the flusher's CPU budget off")
    ap.add_argument("--rounds", type=int, default=16, help="pairs of runs (without, with), in ABBA order")
    ap.add_argument("--in-process", action="store_true", help="no kernel: comms go nowhere (comparison only)")
    args = ap.parse_args()
    from tqdm import tqdm

    out = Path(tempfile.mkdtemp(prefix="live-plot-bench-")) / "result.json"
    where = "in-process (no kernel: comm messages go nowhere)"
    try:
        runner = InProcessRunner() if args.in_process else KernelRunner()
        if not args.in_process:
            where = "a real ipykernel (jupyter_client), iopub drained by a client thread"
    except Exception as e:  # no kernel possible here: measure in-process and say so
        print(f"could not start a kernel ({e!r}); running in-process instead", file=sys.stderr)
        runner = InProcessRunner()

    def call(code):
        runner.call(code)
        return json.loads(out.read_text())

    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    try:
        runner.call(KERNEL_CODE.replace("__ROOT__", repr(str(ROOT))))
        setup = call(f"bench_setup({str(out)!r}, {args.work_ms}, {args.hz}, {args.max_points}, {args.max_cpu_share})")
        append = call(f"bench_append({str(out)!r}, 30000)")
        runs = []
        for i in tqdm(range(2 * args.rounds), desc="runs (ABBA order)", unit="run"):
            with_plot = (i % 2 == 1) == ((i // 2) % 2 == 0)  # without,with, with,without, ...: no order bias
            before = runner.snapshot()
            res = call(f"bench_run({str(out)!r}, {args.steps}, {with_plot}, {args.prefill})")
            after = runner.snapshot()
            res["iopub"] = {k: after[k] - before[k] for k in after}
            runs.append(res)
    finally:
        runner.close()

    a = [r for r in runs if not r["with_plot"]]
    b0 = [r for r in runs if r["with_plot"]]
    # Accounted cost per pair: what the plot adds to the loop thread (its appends, timed alone) plus the CPU
    # of the threads that compete with it for the GIL (the flusher; ipykernel's threads, minus what they used
    # without a plot), over the loop thread's own CPU time without a plot (~its wall time on a quiet machine).
    acct = [(append["append_us"] * 1e-6 * args.steps + rb["flush_cpu_s"] + rb["other_cpu"] - ra["other_cpu"])
            / ra["loop_cpu"] for ra, rb in zip(a, b0)]
    b = [r for r in runs if r["with_plot"]]
    pair = [(rb["t"] - ra["t"]) / ra["t"] for ra, rb in zip(a, b)]
    t_a, t_b = sum(r["t"] for r in a), sum(r["t"] for r in b)
    cpu_a = sum(r["cpu"] for r in a)
    cpu_over = (sum(r["cpu"] for r in b) - cpu_a) / cpu_a
    cpu_pair = [(rb["cpu"] - ra["cpu"]) / ra["cpu"] for ra, rb in zip(a, b)]
    flush_cpu = sum(r["flush_cpu_s"] for r in b)
    flushes = sum(r["flushes"] for r in b)
    comm_msgs = sum(r["iopub"]["comm_msgs"] for r in b)
    comm_bytes = sum(r["iopub"]["comm_bytes"] for r in b)
    open_mb = b[-1]["iopub"]["open_bytes"] / 1e6
    errors = sum(r["errors"] for r in b)
    per_step_ms = 1e3 * t_a / (len(a) * args.steps)

    print(f"\nLive plot overhead, measured in {where}")
    print(f"  loop: {args.steps} timed steps per run, each {args.work_ms:g} ms of pure-Python work (k={setup['k']},"
          f" measured {per_step_ms:.2f} ms/step without plot) + 3 metric values")
    print(f"  plot: LivePlot(hz={args.hz:g}, max_points={args.max_points}, max_cpu_share={args.max_cpu_share:g}), {args.prefill} steps of history before timing, so it "
          f"holds {args.prefill}-{b[-1]['points_per_trace']} points per trace (x3 traces)")
    print(f"  {args.rounds} pairs of runs in ABBA order; total {time.perf_counter() - t_start:.0f} s; "
          f"load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs)")
    print(f"  {'pair':<5} {'without s':>10} {'with s':>8} {'overhead':>9} {'cpu w/o':>8} {'cpu with':>9} "
          f"{'flushes':>8}")
    for i, (ra, rb) in enumerate(zip(a, b)):
        print(f"  {i + 1:<5} {ra['t']:>10.3f} {rb['t']:>8.3f} {(rb['t'] - ra['t']) / ra['t']:>+9.2%} "
              f"{ra['cpu']:>8.3f} {rb['cpu']:>9.3f} {rb['flushes']:>8}")
    print(f"  wall overhead: pooled {(t_b - t_a) / t_a:+.2%}, median of pairs {statistics.median(pair):+.2%}, "
          f"quartiles {_q(pair, 1):+.2%} .. {_q(pair, 3):+.2%} (goal < 1%)")
    print(f"  kernel CPU overhead (CPU s of all kernel threads, with vs without): pooled {cpu_over:+.2%}, "
          f"median of pairs {statistics.median(cpu_pair):+.2%}, quartiles {_q(cpu_pair, 1):+.2%} .. "
          f"{_q(cpu_pair, 3):+.2%}")
    print(f"  accounted cost (appends + flusher CPU + extra CPU of ipykernel's threads) / loop CPU: "
          f"median {statistics.median(acct):.2%}, range {min(acct):.2%} .. {max(acct):.2%}")
    print(f"  appends: {append['append_us']:.2f} us per call (3 metrics, timed alone) = "
          f"{append['append_us'] / 1e3 / per_step_ms:.3%} of a step; "
          f"ipykernel threads' extra CPU: "
          f"{(sum(r['other_cpu'] for r in b0) - sum(r['other_cpu'] for r in a)) / t_b:.2%} of the loop's time")
    print(f"  flusher thread's own CPU: {flush_cpu / t_b:.2%} of the loop's time; {flushes / t_b:.2f} flushes/s, "
          f"{1e3 * flush_cpu / max(flushes, 1):.2f} ms CPU per flush; last flush sent {b[-1]['last_sent']}")
    print(f"  iopub in the with-plot runs (flushes, plus each widget's opening, display and closing): "
          f"{comm_msgs / t_b:.1f} comm msg/s, {comm_bytes / t_b / 1e3:.0f} kB/s (jupyter_server's limit: "
          f"1000 msg/s; its byte limit counts stream output only); each FigureWidget's comm_open also carries "
          f"{open_mb:.1f} MB (plotly.js), once")
    if errors:
        print(f"  flusher errors: {errors}")


if __name__ == "__main__":
    main()
