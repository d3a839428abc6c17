"""`figure_widget()`: a plotly FigureWidget whose views are as wide as the notebook.

plotly's widget draws once, when anywidget renders it, before the view is attached to the page: the element has
no width yet, so plotly falls back to 700 px and only resizes on a window resize. The module sent to the page
here is plotly's own (same code, same ~5 MB) with its default export wrapped: a ResizeObserver on the view's
element asks plotly to re-fit whenever the element's width changes (first when it is attached). Without the
pattern this expects (another plotly version), plain FigureWidget is used.
"""

from __future__ import annotations

import re
from typing import Any

_WRAP = """
export default () => {
  const base = %(factory)s();
  return {
    initialize: base.initialize,
    render(ctx) {
      const cleanup = base.render(ctx);
      const el = ctx.el;
      let width = 0;
      const fit = () => {
        const w = el.clientWidth;
        if (!w || w === width || !window.Plotly) return;
        if (!el._fullLayout) { setTimeout(fit, 100); return; }  // plotly has not drawn yet
        width = w;
        window.Plotly.Plots.resize(el).catch(() => {});
      };
      const observer = new ResizeObserver(fit);
      observer.observe(el);
      return () => { observer.disconnect(); if (cleanup) cleanup(); };
    },
  };
};
"""

_class: Any = None


def _responsive_esm(source: str) -> str | None:
    end = source.rfind("as default};")
    m = re.search(r"export\{([^{}]*?)\b([A-Za-z_$][\w$]*) as default\};", source[max(0, end - 400) : end + 12])
    if m is None:
        return None
    start = max(0, end - 400) + m.start()
    stop = max(0, end - 400) + m.end()
    exports = f"export{{{m.group(1).rstrip(', ')}}};" if m.group(1).strip(", ") else ""
    return source[:start] + exports + source[stop:] + _WRAP % {"factory": m.group(2)}


def figure_class() -> Any:
    """The FigureWidget subclass (made once per process; the kernel extension's warm-up makes it early)."""
    global _class  # noqa: PLW0603 - one class per process, made on first use
    if _class is None:
        import plotly.graph_objects as go

        esm = _responsive_esm(str(go.FigureWidget._esm))  # anywidget's FileContents: str() is the text
        _class = (
            go.FigureWidget
            if esm is None
            else type(go.FigureWidget)(
                "ResponsiveFigureWidget", (go.FigureWidget,), {"_esm": esm, "__module__": __name__}
            )
        )
    return _class


def figure_widget(**kwargs) -> Any:
    """A FigureWidget(**kwargs) whose views follow their container's width."""
    return figure_class()(**kwargs)
