/**
 * The server extension's routes (openrl_lab/lab/server_extension.py), as the sidebar reads them.
 *
 * Every URL comes from the page's ServerConnection settings (PageConfig's base URL), so the sidebar works
 * under JupyterHub's `/user/<name>/` prefix; POSTs go through `ServerConnection.makeRequest`, which adds
 * Jupyter's XSRF header and token.
 */
import { URLExt } from "@jupyterlab/coreutils";
import { ServerConnection } from "@jupyterlab/services";

/** One lease as the sidebar, `%openrl status` and the LeasePanel show it (docs: contracts, issue 12). */
export interface ILeaseRow {
  name: string;
  group: string;
  state: string; // running | waiting | idle | evicted | lost | released
  resident: boolean;
  share: number | null;
  weight?: number | null;
  priority?: string; // interactive | batch: whether its phases go before waiting batch phases
  used_s?: number | null;
  slices?: number | null;
  queue_position: number;
  reason: string;
  expected_wait_s?: number | null;
  kernel?: string | null;
  host?: string | null;
  model_id?: string | null;
  base_model?: string | null;
  state_bytes?: number | null; // the run's device memory (weights, gradients, AdamW moments), as its kernel says
  last_step?: number | null;
  last_metrics?: Record<string, unknown>;
  last_reward?: number | null;
  /** the step at which the collapse its last logged step is in began (openrl_lab/collapse.py); null: none */
  collapse_since?: number | null;
  last_checkpoint?: string | null;
  checkpoint_time?: number | null;
  variant?: IVariant | null; // a fork's origin and settings (`Lab.fork`); null for a run that is not one
  devices?: number; // how many devices the run is sharded over (1: not a gang)
  ranks?: IRank[]; // a gang's ranks, rank 0 first; [] for a run on one device
}

/** Where one rank of a run on several devices lives. */
export interface IRank {
  kernel?: string | null;
  group?: string | null;
  host?: string | null;
  device?: string | null;
}

/** Where a fork came from: the run, its step then, and the variant's settings (`learning_rate: 1e-3`). */
export interface IVariant {
  forked_from?: string | null;
  step?: number | null;
  settings?: Record<string, unknown> | null;
}

/** A fork's origin and settings in a line, as `%openrl status` says it: `fork of sweep @ 12: learning_rate=0.001`. */
export function variantText(v: IVariant | null | undefined): string {
  if (!v || !v.forked_from) {
    return "";
  }
  const value = (x: unknown) =>
    typeof x === "number" && !Number.isInteger(x) ? String(Number(x.toPrecision(6))) : String(x);
  const settings = Object.entries(v.settings ?? {})
    .map(([k, x]) => `${k}=${value(x)}`)
    .join(", ");
  const step = v.step === null || v.step === undefined ? "" : ` @ ${v.step}`;
  return `fork of ${v.forked_from}${step}${settings ? `: ${settings}` : ""}`;
}

/** A gang's devices in a line, as `%openrl status` says it (`rows.devices_text`): `devices 2: cpu0,cpu1` (each
 * rank's group, rank 0 first; its kernels where the ranks share a group), `devices 2` while its kernels are
 * unknown, "" for a run on one device. */
export function devicesText(r: Pick<ILeaseRow, "devices" | "ranks">): string {
  const n = Number(r.devices || 1);
  if (!(n > 1)) {
    return "";
  }
  const ranks = (r.ranks ?? []).filter((x) => !!x);
  const groups = ranks.map((x) => String(x.group || ""));
  const distinct = groups.every((g) => g) && new Set(groups).size === groups.length;
  const where = distinct ? groups : ranks.map((x) => String(x.kernel || "?"));
  return `devices ${n}` + (where.length ? `: ${where.join(",")}` : "");
}

export interface IQueueEntry {
  job: string;
  mine: boolean;
  lease_ref?: string;
  kind?: string;
  since?: number;
  weight?: number;
  position?: number;
  reason?: string;
  who?: string;
  expected_wait_s?: number | null;
  priority?: string; // waiting: interactive | interactive-capped (queued as batch) | batch
}

