/**
 * Live metrics in the main area: one run's, or several runs' overlaid (a comparison: a fork's variants side by
 * side), fed by the `metrics:<lease>` topics of `openrl/api/stream` (the browser reads the server; the kernel is
 * not in the data path, so the plot follows runs from any notebook, after a kernel restart, and refills after a
 * page reload). Drawn with uPlot (~50 kB, made for streaming time series). A comparison colours each run and
 * dashes each metric, and a table under it gives each run's variant, steps, and each metric's last and best.
 */
import { Widget } from "@lumino/widgets";
import { Message } from "@lumino/messaging";
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";

import { ILeasesPayload, leaseRows, requestAPI, StreamClient, variantText } from "./api";

const MAX_POINTS = 20000;
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const DASHES: (number[] | undefined)[] = [undefined, [6, 4], [2, 3], [10, 3, 2, 3]];
/** What a comparison shows at first (the legend turns the others on): as `Lab.compare` does. */
export const COMPARE_METRICS = ["reward", "loss"];

/** A row of `GET openrl/api/metrics/<lease>`: `{step, time, metrics: {name: value}}`. */
interface IMetricRow {
  step: number;
  time?: number | null;
  metrics?: Record<string, unknown>;
}

/** One run's logged steps (increasing) and a column per metric, aligned with them. */
class RunSeries {
  steps: number[] = [];
  series = new Map<string, (number | null)[]>();

  clear(): void {
    this.steps = [];
    this.series.clear();
  }

  add(rows: IMetricRow[]): void {
    const last = this.steps.length ? this.steps[this.steps.length - 1] : -Infinity;
    for (const row of rows) {
      if (typeof row.step !== "number" || row.step <= last) {
        continue;
      }
      const i = this.steps.length;
      this.steps.push(row.step);
      for (const [k, v] of Object.entries(row.metrics ?? {})) {
        if (typeof v !== "number" || !isFinite(v)) {
          continue;
        }
        let s = this.series.get(k);
        if (!s) {
          s = new Array(i).fill(null);
          this.series.set(k, s);
        }
        s.push(v);
      }
      for (const s of this.series.values()) {
        if (s.length < i + 1) {
          s.push(null);
        }
      }
    }
    if (this.steps.length > MAX_POINTS) {
      const drop = this.steps.length - MAX_POINTS;
      this.steps.splice(0, drop);
      for (const s of this.series.values()) {
        s.splice(0, drop);
      }
    }
  }

  /** The last and the best (lowest for a loss, else highest) logged value of `metric`. */
  lastAndBest(metric: string): [number | null, number | null] {
    const values = (this.series.get(metric) ?? []).filter((v): v is number => v !== null);
    if (!values.length) {
      return [null, null];
    }
    const best = /loss/i.test(metric) ? Math.min(...values) : Math.max(...values);
    return [values[values.length - 1], best];
  }
}

function fmt(x: number | null): string {
  return x === null ? "-" : Math.abs(x) >= 1000 || Number.isInteger(x) ? String(x) : x.toPrecision(4);
}

export class MetricsPlot extends Widget {
  /** The runs shown: one for a run's plot, several for a comparison. */
  readonly runs: string[];
  /** The metrics a comparison shows at first (the others are in the legend, off). */
  readonly metrics: string[];
  private stream: StreamClient;
  private data = new Map<string, RunSeries>();
  private variants = new Map<string, string>();
  private plot: uPlot | null = null;
  private plotKeys = "";
  private chartNode: HTMLDivElement;
  private infoNode: HTMLDivElement;
  private tableNode: HTMLTableElement;
  private errors = new Map<string, string>();
  private pending = false;

