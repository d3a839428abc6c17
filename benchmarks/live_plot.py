"""What a LivePlot costs a training loop: 5 Hz updates of a plot holding 10,000+ points per metric.

    .venv/bin/python benchmarks/live_plot.py [--loop cpu|sdk|both] [--prefill 10000] [--hz 5]
        [--max-points 2000] [--max-cpu-share 0.005] [--in-process]
        [--steps 750] [--work-ms 2] [--rounds 16]                                    # cpu loop
        [--sdk-steps 120] [--sdk-rounds 10] [--sdk-uncapped-rounds 4] [--sdk-batch 4] [--sdk-tokens 24]  # sdk loop

The loop runs inside a real ipykernel started with jupyter_client (KernelManager + BlockingKernelClient), so
the plot's comm messages really go out on iopub; a client thread here drains iopub as a frontend's server
would (its CPU use competes for the same two cores, as jupyter_server's would), counting messages and bytes.
By default both loops run, one after the other, each in its own fresh kernel; `--loop` picks one.

Two loops:
* `cpu` (the worst case): one step = `--work-ms` of pure-Python arithmetic (calibrated in the kernel; no
  numpy/torch) plus computing three metric values. The loop always wants the GIL, so every GIL hand-off of
  the flusher (numpy, zmq sends, ipykernel's IOPub thread) lands on it directly.
* `sdk` (what a researcher's loop does): one step = a real training step through the `tinker` SDK, inside
  the kernel, against a real local lab started here (`LabServer`, a temporary home, stopped at the end; its
  address and key reach the kernel as $OPENRL_LAB_URL/$OPENRL_LAB_API_KEY): `forward_backward` + `optim_step`,
  `.result()` on both, LoRA rank 16 on openrl-lab/tiny-llama-1m, 4 sequences x 24 tokens (~35 ms here). The
  loop thread mostly waits on the lab, so the GIL is often free. The lab's processes get OMP_NUM_THREADS=1
  (`--lab-threads`): on a shared 2-core machine torch's default pool, oversubscribed, stalled steps for seconds.
  After the pairs at the plot's default `max_cpu_share`, `--sdk-uncapped-rounds` pairs run with the CPU budget
  off (`max_cpu_share=1`: true 5 Hz).

Without the plot the step stops there; with it the step also calls
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
  threads: loop, flusher, ipykernel's iopub and ZMQ threads, the SDK's threads);
* accounted cost = (appends, timed alone, x steps + the flusher thread's CPU + the extra CPU of ipykernel's
  Python threads) / the loop thread's CPU without a plot (cpu loop) or the loop's wall time without a plot
  (sdk loop, which mostly waits): the direct cost, much less noisy;
* the flusher's flush rate and CPU per flush (`LivePlot.stats`), iopub message and byte rates; the step time.
`--in-process` runs the same loop in this process without a kernel (comms go nowhere): for comparison only.
At the end, one markdown row per loop and plot setting, as in docs/benchmarks.md.
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

    def bench_run(out, steps, with_plot, prefill, loop="cpu", max_cpu_share=None):
        gc.collect()
        plot = None
        if with_plot:
            opts = dict(OPTS, **({} if max_cpu_share is None else dict(max_cpu_share=max_cpu_share)))
            plot = LivePlot(["reward", "loss", "kl"], title="bench", **opts)
            plot.extend([dict(step=s, **_values(s)) for s in range(prefill)])  # the history so far
            display(plot)
            s0 = plot.stats
        time.sleep(0.5)  # both runs: lets the client finish reading the widget's 5 MB comm_open first
        th0 = _thread_cpu()
        t0, c0 = time.perf_counter(), time.process_time()
        if loop == "cpu":
            for step in range(prefill, prefill + steps):
                _work(K)
                reward = math.sin(step / 300.0)
                loss = 1.0 / (1.0 + step)
                kl = 0.01 * (step % 97)
                if plot is not None:  # not timed per call: a thread_time() per step here cost the run ~10% itself
                    plot.append(step, reward=reward, loss=loss, kl=kl)
        else:  # a real training step through the tinker SDK, as a researcher's SFT/RL loop makes it
            for step in range(prefill, prefill + steps):
                fb = TRAINER.forward_backward(BATCH, "cross_entropy")
                opt = TRAINER.optim_step(ADAM)
                loss = fb.result().metrics["loss:sum"] / N_TOKENS
                opt.result()
                reward = -loss  # an RL loop would score its samples here; not part of this measurement
                kl = 0.01 * (step % 97)
                if plot is not None:
                    plot.append(step, reward=reward, loss=loss, kl=kl)
        t, cpu = time.perf_counter() - t0, time.process_time() - c0
        th1 = _thread_cpu()
        main, flusher = threading.main_thread().ident, plot._thread.ident if plot is not None else None
        threads = {k: (v[0], th1[k][1] - v[1]) for k, v in th0.items() if k in th1}
        others = [(n, c) for k, (n, c) in threads.items() if k not in (main, flusher)]
        res = dict(with_plot=with_plot, t=t, cpu=cpu, steps=steps,
                   loop_cpu=threads.get(main, ("", 0.0))[1],
                   other_cpu=sum(c for n, c in others),
                   # the SDK's own threads (its event loop, HTTP) vs ipykernel's (IOPub, control, heartbeat, ...)
                   sdk_cpu=sum(c for n, c in others if n in SDK_THREADS))
        if plot is not None:
            s1 = plot.stats  # the flushes during the timed loop (not the one at display, nor the one at stop)
            res.update(flushes=s1["flushes"] - s0["flushes"], flush_cpu_s=s1["flush_cpu_s"] - s0["flush_cpu_s"],
                       points_per_trace=len(plot), last_sent=s1["last_sent"], errors=s1["errors"])
            plot.close()
        _save(out, res)

    SDK_THREADS = set()

    def _sdk_step():
        fb = TRAINER.forward_backward(BATCH, "cross_entropy")
        opt = TRAINER.optim_step(ADAM)
        fb.result(), opt.result()

    def sdk_setup(out, model, rank, batch, tokens, lr, warmup, hz, max_points, max_cpu_share):
        # The lab's address and key come in the kernel's environment, as `openrl_lab.lab.find_connection` reads them.
        global TRAINER, BATCH, ADAM, N_TOKENS, SERVICE, OPTS
        import os, random, tinker
        from tinker import types
        OPTS = dict(hz=hz, max_points=max_points, max_cpu_share=max_cpu_share)
        LivePlot(["x"], autostart=False).close()  # import plotly, build one widget: not part of any run
        before = {t.ident for t in threading.enumerate()}
        SERVICE = tinker.ServiceClient(base_url=os.environ["OPENRL_LAB_URL"], api_key=os.environ["OPENRL_LAB_API_KEY"])
        TRAINER = SERVICE.create_lora_training_client(base_model=model, rank=rank, seed=0).result()
        vocab = len(TRAINER.get_tokenizer())
        rng = random.Random(0)
        rows = [[rng.randrange(3, vocab) for _ in range(tokens + 1)] for _ in range(batch)]
        BATCH = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                             loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * tokens}) for r in rows]
        N_TOKENS = batch * tokens
        ADAM = types.AdamParams(learning_rate=lr)
        for _ in range(warmup):
            _sdk_step()
        SDK_THREADS.update(t.name for t in threading.enumerate() if t.ident not in before)
        t = time.perf_counter()
        for _ in range(10):
            _sdk_step()
        _save(out, dict(step_ms=(time.perf_counter() - t) / 10 * 1e3, vocab=vocab, python=sys.version.split()[0],
                        tinker=tinker.__version__, sdk_threads=sorted(SDK_THREADS),
                        threads=sorted(t.name for t in threading.enumerate())))

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

    def __init__(self, env: dict | None = None):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(ROOT), env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
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
    def __init__(self, env: dict | None = None):
        os.environ.update(env or {})
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


# Student's t, two-sided 95%, by degrees of freedom (no scipy here); 2.0 beyond the table.
_T95 = {
    1: 12.71,
    2: 4.30,
    3: 3.18,
    4: 2.78,
    5: 2.57,
    6: 2.45,
    7: 2.36,
    8: 2.31,
    9: 2.26,
    10: 2.23,
    11: 2.20,
    12: 2.18,
    13: 2.16,
    14: 2.14,
    15: 2.13,
    16: 2.12,
    17: 2.11,
    18: 2.10,
    19: 2.09,
    20: 2.09,
}


def _ci95(xs: list[float]) -> tuple[float, float]:
    """Mean of the pairs' overheads and the half-width of its 95% confidence interval: what the A/B can resolve."""
    if len(xs) < 2:
        return xs[0], float("inf")
    return statistics.fmean(xs), _T95.get(len(xs) - 1, 2.0) * statistics.stdev(xs) / len(xs) ** 0.5


