/**
 * The server extension's routes (openrl_lab/lab/server_extension.py), as the sidebar reads them.
 *
 * Every URL comes from the page's ServerConnection settings (PageConfig's base URL), so the sidebar works
 * under JupyterHub's `/user/<name>/` prefix; POSTs go through `ServerConnection.makeRequest`, which adds
 * Jupyter's XSRF header and token.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** One lease as the sidebar, `%openrl status` and the LeasePanel show it (docs: contracts, issue 12). */
export interface ILeaseRow {
  name: string;
  group: string;
  state: string; // running | waiting | idle | evicted | lost | released
  resident: boolean;
  share: number | null;
  weight?: number | null;
  used_s?: number | null;
  slices?: number | null;
  queue_position: number;
  reason: string;
  expected_wait_s?: number | null;
  kernel?: string | null;
  host?: string | null;
  model_id?: string | null;
  base_model?: string | null;
  last_step?: number | null;
  last_metrics?: Record<string, unknown>;
  last_reward?: number | null;
  last_checkpoint?: string | null;
  checkpoint_time?: number | null;
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
  timelines?: { group_id: string; records: ISliceRecord[]; last_seq?: number; duty?: IGroupStatus['duty'] }[];
  error?: string;
  status?: number;
}

export class ApiError extends Error {
  constructor(
    message: string,
    public status: number
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
  const url = URLExt.join(s.baseUrl, 'openrl', 'api', path);
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
  return requestAPI(`leases/${encodeURIComponent(name)}/release`, { method: 'POST', body: '{}' });
}

/** The per-lease rows: the server's `rows` when it sends them, else joined here from the raw lists. */
export function leaseRows(payload: ILeasesPayload | null | undefined): ILeaseRow[] {
  if (!payload) {
    return [];
  }
  if (Array.isArray(payload.rows)) {
    return payload.rows.map(r => ({
      ...r,
      share: r.share ?? null,
      reason: r.reason ?? '',
      queue_position: r.queue_position ?? 0,
      resident: !!r.resident
    }));
  }
  // an older server extension without `rows`: the same join as openrl_lab/lab/rows.py, done here
  const orch: any[] = payload.orchestrator_leases ?? [];
  const lab: any[] = payload.lab_leases ?? [];
  const stateOf = (o: any | undefined) =>
    !o
      ? 'idle'
      : o.state === 'holding'
        ? 'running'
        : o.state === 'waiting'
          ? 'waiting'
          : ['host', 'evicting'].includes(o.resident)
            ? 'evicted'
            : 'idle';
  const row = (name: string, group: string, o: any | undefined, L: any | undefined): ILeaseRow => {
    const placement = (L && L.placement) || {};
    const lost = !!L && (!L.placement || (L.placement.state !== undefined && L.placement.state !== 'up'));
    const state = lost ? 'lost' : stateOf(o);
    const waiting = state === 'waiting';
    const wait = o && waiting ? o.expected_wait_s : null;
    return {
      name,
      group,
      state,
      resident: !!o && !lost && o.resident === 'device',
      share: 0,
      weight: o ? Number(o.weight) : 1,
      used_s: o ? Number(o.used_s || 0) : 0,
      slices: o ? Number(o.slices || 0) : 0,
      queue_position: o && waiting ? Number(o.queue_position || 0) : 0,
      reason: o && waiting ? String(o.reason || '') : '',
      expected_wait_s: wait === null || wait === undefined || wait < 0 ? null : Number(wait),
      kernel: placement.kernel ?? null,
      host: placement.host ?? null,
      model_id: L?.model_id ?? null,
      base_model: L?.base_model ?? null,
      last_step: L?.last_step ?? null,
      last_metrics: L?.last_metrics ?? {},
      last_reward: L?.last_reward ?? null,
      last_checkpoint: L?.checkpoint ?? null,
      checkpoint_time: L?.checkpoint_time ?? null
    };
  };
  const rows: ILeaseRow[] = [];
  const used = new Set<any>();
  for (const L of lab) {
    // the group a lab lease was asked on may be an alias: match by name, preferring the same group id
    const o =
      orch.find(x => x.name === L.name && x.group_id === L.group && !used.has(x)) ??
      orch.find(x => x.name === L.name && !used.has(x));
    if (o) {
      used.add(o);
    }
    rows.push(row(L.name, o ? o.group_id : L.group, o, L));
  }
  for (const o of orch) {
    if (!used.has(o)) {
      rows.push(row(o.name, o.group_id, o, undefined));
    }
  }
  const live = ['running', 'waiting', 'idle', 'evicted'];
  const total = new Map<string, number>();
  for (const r of rows) {
    if (live.includes(r.state)) {
      total.set(r.group, (total.get(r.group) ?? 0) + (r.weight ?? 0));
    }
  }
  for (const r of rows) {
    const t = total.get(r.group) ?? 0;
    r.share = live.includes(r.state) && t > 0 ? (r.weight ?? 0) / t : 0;
  }
  return rows;
}

export type StreamState = 'connecting' | 'open' | 'polling' | 'closed';

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
  state: StreamState = 'closed';

  constructor(private options: IStreamOptions) {}

  start(): void {
    this.connect();
  }

  get url(): string {
    const s = settings();
    let url = URLExt.join(s.wsUrl, 'openrl', 'api', 'stream');
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
    this.setState(this.pollTimer !== null ? 'polling' : 'connecting'); // (the GETs go on meanwhile)
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
    ws.onmessage = event => {
      let msg: any;
      try {
        msg = JSON.parse(event.data);
      } catch {
        return;
      }
      if (this.state !== 'open') {
        // live once the server answers (a proxy may accept the websocket and pass nothing): the GETs stop
        this.backoffMs = 500;
        this.stopPolling();
        this.setState('open');
      }
      if (msg.type === 'update' || msg.type === 'error') {
        const fresh = this.fresh && msg.type === 'update';
        if (fresh) {
          this.fresh = false;
        }
        this.options.onUpdate(msg, fresh);
      }
    };
    ws.onclose = event => {
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
      this.setState('closed', detail);
      return;
    }
    if (this.pollTimer !== null) {
      this.setState('polling', detail); // polling already
      return;
    }
    this.setState('polling', detail);
    const tick = async () => {
      if (this.disposed || this.state === 'open') {
        return;
      }
      if (!this.paused) {
        try {
          const msg = await this.options.poll!();
          if ((this.state as StreamState) !== 'open') {
            this.options.onUpdate(msg, true);
          }
        } catch (error) {
          this.options.onUpdate({ type: 'error', message: String((error as Error).message ?? error) }, false);
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

export function fmtSeconds(s: number | null | undefined): string {
  if (s === null || s === undefined || !isFinite(s) || s < 0) {
    return '?';
  }
  if (s < 1) {
    return '< 1 s';
  }
  if (s < 90) {
    return `${Math.round(s)} s`;
  }
  if (s < 5400) {
    return `${Math.round(s / 60)} min`;
  }
  return `${(s / 3600).toFixed(1)} h`;
}