  constructor(runs: string | string[], metrics: string[] = COMPARE_METRICS) {
    super();
    this.runs = typeof runs === "string" ? [runs] : [...runs];
    this.metrics = metrics;
    for (const r of this.runs) {
      this.data.set(r, new RunSeries());
    }
    this.id = this.isComparison ? `openrl-compare-${this.runs.join("-")}` : `openrl-plot-${this.runs[0]}`;
    this.addClass("jp-OpenRL-plot");
    if (this.isComparison) {
      this.addClass("jp-OpenRL-compare");
    }
    this.infoNode = document.createElement("div");
    this.infoNode.className = "jp-OpenRL-plot-info";
    this.infoNode.textContent = `${this.label}: waiting for metrics…`;
    this.chartNode = document.createElement("div");
    this.chartNode.className = "jp-OpenRL-plot-chart";
    this.tableNode = document.createElement("table");
    this.tableNode.className = "jp-OpenRL-compare-summary";
    this.node.appendChild(this.infoNode);
    this.node.appendChild(this.chartNode);
    if (this.isComparison) {
      this.node.appendChild(this.tableNode);
      void this.loadVariants();
    }
    const topics = this.runs.map((r) => `metrics:${r}`);
    this.stream = new StreamClient({
      topics,
      hz: 2,
      onUpdate: (msg, fresh) => this.onUpdate(msg, fresh),
      poll: async () => {
        const out: any = { type: "update" };
        await Promise.all(
          this.runs.map(async (r) => {
            out[`metrics:${r}`] = await requestAPI<any>(`metrics/${encodeURIComponent(r)}`).catch((e) => ({
              error: e.message,
            }));
          }),
        );
        return out;
      },
      pollMs: 3000,
    });
    this.stream.start();
  }

  get isComparison(): boolean {
    return this.runs.length > 1;
  }

  /** The run's name, or `a vs b vs c` for a comparison. */
  get label(): string {
    return this.runs.join(" vs ");
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this.stream.dispose();
    this.plot?.destroy();
    super.dispose();
  }

  protected onResize(msg: Widget.ResizeMessage): void {
    super.onResize(msg);
    this.resizePlot();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this.stream.pause(false);
    this.resizePlot();
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this.stream.pause(true); // a tab in the background: no pushes (the server keeps the step cursor)
  }

  private size(): { width: number; height: number } {
    const below = this.isComparison ? this.tableNode.offsetHeight + 8 : 0;
    return {
      width: Math.max(200, this.node.clientWidth - 16),
      height: Math.max(150, this.node.clientHeight - this.infoNode.offsetHeight - below - 60),
    };
  }

  private resizePlot(): void {
    this.plot?.setSize(this.size());
  }

  /** Each run's variant (a fork's origin and settings), from the lease rows: for the summary table. */
  private async loadVariants(): Promise<void> {
    try {
      const rows = leaseRows(await requestAPI<ILeasesPayload>("leases"));
      for (const r of rows) {
        if (this.data.has(r.name)) {
          this.variants.set(r.name, variantText(r.variant));
        }
      }
      this.renderTable();
    } catch {
      // the table shows no variants: the curves do not need them
    }
  }

  private onUpdate(msg: any, fresh: boolean): void {
    if (msg.type === "error") {
      this.infoNode.textContent = `${this.label}: ${msg.message}`;
      return;
    }
    let changed = false;
    for (const [run, series] of this.data) {
      const data = msg[`metrics:${run}`];
      if (!data) {
        continue;
      }
      if (data.error) {
        this.errors.set(run, data.error);
        continue;
      }
      this.errors.delete(run);
      if (fresh) {
        series.clear();
      }
      series.add(data.rows ?? []);
      changed = true;
    }
    this.renderInfo();
    if (changed && !this.pending) {
      this.pending = true;
      requestAnimationFrame(() => {
        this.pending = false;
        this.renderTable(); // first: the plot's height leaves room for it
        this.draw();
      });
    }
  }

  private renderInfo(): void {
    const parts = this.runs.map((run) => {
      const err = this.errors.get(run);
      if (err) {
        return `${run}: ${err}`;
      }
      const steps = this.data.get(run)!.steps;
      const n = steps.length;
      return n ? `${run}: ${n} steps, last step ${steps[n - 1]}` : `${run}: no metrics logged yet`;
    });
    this.infoNode.textContent = parts.join(" · ");
  }

