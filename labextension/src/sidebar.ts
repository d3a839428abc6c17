/**
 * The sidebar: "where is my job and why is it waiting?"
 *
 * My leases (group, share, resident or evicted, kernel and host, a gang's devices, device memory, last step's
 * reward, last checkpoint, a fork's origin and settings, and while waiting the queue position, the orchestrator's
 * reason and a rough wait; runs ticked, or a fork's family, open overlaid in one plot to compare), the queue and
 * duty cycle per group, and a live slice timeline; fed by the `leases`, `queue` and `timeline` topics of
 * `openrl/api/stream`, with GETs while the websocket is down.
 */
import { Widget } from "@lumino/widgets";
import { Message } from "@lumino/messaging";

import {
  devicesText,
  fmtBytes,
  fmtSeconds,
  IGroupStatus,
  ILeaseRow,
  ILeasesPayload,
  IQueueEntry,
  IQueuePayload,
  ISliceRecord,
  ITimelinePayload,
  leaseRows,
  requestAPI,
  StreamClient,
  StreamState,
  variantText,
} from "./api";

export interface ISidebarActions {
  release(name: string): Promise<void>;
  attach(name: string): void;
  plot(name: string): void;
  /** The runs' curves overlaid in one plot, with a summary table (a fork's variants side by side). */
  compare(names: string[]): void;
}

const TIMELINE_WINDOW_S = 120;
const SVG_NS = "http://www.w3.org/2000/svg";