def measure(loop: str, args, tqdm) -> dict:
    """One loop kind, in its own kernel (and, for the SDK loop, its own lab): setup, appends alone, then the
    ABBA pairs of each plot configuration. Everything the report needs."""
    out = Path(tempfile.mkdtemp(prefix="live-plot-bench-")) / "result.json"
    lab, env = None, {"HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    if loop == "sdk":
        from openrl_lab.server import LabServer

        # The lab's processes inherit this environment. On a shared 2-core machine torch's default OpenMP pool
        # (one thread per core) oversubscribed by other work stalls steps for seconds (3.2 s instead of ~35 ms
        # median, measured here under a test suite); a 1M-parameter model loses nothing on one thread.
        saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        if args.lab_threads:
            os.environ.update(OMP_NUM_THREADS=str(args.lab_threads), MKL_NUM_THREADS=str(args.lab_threads))
        try:
            lab = LabServer(Path(tempfile.mkdtemp(prefix="live-plot-bench-lab-"))).start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        env.update(OPENRL_LAB_URL=lab.base_url, OPENRL_LAB_API_KEY=lab.api_key)
    where = "in-process (no kernel: comm messages go nowhere)"
    runner = None
    try:
        try:
            runner = InProcessRunner(env) if args.in_process else KernelRunner(env)
            if not args.in_process:
                where = "a real ipykernel (jupyter_client), iopub drained by a client thread"
        except Exception as e:  # noqa: BLE001 - no kernel possible here: measure in-process and say so
            print(f"could not start a kernel ({e!r}); running in-process instead", file=sys.stderr)
            runner = InProcessRunner(env)

        def call(code):
            runner.call(code)
            return json.loads(out.read_text())

        runner.call(KERNEL_CODE.replace("__ROOT__", repr(str(ROOT))))
        if loop == "cpu":
            steps, configs = args.steps, [(args.max_cpu_share, args.rounds)]
            setup = call(
                f"bench_setup({str(out)!r}, {args.work_ms}, {args.hz}, {args.max_points}, {args.max_cpu_share})"
            )
        else:
            steps, configs = args.sdk_steps, [(args.max_cpu_share, args.sdk_rounds)]
            if args.sdk_uncapped_rounds and args.max_cpu_share != 1:
                configs.append((1.0, args.sdk_uncapped_rounds))
            setup = call(
                f"sdk_setup({str(out)!r}, {args.sdk_model!r}, {args.sdk_rank}, {args.sdk_batch}, "
                f"{args.sdk_tokens}, {args.sdk_lr}, 10, {args.hz}, {args.max_points}, {args.max_cpu_share})"
            )
        append = call(f"bench_append({str(out)!r}, 30000)")
        tables = []
        for share, rounds in configs:
            runs = []
            for i in tqdm(
                range(2 * rounds), desc=f"{loop} loop, max_cpu_share={share:g}: runs (ABBA order)", unit="run"
            ):
                with_plot = (i % 2 == 1) == ((i // 2) % 2 == 0)  # without,with, with,without, ...: no order bias
                before = runner.snapshot()
                res = call(f"bench_run({str(out)!r}, {steps}, {with_plot}, {args.prefill}, {loop!r}, {share})")
                after = runner.snapshot()
                res["iopub"] = {k: after[k] - before[k] for k in after}
                runs.append(res)
            tables.append({"share": share, "rounds": rounds, "runs": runs})
    finally:
        if runner is not None:
            runner.close()
        if lab is not None:
            lab.stop()
    return {
        "loop": loop,
        "where": where,
        "steps": steps,
        "setup": setup,
        "append": append,
        "tables": tables,
        "elapsed": time.perf_counter() - t_start,
        "load": (load0, os.getloadavg()[0]),
    }


def report(m: dict, args) -> list[dict]:
    """Prints one loop kind's tables; returns one summary row per plot configuration."""
    rows = []
    loop, steps, setup, append = m["loop"], m["steps"], m["setup"], m["append"]
    for tab in m["tables"]:
        runs, share = tab["runs"], tab["share"]
        a = [r for r in runs if not r["with_plot"]]
        b = [r for r in runs if r["with_plot"]]

        # Accounted (direct) cost per pair: what the plot adds to the loop thread (its appends, timed alone) plus
        # the CPU of the threads that compete with it (the flusher; ipykernel's threads, minus what they used
        # without a plot; the SDK's own threads are left out, their per-run noise dwarfs the plot). CPU loop: over
        # the loop thread's CPU without a plot (~its wall time on a quiet machine). SDK loop: over the loop's wall
        # time without a plot, since that loop mostly waits for the lab.
        def ipk(r):
            return r["other_cpu"] - r.get("sdk_cpu", 0.0)

        denom = (lambda r: r["loop_cpu"]) if loop == "cpu" else (lambda r: r["t"])
        acct = [
            (append["append_us"] * 1e-6 * steps + rb["flush_cpu_s"] + ipk(rb) - ipk(ra)) / denom(ra)
            for ra, rb in zip(a, b)
        ]
        flusher_share = [rb["flush_cpu_s"] / denom(ra) for ra, rb in zip(a, b)]
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
        step_a = [1e3 * r["t"] / steps for r in a]
        step_b = [1e3 * r["t"] / steps for r in b]
        per_step_ms = 1e3 * t_a / (len(a) * steps)

        print(f"\nLive plot overhead, {loop.upper()} loop, measured in {m['where']}")
        if loop == "cpu":
            print(
                f"  loop: {steps} timed steps per run, each {args.work_ms:g} ms of pure-Python work (k={setup['k']},"
                f" measured {per_step_ms:.2f} ms/step without plot) + 3 metric values"
            )
        else:
            print(
                f"  loop: {steps} timed steps per run, each a real training step through the tinker SDK "
                f"{setup['tinker']} inside the kernel against a local lab (LabServer): forward_backward + "
                f"optim_step, .result() on both, LoRA rank {args.sdk_rank} on {args.sdk_model}, "
                f"{args.sdk_batch} sequences x {args.sdk_tokens} tokens; + 3 metric values"
            )
            print(
                f"  step time: without plot median {statistics.median(step_a):.1f} ms (quartiles "
                f"{_q(step_a, 1):.1f} .. {_q(step_a, 3):.1f}), with plot {statistics.median(step_b):.1f} ms "
                f"({_q(step_b, 1):.1f} .. {_q(step_b, 3):.1f}); SDK threads in the kernel: "
                f"{', '.join(setup['sdk_threads']) or 'none'}"
            )
        print(
            f"  plot: LivePlot(hz={args.hz:g}, max_points={args.max_points}, max_cpu_share={share:g}), "
            f"{args.prefill} steps of history before timing, so it holds {args.prefill}-"
            f"{b[-1]['points_per_trace']} points per trace (x3 traces)"
        )
        print(
            f"  {tab['rounds']} pairs of runs in ABBA order; this loop kind took {m['elapsed']:.0f} s in all; "
            f"load average {m['load'][0]:.2f} before, {m['load'][1]:.2f} after ({os.cpu_count()} CPUs)"
        )
        print(
            f"  {'pair':<5} {'without s':>10} {'with s':>8} {'overhead':>9} {'cpu w/o':>8} {'cpu with':>9} "
            f"{'flushes':>8}"
        )
        for i, (ra, rb) in enumerate(zip(a, b)):
            print(
                f"  {i + 1:<5} {ra['t']:>10.3f} {rb['t']:>8.3f} {(rb['t'] - ra['t']) / ra['t']:>+9.2%} "
                f"{ra['cpu']:>8.3f} {rb['cpu']:>9.3f} {rb['flushes']:>8}"
            )
        print(
            f"  wall overhead: pooled {(t_b - t_a) / t_a:+.2%}, median of pairs {statistics.median(pair):+.2%}, "
            f"quartiles {_q(pair, 1):+.2%} .. {_q(pair, 3):+.2%}; mean of pairs {_ci95(pair)[0]:+.2%} "
            f"+- {_ci95(pair)[1]:.2%} (95% CI) (goal < 1%)"
        )
        print(
            f"  kernel CPU overhead (CPU s of all kernel threads, with vs without): pooled {cpu_over:+.2%}, "
            f"median of pairs {statistics.median(cpu_pair):+.2%}, quartiles {_q(cpu_pair, 1):+.2%} .. "
            f"{_q(cpu_pair, 3):+.2%}"
        )
        denom_name = "loop CPU" if loop == "cpu" else "loop wall"
        print(
            f"  accounted cost (appends + flusher CPU + extra CPU of ipykernel's threads) / {denom_name}: "
            f"median {statistics.median(acct):.2%}, range {min(acct):.2%} .. {max(acct):.2%}; flusher alone "
            f"{statistics.median(flusher_share):.2%}"
        )
        print(
            f"  appends: {append['append_us']:.2f} us per call (3 metrics, timed alone) = "
            f"{append['append_us'] / 1e3 / per_step_ms:.3%} of a step; "
            f"ipykernel threads' extra CPU: {(sum(ipk(r) for r in b) - sum(ipk(r) for r in a)) / t_b:.2%} "
            f"of the loop's time"
            + (
                ""
                if loop == "cpu"
                else f"; SDK threads' extra CPU (not counted: noise) "
                f"{(sum(r['sdk_cpu'] for r in b) - sum(r['sdk_cpu'] for r in a)) / t_b:+.2%}"
            )
        )
        print(
            f"  flusher thread's own CPU: {flush_cpu / t_b:.2%} of the loop's time; {flushes / t_b:.2f} flushes/s, "
            f"{1e3 * flush_cpu / max(flushes, 1):.2f} ms CPU per flush; last flush sent {b[-1]['last_sent']}"
        )
        print(
            f"  iopub in the with-plot runs (flushes, plus each widget's opening, display and closing): "
            f"{comm_msgs / t_b:.1f} comm msg/s, {comm_bytes / t_b / 1e3:.0f} kB/s (jupyter_server's limit: "
            f"1000 msg/s; its byte limit counts stream output only); each FigureWidget's comm_open also carries "
            f"{open_mb:.1f} MB (plotly.js), once"
        )
        if errors:
            print(f"  flusher errors: {errors}")
        rows.append(
            {
                "loop": loop,
                "share": share,
                "rounds": tab["rounds"],
                "step_ms": per_step_ms,
                "hz": flushes / t_b,
                "flush_ms": 1e3 * flush_cpu / max(flushes, 1),
                "acct": statistics.median(acct),
                "acct_lo": min(acct),
                "acct_hi": max(acct),
                "denom": denom_name,
                "pooled": (t_b - t_a) / t_a,
                "median": statistics.median(pair),
                "q1": _q(pair, 1),
                "q3": _q(pair, 3),
                "mean": _ci95(pair)[0],
                "ci": _ci95(pair)[1],
                "cpu_median": statistics.median(cpu_pair),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--loop",
        choices=["cpu", "sdk", "both"],
        default="both",
        help="cpu: 2 ms of pure Python per step (worst case); sdk: a real tinker SDK training step "
        "against a local lab; both (default): one after the other, each in its own kernel",
    )
    ap.add_argument("--prefill", type=int, default=10_000, help="steps of history in the plot before timing")
    ap.add_argument("--hz", type=float, default=5.0)
    ap.add_argument("--max-points", type=int, default=2000, help="LivePlot(max_points=...): points sent per trace")
    ap.add_argument(
        "--max-cpu-share",
        type=float,
        default=0.005,
        help="LivePlot(max_cpu_share=...), its default; 1.0 turns the flusher's CPU budget off",
    )
    ap.add_argument("--in-process", action="store_true", help="no kernel: comms go nowhere (comparison only)")
    cpu = ap.add_argument_group("cpu loop")
    cpu.add_argument("--steps", type=int, default=750, help="timed steps per run")
    cpu.add_argument("--work-ms", type=float, default=2.0, help="pure-Python work per step")
    cpu.add_argument("--rounds", type=int, default=16, help="pairs of runs (without, with), in ABBA order")
    sdk = ap.add_argument_group("sdk loop")
    sdk.add_argument("--sdk-steps", type=int, default=120, help="timed training steps per run")
    sdk.add_argument("--sdk-rounds", type=int, default=10, help="pairs of runs at --max-cpu-share")
    sdk.add_argument(
        "--sdk-uncapped-rounds",
        type=int,
        default=4,
        help="then pairs with max_cpu_share=1 (no CPU budget: true 5 Hz); 0 skips them",
    )
    sdk.add_argument("--sdk-model", default="openrl-lab/tiny-llama-1m")
    sdk.add_argument("--sdk-rank", type=int, default=16, help="LoRA rank")
    sdk.add_argument("--sdk-batch", type=int, default=4, help="sequences per step")
    sdk.add_argument("--sdk-tokens", type=int, default=24, help="tokens per sequence")
    sdk.add_argument("--sdk-lr", type=float, default=1e-4)
    sdk.add_argument(
        "--lab-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS for the lab's processes (0: torch's default, one per core)",
    )
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from tqdm import tqdm

    t0 = time.perf_counter()
    results = [measure(loop, args, tqdm) for loop in (["cpu", "sdk"] if args.loop == "both" else [args.loop])]
    rows = [row for m in results for row in report(m, args)]
    print(f"\nSummary ({time.perf_counter() - t0:.0f} s in all), as in docs/benchmarks.md:")
    print(
        "| loop | `max_cpu_share` | step | flushes/s | flusher CPU per flush | direct cost (appends + flusher + "
        "ipykernel threads) | wall overhead: pooled, median of pairs (quartiles) | wall overhead: mean of pairs, "
        "95% CI | kernel CPU overhead, median |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['loop']}, {r['rounds']} pairs | {r['share']:g} | {r['step_ms']:.1f} ms | {r['hz']:.1f} | "
            f"{r['flush_ms']:.2f} ms | {r['acct']:.2%} of {r['denom']} ({r['acct_lo']:.2%}-{r['acct_hi']:.2%}) | "
            f"{r['pooled']:+.1%}, {r['median']:+.1%} ({r['q1']:+.1%} .. {r['q3']:+.1%}) | "
            f"{r['mean']:+.1%} +- {r['ci']:.1%} | {r['cpu_median']:+.1%} |"
        )


if __name__ == "__main__":
    main()