export interface IGroupStatus {
  group_id: string;
  aliases?: string[];
  devices?: string[];
  policy?: string;
  holder?: IQueueEntry | null;
  queue?: IQueueEntry[];
  resident?: IQueueEntry | null;
  switching?: boolean;
  duty_cycle?: number;
  duty?: { duty_cycle?: number; wall_s?: number; busy_s?: number; switch_share?: number; slices?: number };
  slices?: number;
  evictions?: number;
}

export interface ISliceRecord {
  seq: number;
  slice_id: string;
  group_id: string;
  job: string;
  mine: boolean;
  kind: string;
  granted_at: number;
  released_at: number;
  run_s: number;
  outcome: string;
  priority?: string; // interactive (went first) | interactive-capped (queued as batch) | batch
}

export interface ILeasesPayload {
  rows?: ILeaseRow[];
  lab_leases?: any[];
  orchestrator_leases?: any[];
  warnings?: string[];
  error?: string;
  status?: number;
}

export interface IQueuePayload {
  groups?: IGroupStatus[];
  error?: string;
  status?: number;
}

export interface ITimelinePayload {
  timelines?: { group_id: string; records: ISliceRecord[]; last_seq?: number; duty?: IGroupStatus["duty"] }[];
  error?: string;
  status?: number;
}

export class ApiError extends Error {
  constructor(
    message: string,
    public status: number,
  ) {
    super(message);
  }
}

export function settings(): ServerConnection.ISettings {
  return ServerConnection.makeSettings();
}

/** A request to `openrl/api/<path>` under the server's base URL; the JSON answer, or an ApiError. */
export async function requestAPI<T>(path: string, init: RequestInit = {}): Promise<T> {
  const s = settings();
  const url = URLExt.join(s.baseUrl, "openrl", "api", path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, s);
  } catch (error) {
    throw new ApiError(`the Jupyter server did not answer: ${error}`, 0);
  }
  const text = await response.text();
  let data: any = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    let message = data && data.message ? data.message : `HTTP ${response.status} from openrl/api/${path}`;
    if (data === null && response.status === 404) {
      message = `this Jupyter server has no openrl/api/${path} route (an older openrl_lab server extension?)`;
    }
    throw new ApiError(message, response.status);
  }
  return data as T;
}

export function releaseLease(name: string): Promise<{ released: string }> {
  return requestAPI(`leases/${encodeURIComponent(name)}/release`, { method: "POST", body: "{}" });
}

/** The per-lease rows, as the server extension joins them (`openrl_lab/lab/rows.py`, shipped in the same wheel):
 * the browser does not join them again. */
export function leaseRows(payload: ILeasesPayload | null | undefined): ILeaseRow[] {
  return (payload?.rows ?? []).map((r) => ({
    ...r,
    share: r.share ?? null,
    reason: r.reason ?? "",
    queue_position: r.queue_position ?? 0,
    resident: !!r.resident,
  }));
}

export type StreamState = "connecting" | "open" | "polling" | "closed";

export interface IStreamOptions {
  topics: string[];
  hz: number;
  /** Each update (stream or GET fallback); `fresh` when a new connection starts over with snapshots. */
  onUpdate: (msg: any, fresh: boolean) => void;
  onState?: (state: StreamState, detail?: string) => void;
  /** The GET fallback while the websocket is down: called every `pollMs`, returns an update-like object. */
  poll?: () => Promise<any>;
  pollMs?: number;
}

/**
 * The `openrl/api/stream` websocket, reconnecting with backoff; while it is down the `poll` fallback
 * (plain GETs) keeps the view filled. `pause(true)` asks the server to stop pushing (a hidden panel).
 */
export class StreamClient {
  private ws: WebSocket | null = null;
  private disposed = false;
  private backoffMs = 500;
  private reconnectTimer: number | null = null;
  private pollTimer: number | null = null;
  private paused = false;
  private fresh = true;
  state: StreamState = "closed";

  constructor(private options: IStreamOptions) {}

  start(): void {
    this.connect();
  }

  get url(): string {
    const s = settings();
    let url = URLExt.join(s.wsUrl, "openrl", "api", "stream");
    // as JupyterLab does for kernels: the page's cookie authenticates; the token only goes in the URL when
    // the websocket is on another host (appendToken)
    if (s.appendToken && s.token) {
      url += `?token=${encodeURIComponent(s.token)}`;
    }
    return url;
  }

  setTopics(topics: string[]): void {
    this.options.topics = topics;
    this.send({ subscribe: topics, hz: this.options.hz });
  }

