/**
 * A run's live metrics in the main area, fed by the `metrics:<lease>` topic of `openrl/api/stream`
 * (the browser reads the server; the kernel is not in the data path, so the plot follows a run from any
 * notebook, after a kernel restart, and refills after a page reload). Drawn with uPlot (~50 kB, made for
 * streaming time series).
 */
import { Widget } from "@lumino/widgets";
import { Message } from "@lumino/messaging";
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";

import { requestAPI, StreamClient } from "./api";

const MAX_POINTS = 20000;
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

/** A row of `GET openrl/api/metrics/<lease>`: `{step, time, metrics: {name: value}}`. */
interface IMetricRow {
  step: number;
  time?: number | null;
  metrics?: Record<string, unknown>;
}

export class MetricsPlot extends Widget {
  readonly leaseName: string;
  private stream: StreamClient;
  private steps: number[] = [];
  private series = new Map<string, (number | null)[]>();
  private plot: uPlot | null = null;
  private plotKeys = "";
  private chartNode: HTMLDivElement;
  private infoNode: HTMLDivElement;
  private pending = false;

  constructor(name: string) {
    super();
    this.leaseName = name;
    this.id = `openrl-plot-${name}`;
    this.addClass("jp-OpenRL-plot");
    this.infoNode = document.createElement("div");
    this.infoNode.className = "jp-OpenRL-plot-info";
    this.infoNode.textContent = `${name}: waiting for metrics…`;
    this.chartNode = document.createElement("div");
    this.chartNode.className = "jp-OpenRL-plot-chart";
    this.node.appendChild(this.infoNode);
    this.node.appendChild(this.chartNode);
    this.stream = new StreamClient({
      topics: [`metrics:${name}`],
      hz: 2,
      onUpdate: (msg, fresh) => this.onUpdate(msg, fresh),
      poll: async () => {
        const data = await requestAPI<any>(`metrics/${encodeURIComponent(name)}`);
        return { type: "update", [`metrics:${name}`]: data };
      },
      pollMs: 3000,
    });
    this.stream.start();
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

  private resizePlot(): void {
    if (this.plot) {
      const w = Math.max(200, this.node.clientWidth - 16);
      const h = Math.max(150, this.node.clientHeight - this.infoNode.offsetHeight - 60);
      this.plot.setSize({ width: w, height: h });
    }
  }

  private onUpdate(msg: any, fresh: boolean): void {
    if (msg.type === "error") {
      this.infoNode.textContent = `${this.leaseName}: ${msg.message}`;
      return;
    }
    const data = msg[`metrics:${this.leaseName}`];
    if (!data) {
      return;
    }
    if (data.error) {
      this.infoNode.textContent = `${this.leaseName}: ${data.error}`;
      return;
    }
    if (fresh) {
      this.steps = [];
      this.series.clear();
    }
    const rows: IMetricRow[] = data.rows ?? [];
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
    const n = this.steps.length;
    this.infoNode.textContent = n
      ? `${this.leaseName}: ${n} steps, last step ${this.steps[n - 1]}`
      : `${this.leaseName}: no metrics logged yet`;
    if (!this.pending) {
      this.pending = true;
      requestAnimationFrame(() => {
        this.pending = false;
        this.draw();
      });
    }
  }

  private draw(): void {
    if (!this.steps.length) {
      return;
    }
    const keys = [...this.series.keys()].sort();
    const data: uPlot.AlignedData = [this.steps, ...keys.map((k) => this.series.get(k)!)] as any;
    if (this.plot && keys.join("\u0000") === this.plotKeys) {
      this.plot.setData(data);
      return;
    }
    this.plot?.destroy();
    this.plotKeys = keys.join("\u0000");
    // the canvas cannot read CSS variables: the theme's colours, resolved now (light or dark theme)
    const css = getComputedStyle(document.body);
    const ink = css.getPropertyValue("--jp-ui-font-color1").trim() || "#333";
    const grid = css.getPropertyValue("--jp-border-color2").trim() || "#ddd";
    const opts: uPlot.Options = {
      width: Math.max(200, this.node.clientWidth - 16),
      height: Math.max(150, this.node.clientHeight - 80),
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
      series: [
        { label: "step" },
        ...keys.map((k, i) => ({ label: k, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true })),
      ],
    };
    this.plot = new uPlot(opts, data, this.chartNode);
  }
}