function el<K extends keyof HTMLElementTagNameMap>(tag: K, cls?: string, text?: string): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (cls) {
    node.className = cls;
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

function pct(x: number | null | undefined): string {
  return x === null || x === undefined || !isFinite(x) ? "?" : `${Math.round(x * 100)}%`;
}

function num(x: unknown): string {
  if (typeof x !== "number" || !isFinite(x)) {
    return "-";
  }
  return Math.abs(x) >= 1000 || Number.isInteger(x) ? String(x) : x.toPrecision(3);
}

/** A stable colour per job name (hash -> hue). */
function colour(job: string, mine: boolean): string {
  if (!mine || !job) {
    return "var(--jp-layout-color3)";
  }
  let h = 0;
  for (let i = 0; i < job.length; i++) {
    h = (h * 31 + job.charCodeAt(i)) % 360;
  }
  return `hsl(${h}, 60%, 50%)`;
}

export class OpenRLSidebar extends Widget {
  private stream: StreamClient;
  private rows: ILeaseRow[] = [];
  private warnings: string[] = [];
  private groups: IGroupStatus[] = [];
  private slices = new Map<string, Map<string, ISliceRecord>>(); // group -> slice_id -> record
  private duty = new Map<string, number>();
  private error = "";
  private topicErrors: string[] = [];
  private connState: StreamState = "connecting";
  private busy = new Set<string>();
  private picked = new Set<string>(); // runs ticked for "Compare"
  private started = false;
  private statusNode = el("div", "jp-OpenRL-status");
  private leasesNode = el("div", "jp-OpenRL-leases");
  private queueNode = el("div", "jp-OpenRL-queue");
  private timelineNode = el("div", "jp-OpenRL-timeline");
  private redrawTimer: number;

  constructor(private actions: ISidebarActions) {
    super();
    this.id = "openrl-lab-sidebar";
    this.addClass("jp-OpenRL-sidebar");
    this.title.caption = "OpenRL Lab: my leases, queues, timeline";
    const header = el("div", "jp-OpenRL-header");
    header.appendChild(el("h2", "", "OpenRL Lab"));
    header.appendChild(this.statusNode);
    const section = (title: string, body: HTMLElement, cls: string) => {
      const s = el("section", `jp-OpenRL-section ${cls}`);
      s.appendChild(el("h3", "", title));
      s.appendChild(body);
      return s;
    };
    this.node.appendChild(header);
    this.node.appendChild(section("My leases", this.leasesNode, "jp-OpenRL-section-leases"));
    this.node.appendChild(section("Queues and duty cycle", this.queueNode, "jp-OpenRL-section-queue"));
    this.node.appendChild(
      section(`Timeline (last ${TIMELINE_WINDOW_S} s)`, this.timelineNode, "jp-OpenRL-section-timeline"),
    );
    this.stream = new StreamClient({
      topics: ["leases", "queue", "timeline"],
      hz: 1,
      onUpdate: (msg, fresh) => this.onUpdate(msg, fresh),
      onState: (state) => {
        this.connState = state;
        this.renderStatus();
      },
      poll: () => this.pollOnce(),
      pollMs: 3000,
    });
    this.render();
    // the stream starts when the panel is first shown (a closed sidebar costs the server nothing)
    // the timeline scrolls with the clock, also between updates
    this.redrawTimer = window.setInterval(() => {
      if (this.isVisible) {
        this.renderTimeline();
      }
    }, 1000);
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    window.clearInterval(this.redrawTimer);
    this.stream.dispose();
    super.dispose();
  }

  /** The rows shown now (for tests and commands). */
  get leaseRows(): ILeaseRow[] {
    return this.rows;
  }

  /** Asks for fresh data at once (after an action). */
  refresh(): void {
    void this.pollOnce().then(
      (msg) => this.onUpdate(msg, false),
      () => undefined,
    );
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    if (!this.started) {
      this.started = true;
      this.stream.start();
    } else {
      this.stream.pause(false);
    }
    this.render();
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this.stream.pause(true);
  }

  /** The GET fallback: the same topics as one update-like object. */
  private async pollOnce(): Promise<any> {
    const [leases, queue] = await Promise.all([
      requestAPI<ILeasesPayload>("leases").catch((e) => ({ error: e.message, status: e.status })),
      requestAPI<IQueuePayload>("queue").catch((e) => ({ error: e.message, status: e.status })),
    ]);
    const since = Date.now() / 1000 - TIMELINE_WINDOW_S;
    const timeline = await requestAPI<ITimelinePayload>(`timeline?since=${since.toFixed(3)}`).catch((e) => ({
      error: e.message,
      status: e.status,
    }));
    if ((leases as any).status === 503 && (queue as any).status === 503) {
      return { type: "error", status: 503, message: (leases as any).error };
    }
    return { type: "update", leases, queue, timeline };
  }

  private onUpdate(msg: any, fresh: boolean): void {
    if (msg.type === "error") {
      this.error = msg.message ?? "error";
      this.renderStatus();
      return;
    }
    this.error = "";
    this.topicErrors = [];
    if (msg.leases) {
      if (msg.leases.error) {
        this.topicErrors.push(`leases: ${msg.leases.error}`);
      } else {
        this.rows = leaseRows(msg.leases);
        this.warnings = msg.leases.warnings ?? [];
      }
    }
    if (msg.queue) {
      if (msg.queue.error) {
        this.topicErrors.push(`queue: ${msg.queue.error}`);
      } else {
        this.groups = msg.queue.groups ?? [];
        for (const g of this.groups) {
          const d = g.duty_cycle ?? g.duty?.duty_cycle;
          if (typeof d === "number") {
            this.duty.set(g.group_id, d);
          }
        }
      }
    }
    if (msg.timeline) {
      if (msg.timeline.error) {
        this.topicErrors.push(`timeline: ${msg.timeline.error}`);
      } else {
        if (fresh) {
          this.slices.clear();
        }
        for (const t of msg.timeline.timelines ?? []) {
          let m = this.slices.get(t.group_id);
          if (!m) {
            m = new Map();
            this.slices.set(t.group_id, m);
          }
          for (const r of t.records ?? []) {
            m.set(r.slice_id, r); // a slice comes again, with a higher seq, when it ends
          }
          if (t.duty && typeof t.duty.duty_cycle === "number") {
            this.duty.set(t.group_id, t.duty.duty_cycle);
          }
        }
        this.pruneSlices();
      }
    }
    this.render();
  }

  private pruneSlices(): void {
    const cutoff = Date.now() / 1000 - TIMELINE_WINDOW_S;
    for (const m of this.slices.values()) {
      for (const [id, r] of m) {
        if (r.released_at && r.released_at < cutoff) {
          m.delete(id);
        }
      }
    }
  }

  private render(): void {
    if (!this.isVisible && this.isAttached) {
      return;
    }
    this.renderStatus();
    this.renderLeases();
    this.renderQueue();
    this.renderTimeline();
  }

  private renderStatus(): void {
    const s = this.statusNode;
    s.textContent = "";
    const live = {
      open: "live",
      connecting: "connecting…",
      polling: "reconnecting (polling)",
      closed: "disconnected",
    }[this.connState];
    s.appendChild(el("span", `jp-OpenRL-conn jp-OpenRL-conn-${this.connState}`, live));
    if (this.error) {
      s.appendChild(el("div", "jp-OpenRL-error", this.error));
    }
    for (const w of [...this.topicErrors, ...this.warnings]) {
      s.appendChild(el("div", "jp-OpenRL-warning", w));
    }
  }

  private renderLeases(): void {
    const root = this.leasesNode;
    root.textContent = "";
    if (this.rows.length === 0) {
      root.appendChild(el("p", "jp-OpenRL-empty", "No leases. Start one in a notebook with `%openrl lease NAME`."));
      return;
    }
    const runs = this.rows.filter((r) => !!(r.model_id || r.base_model)).map((r) => r.name);
    for (const name of [...this.picked]) {
      if (!runs.includes(name)) {
        this.picked.delete(name); // released: no longer offered
      }
    }
    if (runs.length >= 2) {
      root.appendChild(this.compareBar());
    }
    for (const r of this.rows) {
      const card = el("div", `jp-OpenRL-lease jp-OpenRL-state-${r.state}`);
      card.dataset.lease = r.name;
      // a lab lease (a named run: model, metrics, kernel job) has a kernel, steps, a plot, an attach cell and a
      // release; an orchestrator lease of a script of yours only shows where it stands
      const isRun = !!(r.model_id || r.base_model);
      const head = el("div", "jp-OpenRL-lease-head");
      head.appendChild(el("span", "jp-OpenRL-lease-name", r.name));
      head.appendChild(el("span", `jp-OpenRL-badge jp-OpenRL-state jp-OpenRL-badge-${r.state}`, r.state));
      // resident: its state is on the device now; evicted (the state badge) when it was moved off
      if (r.resident) {
        head.appendChild(el("span", "jp-OpenRL-badge jp-OpenRL-residency jp-OpenRL-resident", "resident"));
      } else if (["running", "waiting", "idle"].includes(r.state)) {
        head.appendChild(el("span", "jp-OpenRL-badge jp-OpenRL-residency jp-OpenRL-offdevice", "not resident"));
      }
      if (r.priority === "interactive") {
        const badge = el("span", "jp-OpenRL-badge jp-OpenRL-priority jp-OpenRL-priority-interactive", "interactive");
        badge.title = "its phases go before waiting batch phases, within the group's interactive share";
        head.appendChild(badge);
      }
      if (isRun && runs.length >= 2) {
        const pick = el("label", "jp-OpenRL-pick");
        const box = el("input", "jp-OpenRL-pick-box");
        box.type = "checkbox";
        box.checked = this.picked.has(r.name);
        box.addEventListener("change", () => {
          if (box.checked) {
            this.picked.add(r.name);
          } else {
            this.picked.delete(r.name);
          }
          this.renderLeases();
        });
        pick.title = `Tick runs, then "Compare" at the top of this list to overlay their curves`;
        pick.appendChild(box);
        pick.appendChild(document.createTextNode("compare"));
        head.appendChild(pick);
      }
      card.appendChild(head);

      const facts: [string, string][] = [
        ["group", r.group || "?"],
        ["share", pct(r.share)],
        ["class", r.priority || "-"],
      ];
      if (typeof r.used_s === "number") {
        facts.push(["used", fmtSeconds(r.used_s)]);
      }
      if (isRun) {
        facts.push(["step", num(r.last_step)]);
        facts.push(["reward", num(r.last_reward ?? (r.last_metrics as any)?.reward)]);
        facts.push(["kernel", r.kernel ? `${r.kernel}${r.host ? ` @ ${r.host}` : ""}` : "-"]);
        facts.push(["memory", fmtBytes(r.state_bytes)]);
      } else if (typeof r.slices === "number") {
        facts.push(["slices", String(r.slices)]);
      }
      const dl = el("dl", "jp-OpenRL-facts");
      for (const [k, v] of facts) {
        const item = el("div", `jp-OpenRL-fact jp-OpenRL-fact-${k}`);
        item.appendChild(el("dt", "", k));
        const dd = el("dd", "", v);
        dd.title = v;
        item.appendChild(dd);
        dl.appendChild(item);
      }
      card.appendChild(dl);
      const devices = devicesText(r);
      if (devices) {
        // a gang: one line for its devices, each rank's kernel, host and device on hover
        const d = el("div", "jp-OpenRL-devices", devices);
        d.title = (r.ranks ?? [])
          .map(
            (x, i) => `rank ${i}: ${x.kernel || "?"}${x.host ? ` @ ${x.host}` : ""}${x.device ? ` (${x.device})` : ""}`,
          )
          .join("\n");
        card.appendChild(d);
      }
      const variant = variantText(r.variant);
      if (variant) {
        const v = el("div", "jp-OpenRL-variant", variant);
        v.title = `a fork: it carried on from ${r.variant?.forked_from}'s weights and optimizer state`;
        card.appendChild(v);
      }
      if (isRun && typeof r.collapse_since === "number") {
        const c = el("div", "jp-OpenRL-collapse", `collapse since step ${r.collapse_since}`);
        c.title =
          "Its entropy fell below the floor while its reward fell or stayed at zero: the policy is sure of wrong " +
          "answers (openrl_lab/collapse.py). Lower the learning rate, or see docs/recipes.md, 'Against collapse'.";
        card.appendChild(c);
      }
      if (r.last_checkpoint) {
        const ck = el("div", "jp-OpenRL-checkpoint", `checkpoint ${r.last_checkpoint}`);
        ck.title = r.last_checkpoint;
        card.appendChild(ck);
      }
      if (r.state === "waiting" || r.reason) {
        const why = el("div", "jp-OpenRL-why");
        const where = r.queue_position ? `#${r.queue_position} in queue` : "waiting";
        const wait =
          r.expected_wait_s !== undefined && r.expected_wait_s !== null && r.expected_wait_s >= 0
            ? ` · wait ${r.expected_wait_s < 1 ? "" : "~"}${fmtSeconds(r.expected_wait_s)}`
            : "";
        why.appendChild(el("span", "jp-OpenRL-position", where + wait));
        why.appendChild(el("span", "jp-OpenRL-reason", r.reason || "no reason given"));
        card.appendChild(why);
      }
      const buttons = el("div", "jp-OpenRL-actions");
      const button = (label: string, title: string, cls: string, fn: () => void) => {
        const b = el("button", `jp-Button jp-mod-styled jp-OpenRL-button ${cls}`, label);
        b.title = title;
        b.addEventListener("click", fn);
        buttons.appendChild(b);
        return b;
      };
      if (isRun) {
        button("Plot", `Open ${r.name}'s live metrics`, "jp-OpenRL-plot", () => this.actions.plot(r.name));
        const family = this.family(r);
        if (family.length >= 2) {
          button(
            "Compare",
            `Overlay the curves of ${family.join(", ")} (the run and its forks) in one plot`,
            "jp-OpenRL-compare-family",
            () => this.actions.compare(family),
          );
        }
        button(
          "Attach",
          `Insert a \`%openrl attach ${r.name}\` cell into the current notebook`,
          "jp-OpenRL-attach",
          () => this.actions.attach(r.name),
        );
        const rel = button(
          "Release",
          `Release ${r.name}: its kernel job ends (checkpoints stay)`,
          "jp-OpenRL-release jp-mod-warn",
          () => {
            this.busy.add(r.name);
            rel.disabled = true;
            void this.actions.release(r.name).finally(() => {
              this.busy.delete(r.name);
              this.refresh();
            });
          },
        );
        rel.disabled = this.busy.has(r.name) || r.state === "released";
      }
      if (buttons.childElementCount) {
        card.appendChild(buttons);
      }
      root.appendChild(card);
    }
  }

  /** "Compare (n)": the ticked runs overlaid in one plot (two or more). */
  private compareBar(): HTMLElement {
    const bar = el("div", "jp-OpenRL-compare-bar");
    const picked = this.rows.map((r) => r.name).filter((n) => this.picked.has(n));
    const b = el(
      "button",
      "jp-Button jp-mod-styled jp-OpenRL-button jp-OpenRL-compare-picked",
      `Compare (${picked.length})`,
    );
    b.title =
      picked.length >= 2 ? `Overlay the curves of ${picked.join(", ")}` : "Tick two or more runs below to compare them";
    b.disabled = picked.length < 2;
    b.addEventListener("click", () => this.actions.compare(picked));
    bar.appendChild(b);
    return bar;
  }

  /** A run and its forks (or a fork, its origin and its siblings), those listed: what "Compare" overlays, origin first. */
  private family(r: ILeaseRow): string[] {
    const root = r.variant?.forked_from || r.name;
    const runs = this.rows.filter((x) => !!(x.model_id || x.base_model));
    const forks = runs.filter((x) => x.variant?.forked_from === root).map((x) => x.name);
    return [...runs.filter((x) => x.name === root).map((x) => x.name), ...forks.sort()];
  }

  private renderQueue(): void {
    const root = this.queueNode;
    root.textContent = "";
    if (this.groups.length === 0) {
      root.appendChild(el("p", "jp-OpenRL-empty", "No groups reported yet."));
      return;
    }
    for (const g of this.groups) {
      const box = el("div", "jp-OpenRL-group");
      box.dataset.group = g.group_id;
      const head = el("div", "jp-OpenRL-group-head");
      const name = g.group_id + (g.aliases && g.aliases.length ? ` (${g.aliases.join(", ")})` : "");
      head.appendChild(el("span", "jp-OpenRL-group-name", name));
      const duty = this.duty.get(g.group_id) ?? g.duty_cycle ?? g.duty?.duty_cycle;
      const bar = el("span", "jp-OpenRL-duty");
      bar.title = "duty cycle: the share of the recent window the group ran a job";
      const fill = el("span", "jp-OpenRL-duty-fill");
      fill.style.width = `${Math.max(0, Math.min(1, duty ?? 0)) * 100}%`;
      bar.appendChild(fill);
      head.appendChild(bar);
      head.appendChild(el("span", "jp-OpenRL-duty-text", `duty ${pct(duty)}`));
      box.appendChild(head);
      const holder = g.holder;
      box.appendChild(
        el(
          "div",
          "jp-OpenRL-holder",
          holder ? `running: ${this.who(holder)}${holder.kind ? ` (${holder.kind})` : ""}` : "free",
        ),
      );
      const queue = g.queue ?? [];
      if (queue.length) {
        const ol = el("ol", "jp-OpenRL-queue-list");
        for (const e of queue) {
          const li = el("li", `jp-OpenRL-queue-entry${e.mine ? " jp-OpenRL-mine" : ""}`);
          li.dataset.job = e.job;
          const wait =
            e.expected_wait_s !== undefined && e.expected_wait_s !== null && e.expected_wait_s >= 0
              ? ` · wait ${e.expected_wait_s < 1 ? "" : "~"}${fmtSeconds(e.expected_wait_s)}`
              : "";
          li.appendChild(el("span", "jp-OpenRL-position", `#${e.position ?? "?"} ${this.who(e)}${wait}`));
          if (e.priority && e.priority !== "batch") {
            li.dataset.priority = e.priority;
            li.appendChild(
              el("span", `jp-OpenRL-badge jp-OpenRL-priority jp-OpenRL-priority-${e.priority}`, e.priority),
            );
          }
          if (e.reason) {
            li.appendChild(el("span", "jp-OpenRL-reason", e.reason));
          }
          ol.appendChild(li);
        }
        box.appendChild(ol);
      }
      root.appendChild(box);
    }
  }

  private who(e: IQueueEntry): string {
    return e.mine && e.job ? e.job : (e.who ?? "another user's job");
  }

  private renderTimeline(): void {
    const root = this.timelineNode;
    const groups = [...new Set([...this.groups.map((g) => g.group_id), ...this.slices.keys()])];
    root.textContent = "";
    if (groups.length === 0) {
      root.appendChild(el("p", "jp-OpenRL-empty", "No slices yet."));
      return;
    }
    const width = Math.max(200, (this.node.clientWidth || 300) - 24);
    const label = 0;
    const rowH = 18;
    const top = 14;
    const height = top + groups.length * (rowH + 16) + 14;
    const now = Date.now() / 1000;
    const t0 = now - TIMELINE_WINDOW_S;
    const x = (t: number) => label + ((t - t0) / TIMELINE_WINDOW_S) * (width - label);
    const svg = document.createElementNS(SVG_NS, "svg");
    svg.setAttribute("width", String(width));
    svg.setAttribute("height", String(height));
    svg.setAttribute("class", "jp-OpenRL-timeline-svg");
    const add = (tag: string, attrs: Record<string, string | number>, text?: string) => {
      const n = document.createElementNS(SVG_NS, tag);
      for (const [k, v] of Object.entries(attrs)) {
        n.setAttribute(k, String(v));
      }
      if (text !== undefined) {
        n.textContent = text;
      }
      svg.appendChild(n);
      return n;
    };
    groups.forEach((g, i) => {
      const y = top + i * (rowH + 16);
      add("text", { x: 0, y: y - 2, class: "jp-OpenRL-tl-label" }, g);
      add("rect", { x: label, y: y, width: width - label, height: rowH, class: "jp-OpenRL-tl-lane" });
      for (const r of this.slices.get(g)?.values() ?? []) {
        const start = Math.max(r.granted_at, t0);
        const end = r.released_at || now;
        if (end < t0) {
          continue;
        }
        const w = Math.max(1, x(end) - x(start));
        const rect = add("rect", {
          x: x(start),
          y: y + 1,
          width: w,
          height: rowH - 2,
          fill: colour(r.job, r.mine),
          class: `jp-OpenRL-tl-slice jp-OpenRL-tl-${r.outcome}${
            r.priority && r.priority !== "batch" ? ` jp-OpenRL-tl-${r.priority}` : ""
          }`,
        });
        const title = document.createElementNS(SVG_NS, "title");
        title.textContent = `${r.mine ? r.job : "another user's job"} ${r.kind} ${r.outcome} ${(
          (r.released_at || now) - r.granted_at
        ).toFixed(2)} s${r.priority ? ` (${r.priority})` : ""}`;
        rect.appendChild(title);
        if (w > 40 && r.mine && r.job) {
          add("text", { x: x(start) + 3, y: y + rowH - 5, class: "jp-OpenRL-tl-job" }, r.job);
        }
      }
    });
    const axisY = height - 2;
    for (let s = TIMELINE_WINDOW_S; s >= 0; s -= 30) {
      add(
        "text",
        {
          x: x(now - s),
          y: axisY,
          class: "jp-OpenRL-tl-tick",
          "text-anchor": s === 0 ? "end" : s === TIMELINE_WINDOW_S ? "start" : "middle",
        },
        s === 0 ? "now" : `-${s} s`,
      );
    }
    root.appendChild(svg);
  }
}