  pause(paused: boolean): void {
    this.paused = paused;
    this.send({ pause: paused });
  }

  dispose(): void {
    this.disposed = true;
    this.stopPolling();
    if (this.reconnectTimer !== null) {
      window.clearTimeout(this.reconnectTimer);
    }
    if (this.ws) {
      this.ws.onclose = null;
      this.ws.close();
      this.ws = null;
    }
  }

  private setState(state: StreamState, detail?: string): void {
    this.state = state;
    this.options.onState?.(state, detail);
  }

  private send(msg: object): void {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify(msg));
    }
  }

  private connect(): void {
    if (this.disposed) {
      return;
    }
    this.setState(this.pollTimer !== null ? "polling" : "connecting"); // (the GETs go on meanwhile)
    let ws: WebSocket;
    try {
      ws = new WebSocket(this.url);
    } catch (error) {
      this.scheduleReconnect(String(error));
      return;
    }
    this.ws = ws;
    ws.onopen = () => {
      this.fresh = true;
      this.send({ subscribe: this.options.topics, hz: this.options.hz });
      if (this.paused) {
        this.send({ pause: true });
      }
    };
    ws.onmessage = (event) => {
      let msg: any;
      try {
        msg = JSON.parse(event.data);
      } catch {
        return;
      }
      if (this.state !== "open") {
        // live once the server answers (a proxy may accept the websocket and pass nothing): the GETs stop
        this.backoffMs = 500;
        this.stopPolling();
        this.setState("open");
      }
      if (msg.type === "update" || msg.type === "error") {
        const fresh = this.fresh && msg.type === "update";
        if (fresh) {
          this.fresh = false;
        }
        this.options.onUpdate(msg, fresh);
      }
    };
    ws.onclose = (event) => {
      this.ws = null;
      this.scheduleReconnect(`websocket closed (${event.code})`);
    };
    ws.onerror = () => {
      /* onclose follows */
    };
  }

  private scheduleReconnect(detail: string): void {
    if (this.disposed) {
      return;
    }
    this.startPolling(detail);
    this.reconnectTimer = window.setTimeout(() => {
      this.reconnectTimer = null;
      this.connect();
    }, this.backoffMs);
    this.backoffMs = Math.min(this.backoffMs * 2, 10000);
  }

  private startPolling(detail: string): void {
    if (!this.options.poll) {
      this.setState("closed", detail);
      return;
    }
    if (this.pollTimer !== null) {
      this.setState("polling", detail); // polling already
      return;
    }
    this.setState("polling", detail);
    const tick = async () => {
      if (this.disposed || this.state === "open") {
        return;
      }
      if (!this.paused) {
        try {
          const msg = await this.options.poll!();
          if ((this.state as StreamState) !== "open") {
            this.options.onUpdate(msg, true);
          }
        } catch (error) {
          this.options.onUpdate({ type: "error", message: String((error as Error).message ?? error) }, false);
        }
      }
    };
    void tick();
    this.pollTimer = window.setInterval(tick, this.options.pollMs ?? 3000);
  }

  private stopPolling(): void {
    if (this.pollTimer !== null) {
      window.clearInterval(this.pollTimer);
      this.pollTimer = null;
    }
  }
}

/** 1.5 GiB, 17.0 MiB, 12 KiB: as openrl_lab/memory.py's fmt_bytes prints a size ("-" for none). */
export function fmtBytes(n: number | null | undefined): string {
  if (n === null || n === undefined || !isFinite(n)) {
    return "-";
  }
  for (const [unit, size] of [
    ["GiB", 2 ** 30],
    ["MiB", 2 ** 20],
    ["KiB", 2 ** 10],
  ] as [string, number][]) {
    if (Math.abs(n) >= size) {
      return `${(n / size).toFixed(1)} ${unit}`;
    }
  }
  return `${Math.trunc(n)} B`;
}

export function fmtSeconds(s: number | null | undefined): string {
  if (s === null || s === undefined || !isFinite(s) || s < 0) {
    return "?";
  }
  if (s < 1) {
    return "< 1 s";
  }
  if (s < 90) {
    return `${Math.round(s)} s`;
  }
  if (s < 5400) {
    return `${Math.round(s / 60)} min`;
  }
  return `${(s / 3600).toFixed(1)} h`;
}
