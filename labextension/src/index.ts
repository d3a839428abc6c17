/**
 * OpenRL Lab's JupyterLab extension: a left sidebar that answers "where is my job and why is it
 * waiting?", and main-area panels with a run's live metrics. It reads only the `openrl_lab` server
 * extension's routes (`openrl/api/...` under the page's base URL).
 *
 * Commands (also for the palette and for tests): `openrl:open-sidebar`, `openrl:release-lease {name}`,
 * `openrl:insert-attach {name}`, `openrl:open-plot {name}`, `openrl:open-compare {names, metrics?}`.
 */
import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from "@jupyterlab/application";
import { Dialog, ICommandPalette, MainAreaWidget, Notification, showDialog, WidgetTracker } from "@jupyterlab/apputils";
import { INotebookTracker, NotebookActions } from "@jupyterlab/notebook";
import { LabIcon } from "@jupyterlab/ui-components";

import { releaseLease } from "./api";
import { MetricsPlot } from "./plot";
import { OpenRLSidebar } from "./sidebar";

const PLUGIN_ID = "openrl-lab-labextension:plugin";

namespace CommandIDs {
  export const open = "openrl:open-sidebar";
  export const release = "openrl:release-lease";
  export const attach = "openrl:insert-attach";
  export const plot = "openrl:open-plot";
  export const compare = "openrl:open-compare";
}

export const openrlIcon = new LabIcon({
  name: "openrl-lab:icon",
  svgstr: `<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16" height="16">
  <g class="jp-icon3" fill="#616161">
    <rect x="2" y="4" width="9" height="4" rx="1"/>
    <rect x="8" y="10" width="13" height="4" rx="1"/>
    <rect x="4" y="16" width="7" height="4" rx="1"/>
    <circle cx="19" cy="18" r="3"/>
  </g>
</svg>`,
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: "OpenRL Lab: my leases, the queue and why a job waits, duty cycle, a live timeline, live plots",
  autoStart: true,
  optional: [ILayoutRestorer, INotebookTracker, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    notebooks: INotebookTracker | null,
    palette: ICommandPalette | null,
  ) => {
    const { commands, shell } = app;
    const plots = new WidgetTracker<MainAreaWidget<MetricsPlot>>({ namespace: "openrl-lab-plot" });

    const sidebar = new OpenRLSidebar({
      release: async (name) => {
        await commands.execute(CommandIDs.release, { name });
      },
      attach: (name) => void commands.execute(CommandIDs.attach, { name }),
      plot: (name) => void commands.execute(CommandIDs.plot, { name }),
      compare: (names) => void commands.execute(CommandIDs.compare, { names }),
    });
    sidebar.title.icon = openrlIcon;
    shell.add(sidebar, "left", { rank: 850 });
    if (restorer) {
      restorer.add(sidebar, "openrl-lab-sidebar"); // open or closed, as left before a reload
    }

    commands.addCommand(CommandIDs.open, {
      label: "OpenRL Lab: Show Leases and Queues",
      caption: "Where is my job and why is it waiting?",
      icon: openrlIcon,
      execute: () => shell.activateById(sidebar.id),
    });

    commands.addCommand(CommandIDs.release, {
      label: (args) => (args.name ? `Release Lease ${args.name}` : "Release Lease"),
      caption: "End the run: its kernel job is dropped (device and host memory freed); checkpoints stay",
      execute: async (args) => {
        const name = String(args.name ?? "");
        if (!name) {
          return;
        }
        if (!args.noConfirm) {
          const answer = await showDialog({
            title: `Release ${name}?`,
            body: "Its kernel job ends and its device and host memory are freed; its checkpoints stay.",
            buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: "Release" })],
          });
          if (!answer.button.accept) {
            return;
          }
        }
        try {
          await releaseLease(name);
          Notification.success(`Released ${name}`, { autoClose: 3000 });
        } catch (error) {
          Notification.error(`Could not release ${name}: ${(error as Error).message}`, { autoClose: 8000 });
        } finally {
          sidebar.refresh();
        }
      },
    });

    commands.addCommand(CommandIDs.attach, {
      label: (args) => (args.name ? `Insert %openrl attach ${args.name}` : "Insert %openrl attach Cell"),
      caption:
        "Insert a cell that attaches this notebook to the run (after a kernel restart, or from another notebook)",
      execute: (args) => {
        const name = String(args.name ?? "");
        const panel = notebooks?.currentWidget;
        if (!panel) {
          Notification.warning(`Open a notebook first: then "Attach" inserts \`%openrl attach ${name}\` into it.`, {
            autoClose: 5000,
          });
          return;
        }
        const notebook = panel.content;
        NotebookActions.insertBelow(notebook);
        const cell = notebook.activeCell;
        if (cell) {
          cell.model.sharedModel.setSource(`%openrl attach ${name}`);
        }
        shell.activateById(panel.id);
      },
    });

    /** The plot of `runs` (one run's, or a comparison), opened or brought to the front. */
    const openPlot = (runs: string[], metrics?: string[]) => {
      const key = runs.join("\u0000");
      const open = plots.find((w) => w.content.runs.join("\u0000") === key);
      if (open) {
        shell.activateById(open.id);
        return open;
      }
      const content = new MetricsPlot(runs, metrics);
      const widget = new MainAreaWidget({ content });
      widget.id = content.isComparison ? `openrl-lab-compare-${runs.join("-")}` : `openrl-lab-plot-${runs[0]}`;
      widget.title.label = content.isComparison ? `compare ${content.label}` : `${runs[0]} · metrics`;
      widget.title.caption = content.isComparison ? `${content.label}: their curves overlaid` : widget.title.label;
      widget.title.icon = openrlIcon;
      widget.title.closable = true;
      void plots.add(widget);
      shell.add(widget, "main", { mode: "split-right" });
      shell.activateById(widget.id);
      return widget;
    };

    commands.addCommand(CommandIDs.plot, {
      label: (args) => (args.name ? `Live Metrics of ${args.name}` : "Live Metrics"),
      caption: "A run's metrics as they are logged (read from the server, not the kernel)",
      execute: (args) => {
        const name = String(args.name ?? "");
        return name ? openPlot([name]) : undefined;
      },
    });

    commands.addCommand(CommandIDs.compare, {
      label: (args) => (Array.isArray(args.names) ? `Compare ${(args.names as string[]).join(", ")}` : "Compare Runs"),
      caption: "Runs' curves overlaid in one live plot, with each run's variant, last and best values",
      execute: (args) => {
        const names = Array.isArray(args.names) ? [...new Set((args.names as unknown[]).map(String))] : [];
        const metrics = Array.isArray(args.metrics) ? (args.metrics as unknown[]).map(String) : undefined;
        if (names.length === 0) {
          Notification.warning("Compare needs runs to compare: tick them in the OpenRL sidebar.", {
            autoClose: 5000,
          });
          return;
        }
        return openPlot(names, metrics);
      },
    });

    if (restorer) {
      // one command brings back both kinds: one name opens that run's plot
      void restorer.restore(plots, {
        command: CommandIDs.compare,
        args: (w) => ({ names: w.content.runs, metrics: w.content.metrics }),
        name: (w) => w.content.runs.join(","),
      });
    }
    if (palette) {
      palette.addItem({ command: CommandIDs.open, category: "OpenRL Lab" });
    }
  },
};

export default plugin;