  /** A comparison's table: per run its variant, steps, and each shown metric's last and best. */
  private renderTable(): void {
    if (!this.isComparison) {
      return;
    }
    const metrics = this.shownMetrics();
    const t = this.tableNode;
    t.textContent = "";
    const head = t.createTHead().insertRow();
    for (const h of ["run", "variant", "steps", ...metrics.flatMap((m) => [`${m} last`, `${m} best`])]) {
      const th = document.createElement("th");
      th.textContent = h;
      head.appendChild(th);
    }
    const body = t.createTBody();
    for (const run of this.runs) {
      const s = this.data.get(run)!;
      const tr = body.insertRow();
      tr.dataset.run = run;
      const cells = [run, this.variants.get(run) ?? "", String(s.steps.length ? s.steps[s.steps.length - 1] : 0)];
      for (const m of metrics) {
        const [last, best] = s.lastAndBest(m);
        cells.push(fmt(last), fmt(best));
      }
      for (const c of cells) {
        tr.insertCell().textContent = c;
      }
    }
  }

  /** The comparison's metrics at first: the asked ones that were logged, else every logged one. */
  private shownMetrics(): string[] {
    const logged = new Set<string>();
    for (const s of this.data.values()) {
      for (const k of s.series.keys()) {
        logged.add(k);
      }
    }
    const asked = this.metrics.filter((m) => logged.has(m));
    return asked.length ? asked : [...logged].sort();
  }

  /** The x values (every step any run logged) and a y column per (run, metric), aligned with them. */
  private aligned(): { steps: number[]; columns: { run: string; metric: string; values: (number | null)[] }[] } {
    if (!this.isComparison) {
      const s = this.data.get(this.runs[0])!;
      const keys = [...s.series.keys()].sort();
      return { steps: s.steps, columns: keys.map((k) => ({ run: this.runs[0], metric: k, values: s.series.get(k)! })) };
    }
    const all = new Set<number>();
    for (const s of this.data.values()) {
      s.steps.forEach((x) => all.add(x));
    }
    const steps = [...all].sort((a, b) => a - b).slice(-MAX_POINTS);
    const at = new Map(steps.map((x, i) => [x, i]));
    const metrics = [...new Set([...this.data.values()].flatMap((s) => [...s.series.keys()]))].sort();
    const columns = [];
    for (const metric of metrics) {
      for (const run of this.runs) {
        const s = this.data.get(run)!;
        const col = s.series.get(metric);
        if (!col) {
          continue;
        }
        const values: (number | null)[] = new Array(steps.length).fill(null);
        s.steps.forEach((x, i) => {
          const j = at.get(x);
          if (j !== undefined) {
            values[j] = col[i];
          }
        });
        columns.push({ run, metric, values });
      }
    }
    return { steps, columns };
  }

  private draw(): void {
    const { steps, columns } = this.aligned();
    if (!steps.length) {
      return;
    }
    const data: uPlot.AlignedData = [steps, ...columns.map((c) => c.values)] as any;
    const keys = columns.map((c) => `${c.metric}\u0001${c.run}`).join("\u0000");
    if (this.plot && keys === this.plotKeys) {
      this.plot.setData(data);
      return;
    }
    this.plot?.destroy();
    this.plotKeys = keys;
    // the canvas cannot read CSS variables: the theme's colours, resolved now (light or dark theme)
    const css = getComputedStyle(document.body);
    const ink = css.getPropertyValue("--jp-ui-font-color1").trim() || "#333";
    const grid = css.getPropertyValue("--jp-border-color2").trim() || "#ddd";
    const shown = new Set(this.shownMetrics());
    const metricIndex = new Map([...new Set(columns.map((c) => c.metric))].map((m, i) => [m, i]));
    const series: uPlot.Series[] = columns.map((c, i) =>
      this.isComparison
        ? {
            // as Lab.compare names them: `metric run`; a colour per run, a dash per metric
            label: `${c.metric} ${c.run}`,
            stroke: PALETTE[this.runs.indexOf(c.run) % PALETTE.length],
            dash: DASHES[metricIndex.get(c.metric)! % DASHES.length],
            width: 1.5,
            spanGaps: true,
            show: shown.has(c.metric),
          }
        : { label: c.metric, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true },
    );
    const opts: uPlot.Options = {
      ...this.size(),
      scales: { x: { time: false } },
      // whole steps only on the x axis
      axes: [
        {
          label: "step",
          incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000],
          stroke: ink,
          grid: { stroke: grid },
          ticks: { stroke: grid },
        },
        { stroke: ink, grid: { stroke: grid }, ticks: { stroke: grid } },
      ],
      series: [{ label: "step" }, ...series],
    };
    this.plot = new uPlot(opts, data, this.chartNode);
  }
}
